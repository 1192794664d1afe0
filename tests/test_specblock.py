"""SpecBlock unit tests: config, valid-prefix mask, block forward vs an unrolled reference,
cross-block inheritance (inference == training), rank-head-shaped trees, checkpoints, training.

Everything runs on a tiny random Llama target in fp32.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from adaptation.batches import FeatureBatch
from adaptation.data import TrainData, regenerate, regenerated_samples
from adaptation.specblock_loss import SpecBlockFamily, block_forward, block_masks, rank_soft_labels, valid_prefix
from adaptation.trainer import Trainer, TrainConfig
from speculation.config import ConfigError, EngineConfig, SamplingConfig, SpecBlockConfig
from speculation.drafters.base import DraftContext
from speculation.drafters.checkpoint import (
    EAGLE3,
    SPECBLOCK,
    CheckpointError,
    TargetFingerprint,
    load_checkpoint,
    save_checkpoint,
)
from speculation.drafters.eagle3 import random_model as eagle3_random_model
from speculation.drafters.specblock import PendingLeaf, SpecBlockDrafter, build_specblock_drafter, slot_widths
from speculation.drafters.specblock_model import RankClass, rank_bucket, rank_features
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.spec.tree import ROOT
from tests.helpers import shared_tiny_llama, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
K = 4


def _cfg(**kw) -> SpecBlockConfig:
    base = dict(checkpoint="random", draft_vocab_size=VOCAB, block_size=K, max_blocks=2, beam=4, total_tokens=24)
    base.update(kw)
    return SpecBlockConfig(**base)


@functools.lru_cache(maxsize=4)
def _target(seed: int = 3):
    return tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=seed, lm_head_scale=4.0))


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, field",
    [
        ({"block_size": 0}, "specblock.block_size must be in [1, 16]"),
        ({"max_blocks": 9}, "specblock.max_blocks must be in [1, 8]"),
        ({"slot_widths": (2, 4, 6)}, "specblock.slot_widths must be a list of 4"),
        ({"slot_widths": (0, 4, 6, 4)}, "specblock.slot_widths[0]"),
        ({"slot_widths": (2, 4, 65, 4)}, "specblock.slot_widths[] must be in [0, 64]"),
        ({"rank_head": "yes"}, "specblock.rank_head must be true or false"),
        ({"total_tokens": 1}, "specblock.total_tokens must be in [2, 1024]"),
        ({"checkpoint": "/no/such/dir"}, "specblock.checkpoint: no such file"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        SpecBlockConfig(**kw)
    assert field in str(err.value)


def test_train_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"train.shift must be false with num_layers=1"):
        SpecBlockFamily(num_layers=1)
    with pytest.raises(ConfigError, match=r"train.eval_tree.block_size must be <= block_size=2"):
        SpecBlockFamily(block_size=2)
    with pytest.raises(ConfigError, match=r"train.position_weight must be in \(0, 1\]"):
        SpecBlockFamily(position_weight=0.0)


def test_block_size_above_the_checkpoints_is_refused():
    target = _target()
    model = build_specblock_drafter(_cfg(block_size=2), target).model
    with pytest.raises(ValueError, match="block_size = 3 exceeds the checkpoint's K = 2"):
        SpecBlockDrafter(_cfg(block_size=3), model, target.model.get_input_embeddings().weight)


# ---------------------------------------------------------------------------- valid-prefix mask
def test_valid_prefix_mask_on_hand_made_examples():
    T, F = True, False  # noqa: N806
    correct = torch.tensor([[T, T, T, T], [T, F, T, T], [F, T, T, T], [T, T, F, F]])
    base = torch.tensor([[T, T, T, T], [T, T, T, T], [T, T, T, T], [T, F, T, T]])
    chain = valid_prefix(correct, base)
    assert chain.tolist() == [
        [T, T, T, T],  # all right: every slot counts
        [T, T, F, F],  # slot 1 wrong: slots 2, 3 no longer count (slot 1 itself does)
        [T, F, F, F],  # slot 0 wrong: only slot 0 counts
        [T, T, F, F],  # slot 1 outside the assistant text / draft vocab breaks the chain too
    ]


def test_training_counts_exactly_the_valid_prefix_rows():
    """block_forward's counted rows == valid_prefix(correct, base) from an unmasked run."""
    target = _target()
    model = build_specblock_drafter(_cfg(), target).model.float()
    batch = _batch(target, _sequence(20, seed=1))
    t2d = model.target_to_draft()
    embed = target.model.get_input_embeddings().weight.detach()
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    free = block_forward(model, embed, batch, t2d, 1, g(), valid_prefix_mask=False)
    masked = block_forward(model, embed, batch, t2d, 1, g(), valid_prefix_mask=True)
    base = free.counted[0]  # without the mask every base row counts
    expected = valid_prefix(free.correct[0], base) & base
    assert torch.equal(masked.counted[0], expected)
    assert int(base[:, 0].sum()) > 10 and int(expected[:, 1].sum()) < int(base[:, 1].sum())


def test_rank_labels_and_features():
    assert rank_bucket(torch.tensor([1, 2, 4, 5, 10, 11, 400])).tolist() == [0, 1, 1, 2, 2, 3, 3]
    s = rank_soft_labels(torch.tensor([0, 3]))
    assert torch.allclose(s.sum(-1), torch.ones(2))
    assert int(s[0].argmax()) == 0 and int(s[1].argmax()) == 3
    # under-predicting a high class costs more than over-predicting: s(2|3) < s(3|2)-style asymmetry
    assert float(s[1, 2]) < float(rank_soft_labels(torch.tensor([2]))[0, 3])
    phi = rank_features(torch.tensor([[5.0, 1.0, 0.0, -1.0, -2.0] + [-9.0] * 30]))
    assert phi.shape == (1, 15)
    assert phi[0, 10].item() == pytest.approx(4.0) and phi[0, 12].item() == pytest.approx(7.0)  # l1-l2, l1-l5
    assert 0.9 < phi[0, 13].item() < 1.0  # p1 of the top-20 distribution


# ---------------------------------------------------------------------------- reference computation
def _sequence(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _batch(target, tokens: list[int], topk: int = 8) -> FeatureBatch:
    _, _, aux = target.prefill(tokens, need_aux=True)
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([tokens])).logits[0].float()
    vals, idx = logits.topk(topk, dim=-1)
    n = len(tokens)
    return FeatureBatch(aux=aux.float().clone()[None], input_ids=torch.tensor([tokens]),
                        loss_mask=torch.ones(1, n, dtype=torch.bool), topk_values=vals[None], topk_indices=idx[None],
                        num_tokens=n)


def _trace_keys(model, cond, emb, pos, ctx, keys, anchor):
    """One block at one anchor, slot by slot and layer by layer, with explicit key lists (no masks,
    no batching): the shift is ``W [z_k; z_{k-1}]`` per slot, attention a softmax over
    ``ctx(layer)`` keys plus the block's own slots <= k. Records this anchor's keys per layer in
    ``keys[(layer, anchor, slot)]``; returns d ``[K, H]``."""
    a = model.arch
    u = model.query_norm(model.queries[:K])
    z = [model.fuse(torch.cat((cond, model.embed_norm(emb), u[k]))) for k in range(K)]
    rep = a.num_heads // a.num_kv_heads
    for li, layer in enumerate(model.layers):
        if li > 0 and a.shift:
            z = [model.shift_proj[li - 1](torch.cat((z[k], z[max(k - 1, 0)]))) for k in range(K)]
        ck, cv = ctx(li)
        own_k, own_v, nz = [], [], []
        for k in range(K):
            n = layer.input_norm(z[k])
            cos, sin = model.rope(pos[k : k + 1], n.dtype)
            half = a.head_dim // 2
            rot = lambda x: x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin  # noqa: E731
            q = rot(layer.q_proj(n).view(a.num_heads, a.head_dim))
            kk = rot(layer.k_proj(n).view(a.num_kv_heads, a.head_dim))
            vv = layer.v_proj(n).view(a.num_kv_heads, a.head_dim)
            keys[(li, anchor, k)] = (kk, vv)
            own_k.append(kk)
            own_v.append(vv)
            ks, vs = torch.stack(ck + own_k), torch.stack(cv + own_v)
            att = torch.cat([torch.softmax(ks[:, h // rep] @ q[h] / math.sqrt(a.head_dim), 0) @ vs[:, h // rep]
                             for h in range(a.num_heads)])
            nz.append(layer.mlp_residual(z[k] + layer.o_proj(att)))
        z = nz
    return torch.stack(z)


@pytest.mark.parametrize("shift", [True, False])
@torch.no_grad()
def test_block_forward_equals_the_unrolled_reference_and_inheritance_matches_training(shift):
    """Block 1 (training, batched masks) == block 1 (inference, cache) == slot-by-slot reference;
    a later block started from slot M-1 (inference, TTT cache) == training's block 2 with that M
    == the reference over the inherited keys."""
    target = _target()
    drafter = build_specblock_drafter(_cfg(shift=shift), target)
    model = drafter.model.float()
    tokens = _sequence(14, seed=2)
    batch = _batch(target, tokens)
    embed = target.model.get_input_embeddings().weight.detach()
    t2d = model.target_to_draft()
    seed = next(s for s in range(100) if int(torch.randint(1, K + 1, (1,), generator=torch.Generator().manual_seed(s))) == 3)
    M = 3
    train = block_forward(model, embed, batch, t2d, 2, torch.Generator().manual_seed(seed))
    assert train.offsets == [0, M]

    # reference block 1 at every anchor: keys of earlier anchors, then own slots
    S = len(tokens)
    cond = model.condition_from_aux(batch.aux[0])
    emb = embed[torch.tensor(tokens[1:] + [0])]
    pos = torch.arange(S)[:, None] + 1 + torch.arange(K)
    keys: dict = {}
    ref1 = torch.stack([
        _trace_keys(model, cond[i], emb[i], pos[i],
                    lambda li, i=i: ([keys[(li, j, k)][0] for j in range(i) for k in range(K)],
                                     [keys[(li, j, k)][1] for j in range(i) for k in range(K)]), keys, i)
        for i in range(S)
    ])
    assert torch.allclose(train.hidden[0][0], ref1, atol=1e-5)

    # inference: anchors 0..i committed, root anchor i; its block 1 == the reference's
    i = 6
    ctx = DraftContext(tokens=tokens[: i + 2], prompt_len=i + 1)
    drafter.begin(ctx, batch.aux[0, : i + 1])
    drafter.propose(ctx)
    assert torch.allclose(drafter._block1, ref1[i], atol=1e-5)

    # a block inheriting slot M-1 with the teacher token x_{i+1+M}: inference == training block 2
    leaf = PendingLeaf(node=0, token=tokens[i + 1 + M], score=0.0, cond=drafter._block1[M - 1],
                       ttt=list(range(i * K, i * K + M)))
    d2 = drafter._run_block([leaf], scratch=(i + 1) * K)
    assert torch.allclose(d2, train.hidden[1][0, i], atol=1e-5)
    # ... and == the reference over (earlier anchors' block-1 keys) + (anchor i's slots < M)
    c2 = model.condition_from_parent(drafter._block1[M - 1])
    ref2 = _trace_keys(model, c2, embed[tokens[i + 1 + M]], pos[i],
                       lambda li: ([keys[(li, j, k)][0] for j in range(i) for k in range(K)]
                                   + [keys[(li, i, k)][0] for k in range(M)],
                                   [keys[(li, j, k)][1] for j in range(i) for k in range(K)]
                                   + [keys[(li, i, k)][1] for k in range(M)]), {}, -1)
    assert torch.allclose(d2[0], ref2, atol=1e-5)
    assert block_masks(2, 2, []).tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False], [True, True, True, True],
    ]


# ---------------------------------------------------------------------------- rank head shapes the tree
def _forced(drafter: SpecBlockDrafter, classes: list[int]) -> None:
    """Make the rank head return ``classes[k]`` at slot k (every leaf)."""
    onehot = torch.full((len(classes), 4), -10.0)
    onehot[torch.arange(len(classes)), torch.tensor(classes)] = 10.0
    drafter.model.rank_logits = lambda d, logits: onehot.expand(*d.shape[:-2], len(classes), 4)


def _children_count(tree, node):
    return len(tree.children(node))


def test_slot_widths_follow_rank_classes_and_caps():
    cfg = _cfg(slot_widths=(1, 3, 5, 0), beam=6, adaptive_widths=False)
    classes = torch.tensor([RankClass.GIVE_UP, RankClass.CONTINUE, RankClass.BRANCH_FEW, RankClass.GIVE_UP])
    p = torch.tensor([0.5, 0.5, 0.5, 0.5])
    assert slot_widths(cfg, classes, p, True) == [6, 1, 3, 0]  # slot 0 of block 1 takes the beam
    assert slot_widths(cfg, classes, p, False) == [0, 1, 3, 0]
    adaptive = _cfg(slot_widths=(2, 4, 6, 4), beam=8, adaptive_widths=True)
    hi = torch.tensor([0.95, 0.96, 0.9, 0.5])
    assert slot_widths(adaptive, torch.full((4,), 2), hi, True) == [3, 2, 3, 6]
    fixed = _cfg(rank_head=False, top_k=3, beam=5, adaptive_widths=False)
    assert slot_widths(fixed, torch.full((4,), 3), p, True) == [5, 3, 3, 3]


@torch.no_grad()
def test_rank_head_decisions_shape_the_tree():
    target = _target()
    ctx = DraftContext(tokens=_sequence(9, seed=4), prompt_len=8)
    _, _, aux = target.prefill(ctx.tokens[:-1], need_aux=True)

    def tree_for(classes, **kw):
        d = build_specblock_drafter(_cfg(adaptive_widths=False, max_blocks=1, total_tokens=60, **kw), target)
        _forced(d, classes)
        d.begin(ctx, aux)
        prop = d.propose(ctx)
        return prop.tree, prop

    # continue / branch-few / branch-many / continue with widths (1, 2, 3, 1) and beam 3:
    # root gets 3 children, g_0 gets 2 (the greedy g_1 + 1 sibling), g_1 gets 3, g_2 gets 1
    tree, prop = tree_for([0, 1, 2, 0], slot_widths=(1, 2, 3, 1), beam=3)
    assert len(tree) - 1 == 3 + 2 + 3 + 1 and tree.max_depth() == K
    greedy = [ROOT]
    for _ in range(K):
        kids = tree.children(greedy[-1])
        greedy.append(max(kids, key=lambda c: tree.scores[c]))
    assert [_children_count(tree, g) for g in greedy] == [3, 2, 3, 1, 0]
    assert prop.drafter_forwards == 1
    # give up at slot 2 (width 0): the chain ends after slot 1
    tree, _ = tree_for([0, 1, 3, 0], slot_widths=(1, 2, 3, 0), beam=3)
    assert len(tree) - 1 == 3 + 2 and tree.max_depth() == 2
    # all "continue" with width 1 and beam 1: a single chain of K tokens
    tree, _ = tree_for([0, 0, 0, 0], slot_widths=(1, 2, 3, 1), beam=1)
    assert len(tree) - 1 == K and tree.max_depth() == K
    # a second block inherits from pending leaves: deeper tree, one more drafter forward
    d = build_specblock_drafter(_cfg(adaptive_widths=False, max_blocks=2, total_tokens=60, beam=2,
                                     slot_widths=(1, 2, 2, 1)), target)
    _forced(d, [0, 1, 0, 0])
    d.begin(ctx, aux)
    prop = d.propose(ctx)
    assert prop.drafter_forwards == 2 and K < prop.tree.max_depth() <= 2 * K
    # without the rank head the width is the fixed top_k everywhere but slot 0 of block 1
    tree, _ = tree_for([3, 3, 3, 3], slot_widths=(1, 2, 3, 0), beam=2, rank_head=False, top_k=2)
    assert len(tree) - 1 == 2 + 2 + 2 + 2 and tree.max_depth() == K


@torch.no_grad()
def test_the_give_up_class_stops_the_chain_with_the_default_widths():
    """Default widths (2, 4, 6, 0): a slot the rank head classes "give up" ends the chain there;
    with the reference's slim_r2 (2, 4, 6, 4) the same class branched 4-wide and never gave up."""
    assert SpecBlockConfig().slot_widths[RankClass.GIVE_UP] == 0
    target = _target()
    ctx = DraftContext(tokens=_sequence(9, seed=4), prompt_len=8)
    _, _, aux = target.prefill(ctx.tokens[:-1], need_aux=True)

    def tree_for(**kw):
        d = build_specblock_drafter(_cfg(max_blocks=1, total_tokens=60, **kw), target)
        _forced(d, [RankClass.CONTINUE, RankClass.GIVE_UP, RankClass.CONTINUE, RankClass.CONTINUE])
        d.begin(ctx, aux)
        return d.propose(ctx).tree

    assert tree_for().max_depth() == 1  # slot 1 gives up: only slot 0 (under the root) is drafted
    assert tree_for(slot_widths=(2, 4, 6, 4)).max_depth() == K


@torch.no_grad()
def test_block_size_below_the_checkpoints_keeps_every_slot_in_the_cross_cache_and_is_exact():
    """K' = 2 drafted slots of a K = 4 head: every anchor still writes all K slots to the cross
    cache (the context training exposed), so the cache and block 1 equal the full-K drafter's, a
    later block equals the full block's first K' slots, and greedy output equals vanilla."""
    target = _target()
    embed = target.model.get_input_embeddings().weight
    full = build_specblock_drafter(_cfg(), target)  # random head, K = 4
    short = SpecBlockDrafter(_cfg(block_size=2), full.model, embed)
    ctx = DraftContext(tokens=_sequence(9, seed=4), prompt_len=8)
    _, _, aux = target.prefill(ctx.tokens[:-1], need_aux=True)
    for d in (full, short):
        d.begin(ctx, aux)
        d.propose(ctx)
    n = 8  # committed anchors (the prompt's pairs)
    for layer in range(full.arch.num_layers):
        assert short.caches[layer].length == full.caches[layer].length == n * K
        for a, b in zip(short.caches[layer].view(n * K), full.caches[layer].view(n * K)):
            assert torch.equal(a, b)
    assert torch.equal(short._block1, full._block1[:2])
    leaf = PendingLeaf(node=0, token=ctx.tokens[3], score=0.0, cond=full._block1[1], ttt=[(n - 1) * K, (n - 1) * K + 1])
    assert torch.allclose(short._run_block([leaf], n * K), full._run_block([leaf], n * K)[:, :2], atol=1e-5)
    wide = SpecBlockDrafter(_cfg(block_size=2, rank_head=False, top_k=8, beam=8), full.model, embed)
    cfg = EngineConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig())
    accepted = 0
    for seed in range(3):
        prompt = _sequence(10, seed=10 + seed)
        res = generate_speculative(target, wide, prompt, cfg)
        assert res.tokens == generate_vanilla(target, prompt, cfg).tokens
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0, "no draft was ever accepted: the exactness check exercised no accepted path"


# ---------------------------------------------------------------------------- lossless on the tiny model
@pytest.mark.parametrize("kw", [{}, {"rank_head": False}, {"shift": False, "max_blocks": 3}, {"block_size": 2}])
def test_greedy_output_equals_vanilla(kw):
    target = _target()
    drafter = build_specblock_drafter(_cfg(**kw), target)
    cfg = EngineConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig())
    for seed in range(3):
        prompt = _sequence(10, seed=10 + seed)
        ref = generate_vanilla(target, prompt, cfg).tokens
        assert generate_speculative(target, drafter, prompt, cfg).tokens == ref


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_refusals(tmp_path):
    target = _target()
    model = build_specblock_drafter(_cfg(), target).model
    live = TargetFingerprint.from_target(target, name="tiny")
    save_checkpoint(tmp_path / "sb", model, live, dtype=torch.float32, kind=SPECBLOCK)
    back = load_checkpoint(tmp_path / "sb", live, kind=SPECBLOCK)
    assert back.arch == model.arch
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    drafter = build_specblock_drafter(_cfg(checkpoint=str(tmp_path / "sb")), target)
    assert drafter.model.arch.shift is True
    # an EAGLE-3 checkpoint is not a SpecBlock one, and the other way round
    save_checkpoint(tmp_path / "e3", eagle3_random_model(target, VOCAB), live, kind=EAGLE3)
    with pytest.raises(CheckpointError, match="not a SpecBlock checkpoint"):
        load_checkpoint(tmp_path / "e3", live, kind=SPECBLOCK)
    with pytest.raises(CheckpointError, match="not an? EAGLE-3 checkpoint"):
        load_checkpoint(tmp_path / "sb", live, kind=EAGLE3)
    # another target (other vocabulary and weights) is refused, naming the mismatch
    other = tiny_target(tiny_llama(vocab_size=VOCAB + 8, seed=9))
    with pytest.raises(CheckpointError, match=r"vocab_size: checkpoint 64 != target 72"):
        build_specblock_drafter(_cfg(checkpoint=str(tmp_path / "sb")), other)


# ---------------------------------------------------------------------------- training
@functools.lru_cache(maxsize=1)
def _train_setup():
    model = tiny_llama(vocab_size=VOCAB, seed=11, lm_head_scale=8.0)
    target = tiny_target(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(6)] for _ in range(48)]
    samples = regenerated_samples(prompts, regenerate(model, prompts, max_new_tokens=40, batch_size=16))
    data = TrainData(items=lambda: iter(samples[4:]), to_samples=lambda items: list(items),
                     vocab_samples=lambda: iter(samples), heldout=samples[:4], eval_prompts=prompts[:6],
                     description={"source": "tiny self-distillation"})
    return target, data


TRAIN_FAMILY = SpecBlockFamily(eval_tree=SpecBlockConfig(checkpoint="random", total_tokens=16, block_size=4, beam=4))


def _train_cfg(**kw) -> TrainConfig:
    base = dict(max_len=64, draft_vocab_size=VOCAB, ttt_steps=2, curriculum_steps=1, curriculum_tokens=600,
                lr=1e-2, warmup_steps=5, batch_tokens=256, max_tokens=12_000, epochs=40, topk=8, shard_size=12,
                eval_every_tokens=0, eval_prompts=6, eval_max_new_tokens=24, save_every_steps=10,
                log_every_steps=5, autocast_bf16=False, eval_at_start=True)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow  # ~5 s of training; tests/test_train.py trains EAGLE-3 in the fast tier
def test_training_lowers_loss_raises_acceptance_and_resumes(tmp_path):
    target, data = _train_setup()
    first = Trainer(_train_cfg(max_tokens=1500), TRAIN_FAMILY, target, data, tmp_path / "run", "tiny", progress=False)
    first.run()
    second = Trainer(_train_cfg(), TRAIN_FAMILY, target, data, tmp_path / "run", "tiny", progress=False)
    manifest = second.run(export=tmp_path / "export", command="pytest")
    evals = second.state.evals
    assert evals[0]["tokens"] == 0 and manifest["training"]["tokens"] >= 12_000
    print(f"tau {evals[0]['heldout.tau']:.2f} -> {evals[-1]['heldout.tau']:.2f}; prefix "
          f"{evals[0]['heldout.prefix_len']:.2f} -> {evals[-1]['heldout.prefix_len']:.2f}; rank acc "
          f"{evals[-1]['heldout.rank_acc']:.2f}")
    assert evals[-1]["heldout.loss"] < evals[0]["heldout.loss"]
    assert evals[-1]["heldout.prefix_len"] > evals[0]["heldout.prefix_len"] + 0.5
    assert evals[-1]["heldout.tau"] > evals[0]["heldout.tau"] + 0.5
    assert manifest["format"] == SPECBLOCK.format and manifest["training"]["config"]["valid_prefix_mask"] is True
    # the export loads as a drafter and stays lossless
    drafter = build_specblock_drafter(_cfg(checkpoint=str(tmp_path / "export"), total_tokens=16), target)
    cfg = EngineConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig())
    for p in data.eval_prompts[:2]:
        assert generate_speculative(target, drafter, p, cfg).tokens == generate_vanilla(target, p, cfg).tokens
