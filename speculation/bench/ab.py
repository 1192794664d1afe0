"""The shared frame of the closed-loop A/B scripts under ``benchmarks/`` (``fold_prefills.py``,
``single_query_attention.py``, ``batch_invariant.py``): their common flags, the checks on them, and the run order.

Two arms of one setting run the closed loop of ``graftblock bench --concurrency``
(:func:`~speculation.bench.runner.run_concurrency`) on the same prompts, alternating run by run,
and the arm that goes first alternates from repeat to repeat, so a drifting host hits both alike.
The paired ratio of repeat r is arm one's figure over arm two's in that repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculation import assets
from speculation.bench.runner import environment, run_concurrency
from speculation.config import ConfigError, parse_concurrency
from speculation.config import BenchConfig, DType, EngineConfig, SamplingConfig
from speculation.engine.solo import generate_vanilla
from speculation.model.target import TargetModel


def add_args(ap: argparse.ArgumentParser, *, dtypes: Sequence[str], concurrency: str, questions: int,
             repeats: int, kernel_calls: int | None = None) -> None:
    """The flags every A/B script takes (the first of ``dtypes`` is the default), and
    ``--kernel-calls`` for a script that also times a kernel when ``kernel_calls`` is given."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=dtypes[0], choices=list(dtypes))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", default="vanilla", help="a bench method (vanilla, retrieval, ...)")
    ap.add_argument("--goodput", action="store_true")
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--questions", type=int, default=questions, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--json", type=Path)
    if kernel_calls is not None:
        ap.add_argument("--kernel-calls", type=int, default=kernel_calls, help="timed calls per kernel figure")


def levels(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """``--concurrency`` parsed as the bench CLI parses it, with ``--repeats`` checked; exits through
    ``ap.error`` on bad values."""
    try:
        out = parse_concurrency(args.concurrency)
    except ConfigError as e:
        ap.error(str(e))
    if not out:
        ap.error("--concurrency needs at least one level")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "kernel_calls", 1) < 1:
        ap.error(f"--kernel-calls must be >= 1, got {args.kernel_calls}")
    return out


def lean_target(ap: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> Any:
    """``--model`` in ``--dtype`` on ``--threads`` torch threads; exits through ``ap.error`` when it does
    not run the lean forward, where ``what`` (the setting the script compares) does not apply."""
    torch.set_num_threads(args.threads)
    target = TargetModel(*assets.load_model_and_tokenizer(args.model, DType.parse(args.dtype).torch))
    if target.lean is None:
        ap.error(f"{args.model} does not run the lean forward: {what} does not apply")
    return target


def alternate(arms: Sequence[str], ns: Sequence[int], repeats: int,
              run: Callable[[int, str], dict]) -> dict[int, dict[str, list[dict]]]:
    """``run(n, arm)`` (one closed loop, returning the method's row) for every repeat, N and arm,
    the arms' order reversed on odd repeats; the rows per N and arm, in repeat order."""
    rows: dict[int, dict[str, list[dict]]] = {n: {a: [] for a in arms} for n in ns}
    for r in range(repeats):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for n in ns:
            for arm in order:
                row = run(n, arm)
                rows[n][arm].append(row)
                print(f"repeat {r + 1}/{repeats} N={n} {arm}: {row['tokens_per_s']:.1f} tok/s, "
                      f"lossless {row['lossless']}", file=sys.stderr)
    return rows


def paired(rows: dict[str, list[dict]], figures: Sequence[str]) -> dict:
    """Medians of ``figures`` per arm, each repeat's ``lossless``, and the paired tokens/s ratios of
    the first arm over the second (sorted), their median and how many favoured the first arm."""
    arms = {a: {f: statistics.median(m[f] for m in ms) for f in figures} for a, ms in rows.items()}
    for a, ms in rows.items():
        arms[a]["lossless"] = [m["lossless"] for m in ms]
    one, two = rows.values()
    ratios = sorted(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(one, two))
    return {"arms": arms, "ratio_tokens_per_s_paired": ratios, "ratio_median": statistics.median(ratios),
            "repeats_faster": sum(x > 1.0 for x in ratios)}


@dataclass
class Workload:
    """The A/B scripts' workload: ``--questions`` Spec-Bench first turns per category for ``--method``,
    greedy, ``--max-new-tokens`` each, on ``target``."""

    target: Any
    questions: list
    prompts: list[list[int]]
    cfg: Any  # BenchConfig
    method: str

    @classmethod
    def spec_bench(cls, args: argparse.Namespace, target: Any) -> Workload:
        questions = assets.load_questions("spec_bench", args.questions)
        cfg = BenchConfig(methods=(args.method,), model=args.model, dtype=DType.parse(args.dtype),
                          max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=0.0))
        prompts = [assets.encode_turn(target.tokenizer, [], q.turns[0]) for q in questions]
        return cls(target, questions, prompts, cfg, args.method)

    def solo_outputs(self) -> list[list[int]]:
        """Every prompt's solo greedy vanilla output (the ``lossless`` references)."""
        engine = EngineConfig(max_new_tokens=self.cfg.max_new_tokens, sampling=self.cfg.sampling)
        return [generate_vanilla(self.target, p, engine).tokens for p in self.prompts]

    def closed_loop(self, n: int, refs: list[list[int]], goodput: bool = False,
                    questions: list | None = None) -> dict:
        """One closed loop at concurrency ``n``: the method's row of ``run_concurrency``."""
        qs = self.questions if questions is None else questions
        level = run_concurrency(self.cfg, self.target, qs, [n], goodput=goodput, refs=refs[: len(qs)])
        return level[str(n)]["methods"][self.method]


def compare(work: Workload, arms: Sequence[str], set_arm: Callable[[str], None], ns: Sequence[int],
            repeats: int, figures: Sequence[str], goodput: bool = False) -> tuple[dict[str, dict], dict]:
    """Each arm's solo references (computed with the arm set: the arms may round differently), one
    warm-up loop, then :func:`alternate` and :func:`paired` per N. The first arm is set on return.
    Returns (per N as a string: the paired result, per arm: its solo outputs)."""
    refs: dict[str, list[list[int]]] = {}
    for arm in arms:
        set_arm(arm)
        refs[arm] = work.solo_outputs()
    set_arm(arms[0])
    work.closed_loop(2, refs[arms[0]], questions=work.questions[:2])  # warm-up: oneDNN, drafters

    def run(n: int, arm: str) -> dict:
        set_arm(arm)
        return work.closed_loop(n, refs[arm], goodput)

    rows = alternate(arms, ns, repeats, run)
    set_arm(arms[0])
    return {str(n): paired(rows[n], figures) for n in ns}, refs


def record(kind: str, script: str, args: argparse.Namespace, argv: list[str] | None, work: Workload,
           **figures: Any) -> dict:
    """The result JSON of an A/B script: its kind, command line, host, workload and ``figures``."""
    return {"kind": kind, "command": " ".join([script, *(argv if argv is not None else sys.argv[1:])]),
            "env": environment(), "model": args.model, "dtype": args.dtype, "method": args.method,
            "goodput": args.goodput, "prompts": len(work.prompts), "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, **figures}
