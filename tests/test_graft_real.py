"""Graft on real SmolLM2-135M weights: fp32 greedy output equals vanilla token for token.

Eight Spec-Bench questions (``spec_bench_refs``: one per category, first turn, 64 new tokens),
with (a) stages (0, 1, 5) over the committed EAGLE-3 checkpoint, thresholds set so that every
stage occurs (retrieval only, pruned at depth 1 plus grafts, dense depth 5 plus grafts), and
(b) "retrieval only" on every step (stages = [0]). Runtime: about 1 minute on 2 CPU cores.
"""

from __future__ import annotations

import pytest

from speculation.config import GraftConfig
from speculation.drafters.graft import build_graft_drafter
from tests.helpers import RecordingDrafter, assert_lossless_on_refs

pytestmark = pytest.mark.slow


def test_every_stage_is_lossless_on_spec_bench(smol_fp32, spec_bench_refs):
    cfg = GraftConfig(stages=(0, 1, 5), threshold=0.4, retrieval_confidence=2.0, dense_budget=32)
    drafter = RecordingDrafter(build_graft_drafter(cfg, smol_fp32))
    tau = assert_lossless_on_refs(smol_fp32, drafter, spec_bench_refs)
    stages = [int(p.stats["stage"]) for p in drafter.proposals]
    seen = {s: stages.count(s) for s in cfg.stages}
    print(f"graft tau {tau:.2f}, steps per stage {seen}")
    assert all(seen.values()), f"a stage never occurred, so it was not tested: {seen}"
    assert tau > 1.2


def test_retrieval_only_is_lossless_on_spec_bench(smol_fp32, spec_bench_refs):
    drafter = build_graft_drafter(GraftConfig(stages=(0,), dense_budget=32), smol_fp32)
    assert drafter.drafter is None
    assert assert_lossless_on_refs(smol_fp32, drafter, spec_bench_refs) >= 1.0
