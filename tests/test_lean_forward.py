"""The lean decoder loop computes what transformers' forward computes (bit for bit for multi-token
passes on the real SmolLM2 weights: prefill, tree verification, auxiliary features at every index
including the final-normed one; to rounding for single-token passes, whose GEMMs run on two rows),
its batched verify equals its solo verify bit for bit (batch invariance), and it is used only where
the model qualifies and autograd is off."""

from __future__ import annotations

import pytest
import torch

from speculation import assets
from speculation.model.lean_forward import LeanDecoder
from speculation.model.output_head import onednn_available
from speculation.model.target import TargetModel
from speculation.spec.tree import DraftTree, NodeSource

pytestmark = [pytest.mark.skipif(not onednn_available(), reason="torch has no oneDNN on this platform"),
              pytest.mark.slow]  # SmolLM2's (and Gemma's) real weights, in fp32 and bf16

needs_bf16_onednn = pytest.mark.skipif(
    not onednn_available(torch.bfloat16),
    reason="oneDNN's bf16 kernels need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; this CPU has neither, so a "
    "bf16 model runs transformers' own forward (no lean loop to test)",
)
BF16 = pytest.param(torch.bfloat16, marks=needs_bf16_onednn, id="bfloat16")


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


def _load(dtype, request) -> tuple:
    if dtype == torch.float32:
        target = request.getfixturevalue("smol_fp32")
        return target.model, target.tokenizer
    return assets.load_model_and_tokenizer("smollm2-135m", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_lean_passes_equal_the_transformers_forward_bit_for_bit(dtype, request):
    """Multi-token passes (prefill, tree verify, after a commit that moves rows) are transformers'
    forward bit for bit; single-token passes (decode, a root-only tree) run every GEMM on two rows
    where the one-row kernel sums differently (:class:`speculation.model.lean_forward.PackedGemm`, for
    batch invariance), so they equal it to rounding."""
    model, tok = _load(dtype, request)
    lean, plain = _twins(model, tok)
    prompt = assets.encode_turn(tok, [], "Name three uses of a paperclip.")

    sl, logits_l, aux_l = lean.prefill(prompt, need_aux=True)
    sp, logits_p, aux_p = plain.prefill(prompt, need_aux=True)
    assert torch.equal(logits_l, logits_p) and torch.equal(aux_l, aux_p)
    assert aux_l.shape == (len(prompt), 3 * model.config.hidden_size)

    tree = _branching_tree(int(logits_p.argmax()))
    fwd_l, fwd_p = lean.verify(sl, tree, need_aux=True), plain.verify(sp, tree, need_aux=True)
    assert torch.equal(fwd_l.logits, fwd_p.logits) and torch.equal(fwd_l.aux_hidden, fwd_p.aux_hidden)
    lean.commit(sl, tree, [0, 1, 4])  # a branch that is not the first-added one: rows move
    plain.commit(sp, tree, [0, 1, 4])
    again_l, again_p = lean.verify(sl, _branching_tree(5)), plain.verify(sp, _branching_tree(5))
    assert torch.equal(again_l.logits, again_p.logits)
    lean.commit(sl, tree, [0])
    plain.commit(sp, tree, [0])

    token = int(again_p.logits[0].argmax())
    for _ in range(3):
        step_l, step_p = lean.decode(sl, token), plain.decode(sp, token)
        _close(step_l, step_p)
        token = int(step_p.argmax())
    root_l, root_p = lean.verify(sl, DraftTree(7)), plain.verify(sp, DraftTree(7))  # a root-only tree
    _close(root_l.logits, root_p.logits)

    # Continuous batching: two slots of different lengths, multi-token trees of different sizes.
    # The lean target packs them flat (no padding rows) and attends per row: each row is
    # transformers' forward of that sequence alone, bit for bit. (Transformers' own padded batch
    # is not: in bf16 its short row differs from its solo pass by 4% in relative norm.)
    pool = lean.new_slot_pool(2, 256)
    states = [lean.prefill_slot(pool, ids)[0] for ids in (prompt, prompt[:9])]
    small = DraftTree(7)
    small.add(0, 8, 0.0, NodeSource.DRAFTER)
    trees = [_branching_tree(3), small]
    flat = lean.verify_batch(states, trees, need_aux=True)
    for ids, tree, got in zip((prompt, prompt[:9]), trees, flat):
        want = plain.verify(plain.prefill(ids)[0], tree, need_aux=True)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.aux_hidden, want.aux_hidden)
    padded_pool = plain.new_slot_pool(2, 256)
    padded = plain.verify_batch([plain.prefill_slot(padded_pool, ids)[0] for ids in (prompt, prompt[:9])], trees)
    if dtype == torch.float32:
        for a, b in zip(padded, flat):
            _close(a.logits, b.logits)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to rounding: fp32 within 1e-4; bf16 (8-bit mantissa, compounded over 30 layers)
    within 10% in relative L2 norm. Measured on SmolLM2: rounding differences reach about 5%
    (transformers' padded batch against its own solo pass: 4.4%), a RoPE position off by one
    moves the logits by 40%, one different prompt token by 150%."""
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return
    rel = float((a.float() - b.float()).norm() / b.float().norm())
    assert rel <= 0.10, f"relative L2 difference {rel:.4f}"


def _gemms_batch_invariant(model) -> bool:
    """Whether oneDNN's packed GEMMs give every row the same bits at M = 2 .. 40 as inside a pass of
    64 rows, for each projection shape of ``model`` (a property of the CPU's kernels: true on the
    AVX2 host of BENCHMARKS.md; a one-row product that differs is run on two rows, see
    ``lean_forward.PackedGemm``)."""
    from speculation.model.lean_forward import LeanDecoder

    lean = LeanDecoder.from_model(model)
    layer = next(iter(lean.layers.layers.values()))
    gen = torch.Generator().manual_seed(0)
    for g, k in ((layer.qkv, 576), (layer.wo, 576), (layer.gate_up, 576), (layer.down, 1536), (lean.head, 576)):
        x = torch.randn(64, k, generator=gen).to(lean.layers.dtype)
        full = g(x)
        for m in (1, 2, 3, 5, 17, 40):
            if not torch.equal(g(x[3 : 3 + m]), full[3 : 3 + m]):
                return False
    return True


INVARIANCE_CASES = [
    (torch.float32, False),
    pytest.param(torch.bfloat16, False, marks=needs_bf16_onednn),
    pytest.param(torch.bfloat16, True, marks=needs_bf16_onednn),
]
"""(dtype, batch-invariant mode): the mode must give bits in bf16, where the AMX host's kernels switch
at 33 rows; fp32 needs no limit on the hosts measured (the mode is then a no-op)."""


@needs_bf16_onednn
def test_batch_invariant_products_equal_the_two_row_products_at_every_row_count():
    """In batch-invariant mode every product of SmolLM2 bf16 (each layer shape and the head) gives
    every row of an M-row input the bits of the same row multiplied two rows at a time, for M on
    both sides of the probed limit (the limit is where the kernel switches, or None where it never
    does), and every switch visible with the mode off was found by the probe."""
    model, _ = assets.load_model_and_tokenizer("smollm2-135m", torch.bfloat16)
    lean = LeanDecoder.from_model(model)
    layer = next(iter(lean.layers.layers.values()))
    gen = torch.Generator().manual_seed(7)
    for g in (layer.qkv, layer.wo, layer.gate_up, layer.down, lean.head):
        x = torch.randn(300, g.packed.shape[1], generator=gen).to(torch.bfloat16)
        pairs = torch.cat([g(x[i : i + 2]) for i in range(0, 300, 2)])
        off = {m: torch.equal(g(x[:m]), pairs[:m]) for m in (31, 32, 33, 47, 64, 150, 300)}
        limit = g.set_row_limit(True)
        assert limit is None or limit >= 2
        for m in (1, 3, 31, 32, 33, 47, 64, 150, 300):
            assert torch.equal(g(x[:m]), pairs[:m]), f"{list(g.packed.shape)}: M = {m}, limit {limit}"
        assert all(off.values()) or limit is not None, off  # a switch the test sees, the probe found
        assert g.set_row_limit(False) is None and g.row_limit is None


@needs_bf16_onednn
def test_batch_invariant_mode_needs_the_lean_forward():
    from speculation.config import ConfigError

    model, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.bfloat16)
    plain = TargetModel(model, tok, lean=False)
    assert plain.batch_invariant_rows is None
    with pytest.raises(ConfigError, match="batch_invariant needs the lean forward"):
        TargetModel(model, tok, lean=False, batch_invariant=True)
    on = TargetModel(model, tok, batch_invariant=True)
    assert on.batch_invariant_rows and all(v is None or v >= 2 for v in on.batch_invariant_rows.values())
    assert "[49152, 576] bfloat16" in on.batch_invariant_rows  # the output head is covered


@pytest.mark.parametrize(("dtype", "invariant"), INVARIANCE_CASES)
def test_batched_verify_equals_the_solo_verify_bit_for_bit(dtype, invariant, request):
    """Batch invariance: four chat prompts of different lengths verified together (trees of 1 to 6
    nodes, one-token rows among them, rows that move on commit) give every sequence the logits and
    features of its own solo verify **bit for bit**, step after step, wherever the CPU's GEMMs are
    batch-invariant (probed; elsewhere to rounding). Two of the prompts (one of 200+ tokens) are
    prefilled inside the first batched step (``step_batch``): their next-token logits and features
    equal their solo prefill's. Attention runs per row over the row's own keys with the solo call,
    and every GEMM runs on at least two rows."""
    import random

    from tests.helpers import random_tree

    model, tok = _load(dtype, request)
    target = TargetModel(model, tok, batch_invariant=invariant)
    exact = invariant or _gemms_batch_invariant(model)  # the mode promises bits whatever the kernels
    texts = ["Write a haiku about the sea.", "Hi", "List three prime numbers and explain why they are prime.",
             "Translate 'good morning, my friend' into French, please. " * 12]  # the last: 200+ tokens
    prompts = [assets.encode_turn(tok, [], t) for t in texts]
    pool = target.new_slot_pool(4, 512)
    solos, solo_starts = zip(*((s, (lg, aux)) for s, lg, aux in (target.prefill(p, need_aux=True) for p in prompts)))
    # two sequences prefilled on their own, two prefilled inside the first batched step
    states = [target.prefill_slot(pool, p, need_aux=True)[0] for p in prompts[:2]]
    rng = random.Random(3)
    first = [DraftTree(prompts[0][-1]), random_tree(rng, prompts[1][-1], 2000, max_nodes=6)]
    arriving = [target.empty_slot(pool) for _ in prompts[2:]]
    fwds, starts = target.step_batch(states, first, list(zip(arriving, prompts[2:])), need_aux=True)
    for b, (fwd, tree) in enumerate(zip(fwds, first)):
        ref = target.verify(solos[b], tree, need_aux=True)
        target.commit_slot(states[b], tree, [0])
        target.commit(solos[b], tree, [0])
        assert torch.equal(fwd.logits, ref.logits) if exact else _close(fwd.logits, ref.logits) is None
    for p, (start, (logits, aux)) in enumerate(zip(starts, solo_starts[2:])):
        assert start.aux_hidden.shape == aux.shape and arriving[p].tokens == prompts[2 + p]
        if exact:
            assert torch.equal(start.logits, logits) and torch.equal(start.aux_hidden, aux), (
                f"prefill {p} ({len(prompts[2 + p])} tokens) folded into a step: max |diff| "
                f"{float((start.logits - logits).abs().max())}")
        else:
            _close(start.logits, logits)
    states += arriving
    for step in range(4):
        trees = [DraftTree(p[-1]) if (b + step) % 3 == 0 else random_tree(rng, p[-1], 2000, max_nodes=6)
                 for b, p in enumerate(prompts)]
        fwds = target.verify_batch(states, trees, need_aux=True)
        for b, (st, so, tree, fwd) in enumerate(zip(states, solos, trees, fwds)):
            ref = target.verify(so, tree, need_aux=True)
            if exact:
                assert torch.equal(fwd.logits, ref.logits) and torch.equal(fwd.aux_hidden, ref.aux_hidden), (
                    f"step {step}, row {b} ({len(tree)} nodes): max |diff| "
                    f"{float((fwd.logits - ref.logits).abs().max())}")
            else:
                _close(fwd.logits, ref.logits)
            path = [0, *tree.children(0)[-1:]]  # the last child: rows move
            target.commit_slot(st, tree, path)
            target.commit(so, tree, path)
            assert st.tokens == so.tokens


@pytest.mark.parametrize(("dtype", "invariant"), INVARIANCE_CASES)
def test_chunked_prefill_rows_equal_the_solo_chunked_prefill_bit_for_bit(dtype, invariant, request):
    """Chunked prefill: a 199-token and a 47-token prompt prefilled 32 tokens per batched step
    (each later chunk a masked row over its slot's earlier chunks) beside a live sequence that
    verifies trees, give the logits and features of the solo chunked prefill (``prefill(...,
    chunk_tokens=32)``) bit for bit wherever the GEMMs are batch-invariant, and the KV they leave
    verifies like the solo one. The chunked prefill equals the one-forward prefill to rounding."""
    import random

    from tests.helpers import random_tree

    model, tok = _load(dtype, request)
    target = TargetModel(model, tok, batch_invariant=invariant)
    exact = invariant or _gemms_batch_invariant(model)  # the mode promises bits whatever the kernels
    C = 32
    texts = ["Hi", "List three prime numbers and explain why they are prime, then name a fourth one.",
             "Translate 'good morning, my friend' into French, please. " * 12]
    prompts = [assets.encode_turn(tok, [], t) for t in texts]
    assert len(prompts[2]) > 3 * C and C < len(prompts[1]) < 2 * C
    pool = target.new_slot_pool(3, 512)
    live = target.prefill_slot(pool, prompts[0])[0]
    live_solo = target.prefill(prompts[0])[0]
    arriving = [target.empty_slot(pool) for _ in prompts[1:]]
    solo = [target.prefill(p, need_aux=True, chunk_tokens=C) for p in prompts[1:]]
    whole = [target.prefill(p, need_aux=True) for p in prompts[1:]]
    rng = random.Random(5)
    got: dict[int, tuple] = {}
    auxes: dict[int, list] = {0: [], 1: []}
    while len(got) < 2:
        tree = random_tree(rng, live.tokens[-1], 2000, max_nodes=4)
        rows = [(a, p[a.length: a.length + C]) for a, p in zip(arriving, prompts[1:]) if a.length < len(p)]
        fwds, starts = target.step_batch([live], [tree], rows, need_aux=True)
        ref = target.verify(live_solo, tree)
        assert torch.equal(fwds[0].logits, ref.logits) if exact else _close(fwds[0].logits, ref.logits) is None
        target.commit_slot(live, tree, [0])
        target.commit(live_solo, tree, [0])
        for (a, _), start in zip(rows, starts):
            p = arriving.index(a)
            auxes[p].append(start.aux_hidden)
            if a.length == len(prompts[1 + p]):
                got[p] = (start.logits, torch.cat(auxes[p]))
    for p in range(2):
        (s_logits, s_aux), (w_state, w_logits, w_aux) = got[p], whole[p]
        state, logits, aux = solo[p]
        assert arriving[p].tokens == prompts[1 + p] and s_aux.shape == aux.shape
        if exact:
            assert torch.equal(s_logits, logits) and torch.equal(s_aux, aux), (
                f"prompt {p}: chunked rows against the solo chunked prefill, max |diff| "
                f"{float((s_logits - logits).abs().max())}")
        else:
            _close(s_logits, logits)
        _close(logits, w_logits)  # chunked against one forward: to rounding
        tree = random_tree(rng, prompts[1 + p][-1], 2000, max_nodes=6)
        fwd = target.verify_batch([arriving[p]], [tree])[0]
        ref = target.verify(state, tree)
        assert torch.equal(fwd.logits, ref.logits) if exact else _close(fwd.logits, ref.logits) is None


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
    from speculation.engine.solo import generate_vanilla

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_single_half_precision_query_attends_in_fp32(dtype):
    """One query token in bf16/fp16 (a decode row) attends in fp32 and rounds back: the output is
    fp32 SDPA of the widened tensors, bit for bit, and within rounding of the half-precision call;
    several queries (a tree, a prompt) keep the half-precision call."""
    import types

    import torch.nn.functional as F

    from speculation.model.lean_forward import LeanLayers

    layers = types.SimpleNamespace(scaling=0.125, num_heads=9, num_kv_heads=3, widen_single_query=True)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 3, 300, 64, generator=gen).to(dtype) for _ in range(2))
    for t in (1, 4):
        q = torch.randn(1, 9, t, 64, generator=gen).to(dtype)
        mask = None if t == 1 else torch.ones(1, 1, t, 300, dtype=torch.bool).tril(300 - t)
        got = LeanLayers._attend(layers, q, k, v, mask, False)
        half = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
        wide = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                              enable_gqa=True).to(dtype)
        assert got.dtype == dtype
        assert torch.equal(got, wide if t == 1 else half)
        torch.testing.assert_close(got.float(), half.float(), rtol=2e-2, atol=2e-2)
