"""EAGLE-3 on real SmolLM2-135M weights: fp32 greedy output equals vanilla token for token.

Eight Spec-Bench questions (one per category, first turn, chat template), with (a) a randomly
initialised head, 16 new tokens (every draft path is exercised by rejections) and (b), 40 new tokens, the
committed trained checkpoint when it is present (long accepted paths, non-contiguous KV moves).
Runtime: about 2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import pytest

from speculation.config import Eagle3Config
from speculation.drafters.eagle3 import CHECKPOINT_ROOT, build_eagle3_drafter
from speculation.drafters.checkpoint import TargetFingerprint, find_checkpoint
from tests.helpers import assert_lossless_on_refs

pytestmark = pytest.mark.slow


def test_random_head_is_lossless(smol_fp32, spec_bench_refs):
    cfg = Eagle3Config(checkpoint="random", total_tokens=12, depth=3, top_k=4, draft_vocab_size=8192)
    # 16 tokens per prompt: a random head is rejected almost every step, so each token costs a
    # full draft + verify; 8 x 16 rejections exercise every draft path.
    stats: dict = {}
    tau = assert_lossless_on_refs(smol_fp32, build_eagle3_drafter(cfg, smol_fp32), spec_bench_refs, 16, stats)
    # Each step appends its accepted drafted tokens and one target token, except where the 16-token
    # cap cuts a step short: tau is at most (accepted + steps) / steps, and a random head is rejected
    # almost always, so it stays near 1.
    assert 1.0 <= tau <= (stats["accepted"] + stats["steps"]) / stats["steps"]
    assert stats["accepted"] < stats["steps"] / 2, stats


def test_trained_checkpoint_is_lossless_and_accepts(smol_fp32, spec_bench_refs):
    found = find_checkpoint(CHECKPOINT_ROOT, TargetFingerprint.from_target(smol_fp32))
    if found is None:
        pytest.skip(f"no trained EAGLE-3 checkpoint for SmolLM2 under {CHECKPOINT_ROOT}")
    drafter = build_eagle3_drafter(Eagle3Config(checkpoint="auto", total_tokens=32, depth=5, top_k=8), smol_fp32)
    tau = assert_lossless_on_refs(smol_fp32, drafter, spec_bench_refs, 40)  # suite time: 40 of the 48 tokens
    print(f"trained eagle3 tau on 8 Spec-Bench prompts: {tau:.2f}")
    assert tau > 1.2
