"""Per-step overhead of the Ray actor path (1 and 2 target shards) against one process.

    .venv/bin/python benchmarks/ray_overhead.py --json benchmarks/results/ray_overhead.json

On SmolLM2-135M, bf16 and fp32, a few prompts, it times the same calls three ways, interleaved
prompt by prompt (local, ray x1, ray x2 in rotating order, so drift hits all of them alike):

* ``decode``: one vanilla step (``generate_vanilla`` seconds / tokens);
* ``verify_T``: one tree verify + KV commit of T tokens (T = 8, 32), median over repeats;
* ``spec_step``: one speculative step of the retrieval drafter (draft + verify + commit +
  observe; fixed trees, ``cost_aware: false``) from ``generate_speculative``'s step records.

Overhead = Ray figure - local figure, in ms per step. The actors run with the same torch
thread count as the local target (``--threads``). Greedy outputs are also compared (the
``exact`` flags): every path must produce the same tokens in fp32.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle threads sleep instead of spinning, in this process and (by
# inheritance, and by the topology's actor_env) in every actor, so a waiting pipeline stage does
# not steal the cores of the working one. The local baseline runs under the same policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from cluster.backend import RayTargetBackend  # noqa: E402
from cluster.deploy import RayDeployment, ensure_ray  # noqa: E402
from cluster.topology import Topology  # noqa: E402
from speculation import assets  # noqa: E402
from speculation.bench.runner import environment  # noqa: E402
from speculation.bench.verify_curve import random_tree  # noqa: E402
from speculation.config import EngineConfig  # noqa: E402
from speculation.drafters import build_drafter, resolve_methods  # noqa: E402
from speculation.engine.sequence import TargetBackend  # noqa: E402
from speculation.engine.solo import generate_speculative, generate_vanilla  # noqa: E402
from speculation.model.target import TargetModel  # noqa: E402

PROMPTS = (
    "Repeat the following list three times: red, green, blue, yellow, purple.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences why the sky is blue.",
)
TREE_SIZES = (8, 32)


def _verify_ms(backend: TargetBackend[Any], prompt: list[int], size: int, repeats: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(size, backend.vocab_size, gen)
    state, _, _ = backend.prefill(prompt)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        backend.verify(state, tree)
        backend.commit(state, tree, [0])
        if isinstance(backend, RayTargetBackend):
            backend.sync()  # include the (normally overlapped) commit in the measured step
        if i >= 2:
            times.append(time.perf_counter() - t0)
        backend.truncate(state, len(prompt))
    backend.release(state)
    if isinstance(backend, RayTargetBackend):
        backend.sync()
    return 1000 * statistics.median(times)


def _measure(backend, drafter_for, prompt: list[int], engine: EngineConfig, repeats: int, seed: int) -> dict:
    t0 = time.perf_counter()
    van = generate_vanilla(backend, prompt, engine)
    decode_ms = 1000 * (van.wall_s - van.prefill_s) / max(1, len(van.tokens) - 1)
    spec = generate_speculative(backend, drafter_for(), prompt, engine)
    steps = spec.steps
    step_ms = 1000 * statistics.mean(s.drafting_s + s.verify_s for s in steps) if steps else None
    out = {
        "decode_ms": decode_ms,
        "spec_step_ms": step_ms,
        "spec_steps": len(steps),
        "spec_tree_size": statistics.mean(s.tree_size for s in steps) if steps else None,
        "vanilla_tokens": van.tokens,
        "spec_tokens": spec.tokens,
    }
    for size in TREE_SIZES:
        out[f"verify_{size}_ms"] = _verify_ms(backend, prompt, size, repeats, seed)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _bundle_nodes(dep: RayDeployment) -> list[str]:
    """Node ids of the deployment's shard bundles, in shard order (where each shard runs)."""
    table = ray.util.placement_group_table(dep.pg)
    return [str(table["bundles_to_node_id"][k]) for k in range(dep.topology.shards)]


def run_dtype(dtype: str, args, prompts: list[str]) -> dict:
    model, tok = assets.load_model_and_tokenizer(args.model, getattr(torch, dtype))
    target = TargetModel(model, tok)
    spec = resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False, "budget": 16}})[0]
    engine = EngineConfig(max_new_tokens=args.max_new_tokens)
    ids = [assets.encode_turn(tok, [], p) for p in prompts]
    topo = dict(shard_resources={"CPU": 0.25}, drafter_resources={"CPU": 0.25}, torch_threads=args.threads)
    deps = {
        f"ray_{n}": RayDeployment(
            Topology(shards=n, **topo), args.model, dtype
        )
        for n in (1, 2)
    }
    if args.across_nodes:
        # The same 2 shards with SPREAD: on a cluster of several nodes, each shard on its own node.
        deps["ray_2_across_nodes"] = RayDeployment(
            Topology(shards=2, placement_strategy="SPREAD", **topo), args.model, dtype)
    shard_nodes = {name: _bundle_nodes(dep) for name, dep in deps.items()}  # before shutdown frees the groups
    paths = {"local": (target, lambda: build_drafter(spec, target))}
    for name, dep in deps.items():
        paths[name] = (dep.backend, lambda dep=dep: dep.drafter(spec))
    try:
        # Warm-up: one short pass per path (first calls pay lazy initialisation).
        warm = EngineConfig(max_new_tokens=4)
        for backend, drafter_for in paths.values():
            generate_speculative(backend, drafter_for(), ids[0], warm)
        rows: dict[str, list[dict]] = {name: [] for name in paths}
        order = list(paths)
        for pi, prompt in enumerate(ids):
            for name in order[pi % len(order) :] + order[: pi % len(order)]:
                backend, drafter_for = paths[name]
                rows[name].append(_measure(backend, drafter_for, prompt, engine, args.repeats, seed=pi))
                print(
                    f"[{dtype}] prompt {pi} {name}: decode {rows[name][-1]['decode_ms']:.1f} ms, "
                    f"spec step {rows[name][-1]['spec_step_ms']:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for dep in deps.values():
            dep.shutdown()
    keys = ["decode_ms", "spec_step_ms"] + [f"verify_{s}_ms" for s in TREE_SIZES]
    summary = {
        name: {k: statistics.mean(r[k] for r in rs if r[k] is not None) for k in keys}
        for name, rs in rows.items()
    }
    overhead = {name: {k: summary[name][k] - summary["local"][k] for k in keys} for name in deps}
    exact = {
        name: all(
            r["vanilla_tokens"] == loc["vanilla_tokens"] and r["spec_tokens"] == loc["spec_tokens"]
            for r, loc in zip(rows[name], rows["local"], strict=True)
        )
        for name in deps
    }
    return {
        "shard_nodes": shard_nodes,
        "per_path_ms": summary,
        "overhead_ms": overhead,
        "exact_vs_local": exact,
        "per_prompt": {
            n: [{k: v for k, v in r.items() if not k.endswith("_tokens")} for r in rs]
            for n, rs in rows.items()
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/results/ray_overhead.json")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts"
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per verify size")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, local and in every actor")
    ap.add_argument("--across-nodes", action="store_true",
                    help="also time 2 shards placed SPREAD (one per node on a multi-node cluster: RAY_ADDRESS)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ensure_ray()
    prompts = list(PROMPTS[: args.prompts])
    results = {dt: run_dtype(dt, args, prompts) for dt in args.dtypes.split(",")}
    out = {
        "kind": "ray_overhead",
        "model": args.model,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "ray_nodes": sum(1 for n in ray.nodes() if n["Alive"]),
        "env": environment(),
        "command": "python benchmarks/ray_overhead.py " + " ".join(sys.argv[1:]),
        "results": results,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    for dt, r in results.items():
        for name, o in r["overhead_ms"].items():
            row = ", ".join(f"{k} {v:+.1f}" for k, v in o.items())
            print(f"{dt} {name} overhead vs local (ms/step): {row}; exact: {r['exact_vs_local'][name]}")
    print(f"JSON written to {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
