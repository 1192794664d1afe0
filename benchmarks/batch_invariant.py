"""Batch-invariant mode (``--batch-invariant``): what it costs and what it buys, side by side.

    .venv/bin/python benchmarks/batch_invariant.py --dtype bfloat16 --concurrency 8,16 --questions 3 --repeats 2 --json benchmarks/results/batch_invariant_bf16.json

oneDNN picks a GEMM kernel by the row count; where two kernels sum in different orders, a row's
bits depend on how many rows share its product (on the Xeon host with AMX-BF16: every bf16
product of SmolLM2 above 32 rows). In the mode, :class:`~speculation.model.lean_forward.PackedGemm`
runs a product of M rows as groups within the probed limit (:meth:`PackedGemm.probe_row_limit`).

Part 1, the kernels: per product shape, the probed limit and the median seconds of one product at
M = 1, 32, 64, 256 rows with the mode off and on. Part 2, the system: the closed loop of
``graftblock bench --concurrency`` (:func:`~speculation.bench.runner.run_concurrency`, arriving
prompts folded into the step's forward, so steps carry more than 32 rows) with ``--method`` on
Spec-Bench first turns, the arms ``default`` and ``invariant`` alternating run by run (the first
arm alternates too). Per N and arm: the median over ``--repeats`` of tokens/s and latencies, the
paired ratio invariant / default per repeat, and ``lossless`` against each arm's own solo vanilla
outputs (computed with the arm's mode): the mode is for the match rate to be 1.0 in bf16.
"""

from __future__ import annotations

import argparse
import sys

import torch

from speculation.bench import ab
from speculation.bench.runner import emit_json, median_call_s

ARMS = ("invariant", "default")
"""The two arms; the paired ratio is the first over the second."""
FIGURES = ("tokens_per_s", "itl_p50_s", "itl_p99_s", "ttft_p50_s")
ROWS = (1, 32, 64, 256)


def kernel_table(target, calls: int) -> list[dict]:
    """Per distinct product shape: its probed limit, and the median microseconds at each of ROWS
    with the mode off and on."""
    seen, rows = set(), []
    gen = torch.Generator().manual_seed(0)
    for g in target.lean.gemms():
        shape = tuple(g.packed.shape)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(max(ROWS), shape[1], generator=gen).to(g.dtype)  # [M_max, K]
        row = {"shape": list(shape), "limit": g.probe_row_limit(), "us": {}}
        for arm in ARMS:
            g.set_row_limit(arm == "invariant")
            row["us"][arm] = {str(m): median_call_s(lambda m=m: g(x[:m]), calls=calls) * 1e6 for m in ROWS}
        g.set_row_limit(False)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab.add_args(ap, dtypes=("bfloat16", "float32"), concurrency="8,16", questions=3, repeats=2, kernel_calls=40)
    args = ap.parse_args(argv)
    levels = ab.levels(ap, args)

    target = ab.lean_target(ap, args, "batch-invariant mode")
    kernel = kernel_table(target, args.kernel_calls)
    for row in kernel:
        us = row["us"]
        print(f"{row['shape']} limit {row['limit']}: " + ", ".join(
            f"M={m} {us['default'][str(m)]:.0f}/{us['invariant'][str(m)]:.0f} us" for m in ROWS), file=sys.stderr)
    work = ab.Workload.spec_bench(args, target)

    def set_arm(arm: str) -> None:
        target.lean.set_batch_invariant(arm == "invariant")

    result, refs = ab.compare(work, ARMS, set_arm, levels, args.repeats, FIGURES, args.goodput)
    target.lean.set_batch_invariant(False)
    solo_differs = sum(a != b for a, b in zip(refs["invariant"], refs["default"]))
    out = ab.record("batch_invariant", "benchmarks/batch_invariant.py", args, argv, work, kernel=kernel,
                    solo_outputs_differing_between_modes=solo_differs, concurrency=result)
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
