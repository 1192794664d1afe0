"""Spec-Bench metrics, computed only from per-turn generation records.

Definitions (Spec-Bench ``evaluation/speed.py``; docs/algorithms.md §7):

* per-question speed  = sum over turns of new tokens / sum over turns of wall seconds;
* tokens_per_s        = mean over questions of per-question speed;
* speedup             = tokens_per_s(method) / tokens_per_s(vanilla), same prompts, same run;
* tau                 = mean over all verify steps (pooled) of tokens gained per step (bonus included);
* drafting_share      = drafting seconds / total wall seconds;
* decode_tokens_per_s = all new tokens / (wall - prefill seconds), pooled (ours, and vLLM
  peers by their time to first token; HF peers report no prefill time); decode_speedup is its ratio to vanilla's. Spec-Bench's speed counts
  the prefill, which dominates a long prompt on a CPU; this one isolates the decode loop;
* mean_tree_size      = mean verified tokens per step (root included);
* acceptance_per_depth[d-1] = P(accepted length >= d | the tree reached depth d), pooled over steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from speculation.engine.sequence import GenerationResult


@dataclass
class TurnRun:
    """One method's output on one turn of one question."""

    question_id: str
    category: str
    turn: int
    result: GenerationResult
    matches_vanilla: bool | None = None


@dataclass
class MethodRuns:
    """All turns one method produced in a bench run."""

    name: str
    runs: list[TurnRun] = field(default_factory=list)


def _per_question_speed(runs: list[TurnRun]) -> list[float]:
    toks: dict[str, int] = defaultdict(int)
    secs: dict[str, float] = defaultdict(float)
    for r in runs:
        toks[r.question_id] += len(r.result.tokens)
        secs[r.question_id] += r.result.wall_s
    return [toks[q] / secs[q] for q in toks if secs[q] > 0]


def summarize(runs: list[TurnRun]) -> dict:
    """Metrics of one method over ``runs`` (no speedup: that needs the baseline)."""
    speeds = _per_question_speed(runs)
    steps = [s for r in runs for s in r.result.steps]
    wall = sum(r.result.wall_s for r in runs)
    out: dict = {
        "n_turns": len(runs),
        "n_questions": len({r.question_id for r in runs}),
        "new_tokens": sum(len(r.result.tokens) for r in runs),
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else 0.0,
        "wall_s": wall,
    }
    prefill = sum(r.result.prefill_s for r in runs)
    if prefill > 0 and wall > prefill:
        out["prefill_s"] = prefill
        out["decode_tokens_per_s"] = out["new_tokens"] / (wall - prefill)
    if steps:
        n = len(steps)
        drafting = sum(s.drafting_s for s in steps)
        max_depth = max(s.tree_depth for s in steps)
        per_depth = []
        for d in range(1, max_depth + 1):
            reached = [s for s in steps if s.tree_depth >= d]
            per_depth.append(sum(1 for s in reached if s.accepted >= d) / len(reached) if reached else 0.0)
        accepted_total = sum(s.accepted for s in steps)
        by_source: dict[str, int] = defaultdict(int)
        drafted_source: dict[str, int] = defaultdict(int)
        for s in steps:
            for k, v in s.accepted_by_source.items():
                by_source[k] += v
            for k, v in s.drafted_by_source.items():
                drafted_source[k] += v
        out.update(
            {
                "steps": n,
                "tau": sum(s.tokens_gained for s in steps) / n,
                "drafting_share": drafting / wall if wall > 0 else 0.0,
                "mean_tree_size": sum(s.tree_size for s in steps) / n,
                "drafter_forwards_per_step": sum(s.drafter_forwards for s in steps) / n,
                "drafting_s_per_step": drafting / n,
                "verify_s_per_step": sum(s.verify_s for s in steps) / n,
                "acceptance_per_depth": per_depth,
                "accepted_share_by_source": {
                    k: v / accepted_total for k, v in sorted(by_source.items())
                }
                if accepted_total
                else {},
                "drafted_per_step_by_source": {k: v / n for k, v in sorted(drafted_source.items())},
                "drafter_stats": _mean_stats(steps),
            }
        )
    else:
        out.update({"tau": 1.0, "mean_tree_size": 1.0, "drafting_share": 0.0,
                    "drafter_forwards_per_step": 0.0, "drafting_s_per_step": 0.0})
    checked = [r.matches_vanilla for r in runs if r.matches_vanilla is not None]
    out["match_rate"] = sum(checked) / len(checked) if checked else None
    return out


def _mean_stats(steps) -> dict[str, float]:
    """Mean of each per-step drafter statistic over the steps that report it."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for s in steps:
        for k, v in s.stats.items():
            sums[k] += float(v)
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sorted(sums)}


def summarize_with_speedup(method: MethodRuns, baseline: MethodRuns) -> dict:
    """Overall and per-category metrics, speedup against ``baseline`` on the same questions."""
    overall = summarize(method.runs)
    base = summarize(baseline.runs)
    overall["speedup"] = overall["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    if "decode_tokens_per_s" in overall and "decode_tokens_per_s" in base:
        overall["decode_speedup"] = overall["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    per_cat = {}
    for cat in sorted({r.category for r in method.runs}):
        m = summarize([r for r in method.runs if r.category == cat])
        b = summarize([r for r in baseline.runs if r.category == cat])
        m["speedup"] = m["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else 0.0
        per_cat[cat] = m
    overall["per_category"] = per_cat
    return overall
