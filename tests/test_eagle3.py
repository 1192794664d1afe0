"""EAGLE-3 drafter on a tiny random Llama: losslessness, tree shape, train/inference consistency,
weight swaps and checkpoints.

* Greedy fp32 speculative output equals vanilla token for token (random head).
* Every pool node's score equals the cumulative log-prob a from-scratch TTT unroll
  (adaptation.eagle3_loss) gives along that node's path: the cached, tree-masked inference
  attention and the training-time-test attention pattern compute the same function.
* Checkpoints round-trip; a checkpoint for another target, hidden size or vocabulary is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from adaptation.eagle3_loss import ttt_unroll
from speculation.config import ConfigError, Eagle3Config, EngineConfig, SamplingConfig
from speculation.drafters import DrafterType, build_drafter, resolve_methods
from speculation.drafters.base import DraftContext, Drafter, WeightSwappable
from speculation.drafters.eagle3 import Eagle3Drafter, build_eagle3_drafter, random_model
from speculation.drafters.checkpoint import (
    CheckpointError,
    TargetFingerprint,
    load_checkpoint,
    save_checkpoint,
)
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.spec.tree import NodeSource
from tests.helpers import shared_tiny_llama, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 10, 20, 10, 20, 10], [7] * 20]


def _model():
    return shared_tiny_llama(vocab_size=VOCAB, seed=42)


def _cfg(**kw) -> Eagle3Config:
    base = dict(checkpoint="random", draft_vocab_size=48, total_tokens=20, depth=3, top_k=4)
    base.update(kw)
    return Eagle3Config(**base)


def greedy(n: int = 40) -> EngineConfig:
    return EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0))


def test_registry_builds_eagle3():
    target = tiny_target(_model())
    spec = resolve_methods(["eagle3"], {"eagle3": {"checkpoint": "random", "draft_vocab_size": 48}})[0]
    assert spec.type == DrafterType.EAGLE3
    drafter = build_drafter(spec, target)
    assert isinstance(drafter, Drafter) and isinstance(drafter, Eagle3Drafter)
    assert drafter.needs_aux
    with pytest.raises(ConfigError, match="top_k"):
        resolve_methods(["eagle3"], {"eagle3": {"top_k": 0}})
    with pytest.raises(ConfigError, match="unknown key"):
        resolve_methods(["eagle3"], {"eagle3": {"budget": 3}})


@pytest.mark.parametrize("kw", [dict(), dict(top_k=1, depth=5, total_tokens=6), dict(top_k=6, depth=2, total_tokens=40)])
def test_greedy_equals_vanilla(kw):
    target = tiny_target(_model())
    drafter = build_eagle3_drafter(_cfg(**kw), target)
    for prompt in PROMPTS:
        ref = generate_vanilla(target, prompt, greedy()).tokens
        res = generate_speculative(target, drafter, prompt, greedy())
        assert res.tokens == ref, f"eagle3 diverged from vanilla on {prompt}"
        cfg = drafter.config
        for s in res.steps:
            assert s.tree_size <= cfg.total_tokens
            assert s.tree_depth <= cfg.depth + 1
            assert s.drafter_forwards == cfg.depth + 1
            assert s.drafted_by_source == {"drafter": s.drafted}


def test_tree_is_the_best_pool_nodes_and_parents_first():
    target = tiny_target(_model())
    drafter = build_eagle3_drafter(_cfg(total_tokens=15), target)
    prompt = [1, 2, 3, 4, 5]
    _, _, aux = target.prefill(prompt, need_aux=True)
    ctx = DraftContext(tokens=[*prompt, 9], prompt_len=len(prompt))
    drafter.begin(ctx, aux)
    tree = drafter.propose(ctx).tree
    assert len(tree) == 15
    for i in range(1, len(tree)):
        assert tree.parents[i] < i
        assert tree.scores[i] <= tree.scores[tree.parents[i]] + 1e-6
        assert tree.sources[i] == NodeSource.DRAFTER
    # draft tokens are mapped into the target vocabulary (first 48 ids for a random head)
    assert all(0 <= t < 48 for t in tree.tokens[1:])


@torch.inference_mode()
def test_inference_tree_matches_training_time_test_unroll():
    """Each node's cumulative score = sum of TTT log-probs along its path (fp32, from scratch)."""
    model = _model()
    target = tiny_target(model)
    cfg = _cfg(draft_vocab_size=VOCAB, total_tokens=3 + 3 * 9 + 1, depth=3, top_k=3)
    drafter = build_eagle3_drafter(cfg, target)
    head = drafter.model
    prompt = [3, 14, 15, 9, 26, 5, 35]
    root = 8
    _, _, aux = target.prefill(prompt, need_aux=True)
    ctx = DraftContext(tokens=[*prompt, root], prompt_len=len(prompt))
    drafter.begin(ctx, aux)
    tree = drafter.propose(ctx).tree
    assert len(tree) == cfg.total_tokens  # the whole pool: every node is checked
    n = len(prompt)
    for node in range(1, len(tree)):
        path = tree.path_tokens(node)[1:]  # draft tokens below the root
        ids = torch.tensor([[*prompt, root, *path]])  # x_0..x_{n+len(path)}
        feats = torch.zeros(1, ids.shape[1], aux.shape[1])
        feats[0, :n] = aux  # features beyond the committed text are never attended
        total = 0.0
        for j, y in ttt_unroll(head, drafter.embed_weight, feats, ids, len(path)):
            logp = torch.log_softmax(head.logits(y[0, n - 1]).float(), -1)
            total += float(logp[path[j]])
        assert math.isclose(total, tree.scores[node], abs_tol=1e-4), (node, total, tree.scores[node])


def test_observe_and_reencode_after_weight_swap_keep_output_exact():
    target = tiny_target(_model())
    drafter = build_eagle3_drafter(_cfg(), target)
    other = random_model(target, 48, seed=7).state_dict()
    prompt = PROMPTS[1]
    ref = generate_vanilla(target, prompt, greedy(30)).tokens
    swaps = []

    def feedback(ctx, outcome):  # swap weights between steps, as online adaptation will
        if len(swaps) < 3:
            drafter.load_state_dict(other)
            swaps.append(len(ctx.tokens))

    res = generate_speculative(target, drafter, prompt, greedy(30), feedback=feedback)
    assert res.tokens == ref and len(swaps) == 3
    assert isinstance(drafter, WeightSwappable)
    sd = drafter.state_dict()
    assert sd.keys() == other.keys() and all(torch.equal(sd[k], other[k].to(sd[k].dtype)) for k in other)
    drafter.load_state_dict(random_model(target, 48, seed=3).state_dict())
    now = drafter.state_dict()
    assert any(not torch.equal(sd[k], now[k]) for k in sd)  # sd was a copy, not a live view


def test_swap_is_a_copy_and_rejects_other_architectures():
    target = tiny_target(_model())
    drafter = build_eagle3_drafter(_cfg(), target)
    before = drafter.model
    drafter.load_state_dict(random_model(target, 48, seed=3).state_dict())
    assert drafter.model is not before
    with pytest.raises(RuntimeError):
        drafter.load_state_dict(random_model(target, 32, seed=3).state_dict())
    with pytest.raises(ValueError, match="architecture"):
        drafter.swap_model(random_model(target, 32, seed=3))


def test_checkpoint_roundtrip_and_refusals(tmp_path):
    target = tiny_target(_model())
    live = TargetFingerprint.from_target(target, name="tiny-42")
    model = random_model(target, 40, seed=1)
    ids = [*range(0, 48, 2), *range(48, 64)]  # 40 sorted target ids, not a prefix
    model.set_vocab(torch.tensor(ids))
    path = save_checkpoint(tmp_path / "ck", model, live, dtype=torch.float32, manifest={"steps": 0})
    assert path.name == "model.safetensors" and (tmp_path / "ck" / "manifest.json").is_file()
    loaded = load_checkpoint(tmp_path / "ck", live)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.draft_ids().tolist() == ids
    # bf16 storage (the committed format) loads too
    save_checkpoint(tmp_path / "bf16", model, live)
    assert load_checkpoint(tmp_path / "bf16", live).lm_head.weight.dtype == torch.float32
    # used by the drafter config
    drafter = build_eagle3_drafter(_cfg(checkpoint=str(tmp_path / "ck")), target)
    assert drafter.model.draft_ids().tolist() == ids

    # another target: same shapes, different weights
    other = TargetFingerprint.from_target(tiny_target(tiny_llama(vocab_size=VOCAB + 16, seed=1)), name="tiny-1")
    with pytest.raises(CheckpointError, match="vocab_size: checkpoint 64 != target 80"):
        load_checkpoint(tmp_path / "ck", other)
    same_shape = TargetFingerprint.from_target(tiny_target(tiny_llama(vocab_size=VOCAB, seed=1)), name="tiny-1")
    with pytest.raises(CheckpointError, match="embedding signature"):
        load_checkpoint(tmp_path / "ck", same_shape)
    wide_fp = TargetFingerprint(**{**live.to_dict(), "hidden_size": 48, "aux_layers": (1, 2, 3), "name": "wide"})
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 32 != target 48"):
        load_checkpoint(tmp_path / "ck", wide_fp)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing", live)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "junk.safetensors", live)
    with pytest.raises(CheckpointError, match="no EAGLE-3 checkpoint"):
        build_eagle3_drafter(_cfg(checkpoint="auto"), target)


def test_begin_without_aux_is_a_clear_error():
    target = tiny_target(_model())
    drafter = build_eagle3_drafter(_cfg(), target)
    with pytest.raises(ValueError, match="aux hidden states"):
        drafter.begin(DraftContext(tokens=[1, 2], prompt_len=1), None)
