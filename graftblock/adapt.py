"""``graftblock adapt-bench``: online adaptation policies on a domain-shifting request stream.

    graftblock adapt-bench --drafter eagle3 --policies static,always,periodic,cost_aware \\
        --phases chat,code,math,translation --requests-per-phase 40 --json OUT.json

The stream takes Spec-Bench first turns phase by phase (chat = writing/roleplay/humanities/stem,
code = coding, math = math/math_reasoning, translation = translation). Every policy has its own
drafter (same starting weights) and :class:`~adaptation.controller.AdaptationController`; requests
are interleaved policy by policy, so machine noise hits them alike. Feedback is drained and
rounds run inside the decode loop's feedback hook, on the same cores: a request's wall time
includes the updates (training, replay, sync) it waited for, so tokens/s is *net of update
cost*. Output JSON::

    {"model", "dtype", "drafter", "phases", "requests_per_phase", "max_new_tokens",
     "policies": {"<name>": {"tokens_per_s", "tau", "updates", "rollbacks", "gated", "cost_s",
                             "regret" (cost_aware: vs the best fixed arm, seconds; else null),
                             "lossless" (greedy: token-identical to the first policy),
                             "per_phase": {"<phase>": {"tokens_per_s", "tau", "requests"}},
                             "tau_series": [per request], "decisions": [...]}}}

Every decision is also an MLflow metric of the run (``tracking.adaptation``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculation.config import ConfigError

PHASE_CATEGORIES: dict[str, tuple[str, ...]] = {
    "chat": ("writing", "roleplay", "humanities", "stem"),
    "code": ("coding",),
    "math": ("math", "math_reasoning"),
    "translation": ("translation",),
}
"""Stream phase -> the Spec-Bench categories its requests come from (taken round-robin)."""

DRAFTERS = ("eagle3", "specblock")


def add_adapt_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``adapt-bench`` on the CLI's sub-parsers."""
    p = sub.add_parser("adapt-bench", help="online adaptation policies on a domain-shift stream")
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--drafter", default="eagle3", choices=DRAFTERS)
    p.add_argument("--config", default=None, help="YAML: drafter name -> options (as for bench)")
    p.add_argument("--policies", default="static,always,periodic,cost_aware")
    p.add_argument("--phases", default="chat,code,math,translation")
    p.add_argument("--dataset", default="spec_bench",
                   help="spec_bench, or a jsonl in Spec-Bench's question format whose categories include "
                        "the phases' (see PHASE_CATEGORIES)")
    p.add_argument("--requests-per-phase", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="keep only the last N prompt tokens (0 = whole prompts; for small-context models)")
    p.add_argument("--decide-every-steps", type=int, default=64, help="verify steps between rounds")
    p.add_argument("--horizon-s", type=float, default=60.0, help="gain horizon, seconds")
    p.add_argument("--budgets", default="0,32,128,512", help="bandit arms: optimizer steps (0 = skip)")
    p.add_argument("--fixed-budget", type=int, default=32, help="steps of an always-update round")
    p.add_argument("--periodic-rounds", type=int, default=4)
    p.add_argument("--periodic-budget", type=int, default=128)
    p.add_argument("--guard-window", type=int, default=32, help="verify steps watched after a swap")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--unroll-steps", type=int, default=0, help="TTT steps / blocks per batch (0 = family default)")
    p.add_argument("--window-tokens", type=int, default=128, help="longest training window per sequence")
    p.add_argument("--heldout", type=int, default=4, help="held-out requests in the replay buffer")
    p.add_argument("--json", required=True, help="where to write the result JSON")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--experiment", default="graftblock-adapt")
    p.set_defaults(func=cmd_adapt_bench)


@dataclass
class _PolicyRun:
    name: str
    drafter: Any
    controller: Any
    sink: Any
    tokens: list[list[int]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    decisions: list[Any] = field(default_factory=list)


def _stream(tokenizer, dataset: str, phases: list[str], per_phase: int,
            max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    from speculation import assets

    questions = assets.load_questions(dataset)
    out: list[tuple[str, list[int]]] = []
    for phase in phases:
        pools = [[q for q in questions if q.category == c] for c in PHASE_CATEGORIES[phase]]
        picked = []
        i = 0
        while len(picked) < per_phase and any(i < len(pool) for pool in pools):
            picked.extend(pool[i] for pool in pools if i < len(pool))
            i += 1
        if len(picked) < per_phase:
            raise ConfigError(f"--requests-per-phase {per_phase}: phase {phase!r} has only {len(picked)} questions")
        for q in picked[:per_phase]:
            ids = assets.encode_turn(tokenizer, [], q.turns[0])
            out.append((phase, ids[-max_prompt_tokens:] if max_prompt_tokens else ids))
    return out


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return None
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return x


def _parse_args(args: argparse.Namespace) -> tuple[list[str], list[str], tuple[int, ...]]:
    from adaptation.controller import Policy

    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        try:
            Policy(p)
        except ValueError:
            raise ConfigError(f"--policies: unknown policy {p!r}; choose from {[x.value for x in Policy]}") from None
    phases = [p for p in args.phases.split(",") if p]
    for p in phases:
        if p not in PHASE_CATEGORIES:
            raise ConfigError(f"--phases: unknown phase {p!r}; choose from {sorted(PHASE_CATEGORIES)}")
    try:
        budgets = tuple(int(b) for b in args.budgets.split(","))
    except ValueError:
        raise ConfigError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    if args.max_prompt_tokens < 0:
        raise ConfigError(f"--max-prompt-tokens must be >= 0, got {args.max_prompt_tokens}")
    if args.requests_per_phase < 1:
        raise ConfigError(f"--requests-per-phase must be >= 1, got {args.requests_per_phase}")
    if not policies or not phases:
        raise ConfigError("--policies and --phases must each name at least one entry")
    return policies, phases, budgets


def cmd_adapt_bench(args: argparse.Namespace) -> int:
    import torch

    from adaptation.bandit import BanditConfig
    from adaptation.controller import AdaptationController, ControllerConfig, Policy
    from adaptation.feedback import BufferConfig, FeedbackSink
    from adaptation.online import OnlineConfig
    from adaptation.rollback import GuardConfig
    from graftblock.cli import _load_target, _load_yaml
    from speculation.config import EngineConfig, SamplingConfig
    from speculation.drafters import build_drafter, resolve_methods
    from speculation.engine import generate_speculative

    policies, phases, budgets = _parse_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = None
    if not args.no_mlflow:
        from tracking.adaptation import AdaptationLog

        log = AdaptationLog(args.experiment, args.tracking_uri)
    target = _load_target(args.model, args.dtype)
    stream = _stream(target.tokenizer, args.dataset, phases, args.requests_per_phase, args.max_prompt_tokens)
    spec = resolve_methods([args.drafter], _load_yaml(args.config))[0]
    engine = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    base = dict(
        decide_every_steps=args.decide_every_steps, horizon_s=args.horizon_s, fixed_budget=args.fixed_budget,
        periodic_rounds=args.periodic_rounds, periodic_budget=args.periodic_budget,
        bandit=BanditConfig(budgets=budgets), guard=GuardConfig(window_steps=args.guard_window),
        online=OnlineConfig(lr=args.lr, unroll_steps=args.unroll_steps, window_tokens=args.window_tokens),
        buffer=BufferConfig(heldout_sequences=args.heldout),
    )
    if log is not None:
        log.log_params({"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "policies": args.policies,
                        "phases": args.phases, "dataset": args.dataset, "requests_per_phase": args.requests_per_phase,
                        "max_new_tokens": args.max_new_tokens, "controller": _jsonable(ControllerConfig(**base))})
    runs: list[_PolicyRun] = []
    for name in policies:
        drafter = build_drafter(spec, target)
        controller = AdaptationController(drafter, drafter.load_state_dict,
                                          ControllerConfig(policy=Policy(name), **base))
        run = _PolicyRun(name, drafter, controller, FeedbackSink(controller.add))
        if log is not None:
            controller.on_decision = (lambda d, _n=name: log.log_decision(_n, d.outcome.value, d.metrics()))
        runs.append(run)

    for i, (phase, prompt) in enumerate(stream):
        for run in runs:
            hook = run.sink.hook(i)

            def feedback(ctx, outcome, _hook=hook, _sink=run.sink):
                _hook(ctx, outcome)
                _sink.drain()  # rounds run here, between decode steps, on the serving cores

            t0 = time.perf_counter()
            res = generate_speculative(target, run.drafter, prompt, engine, feedback=feedback)
            run.walls.append(time.perf_counter() - t0)
            run.sink.end_request(i)
            run.tokens.append(res.tokens)
            run.taus.append(sum(s.tokens_gained for s in res.steps) / max(1, len(res.steps)))
            run.phases.append(phase)
        print(f"[{i + 1}/{len(stream)}] {phase}: " + "  ".join(
            f"{r.name} tau={r.taus[-1]:.2f} v{r.controller.version}" for r in runs), flush=True)

    result = _summarise(args, runs, phases)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if log is not None:
        log.finish({k: {kk: vv for kk, vv in v.items() if kk not in ("decisions", "tau_series")}
                    for k, v in result["policies"].items()}, [out])
    for name, p in result["policies"].items():
        print(f"{name:>10}: {p['tokens_per_s']:.2f} tok/s  tau {p['tau']:.3f}  updates {p['updates']}  "
              f"rollbacks {p['rollbacks']}  cost {p['cost_s']:.2f} s  lossless {p['lossless']}")
    print(f"wrote {out}")
    return 0


def _summarise(args: argparse.Namespace, runs: list[_PolicyRun], phases: list[str]) -> dict[str, Any]:
    ref = runs[0].tokens
    policies: dict[str, Any] = {}
    for run in runs:
        s = run.controller.summary()
        n_tok = sum(len(t) for t in run.tokens)
        per_phase = {}
        for ph in phases:
            idx = [j for j, p in enumerate(run.phases) if p == ph]
            per_phase[ph] = {
                "tokens_per_s": sum(len(run.tokens[j]) for j in idx) / sum(run.walls[j] for j in idx),
                "tau": sum(run.taus[j] for j in idx) / len(idx), "requests": len(idx),
            }
        policies[run.name] = {
            "tokens_per_s": n_tok / sum(run.walls), "tau": sum(run.taus) / len(run.taus),
            "updates": int(s["updates"]), "rollbacks": int(s["rollbacks"]), "gated": int(s["gated"]),
            "cost_s": s["cost_s"], "regret": s.get("regret_s"), "best_fixed_arm": s.get("best_fixed_arm"),
            "lossless": run.tokens == ref, "per_phase": per_phase, "tau_series": run.taus,
            "decisions": _jsonable(run.controller.decisions),
        }
    return _jsonable({"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "phases": phases,
                      "requests_per_phase": args.requests_per_phase, "max_new_tokens": args.max_new_tokens,
                      "lossless_reference": runs[0].name, "policies": policies})
