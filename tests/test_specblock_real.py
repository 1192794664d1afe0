"""SpecBlock on real SmolLM2-135M weights: fp32 greedy output equals vanilla token for token.

Eight Spec-Bench questions (one per category, first turn, chat template), with (a) a randomly
initialised head (16 new tokens: nearly every step rejects, exercising every draft path),
(b) the committed trained checkpoint (40 new tokens: accepted paths through inherited blocks) and
(c) that checkpoint (K = 4) drafting blocks of K' = 2 slots, its cross cache still holding all 4
slots per anchor.
Fixed-width trees (no rank head) are covered on the tiny model (``tests/test_specblock.py``).
"""

from __future__ import annotations

import pytest

from speculation.config import SpecBlockConfig
from speculation.drafters.checkpoint import CHECKPOINT_ROOT, SPECBLOCK, TargetFingerprint, find_checkpoint
from speculation.drafters.specblock import build_specblock_drafter
from tests.helpers import assert_lossless_on_refs

pytestmark = pytest.mark.slow


def test_random_head_is_lossless(smol_fp32, spec_bench_refs):
    cfg = SpecBlockConfig(checkpoint="random", total_tokens=16, beam=4, draft_vocab_size=8192, max_blocks=2)
    stats: dict = {}
    tau = assert_lossless_on_refs(smol_fp32, build_specblock_drafter(cfg, smol_fp32), spec_bench_refs, 16, stats)
    # Each step appends its accepted drafted tokens and one target token, except where the 16-token
    # cap cuts a step short: tau is at most (accepted + steps) / steps, and a random head is rejected
    # almost always, so it stays near 1.
    assert 1.0 <= tau <= (stats["accepted"] + stats["steps"]) / stats["steps"]
    assert stats["accepted"] < stats["steps"] / 2, stats


def test_trained_checkpoint_is_lossless_and_accepts(smol_fp32, spec_bench_refs):
    """The rank head's widths and two blocks; 24-token trees keep the fp32 verify short."""
    found = find_checkpoint(CHECKPOINT_ROOT, TargetFingerprint.from_target(smol_fp32), SPECBLOCK)
    assert found is not None, f"the committed SpecBlock checkpoint for SmolLM2 is missing under {CHECKPOINT_ROOT}"
    drafter = build_specblock_drafter(SpecBlockConfig(checkpoint="auto", total_tokens=24), smol_fp32)
    tau = assert_lossless_on_refs(smol_fp32, drafter, spec_bench_refs, 40)  # suite time: 40 of the 48 tokens
    print(f"trained specblock tau on 8 Spec-Bench prompts: {tau:.2f}")
    assert tau > 1.2


def test_trained_checkpoint_with_fewer_slots_per_block_is_lossless(smol_fp32, spec_bench_refs):
    """block_size 2 < the checkpoint's K = 4, three blocks (depth 6); the first 24 tokens of each
    reference (suite time: the full-K test above checks 40)."""
    drafter = build_specblock_drafter(SpecBlockConfig(checkpoint="auto", total_tokens=24, block_size=2, max_blocks=3),
                                      smol_fp32)
    assert drafter.K == 2 and drafter.Kc == 4
    tau = assert_lossless_on_refs(smol_fp32, drafter, spec_bench_refs, max_new_tokens=24)
    assert all(c.length == drafter._encoded * 4 for c in drafter.caches)  # 4 cross-cache slots per anchor
    print(f"trained specblock, 2 of 4 slots per block: tau {tau:.2f}")
    assert tau > 1.2
