"""Prefills folded into the batched step against a prefill forward per arriving request (or, with
``--chunk C``, chunked prefill against whole-prompt prefill), side by side.

    .venv/bin/python benchmarks/fold_prefills.py --dtype float32 --json benchmarks/results/fold_prefills_fp32.json
    .venv/bin/python benchmarks/fold_prefills.py --dtype float32 --chunk 128 --json benchmarks/results/chunked_prefill_fp32.json
    .venv/bin/python benchmarks/fold_prefills.py --dtype float32 --chunk 128 --step-budget 256 --concurrency 16 --json OUT.json
    .venv/bin/python benchmarks/fold_prefills.py --dtype bfloat16 --method retrieval --goodput --veto --concurrency 4,8 --json OUT.json
    .venv/bin/python benchmarks/fold_prefills.py --dtype bfloat16 --method retrieval --goodput --against-vanilla --questions 3 --concurrency 8,16 --json OUT.json

Runs the closed loop of ``graftblock bench --concurrency`` (:func:`~speculation.bench.runner.run_concurrency`:
N clients, each sending the next Spec-Bench first turn when its request ends) through
:class:`~speculation.engine.batch.BatchEngine` twice per repeat: with ``fold_prefills`` on (an arriving
prompt is one more causal row of the step's flat forward) and off (each arriving prompt gets its
own forward before the step); with ``--chunk C``, ``prefill_chunk_tokens=C`` (a long prompt is
prefilled C tokens per step; ``--step-budget S`` adds ``prefill_step_tokens=S``) against whole
prompts (both folded); with ``--veto`` (and ``--goodput``), the goodput rule with its realised-payoff
veto (``payoff_veto``) against the rule's predictions alone; with ``--against-vanilla``, the method
against batched vanilla (one closed loop each, back to back). The arms alternate run by run
(which arm goes first alternates too), so a drifting host hits both alike. Reports per N and arm
the median over ``--repeats`` of total tokens/s, TTFT p50/p99 and ITL p50/p99/max, and the paired
ratio first arm / second arm per repeat (median, and how many repeats were faster), plus whether
each arm equals its solo vanilla run token for token (greedy; the chunked arm's solo run chunks
alike), and with the goodput rule the mean share of sequence steps per verdict before drafting.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from speculation import assets
from speculation.bench import ab
from speculation.bench.runner import emit_json, environment, run_concurrency
from speculation.config import BenchConfig, DType, EngineConfig, SamplingConfig
from speculation.engine.solo import generate_vanilla
from speculation.model.target import load_target

FOLD_ARMS = {"folded": {"fold_prefills": True}, "unfolded": {"fold_prefills": False}}
FIGURES = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab.add_args(ap, dtypes=("float32", "bfloat16"), concurrency="4,8,16", questions=1, repeats=3)
    ap.add_argument("--chunk", type=int, default=None,
                    help="compare prefill_chunk_tokens=CHUNK against whole-prompt prefill instead")
    ap.add_argument("--step-budget", type=int, default=None,
                    help="with --chunk: also cap the prompt tokens per step (prefill_step_tokens)")
    ap.add_argument("--veto", action="store_true",
                    help="compare the goodput rule with its realised-payoff veto against without (needs --goodput)")
    ap.add_argument("--against-vanilla", action="store_true",
                    help="compare --method against batched vanilla itself (no --chunk, --veto)")
    args = ap.parse_args(argv)
    levels = ab.levels(ap, args)
    if args.chunk is not None and args.chunk < 1:
        ap.error(f"--chunk must be >= 1, got {args.chunk}")
    if args.step_budget is not None and (args.chunk is None or args.step_budget < args.chunk):
        ap.error(f"--step-budget needs --chunk and must be >= it, got {args.step_budget}")
    if args.veto and (not args.goodput or args.chunk is not None):
        ap.error("--veto compares the goodput rule's payoff veto: it needs --goodput and no --chunk")
    if args.against_vanilla and (args.method == "vanilla" or args.chunk is not None or args.veto):
        ap.error("--against-vanilla compares --method with vanilla: it needs a --method other than vanilla, "
                 "and no --chunk or --veto")
    if args.against_vanilla:
        arms = {args.method: {}, "vanilla": {}}
    elif args.veto:
        arms = {"veto": {"payoff_veto": True}, "no veto": {"payoff_veto": False}}
    elif args.chunk is None:
        arms = FOLD_ARMS
    elif args.step_budget is None:
        arms = {f"chunked {args.chunk}": {"prefill_chunk_tokens": args.chunk}, "whole": {}}
    else:
        arms = {f"chunked {args.chunk}, {args.step_budget}/step": {"prefill_chunk_tokens": args.chunk,
                                                                  "prefill_step_tokens": args.step_budget},
                "whole": {}}

    torch.set_num_threads(args.threads)
    target = load_target(args.model, args.dtype)
    if not target.folds_prefills and not (args.veto or args.against_vanilla):
        ap.error(f"{args.model} in {args.dtype} does not run the flat batch here: nothing folds")
    questions = assets.load_questions("spec_bench", args.questions)
    greedy = SamplingConfig(temperature=0.0)
    cfg = BenchConfig(methods=(args.method,), model=args.model, dtype=DType.parse(args.dtype),
                      max_new_tokens=args.max_new_tokens, sampling=greedy)
    prompts = [assets.encode_turn(target.tokenizer, [], q.turns[0]) for q in questions]
    solo = {chunk: [generate_vanilla(target, p, EngineConfig(max_new_tokens=args.max_new_tokens, sampling=greedy,
                                                             prefill_chunk_tokens=chunk)).tokens for p in prompts]
            for chunk in {kw.get("prefill_chunk_tokens") for kw in arms.values()}}  # each solo run once
    refs = {arm: solo[kw.get("prefill_chunk_tokens")] for arm, kw in arms.items()}
    first = next(iter(arms))
    run_concurrency(cfg, target, questions[:2], [2], refs=refs[first][:2], **arms[first])  # warm-up: oneDNN, drafters

    runs: dict[int, dict[str, list[dict]]] = {n: {a: [] for a in arms} for n in levels}
    for r in range(args.repeats):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for n in levels:
            if args.against_vanilla:  # one closed loop per method, back to back, in this repeat's order
                level = run_concurrency(dataclasses.replace(cfg, methods=tuple(order)), target, questions, [n],
                                        goodput=args.goodput, refs=refs[first])[str(n)]
                for arm in order:
                    runs[n][arm].append(level["methods"][arm])
                    print(f"repeat {r + 1}/{args.repeats} N={n} {arm}: "
                          f"{level['methods'][arm]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
                continue
            for arm in order:
                level = run_concurrency(cfg, target, questions, [n], goodput=args.goodput, refs=refs[arm],
                                        **arms[arm])[str(n)]
                runs[n][arm].append(level["methods"][args.method])
                print(f"repeat {r + 1}/{args.repeats} N={n} {arm}: "
                      f"{level['methods'][args.method]['tokens_per_s']:.1f} tok/s", file=sys.stderr)

    result: dict[int, dict] = {}
    for n in levels:
        arms = {a: {f: statistics.median(m[f] for m in ms) for f in FIGURES} for a, ms in runs[n].items()}
        for a, ms in runs[n].items():
            arms[a]["lossless"] = all(m["lossless"] is True for m in ms)
            arms[a]["steps"] = statistics.median(m["steps"] for m in ms)
            verdicts = [m["goodput_verdicts"] for m in ms if m.get("goodput_verdicts")]
            if verdicts:
                arms[a]["goodput_verdicts"] = {k: statistics.fmean(v[k] for v in verdicts) for k in verdicts[0]}
        a0, a1 = (runs[n][a] for a in arms)
        ratios = sorted(f["tokens_per_s"] / u["tokens_per_s"] for f, u in zip(a0, a1))
        result[n] = {"arms": arms, "ratio_tokens_per_s_paired": ratios,
                     "ratio_median": statistics.median(ratios), "repeats_faster": sum(x > 1.0 for x in ratios)}
        if all(m.get("saturated_tokens_per_s") for m in (*a0, *a1)):  # every client busy: the N the run is at
            for a, ms in runs[n].items():
                arms[a]["saturated_tokens_per_s"] = statistics.median(m["saturated_tokens_per_s"] for m in ms)
            sat = sorted(f["saturated_tokens_per_s"] / u["saturated_tokens_per_s"] for f, u in zip(a0, a1))
            result[n].update(saturated_ratio_paired=sat, saturated_ratio_median=statistics.median(sat))
    out = {
        "kind": "fold_prefills",
        "command": " ".join(["benchmarks/fold_prefills.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "method": args.method,
        "goodput": args.goodput, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "chunk": args.chunk, "step_budget": args.step_budget, "veto": args.veto,
        "against_vanilla": args.against_vanilla, "prompt_tokens": sorted(len(p) for p in prompts),
        "repeats": args.repeats, "concurrency": {str(n): v for n, v in result.items()},
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
