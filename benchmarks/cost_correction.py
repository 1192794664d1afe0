"""Does the solo cost-aware drafter recover from a c(T) measured on a busy host? Side by side.

    .venv/bin/python benchmarks/cost_correction.py --dtype float32 --json benchmarks/results/cost_correction_fp32.json

The solo retrieval drafter cuts each tree by the verify curve c(T, L) that ``build_drafter``
measures once, in a few seconds, at start-up. In the fp32 concurrency run of BENCHMARKS.md a unit
test shared the two cores during that measurement; the curve read flat, the drafter verified
13-token trees instead of 3, and ran at 0.94x vanilla. The drafters now correct a measured curve
by every solo verify step (:class:`~speculation.policy.cost.OnlineCostModel`).

This script measures c(T, L) twice on one target: on the host as it is (``clean``), and while
``--burners`` busy-loop processes (started here, stopped by PID) share the cores (``disturbed``).
Then it runs the first Spec-Bench turn of ``--questions`` questions per category, each prompt in
turn under every arm, so the arms see the same drift:

* ``vanilla``;
* ``clean``: retrieval on the clean curve, corrected online (how ``graftblock`` runs it);
* ``disturbed_frozen``: retrieval on the disturbed curve, never corrected (the behaviour before
  online correction: a curve given by hand is used as given);
* ``disturbed_online``: retrieval on the disturbed curve, corrected online.

One drafter per arm serves every prompt, as in ``graftblock bench``, so corrections carry over.
Reported per arm: tokens/s (tokens / seconds over all prompts), the ratio to vanilla, mean verified
tree size, tau, whether every output equals vanilla's, and the curve before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import torch

from speculation import assets
from speculation.bench.runner import emit_json, environment
from speculation.config import EngineConfig, RetrievalConfig, SamplingConfig
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.target import TargetModel
from speculation.policy.cost import OnlineCostModel, measure_cost_model

ARMS = ("vanilla", "clean", "disturbed_frozen", "disturbed_online")


def _measure(target, size: int, burners: int):
    """c(T, L) measured now, with ``burners`` busy-loop processes running (0 = none)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        if procs:
            time.sleep(1.0)  # let them reach the cores
        return measure_cost_model(target, max_size=size, fresh=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _curve(model) -> dict:
    return {str(s): sec for s, sec in zip(model.sizes, model.seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=1, help="Spec-Bench questions per category (13 categories)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--burners", type=int, default=2, help="busy-loop processes during the disturbed measurement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not 1 <= args.questions <= 10:
        ap.error(f"--questions must be in [1, 10], got {args.questions}")
    if not 1 <= args.burners <= 16:
        ap.error(f"--burners must be in [1, 16], got {args.burners}")

    model, tok = assets.load_model_and_tokenizer(args.model, getattr(torch, args.dtype))
    target = TargetModel(model, tok)
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in assets.load_questions("spec_bench", args.questions)]
    cfg = RetrievalConfig()
    engine = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    generate_vanilla(target, prompts[0], engine)  # warm-up: first-call allocations are not timed

    clean = _measure(target, cfg.verify_curve_size(), 0)
    disturbed = _measure(target, cfg.verify_curve_size(), args.burners)
    drafters = {
        "clean": RetrievalDrafter(cfg, target.vocab_size, clean),
        "disturbed_frozen": RetrievalDrafter(cfg, target.vocab_size, dataclasses.replace(disturbed, measured=False)),
        "disturbed_online": RetrievalDrafter(cfg, target.vocab_size, disturbed),
    }
    assert isinstance(drafters["disturbed_online"].cost_model, OnlineCostModel)
    assert not isinstance(drafters["disturbed_frozen"].cost_model, OnlineCostModel)
    totals = {a: {"tokens": 0, "seconds": 0.0, "steps": 0, "tree_tokens": 0, "matches": 0} for a in ARMS}
    for prompt in prompts:
        ref = None
        for arm in ARMS:
            t0 = time.perf_counter()
            if arm == "vanilla":
                res = generate_vanilla(target, prompt, engine)
            else:
                res = generate_speculative(target, drafters[arm], prompt, engine)
            sec = time.perf_counter() - t0
            ref = res.tokens if arm == "vanilla" else ref
            t = totals[arm]
            t["tokens"] += len(res.tokens)
            t["seconds"] += sec
            t["steps"] += len(res.steps) if res.steps else len(res.tokens)
            t["tree_tokens"] += sum(s.tree_size for s in res.steps) if res.steps else len(res.tokens)
            t["matches"] += int(res.tokens == ref)
    van = totals["vanilla"]["tokens"] / totals["vanilla"]["seconds"]
    arms = {}
    for arm, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        arms[arm] = {"tokens_per_s": rate, "speedup": rate / van, "mean_tree_tokens": t["tree_tokens"] / t["steps"],
                     "tau": t["tokens"] / t["steps"], "lossless": t["matches"] == len(prompts), **t}
    out = {
        "kind": "cost_correction",
        "command": " ".join(["benchmarks/cost_correction.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(),
        "model": args.model, "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "burners": args.burners, "retrieval": dataclasses.asdict(cfg),
        "arms": arms,
        "curves_s": {"clean": _curve(clean), "disturbed": _curve(disturbed),
                     "clean_after": _curve(drafters["clean"].cost_model),
                     "disturbed_after": _curve(drafters["disturbed_online"].cost_model)},
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
