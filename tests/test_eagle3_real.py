"""EAGLE-3 on real SmolLM2-135M weights: fp32 greedy output equals vanilla token for token.

Eight Spec-Bench questions (one per category, first turn, chat template) x 64 new tokens, with
(a) a randomly initialised head (every draft path is exercised by rejections) and (b) the
committed trained checkpoint when it is present (long accepted paths, non-contiguous KV moves).
Runtime: about 2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch

from speculation import assets
from speculation.config import Eagle3Config, EngineConfig, SamplingConfig
from speculation.drafters.eagle3 import CHECKPOINT_ROOT, build_eagle3_drafter
from speculation.drafters.eagle3_checkpoint import TargetFingerprint, find_checkpoint
from speculation.engine import generate_speculative, generate_vanilla
from speculation.target import TargetModel

pytestmark = pytest.mark.slow

NEW = 64
N_PROMPTS = 8
GREEDY = EngineConfig(max_new_tokens=NEW, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))


@pytest.fixture(scope="module")
def smol() -> TargetModel:
    model, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.float32)
    return TargetModel(model, tok)


@pytest.fixture(scope="module")
def prompts_and_refs(smol):
    try:
        questions = assets.load_questions("spec_bench", limit_per_category=1)
    except assets.AssetError:
        pytest.skip("Spec-Bench question file not available beside the checkout")
    # spread over categories: the 5 non-MT-bench ones first, then MT-bench ones
    questions = sorted(questions, key=lambda q: q.category in {"writing", "roleplay", "reasoning", "math",
                                                               "coding", "extraction", "stem", "humanities"})
    prompts = [assets.encode_turn(smol.tokenizer, [], q.turns[0]) for q in questions[:N_PROMPTS]]
    assert len(prompts) >= 8
    return prompts, [generate_vanilla(smol, p, GREEDY).tokens for p in prompts]


def _check(smol, drafter, prompts_and_refs) -> float:
    prompts, refs = prompts_and_refs
    gained = steps = 0
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        res = generate_speculative(smol, drafter, p, GREEDY)
        assert res.tokens == ref, f"prompt {i}: eagle3 output differs from vanilla"
        gained += sum(s.tokens_gained for s in res.steps)
        steps += len(res.steps)
    return gained / steps


def test_random_head_is_lossless(smol, prompts_and_refs):
    cfg = Eagle3Config(checkpoint="random", total_tokens=12, depth=3, top_k=4, draft_vocab_size=8192)
    tau = _check(smol, build_eagle3_drafter(cfg, smol), prompts_and_refs)
    assert tau >= 1.0


def test_trained_checkpoint_is_lossless_and_accepts(smol, prompts_and_refs):
    found = find_checkpoint(CHECKPOINT_ROOT, TargetFingerprint.from_target(smol))
    if found is None:
        pytest.skip(f"no trained EAGLE-3 checkpoint for SmolLM2 under {CHECKPOINT_ROOT}")
    drafter = build_eagle3_drafter(Eagle3Config(checkpoint="auto", total_tokens=32, depth=5, top_k=8), smol)
    tau = _check(smol, drafter, prompts_and_refs)
    print(f"trained eagle3 tau on {N_PROMPTS} Spec-Bench prompts: {tau:.2f}")
    assert tau > 1.2
