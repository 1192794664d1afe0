"""KV memory of fixed slots against slots sized per request, on a mixed long/short stream.

    .venv/bin/python benchmarks/kv_sized.py --json benchmarks/results/kv_sized.json

One :class:`~speculation.engine.batch.BatchEngine` run per mode over the same requests, all queued
at once: ``--long`` longdoc_4k questions (~4K-token prompts) and ``--short`` Spec-Bench questions,
``--new`` greedy tokens each, retrieval drafting, chunked prefill. Both modes allow
``max_tokens_per_sequence`` = the longest prompt + new tokens + one tree, as ``graftblock serve``
sizes its slots.

* ``fixed``: ``max_sequences`` slots of that size, allocated at once;
* ``sized``: ``batch.kv_token_budget`` = that same total (so the same requests are admitted at the
  same time and the engines' schedules match), each slot holding only its own request's rows.

It records the pool's bytes after every step (peak and mean), the wall time of ``--repeats``
interleaved runs per mode, and whether every output matches across all runs token for token. The budget is set equal on purpose: the figure
is the memory the fixed pool holds that no request uses, at the same schedule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from speculation import assets
from speculation.bench.runner import emit_json, environment
from speculation.config import BatchConfig, RetrievalConfig, SamplingConfig
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.engine.batch import BatchEngine, Request
from speculation.model.target import load_target

CHUNK = 256
TREE = 16


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--long", type=int, default=1, help="longdoc_4k questions")
    p.add_argument("--short", type=int, default=3, help="Spec-Bench questions")
    p.add_argument("--new", type=int, default=32, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _run(target, requests: list[Request], cfg: BatchConfig) -> dict:
    vocab = target.vocab_size
    engine = BatchEngine(target, lambda: RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), vocab), cfg)
    for r in requests:
        engine.add(r)
    sizes: list[int] = []
    results = {}
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        results.update(engine.finished_results())
        sizes.append(engine.pool.nbytes())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps": len(sizes), "peak_bytes": max(sizes), "mean_bytes": sum(sizes) / len(sizes),
            "tokens": {rid: r.tokens for rid, r in results.items()}}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    torch.set_num_threads(2)
    target = load_target(args.model, args.dtype)
    tok = target.tokenizer
    questions = assets.load_questions("longdoc_4k")[: args.long] + assets.load_questions("spec_bench")[: args.short]
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in questions]
    greedy = SamplingConfig(temperature=0.0)
    requests = [Request(f"q{i}", p, args.new, greedy, stop_at_eos=False) for i, p in enumerate(prompts)]
    slot = max(len(p) for p in prompts) + args.new + TREE
    n = len(requests)
    base = dict(max_sequences=n, max_tokens_per_sequence=slot, max_tree_tokens=TREE, prefill_chunk_tokens=CHUNK)
    configs = {"fixed": BatchConfig(**base), "sized": BatchConfig(**base, kv_token_budget=n * slot)}
    runs: dict[str, dict] = {}
    tokens: list[dict] = []
    for _ in range(args.repeats):  # interleaved, so neither mode always runs on a cold or a warm host
        for mode, cfg in configs.items():
            r = _run(target, requests, cfg)
            tokens.append(r.pop("tokens"))
            wall = r.pop("wall_s")
            runs.setdefault(mode, r).setdefault("wall_s", []).append(wall)
    same = all(t == tokens[0] for t in tokens)
    for r in runs.values():
        r["median_wall_s"] = statistics.median(r["wall_s"])
    out = {
        "kind": "kv_sized", "model": args.model, "dtype": args.dtype, "env": environment(),
        "command": "python benchmarks/kv_sized.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"), "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new,
        "slot_rows": slot, "max_sequences": n, "runs": runs, "identical_tokens": same,
        "peak_memory_ratio": runs["sized"]["peak_bytes"] / runs["fixed"]["peak_bytes"],
        "wall_ratio_sized_over_fixed": runs["sized"]["median_wall_s"] / runs["fixed"]["median_wall_s"],
    }
    emit_json(out, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
