"""Long context end to end: the verify cost c(T, L) from 512 to 8K tokens, then retrieval and Graft
against vanilla on the longdoc workloads (2K/4K/8K-token documents), in one run.

    .venv/bin/python benchmarks/long_context.py --json benchmarks/results/long_context_fp32.json

Why: verifying T tokens reads the KV cache of the L committed tokens once, like decoding one token
does (MagicDec, TriForce), so as L grows the relative price of a bigger tree,
``c(T, L) / c(1, L)``, falls, and speculation should pay more. Part 1 measures that ratio on this
host, and records what the drafters' own cost model (measured at ``DEFAULT_CONTEXTS``, up to 1K,
and extrapolated in L beyond) predicts at the same points; part 2 measures what it buys: the same bench as ``graftblock bench --dataset longdoc_Nk``
(every method on the same questions, exactness checked against vanilla), with chunked prefill on.

The run writes its JSON after each stage and, given the same ``--json``, skips the stages already
in it, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from speculation import assets
from speculation.bench.runner import emit_json, environment, run_bench
from speculation.config import BenchConfig, DType, SamplingConfig, to_dict
from speculation.model.target import load_target
from speculation.policy.cost import measure_at_context, measure_cost_model
from speculation.assets.workloads import LONGDOC_TOKENS

CONTEXTS = (512, 1024, 2048, 4096, 8000)
SIZES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNK = 512
"""Chunked prefill: the longdoc prompts go through the target in forwards of at most this many tokens."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=[d.value for d in DType])
    ap.add_argument("--methods", default="vanilla,retrieval,graft")
    ap.add_argument("--questions", type=int, default=4, help="longdoc questions per size, 1..12")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed verify calls per c(T, L) point")
    args = ap.parse_args(argv)
    if not 1 <= args.questions <= 12:
        ap.error(f"--questions must be in [1, 12], got {args.questions}")
    if not 1 <= args.max_new_tokens <= 1024:
        ap.error(f"--max-new-tokens must be in [1, 1024], got {args.max_new_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out: dict = json.loads(args.json.read_text()) if args.json.is_file() else {}
    out.update({"kind": "long_context", "model": args.model, "dtype": args.dtype, "env": environment(),
                "command": "python benchmarks/long_context.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    target = load_target(args.model, args.dtype)
    window = target.max_context

    curve = out.setdefault("verify_cost", {})
    for ctx in CONTEXTS:
        if str(ctx) in curve or ctx + max(SIZES) > window:
            continue
        t0 = time.perf_counter()
        secs = measure_at_context(target, SIZES, ctx, repeats=args.repeats)
        curve[str(ctx)] = {str(s): secs[s] for s in SIZES}
        print(f"c(T, L={ctx}): " + ", ".join(f"T={s} {1000 * secs[s]:.1f} ms" for s in SIZES)
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        emit_json(out, args.json)

    if "predicted_cost" not in out:
        model = measure_cost_model(target, max(SIZES))
        out["predicted_cost"] = {"contexts_measured": list(model.contexts), "grid": {
            str(ctx): {str(s): model.cost(s, ctx) for s in SIZES} for ctx in CONTEXTS if str(ctx) in curve}}
        emit_json(out, args.json)

    runs = out.setdefault("workloads", {})
    for name in LONGDOC_TOKENS:
        if name in runs:
            continue
        questions = assets.load_questions(name)[: args.questions]
        cfg = BenchConfig(methods=tuple(args.methods.split(",")), model=args.model, dtype=DType(args.dtype),
                          dataset=name, max_new_tokens=args.max_new_tokens, warmup=1,
                          sampling=SamplingConfig(temperature=0.0))
        t0 = time.perf_counter()
        res = run_bench(cfg, target, questions, prefill_chunk_tokens=PREFILL_CHUNK)
        prompt_tokens = [len(assets.encode_turn(target.tokenizer, [], q.turns[0])) for q in questions]
        runs[name] = {"prompt_tokens": prompt_tokens, "wall_s": time.perf_counter() - t0,
                      "bench_config": to_dict(cfg), "baseline_tokens_per_s": res["baseline_tokens_per_s"],
                      "methods": res["methods"], "n_turns": res["n_turns"]}
        print(f"{name}: " + ", ".join(f"{m} {r['speedup']:.2f}x tau {r['tau']:.2f} lossless {r['lossless']}"
                                      for m, r in res["methods"].items()), flush=True)
        emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
