"""``TargetShard`` pieces chained in one process equal ``TargetModel`` bit for bit (no Ray; ~2 s).

Covers prefill, decode, tree verify (multi-branch trees, T = 1 included), KV compaction with
moved rows, truncate, aux hidden states gathered from whichever shard owns each layer, the
memory claim (each shard keeps only its layers), and the error paths.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.topology import Topology
from tests.helpers import TINY_AUX_LAYERS, random_tree, single_thread, tiny_llama, tiny_target, tiny_tokenizer
from workers.shard import ShardSpec, StepInput, StepKind, TargetShard, UnknownSequenceError, UnsupportedModelError


def _shards(model, n: int, max_sequences: int = 4) -> list[TargetShard]:
    ranges = Topology(shards=n).layer_ranges(model.config.num_hidden_layers)
    return [
        TargetShard(
            ShardSpec("tiny", "float32", k, n, r.start, r.stop, max_sequences=max_sequences), model=model
        )
        for k, r in enumerate(ranges)
    ]


def _run(shards, seq: str, step: StepInput):
    hidden, aux = None, {}
    for s in shards:
        hidden, part = s.forward(seq, step, hidden)
        aux.update(part)
    cat = torch.cat([aux[i].to_torch() for i in step.aux_layers], -1) if step.aux_layers else None
    return hidden.to_torch(), cat


def _tree_step(tree, aux=TINY_AUX_LAYERS) -> StepInput:
    tt = tree.to_tensors()
    return StepInput(StepKind.TREE, tt.tokens.numpy(), tt.depths.numpy(), tt.ancestor_mask.numpy(), aux)


@pytest.mark.parametrize("n_shards", [1, 2, 3, 4])
def test_sharded_forward_is_bitwise_equal(n_shards):
    with single_thread():
        model = tiny_llama(lm_head_scale=3.0)
        target = tiny_target(model)
        shards = _shards(model, n_shards)
        rng = random.Random(n_shards)
        ids = [rng.randrange(64) for _ in range(11)]
        state, logits, aux = target.prefill(ids, need_aux=True)
        got_logits, got_aux = _run(
            shards, "s", StepInput(StepKind.PREFILL, np.array(ids), aux_layers=TINY_AUX_LAYERS)
        )
        assert torch.equal(logits, got_logits) and torch.equal(aux, got_aux)
        for step in range(8):
            tree = random_tree(rng, rng.randrange(64), 64, max_nodes=1 if step == 0 else 10)
            fwd = target.verify(state, tree, need_aux=True)
            got_logits, got_aux = _run(shards, "s", _tree_step(tree))
            assert torch.equal(fwd.logits, got_logits) and torch.equal(fwd.aux_hidden, got_aux)
            # Accept a path that is not 0..m (rows must move) when the tree has one.
            path = [0]
            while tree.children(path[-1]):
                path.append(tree.children(path[-1])[-1])
            target.commit(state, tree, path)
            for s in shards:
                s.commit("s", len(tree), path)
            tok = rng.randrange(64)
            assert torch.equal(
                target.decode(state, tok), _run(shards, "s", StepInput(StepKind.DECODE, np.array([tok])))[0]
            )
        assert all(s.length("s") == state.length for s in shards)
        target.truncate(state, 12)
        for s in shards:
            s.truncate("s", 12)
        assert torch.equal(
            target.decode(state, 3), _run(shards, "s", StepInput(StepKind.DECODE, np.array([3])))[0]
        )


def test_shards_keep_only_their_modules():
    model = tiny_llama()
    shards = _shards(model, 2)
    total = sum(p.numel() for p in model.parameters())
    first, last = shards
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert last.embed_tokens is None and last.lm_head is not None and last.norm is not None
    assert sorted(first.layers) == ["0", "1"] and sorted(last.layers) == ["2", "3"]
    assert first.parameter_count() + last.parameter_count() == total


def test_unknown_and_evicted_sequences_are_clear_errors():
    model = tiny_llama()
    shards = _shards(model, 1, max_sequences=2)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'nope'"):
        _run(shards, "nope", StepInput(StepKind.DECODE, np.array([1])))
    for seq in ("a", "b", "c"):
        _run(shards, seq, StepInput(StepKind.PREFILL, np.array([1, 2, 3])))
    assert shards[0].sequences() == ["b", "c"]
    with pytest.raises(UnknownSequenceError, match="max_sequences=2"):
        _run(shards, "a", StepInput(StepKind.DECODE, np.array([1])))


def test_bad_layer_range_and_missing_hidden():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"layer range \[3, 9\)"):
        TargetShard(ShardSpec("tiny", "float32", 0, 1, 3, 9), model=model)
    second = TargetShard(ShardSpec("tiny", "float32", 1, 2, 2, 4), model=model)
    with pytest.raises(ValueError, match="needs the previous shard's hidden states"):
        second.forward("s", StepInput(StepKind.PREFILL, np.array([1, 2])), None)


def test_sliding_window_models_are_refused():
    model = tiny_llama()
    model.config.layer_types = ["sliding_attention", "full_attention"] * 2
    with pytest.raises(UnsupportedModelError, match="full-attention decoders only"):
        TargetShard(ShardSpec("tiny", "float32", 0, 1, 0, 4), model=model)


def test_bf16_travels_exactly():
    from workers.wire import to_wire

    t = torch.randn(3, 5).to(torch.bfloat16)
    w = to_wire(t)
    assert w.array.dtype == np.int16 and torch.equal(w.to_torch(), t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_forward_on_cuda_matches(dtype):
    """The GPU placement path: layers on CUDA, hidden states through the CPU wire, same logits."""
    model = tiny_llama(lm_head_scale=3.0).to("cuda", dtype)
    target = tiny_target(model)
    ranges = Topology(shards=2).layer_ranges(4)
    shards = [
        TargetShard(
            ShardSpec("tiny", str(dtype).removeprefix("torch."), k, 2, r.start, r.stop, device="cuda"),
            model=model,
        )
        for k, r in enumerate(ranges)
    ]
    rng = random.Random(0)
    ids = [rng.randrange(64) for _ in range(9)]
    state, logits, aux = target.prefill(ids, need_aux=True)
    got, got_aux = _run(shards, "s", StepInput(StepKind.PREFILL, np.array(ids), aux_layers=TINY_AUX_LAYERS))
    assert torch.equal(logits.cpu(), got) and torch.equal(aux.cpu(), got_aux)
    for _ in range(4):
        tree = random_tree(rng, rng.randrange(64), 64, max_nodes=10)
        fwd = target.verify(state, tree, need_aux=True)
        got, got_aux = _run(shards, "s", _tree_step(tree))
        assert torch.equal(fwd.logits.cpu(), got) and torch.equal(fwd.aux_hidden.cpu(), got_aux)
        target.commit(state, tree, [0])
        for s in shards:
            s.commit("s", len(tree), [0])


def _layer0_inputs(model) -> tuple[list, object]:
    """Record the attention mask and positions every call hands to decoder layer 0."""
    seen: list = []

    def hook(_module, _args, kwargs):
        seen.append((kwargs["attention_mask"], kwargs["position_ids"]))

    return seen, model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("n_shards", [1, 2])
def test_tree_mask_positions_and_eos_are_the_target_models(n_shards):
    """For the same model and tree, layer 0 receives the same mask and positions from a shard
    pipeline as from TargetModel, and both stop at the same EOS set (generation config and
    tokenizer both count)."""
    from speculation.model.target import TargetModel

    with single_thread():
        model = tiny_llama(eos_token_id=5)
        tok = tiny_tokenizer(eos_token=7)
        target = TargetModel(model, tok, aux_layers=TINY_AUX_LAYERS)
        ranges = Topology(shards=n_shards).layer_ranges(4)
        shards = [
            TargetShard(ShardSpec("tiny", "float32", k, n_shards, r.start, r.stop), model=model, tokenizer=tok)
            for k, r in enumerate(ranges)
        ]
        assert target.eos_token_ids == frozenset({5, 7})
        assert all(s.info.eos_token_ids == target.eos_token_ids for s in shards)
        rng = random.Random(n_shards)
        ids = [rng.randrange(64) for _ in range(9)]
        state, _, _ = target.prefill(ids)
        _run(shards, "s", StepInput(StepKind.PREFILL, np.array(ids)))
        seen, handle = _layer0_inputs(model)
        try:
            for _ in range(3):
                tree = random_tree(rng, rng.randrange(64), 64, max_nodes=10)
                target.verify(state, tree)
                _run(shards, "s", _tree_step(tree, aux=()))
                (mask_ref, pos_ref), (mask_got, pos_got) = seen[-2:]
                assert mask_ref.shape == (1, 1, len(tree), state.length)
                assert torch.equal(mask_ref, mask_got) and torch.equal(pos_ref, pos_got)
                target.commit(state, tree, [0])
                for s in shards:
                    s.commit("s", len(tree), [0])
        finally:
            handle.remove()


def test_shard_loads_only_its_layer_range_through_the_one_loader(tmp_path):
    """A shard given a model directory loads it through speculation.assets (the loader every
    target uses) and keeps its layers only; its forward still equals TargetModel's."""
    from speculation import assets
    from speculation.model.target import TargetModel

    with single_thread():
        model = tiny_llama(lm_head_scale=3.0)
        model.save_pretrained(tmp_path)
        tiny_tokenizer().save_pretrained(tmp_path)
        assert assets.model_num_layers(str(tmp_path)) == 4
        # The reference loads the same files the same way (a copy made another way may round
        # differently in the last bit: weight layout picks the matmul kernel).
        target = TargetModel(*assets.load_model_and_tokenizer(str(tmp_path)), aux_layers=TINY_AUX_LAYERS)
        shards = [TargetShard(ShardSpec(str(tmp_path), "float32", k, 2, 2 * k, 2 * k + 2)) for k in range(2)]
        assert sorted(shards[1].layers) == ["2", "3"]
        assert sum(s.parameter_count() for s in shards) == sum(p.numel() for p in model.parameters())
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        _, logits, aux = target.prefill(ids, need_aux=True)
        got, got_aux = _run(shards, "s", StepInput(StepKind.PREFILL, np.array(ids), aux_layers=TINY_AUX_LAYERS))
        assert torch.equal(logits, got) and torch.equal(aux, got_aux)


def test_both_targets_satisfy_the_target_backend_protocol():
    """TargetModel and RayTargetBackend are TargetBackends structurally (no inheritance), with the
    protocol's method signatures (parameter names, in order)."""
    import inspect

    from cluster.backend import RayTargetBackend
    from speculation.engine.sequence import TargetBackend
    from speculation.model.target import TargetModel
    from workers.shard import TargetInfo

    info = TargetInfo(num_layers=4, hidden_size=32, vocab_size=64, max_context=256, sliding_window=None,
                      eos_token_ids=frozenset())
    backends = [tiny_target(tiny_llama()), RayTargetBackend([object()], info)]
    methods = ["check_fits", "prefill", "decode", "verify", "commit", "truncate", "release"]
    for backend in backends:
        assert isinstance(backend, TargetBackend), type(backend).__name__
        assert TargetBackend not in type(backend).__mro__
        for name in methods:
            want = list(inspect.signature(getattr(TargetBackend, name)).parameters)
            got = list(inspect.signature(getattr(type(backend), name)).parameters)
            assert got == want, f"{type(backend).__name__}.{name}{got} != protocol {want}"
    assert not isinstance(object(), TargetBackend)
    assert {TargetModel, RayTargetBackend} == {type(b) for b in backends}
