"""Does the goodput rule's cost model predict the live step? Predicted against measured seconds.

    .venv/bin/python benchmarks/goodput_calibration.py --sequences 16 --dtype float32

Runs the first ``--sequences`` Spec-Bench first turns together through
:class:`~speculation.engine.batch.BatchEngine` with ``--method`` and ``goodput: true`` (greedy,
``--max-new-tokens`` each). For every step in which all sequences are live it records the
rule's prediction (``goodput_predicted_s``: k * c(B, t, L) + drafting seconds), the measured step
seconds, the target-forward seconds (a sequence's ``verify_s`` covers the shared forward plus
its own acceptance and commit), the tree tokens N and the tokens gained. Then it runs the same
prompts as batched vanilla. It prints the medians, the sums over those steps (seconds, tokens,
steps that drafted or probed), the ratio of median step seconds (vanilla / speculative: above 1
means the speculative step is cheaper per step; tokens per step are in the totals) and the
engine's measured grid c(B, .), and writes them to ``--json`` when given.

Why this exists: in the fp32 concurrency table of BENCHMARKS.md, retrieval under the goodput
rule ran at 0.46× batched vanilla at N = 16. This script showed the rule predicting 0.24 s for
a step that took 0.76 s. The rule priced the real tree tokens at a 64-token context; the forward
pads every row to the largest tree and attends over the longest row's context. The rule now
prices c(B, t, L) (rows padded to t positions, longest context L) and rescales it by the
measured / predicted forward seconds (``cost_correction``); ``predicted_forward_s`` against
``forward_s`` shows how well it does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from speculation import assets
from speculation.bench.runner import environment
from speculation.config import BatchConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.batch import BatchEngine, Request
from speculation.model.target import TargetModel


def _run(target, factory, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[dict], object]:
    slot = max(len(p) for p in prompts) + max_new_tokens + 1
    engine = BatchEngine(target, factory, BatchConfig(max_sequences=len(prompts), max_tokens_per_sequence=slot,
                                                      goodput=factory is not None))
    for i, p in enumerate(prompts):
        engine.add(Request(f"q{i}", p, max_new_tokens, SamplingConfig(temperature=0.0)))
    rows = []
    while engine.has_work():
        t0 = time.perf_counter()
        updates = engine.step()
        step_s = time.perf_counter() - t0
        recs = [u.step for u in updates if u.step is not None]
        if len(recs) == len(prompts):  # every sequence live: the batch the rule planned for
            rows.append({
                "step_s": step_s,
                "forward_s": min(r.verify_s for r in recs),
                "predicted_s": recs[0].stats.get("goodput_predicted_s"),
                "predicted_forward_s": recs[0].stats.get("goodput_predicted_forward_s"),
                "cost_correction": recs[0].stats.get("goodput_cost_correction"),
                "row_tokens": recs[0].stats.get("goodput_row_tokens"),
                "drafting_skipped": recs[0].stats.get("goodput_drafting_skipped"),
                "drafting_probe": recs[0].stats.get("goodput_drafting_probe"),
                "drafting_vetoed": recs[0].stats.get("goodput_drafting_vetoed"),
                "drafting_retest": recs[0].stats.get("goodput_drafting_retest"),
                "tree_tokens": recs[0].stats.get("batch_tree_tokens"),
                "gained": sum(r.tokens_gained for r in recs),
                "drafting_s": sum(r.drafting_s for r in recs),
            })
    return rows, engine.cost_model


def _medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}


def _totals(rows: list[dict]) -> dict:
    """Sums over the all-live steps: seconds, tokens gained, and how many steps drafted or probed."""
    drafted = [r for r in rows if r.get("drafting_skipped") == 0.0]
    return {"steps": len(rows), "seconds": sum(r["step_s"] for r in rows),
            "tokens": sum(r["gained"] for r in rows),
            "tokens_per_s": sum(r["gained"] for r in rows) / sum(r["step_s"] for r in rows),
            "steps_drafted": len(drafted), "steps_probed": sum(r.get("drafting_probe") == 1.0 for r in rows),
            "steps_vetoed": sum(r.get("drafting_vetoed") == 1.0 for r in rows),
            "steps_retested": sum(r.get("drafting_retest") == 1.0 for r in rows),
            "drafting_s": sum(r["drafting_s"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--method", default="retrieval")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not 1 <= args.sequences <= 26:
        ap.error(f"--sequences must be in [1, 26] (two Spec-Bench questions per category), got {args.sequences}")

    model, tok = assets.load_model_and_tokenizer(args.model, getattr(torch, args.dtype))
    target = TargetModel(model, tok)
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in assets.load_questions("spec_bench", 2)]
    prompts = prompts[: args.sequences]
    spec = resolve_methods([args.method], {})[0]
    build_drafter(spec, target)  # measures and caches the drafter's c(T) here, not inside a timed step
    spec_rows, cost = _run(target, lambda: build_drafter(spec, target), prompts, args.max_new_tokens)
    van_rows, _ = _run(target, None, prompts, args.max_new_tokens)
    if not spec_rows or not van_rows:
        print("no step had every sequence live; raise --max-new-tokens", file=sys.stderr)
        return 1
    out = {
        "kind": "goodput_calibration",
        "command": " ".join(["benchmarks/goodput_calibration.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(),
        "model": args.model, "dtype": args.dtype, "method": args.method, "sequences": args.sequences,
        "max_new_tokens": args.max_new_tokens, "prompt_tokens": [len(p) for p in prompts],
        "speculative_median": _medians(spec_rows), "vanilla_median": _medians(van_rows),
        "speculative_total": _totals(spec_rows), "vanilla_total": _totals(van_rows),
        "speculative_steps": spec_rows, "vanilla_steps": van_rows,
        "median_step_ratio": statistics.median(r["step_s"] for r in van_rows)
        / statistics.median(r["step_s"] for r in spec_rows),
        "grid": ({str(L): {str(b): {str(t): s for t, s in row.items()} for b, row in by_b.items()}
                  for L, by_b in cost.grid.items()} if cost else None),
    }
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_steps")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
