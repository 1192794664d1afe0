"""Continuous batching over Ray shard actors (:class:`~cluster.batch_backend.RayBatchTarget`).

Real Ray (the shared session cluster), two real :class:`~workers.shard.TargetShard` actors over the
tiny random Llama (fp32, layers [0, 2) and [2, 4)), driven by the unchanged
:class:`~speculation.engine.batch.BatchEngine`:

* staggered arrivals, different prompt lengths and max tokens: every sequence equals its own solo
  in-process vanilla output, for vanilla and the retrieval drafter (which really speculates);
* one call per shard per step: the shards' own call counters (no mock) move by exactly one
  ``verify_batch`` per engine step and nothing else (the arriving prompts ride in it: the shards
  run flat rows, so prefills fold into the step; no ``prefill_slot`` call at all);
* a shard killed mid-generation (``ray.kill(handle, no_restart=False)``, Ray restarts it), in
  the step that also folds an arriving prompt: the live sequences are re-prefilled on it, the
  step is resubmitted with the prompt, and every output still equals the no-fault output;
* a call past its timeout is a ``ShardTimeoutError`` naming the shard;
* without Ray: the shards' batched step chained in one process equals ``TargetModel.verify_batch``
  bit for bit (logits and aux), across steps with moved-row compactions and per-row KV lengths.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.backend import ShardTimeoutError
from cluster.batch_backend import RayBatchTarget, ShardCallConfig
from speculation.config import BatchConfig, EngineConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.batch import BatchEngine, Request
from speculation.engine.solo import generate_vanilla
from tests.helpers import TINY_AUX_LAYERS, random_tree, tiny_llama, tiny_target
from tests.ray_fixtures import ray_local, tiny_model_dir  # noqa: F401  (fixtures)
from workers.shard import BatchStepInput, Compaction, ShardSpec, StepInput, StepKind, TargetShard, make_actor_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    [5, 9, 5, 9, 5, 9, 5, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3],
    [10, 20, 30],
    [63, 0, 17, 42, 42, 42, 9, 31, 8, 8, 1, 60, 2, 63, 0, 17],
    [7, 7, 7, 7, 7],
]
NEW = [24, 10, 18, 14, 20]
ARRIVE = [0, 0, 1, 3, 4]  # engine step at which each request is added
GREEDY = SamplingConfig(temperature=0.0)
CALLS = ShardCallConfig(call_timeout_s=60, restart_timeout_s=60, max_recoveries=2)
RETRIEVAL = resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False, "budget": 8}})[0]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):  # noqa: F811
    """The single-process twin, loaded as the shard actors load it (``assets.load_model``)."""
    from speculation import assets

    model = assets.load_model(str(tiny_model_dir), torch.float32)
    model.generation_config.eos_token_id = None
    return tiny_target(model)


@pytest.fixture(scope="module")
def refs(tiny):
    """Each prompt's solo in-process vanilla output (the reference)."""
    return [generate_vanilla(tiny, p, EngineConfig(max_new_tokens=n, sampling=GREEDY)).tokens
            for p, n in zip(PROMPTS, NEW)]


@pytest.fixture(scope="module")
def shards(ray_local, tiny_model_dir):  # noqa: F811
    """Two restartable shard actors (Ray restarts a killed one; it reloads its layers)."""
    import ray

    cls = make_actor_class(num_cpus=0.25, max_restarts=2)
    handles = [
        cls.remote(ShardSpec(model=str(tiny_model_dir), dtype="float32", index=k, num_shards=2,
                             start=2 * k, end=2 * k + 2, torch_threads=1))
        for k in range(2)
    ]
    ray.get([h.target_info.remote() for h in handles], timeout=120)
    yield handles
    for h in handles:
        ray.kill(h)


def _target(shards, calls: ShardCallConfig = CALLS) -> RayBatchTarget:
    import ray

    info = ray.get(shards[-1].target_info.remote(), timeout=60)
    return RayBatchTarget(shards, info, aux_layers=TINY_AUX_LAYERS, calls=calls)


def _counts(shards) -> list[dict[str, int]]:
    import ray

    return ray.get([s.call_counts.remote() for s in shards], timeout=60)


def _run(target, shards, factory, kill_at: int | None = None) -> tuple[dict[str, list[int]], list, int]:
    """Drive a BatchEngine step by step; returns (outputs by request id, per step (verified?, per-shard
    call-count deltas), draft tokens accepted in all)."""
    import ray

    engine = BatchEngine(target, factory, BatchConfig(max_sequences=4, max_tokens_per_sequence=64,
                                                      max_tree_tokens=9))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    deltas = []
    accepted = 0
    step = 0
    while step <= max(ARRIVE) or engine.has_work():
        for i, (p, n, at) in enumerate(zip(PROMPTS, NEW, ARRIVE)):
            if at == step:
                engine.add(Request(f"r{i}", p, n, GREEDY))
        if kill_at is not None and step == kill_at:
            ray.kill(shards[1], no_restart=False)
        before = _counts(shards) if kill_at is None else None
        updates = engine.step()
        for u in updates:
            out[u.request_id].extend(u.new_tokens)
            accepted += u.step.accepted if u.step is not None else 0
        if before is not None:
            verified = bool(updates)  # a step with live or arriving sequences runs the one forward
            deltas.append((verified, [{k: a.get(k, 0) - b.get(k, 0) for k in a} for a, b in
                                      zip(_counts(shards), before)]))
        step += 1
    return out, deltas, accepted


@pytest.mark.parametrize("method", ["vanilla", "retrieval"])
def test_batched_ray_equals_solo_and_one_call_per_shard_per_step(tiny, refs, shards, method):
    target = _target(shards)
    assert target.folds_prefills  # the shards load through assets.load_model: the lean loop, flat rows
    factory = None if method == "vanilla" else (lambda: build_drafter(RETRIEVAL, tiny))
    out, deltas, accepted = _run(target, shards, factory)
    for i, ref in enumerate(refs):
        assert out[f"r{i}"] == ref, f"request r{i} ({method}) differs from its solo vanilla output"
    steps_verified = 0
    for verified, per_shard in deltas:
        for k, d in enumerate(per_shard):
            # exactly one batched call per shard per step (commits and arriving prompts ride in it)
            assert d.get("verify_batch", 0) == int(verified), (k, d)
            others = {m: v for m, v in d.items() if m != "verify_batch" and v}
            assert not others, f"shard {k} got extra calls in a step: {others}"
        steps_verified += verified
    assert steps_verified == target.batch_calls
    assert target.batch_calls < sum(NEW)  # sequences really shared steps
    assert (accepted > 0) == (method == "retrieval")  # the drafter really speculated


def test_chunked_prefill_over_shards_equals_the_in_process_chunked_runs(tiny, shards):
    """``prefill_chunk_tokens=4`` over the shards: each chunk rides in the step's one call per
    shard (no ``prefill_slot`` call), and every output equals the in-process solo run with the same
    chunks; the solo Ray path (later chunks as chain-shaped tree passes) gives the same tokens."""
    target = _target(shards)
    assert target.folds_prefills  # a chunk is a folded prompt row over its slot's earlier chunks
    cfg = [EngineConfig(max_new_tokens=n, sampling=GREEDY, prefill_chunk_tokens=4) for n in NEW]
    refs = [generate_vanilla(tiny, p, c).tokens for p, c in zip(PROMPTS, cfg)]
    assert [generate_vanilla(target, p, c).tokens for p, c in zip(PROMPTS[1:2], cfg[1:2])] == refs[1:2]
    engine = BatchEngine(target, None, BatchConfig(max_sequences=4, max_tokens_per_sequence=64,
                                                   prefill_chunk_tokens=4))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    before, step, forwards = _counts(shards), 0, 0
    while step <= max(ARRIVE) or engine.has_work():
        for i, (p, n, at) in enumerate(zip(PROMPTS, NEW, ARRIVE)):
            if at == step:
                engine.add(Request(f"r{i}", p, n, GREEDY))
        forwards += bool(engine.num_live or engine.num_prefilling or engine.num_waiting)
        for u in engine.step():
            out[u.request_id].extend(u.new_tokens)
        step += 1
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == refs
    for a, b in zip(_counts(shards), before):
        assert a.get("verify_batch", 0) - b.get("verify_batch", 0) == forwards
        assert a.get("prefill_slot", 0) == b.get("prefill_slot", 0)


def test_shard_killed_mid_generation_recovers_with_identical_output(tiny, refs, shards):
    import ray

    target = _target(shards)
    before = ray.get(shards[1].incarnation.remote(), timeout=60)
    out, _, _ = _run(target, shards, lambda: build_drafter(RETRIEVAL, tiny), kill_at=4)
    assert target.recoveries >= 1
    assert ray.get(shards[1].incarnation.remote(), timeout=60) != before  # Ray really restarted it
    for i, ref in enumerate(refs):
        assert out[f"r{i}"] == ref, f"request r{i} differs from the no-fault output after the shard restart"


def test_call_timeout_names_the_shard(shards):
    target = _target(shards)
    engine = BatchEngine(target, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=32))
    engine.add(Request("a", PROMPTS[0], 4, GREEDY))
    engine.step()
    target.calls = ShardCallConfig(call_timeout_s=1e-4, restart_timeout_s=60)
    with pytest.raises(ShardTimeoutError, match=r"target shard 0 did not answer verify step .* within "
                                                r"call_timeout_s=0.0001s"):
        engine.step()


def test_call_config_is_validated():
    with pytest.raises(ValueError, match=r"shard_calls.call_timeout_s must be in \(0, 86400\]"):
        ShardCallConfig(call_timeout_s=0)
    with pytest.raises(ValueError, match=r"shard_calls.max_recoveries must be an integer in \[0, 100\]"):
        ShardCallConfig(max_recoveries=-1)


@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_shard_batch_step_equals_target_verify_batch_bitwise(layout):
    """No Ray: two TargetShard objects chained in process vs the in-process batched target (both
    layouts: transformers' padded layers, and the lean loop's flat pass)."""
    model = tiny_llama(lm_head_scale=3.0, lean=layout == "flat")
    target = tiny_target(model)
    shards = [TargetShard(ShardSpec("tiny", "float32", k, 2, 2 * k, 2 * k + 2), model=model) for k in range(2)]
    assert target.batch_layout.value == layout and all(s.batch_layout().value == layout for s in shards)
    for s in shards:
        s.new_pool("p", 4, 64)
    pool = target.new_slot_pool(4, 64)
    rng = random.Random(7)
    states = []
    for slot, n in enumerate((5, 11, 2)):
        ids = [rng.randrange(64) for _ in range(n)]
        state, logits, _ = target.prefill_slot(pool, ids)
        hidden = None
        for s in shards:
            hidden, _ = s.prefill_slot("p", slot, StepInput(StepKind.PREFILL, np.array(ids)), hidden)
        assert torch.equal(logits, hidden.to_torch())
        states.append(state)
    comps: tuple[Compaction, ...] = ()
    for step in range(5):
        trees = [random_tree(rng, rng.randrange(64), 64, max_nodes=1 if step == b else 9) for b in range(len(states))]
        bases = tuple(st.length for st in states)
        fold = layout == "flat" and step == 2  # a prompt arrives: prefilled in the step (slot 3)
        prompt = [rng.randrange(64) for _ in range(7)] if fold else None
        if fold:
            arrived = target.empty_slot(pool)
            fwds, starts = target.step_batch(states, trees, [(arrived, prompt)], need_aux=True)
        else:
            fwds, starts = target.verify_batch(states, trees, need_aux=True), []
        tts = [t.to_tensors() for t in trees]
        batch = BatchStepInput(tuple(range(len(states))), bases,
                               tuple((t.tokens.numpy(), t.depths.numpy(), t.ancestor_mask.numpy()) for t in tts),
                               TINY_AUX_LAYERS, comps, prompt_slots=(3,) if fold else (),
                               prompts=(np.array(prompt),) if fold else ())
        hidden, aux = None, {}
        for s in shards:
            hidden, part = s.verify_batch("p", batch, hidden)
            aux.update(part)
        assert torch.equal(torch.cat([f.logits for f in fwds] + [p.logits.view(1, -1) for p in starts]),
                           hidden.to_torch())
        got_aux = torch.cat([aux[i].to_torch() for i in TINY_AUX_LAYERS], -1)
        assert torch.equal(torch.cat([f.aux_hidden for f in fwds] + [p.aux_hidden for p in starts]), got_aux)
        new = []
        for st, tree, base in zip(states, trees, bases):
            path = [0]  # the last child at each level: rows must move
            while tree.children(path[-1]):
                path.append(tree.children(path[-1])[-1])
            target.commit_slot(st, tree, path)
            new.append(Compaction(st.slot, base, tuple(path)))
        comps = tuple(new)
        if fold:
            states.append(arrived)
