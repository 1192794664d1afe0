"""The lean decoder loop computes exactly what transformers' forward computes (bit for bit, on the
real SmolLM2 weights: prefill, decode steps, tree verification, batched verification, auxiliary
features at every index including the final-normed one), and it is used only where the model
qualifies and autograd is off."""

from __future__ import annotations

import pytest
import torch

from speculation import assets
from speculation.lean_forward import LeanDecoder
from speculation.output_head import onednn_available
from speculation.target import TargetModel
from speculation.tree import DraftTree, NodeSource

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch has no oneDNN on this platform")


def _branching_tree(root: int) -> DraftTree:
    """root -> a -> b, root -> c, a -> d: two branches of depth 2 and one of depth 1."""
    tree = DraftTree(root)
    a = tree.add(0, 11, 0.0, NodeSource.DRAFTER)
    tree.add(a, 12, 0.0, NodeSource.DRAFTER)
    tree.add(0, 13, 0.0, NodeSource.DRAFTER)
    tree.add(a, 14, 0.0, NodeSource.DRAFTER)
    return tree


def _twins(model, tok) -> tuple[TargetModel, TargetModel]:
    num_layers = model.config.num_hidden_layers
    aux = (0, num_layers // 2, num_layers)  # the embeddings, a middle layer's input, the normed output
    lean, plain = TargetModel(model, tok, aux_layers=aux), TargetModel(model, tok, aux_layers=aux, lean=False)
    assert lean.lean is not None and plain.lean is None
    return lean, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_passes_equal_the_transformers_forward_bit_for_bit(dtype, request):
    if dtype == torch.float32:
        target = request.getfixturevalue("smol_fp32")
        model, tok = target.model, target.tokenizer
    else:
        model, tok = assets.load_model_and_tokenizer("smollm2-135m", dtype)
    lean, plain = _twins(model, tok)
    prompt = assets.encode_turn(tok, [], "Name three uses of a paperclip.")

    sl, logits_l, aux_l = lean.prefill(prompt, need_aux=True)
    sp, logits_p, aux_p = plain.prefill(prompt, need_aux=True)
    assert torch.equal(logits_l, logits_p) and torch.equal(aux_l, aux_p)
    assert aux_l.shape == (len(prompt), 3 * model.config.hidden_size)

    token = int(logits_p.argmax())
    for _ in range(3):
        step_l, step_p = lean.decode(sl, token), plain.decode(sp, token)
        assert torch.equal(step_l, step_p)
        token = int(step_p.argmax())

    tree = _branching_tree(token)
    fwd_l, fwd_p = lean.verify(sl, tree, need_aux=True), plain.verify(sp, tree, need_aux=True)
    assert torch.equal(fwd_l.logits, fwd_p.logits) and torch.equal(fwd_l.aux_hidden, fwd_p.aux_hidden)
    lean.commit(sl, tree, [0, 1, 4])  # a branch that is not the first-added one: rows move
    plain.commit(sp, tree, [0, 1, 4])
    assert torch.equal(lean.decode(sl, 5), plain.decode(sp, 5))
    root_l, root_p = lean.verify(sl, DraftTree(7)), plain.verify(sp, DraftTree(7))  # a root-only tree
    assert torch.equal(root_l.logits, root_p.logits)

    # Continuous batching: two slots of different lengths, trees of different sizes (padding rows).
    pools = lean.new_slot_pool(2, 256), plain.new_slot_pool(2, 256)
    states = [[t.prefill_slot(pool, ids)[0] for ids in (prompt, prompt[:9])]
              for t, pool in zip((lean, plain), pools)]
    small = DraftTree(7)
    small.add(0, 8, 0.0, NodeSource.DRAFTER)
    trees = [_branching_tree(3), small]
    out_l = lean.verify_batch(states[0], trees, need_aux=True)
    out_p = plain.verify_batch(states[1], trees, need_aux=True)
    for a, b in zip(out_l, out_p):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.aux_hidden, b.aux_hidden)


def test_the_lean_loop_is_used_only_where_the_model_qualifies_and_autograd_is_off(smol_fp32):
    lean = LeanDecoder.from_model(smol_fp32.model)
    assert lean is not None
    with torch.inference_mode():
        assert lean.applies() and lean.layers.applies(torch.zeros(1, 1, 576))
    assert not lean.applies()  # autograd on: oneDNN's packed op has no backward, transformers' forward runs
    # Transformers' separate projections (no grouping) and Gemma-3 (its own norm, sliding
    # windows, soft-capping family) keep the model's own forward.
    assert LeanDecoder.from_model(assets.load_model("smollm2-135m", torch.float32, fuse=False)) is None
    gemma = assets.load_model("gemma3-270m", torch.float32)
    assert LeanDecoder.from_model(gemma) is None and TargetModel(gemma).lean is None


def test_greedy_decoding_through_the_lean_loop_matches_transformers_generate(smol_fp32):
    """The lean target's vanilla greedy tokens are transformers' own ``generate`` tokens."""
    from speculation.config import EngineConfig, SamplingConfig
    from speculation.engine import generate_vanilla

    prompt = assets.encode_turn(smol_fp32.tokenizer, [], "Write a haiku about autumn rain.")
    greedy = EngineConfig(max_new_tokens=32, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0))
    ours = generate_vanilla(smol_fp32, prompt, greedy).tokens
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = smol_fp32.model.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
    assert ours == ref[0, len(prompt):].tolist()


def test_pipeline_shards_run_their_layer_ranges_through_the_lean_loop_bit_for_bit(smol_fp32):
    """Two in-process ``TargetShard`` pieces of the real SmolLM2 (each a ``LeanLayers`` over its own
    range, cache updates at the model's layer indices) equal transformers' forward bit for bit:
    prefill with auxiliary features from both shards, then a branching tree."""
    import numpy as np

    from workers.shard import ShardSpec, StepInput, StepKind, TargetShard

    model, tok = smol_fp32.model, smol_fp32.tokenizer
    L = model.config.num_hidden_layers
    aux = (2, L // 2, L - 3)
    plain = TargetModel(model, tok, aux_layers=aux, lean=False)
    shards = [TargetShard(ShardSpec("smollm2-135m", "float32", k, 2, r.start, r.stop), model=model, tokenizer=tok)
              for k, r in enumerate((range(0, L // 2 + 1), range(L // 2 + 1, L)))]
    assert all(s._lean is not None for s in shards)
    assert sorted(shards[1]._lean.layers) == list(range(L // 2 + 1, L))

    def run(step: StepInput):
        hidden, parts = None, {}
        for shard in shards:
            hidden, part = shard.forward("s", step, hidden)
            parts.update(part)
        return hidden.to_torch(), torch.cat([parts[i].to_torch() for i in aux], -1)

    prompt = assets.encode_turn(tok, [], "Name three uses of a paperclip.")
    state, logits, want_aux = plain.prefill(prompt, need_aux=True)
    got, got_aux = run(StepInput(StepKind.PREFILL, np.array(prompt), aux_layers=aux))
    assert torch.equal(got, logits) and torch.equal(got_aux, want_aux)
    tree = _branching_tree(int(logits.argmax()))
    fwd = plain.verify(state, tree, need_aux=True)
    tt = tree.to_tensors()
    got, got_aux = run(StepInput(StepKind.TREE, tt.tokens.numpy(), tt.depths.numpy(), tt.ancestor_mask.numpy(), aux))
    assert torch.equal(got, fwd.logits) and torch.equal(got_aux, fwd.aux_hidden)
