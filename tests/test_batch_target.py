"""The BatchTarget contract: both batch targets implement it, over one SlotState type that raises
ReleasedSequenceError on use after release (in process and on the Ray coordinator alike)."""

from __future__ import annotations

import inspect

import pytest

from speculation.model.batch_target import BatchTarget, ReleasedSequenceError, SlotPool, SlotState
from speculation.spec.tree import DraftTree
from tests.helpers import tiny_target


def _members(protocol: type) -> dict[str, object]:
    """Protocol member name -> its declaration (a function, a property, or None for an attribute)."""
    out: dict[str, object] = dict.fromkeys(protocol.__annotations__)
    out.update({n: v for n, v in vars(protocol).items()
                if not n.startswith("_") and (callable(v) or isinstance(v, property))})
    return out


def _check_structure(cls: type, protocol: type, instance_attrs: tuple[str, ...] = ()) -> None:
    """``cls`` declares every method and property of ``protocol`` with the same parameters (names,
    kinds and defaults); the protocol's plain attributes are class attributes or set in ``__init__``
    (``instance_attrs``)."""
    for name, decl in _members(protocol).items():
        if decl is None or name in instance_attrs:
            assert name in instance_attrs or hasattr(cls, name), f"{cls.__name__} lacks attribute {name}"
            continue
        impl = inspect.getattr_static(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        if isinstance(decl, property):
            assert isinstance(impl, property), f"{cls.__name__}.{name} should be a property"
            continue
        want = [(p.name, p.kind, p.default) for p in inspect.signature(decl).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(impl).parameters.values()]
        assert got == want, f"{cls.__name__}.{name}{got} does not match the protocol's {want}"


def test_target_model_implements_batch_target():
    target = tiny_target()
    assert isinstance(target, BatchTarget)
    _check_structure(type(target), BatchTarget, ("vocab_size", "eos_token_ids", "device"))
    pool = target.new_slot_pool(2, 16)
    assert isinstance(pool, SlotPool)
    state, logits, _ = target.prefill_slot(pool, [1, 2, 3])
    assert type(state) is SlotState and logits.shape == (target.vocab_size,)
    target.release_slot(state)
    target.release_slot(state)  # idempotent
    with pytest.raises(ReleasedSequenceError, match="released"):
        target.verify_batch([state], [DraftTree(3)])


def test_ray_batch_target_implements_batch_target_over_the_same_slot_state():
    pytest.importorskip("ray")
    from cluster.batch_backend import RayBatchTarget, RaySlotPool, RaySlotState

    # vocab_size and eos_token_ids come from RayTargetBackend.__init__, device and batch_layout
    # (asked of the shards once) from RayBatchTarget's
    _check_structure(RayBatchTarget, BatchTarget, ("vocab_size", "eos_token_ids", "device", "batch_layout"))
    assert RaySlotState.__origin__ is SlotState  # one class, parametrised by its pool
    pool = RaySlotPool("p", max_sequences=2, max_tokens=16)
    assert isinstance(pool, SlotPool)
    state = SlotState(pool=pool, slot=pool.acquire(), length=0, tokens=[])
    assert state.held_slot() == 0
    RayBatchTarget.release_slot(None, state)  # type: ignore[arg-type]  # no shard call: self unused
    assert state.slot is None and pool.free == 2
    with pytest.raises(ReleasedSequenceError, match="released"):
        state.held_slot()
    with pytest.raises(ReleasedSequenceError):  # commit after release: same error as in process
        RayBatchTarget.commit_slot(None, state, DraftTree(1), [0])  # type: ignore[arg-type]


def test_released_sequence_error_is_still_a_value_error():
    """Callers that caught the Ray state's former ValueError keep working."""
    assert issubclass(ReleasedSequenceError, ValueError)


def test_both_slot_pools_raise_the_same_error_when_every_slot_is_held():
    """KVSlotPool and the Ray coordinator's RaySlotPool agree on exhaustion too: SlotsExhaustedError
    (a RuntimeError, as before), naming the slot count."""
    pytest.importorskip("ray")
    from cluster.batch_backend import RaySlotPool
    from speculation.model.kv_slots import SlotsExhaustedError

    pools = [tiny_target().new_slot_pool(2, 16), RaySlotPool("p", max_sequences=2, max_tokens=16)]
    for pool in pools:
        assert sorted([pool.acquire(), pool.acquire()]) == [0, 1]
        with pytest.raises(SlotsExhaustedError, match="all 2 KV slots are held by live sequences"):
            pool.acquire()
        pool.release(1)
        assert pool.acquire() == 1
    assert issubclass(SlotsExhaustedError, RuntimeError)
