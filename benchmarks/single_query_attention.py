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
import statistics
import sys
from pathlib import Path

ARMS = ("widened", "half")
FIGURES = ("tokens_per_s", "itl_p50_s", "itl_p99_s", "ttft_p50_s")
KEYS = (100, 300, 800, 1500)


def kernel_table(dtype, calls: int) -> list[dict]:
    """Per n: the one-query attention call's median microseconds, half precision and widened."""
    import torch
    import torch.nn.functional as F

    from speculation.bench.runner import median_call_s

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
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", default="vanilla", help="a bench method (vanilla, retrieval, ...)")
    ap.add_argument("--goodput", action="store_true")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--questions", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernel-calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from graftblock.cli import _parse_concurrency
    from speculation.config import ConfigError

    try:
        levels = _parse_concurrency(args.concurrency)  # the bench CLI's own parsing and range
    except ConfigError as e:
        ap.error(str(e))
    if not levels:
        ap.error("--concurrency needs at least one level")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.kernel_calls < 1:
        ap.error(f"--kernel-calls must be >= 1, got {args.kernel_calls}")

    import torch

    from graftblock.cli import _load_target
    from speculation import assets
    from speculation.bench.runner import emit_json, environment, run_concurrency
    from speculation.config import BenchConfig, DType, EngineConfig, SamplingConfig
    from speculation.engine import generate_vanilla

    torch.set_num_threads(args.threads)
    dtype = DType.parse(args.dtype)
    kernel = kernel_table(dtype.torch, args.kernel_calls)
    for row in kernel:
        print(f"{row['keys']} keys: {row['half_us']:.0f} us half, {row['widened_us']:.0f} us widened", file=sys.stderr)
    target = _load_target(args.model, args.dtype)
    if target.lean is None:
        ap.error(f"{args.model} does not run the lean forward: the widening does not apply")
    layers = target.lean.layers
    questions = assets.load_questions("spec_bench", args.questions)
    greedy = SamplingConfig(temperature=0.0)
    cfg = BenchConfig(methods=(args.method,), model=args.model, dtype=dtype, max_new_tokens=args.max_new_tokens,
                      sampling=greedy)
    prompts = [assets.encode_turn(target.tokenizer, [], q.turns[0]) for q in questions]
    refs = {}
    for arm in ARMS:  # each arm's own solo vanilla outputs (bf16 rounding differs between the arms)
        layers.widen_single_query = arm == "widened"
        refs[arm] = [generate_vanilla(target, p, EngineConfig(max_new_tokens=args.max_new_tokens,
                                                              sampling=greedy)).tokens for p in prompts]
    layers.widen_single_query = True
    run_concurrency(cfg, target, questions[:2], [2], refs=refs["widened"][:2])  # warm-up: oneDNN, drafters

    runs: dict[int, dict[str, list[dict]]] = {n: {a: [] for a in ARMS} for n in levels}
    for r in range(args.repeats):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for n in levels:
            for arm in order:
                layers.widen_single_query = arm == "widened"
                level = run_concurrency(cfg, target, questions, [n], goodput=args.goodput, refs=refs[arm])[str(n)]
                runs[n][arm].append(level["methods"][args.method])
                print(f"repeat {r + 1}/{args.repeats} N={n} {arm}: "
                      f"{level['methods'][args.method]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    layers.widen_single_query = True

    result: dict[str, dict] = {}
    for n in levels:
        arms = {a: {f: statistics.median(m[f] for m in ms) for f in FIGURES} for a, ms in runs[n].items()}
        for a, ms in runs[n].items():
            arms[a]["lossless"] = [m["lossless"] for m in ms]
        ratios = sorted(w["tokens_per_s"] / h["tokens_per_s"] for w, h in zip(runs[n]["widened"], runs[n]["half"]))
        result[str(n)] = {"arms": arms, "ratio_tokens_per_s_paired": ratios,
                          "ratio_median": statistics.median(ratios), "repeats_faster": sum(x > 1.0 for x in ratios)}
    out = {
        "kind": "single_query_attention",
        "command": " ".join(["benchmarks/single_query_attention.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "method": args.method,
        "goodput": args.goodput, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "kernel": kernel, "concurrency": result,
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
