"""Single-query attention in half precision: torch's SDPA call in bf16 against the same call widened
to fp32 (``LeanLayers.widen_single_query``), per layer and in the batched closed loop.

    .venv/bin/python benchmarks/single_query_attention.py --dtype bfloat16 --concurrency 1,8,16 --repeats 3 --json benchmarks/results/single_query_attention_bf16.json

Part 1, the kernel: the median seconds of one layer's attention call for one query token over n
keys, at SmolLM2-135M's shape (9 query heads, 3 KV heads of 64), with the half-precision call and
with the widened one (the exact widening copies of q, k, v and the rounding back included), for
several n. Part 2, the system: the closed loop of ``graftblock bench --concurrency``
(:func:`~speculation.bench.runner.run_concurrency`) with ``--method`` on the Spec-Bench first
turns, the two arms alternating run by run (which arm goes first alternates too), so a drifting
host hits both alike. Reports per N and arm the median over ``--repeats`` of total tokens/s and
inter-token latency, and the paired ratio widened / half per repeat. Exactness is not at stake in
bf16 (it is defined and tested in fp32, where nothing changes); ``lossless`` is reported as the
bench reports it (bf16 rounding between a tree verify and a one-token decode already flips
tokens, so the match rate against solo vanilla is below 1 for speculative methods in both arms).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from speculation.bench import ab
from speculation.bench.runner import emit_json, median_call_s
from speculation.config import DType

ARMS = ("widened", "half")
FIGURES = ("tokens_per_s", "itl_p50_s", "itl_p99_s", "ttft_p50_s")
KEYS = (100, 300, 800, 1500)


def kernel_table(dtype, calls: int) -> list[dict]:
    """Per n: the one-query attention call's median microseconds, half precision and widened."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in KEYS:
        q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, 3, n, 64, generator=gen).to(dtype) for _ in range(2))
        half = median_call_s(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True),
                             calls=calls)
        wide = median_call_s(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125,
                                                                    enable_gqa=True).to(dtype), calls=calls)
        rows.append({"keys": n, "half_us": half * 1e6, "widened_us": wide * 1e6, "ratio": half / wide})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab.add_args(ap, dtypes=("bfloat16",), concurrency="1,8,16", questions=1, repeats=3, kernel_calls=200)
    args = ap.parse_args(argv)
    levels = ab.levels(ap, args)

    target = ab.lean_target(ap, args, "the widening")
    layers = target.lean.layers
    kernel = kernel_table(DType.parse(args.dtype).torch, args.kernel_calls)
    for row in kernel:
        print(f"{row['keys']} keys: {row['half_us']:.0f} us half, {row['widened_us']:.0f} us widened", file=sys.stderr)
    work = ab.Workload.spec_bench(args, target)

    def set_arm(arm: str) -> None:
        layers.widen_single_query = arm == "widened"

    # each arm's own solo references (bf16 rounding differs between the arms); "widened" set on return
    result, _ = ab.compare(work, ARMS, set_arm, levels, args.repeats, FIGURES, args.goodput)
    out = ab.record("single_query_attention", "benchmarks/single_query_attention.py", args, argv, work,
                    kernel=kernel, concurrency=result)
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
