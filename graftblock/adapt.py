"""``graftblock adapt-bench``: online adaptation policies on a domain-shifting request stream.

    graftblock adapt-bench --drafter eagle3 --policies static,always,periodic,cost_aware \\
        --phases chat,code,math,translation --requests-per-phase 40 --json OUT.json

    graftblock adapt-bench --stream ray_configs/stream_domain_shift.yaml --drafter specblock \\
        --policies static,always,periodic,cost_aware,config_ucb --config-arms pareto_front.yaml --json OUT.json

The stream is a :class:`StreamSpec` (``--stream`` YAML: phases with a dataset source, categories,
request count and order); without one it takes Spec-Bench first turns phase by phase (chat =
writing/roleplay/humanities/stem, code = coding, math = math/math_reasoning, translation =
translation). The ``harmful`` policy is ``static`` plus one deliberately harmful update (the draft
head's rows shuffled) published before request ``--harmful-at``: run beside ``static``, it measures
how soon the swap guard rolls it back and what it costs (the result's ``harmful`` block). The
``config_ucb`` policy adapts the *tree configuration* instead of the weights:
:class:`~adaptation.config_bandit.ConfigAdapter` picks one of ``--config-arms`` (the Pareto front
``graftblock compare`` writes) per request by UCB on measured tokens/s, scoring the other arms on
the verified trajectory (full information); its ``cost_s`` is that scoring time (charged to its
wall time) and its ``regret`` is in tokens/s summed over requests. Every policy has its own
drafter (same starting weights) and :class:`~adaptation.controller.AdaptationController`; requests
are interleaved policy by policy, so machine noise hits them alike. Feedback is drained and
rounds run inside the decode loop's feedback hook, on the same cores: a request's wall time
includes the updates (training, replay, sync) it waited for, so tokens/s is *net of update
cost*. Each policy's controller runs on its own :class:`ServingClock` (wall time minus the other
policies' requests), so its traffic rate and exploration budget are those of serving the stream
alone. Output JSON::

    {"model", "dtype", "drafter", "phases", "requests_per_phase", "max_new_tokens",
     "policies": {"<name>": {"tokens_per_s", "tau", "updates", "rollbacks", "gated", "cost_s",
                             "regret" (cost_aware: vs the best fixed arm, seconds; else null),
                             "lossless" (greedy: token-identical to the first policy),
                             "per_phase": {"<phase>": {"tokens_per_s", "tau", "requests",
                                                       "tau_series", "tokens_per_s_series"}},
                             "tau_series": [per request], "tokens_per_s_series": [per request],
                             "phase_series": [per request], "decisions": [...],
                             "serving_s" (its requests' seconds), "foreign_s" (the other
                             policies' seconds, outside its :class:`ServingClock`),
                             config_ucb only: "arm_series", "config_bandit": {regret, pulls, arms …}}},
     "harmful" (with the harmful policy): {"at_request", "phase", "seed", "rolled_back",
                             "closed_as" (kept | rolled_back | null: the watch never closed),
                             "rollback_request", "requests_to_rollback", "watch_steps", "guard_mode",
                             "tau_pre", "tau_post" (live, before the swap and in the watch window),
                             "tau_replay_prev", "tau_replay_new", "guard_replay_s",
                             "phase_tokens_per_s" (harmful / static, the swap's phase),
                             "affected_tokens_per_s" (harmful / static, the requests from the swap
                             to the rollback; "affected_requests" of them),
                             "before_swap_tokens_per_s" (harmful / static on the
                             phase's requests before the swap, where both serve the same weights:
                             the noise floor; "before_swap_requests" of them),
                             "affected_extra_s" (seconds the affected requests
                             took beyond static's same requests), "phase_serving_s" (the harmful
                             policy's seconds on the phase), "cost_share_of_phase" (those
                             seconds over the harmful policy's serving seconds of the phase: the
                             swap's cost read on its own requests, not through the phase's noise)}}

Every decision is also an MLflow metric of the run (``tracking.adaptation``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from adaptation.bandit import SKIP, BanditConfig
from adaptation.config_bandit import ConfigAdapter, ConfigBanditConfig, load_arms
from adaptation.controller import AdaptationController, ControllerConfig, Outcome, Policy
from adaptation.feedback import BufferConfig, FeedbackSink
from adaptation.online import OnlineConfig
from adaptation.rollback import GuardConfig, shuffled_head
from graftblock.common import add_json_arg, check_threads, json_path, load_yaml
from speculation import assets
from speculation.bench.runner import environment
from speculation.config import ConfigError, EngineConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.solo import generate_speculative
from speculation.model.target import load_target
from tracking.adaptation import AdaptationLog

PHASE_CATEGORIES: dict[str, tuple[str, ...]] = {
    "chat": ("writing", "roleplay", "humanities", "stem"),
    "code": ("coding",),
    "math": ("math", "math_reasoning"),
    "translation": ("translation",),
}
"""Stream phase -> the Spec-Bench categories its requests come from (taken round-robin), without ``--stream``."""

DRAFTERS = ("eagle3", "specblock")
GUARD_MODES = ("paired", "live")
"""adaptation.rollback.GuardMode's values, as the parser's choices."""
CONFIG_POLICY = "config_ucb"
"""The config-adaptation policy (:mod:`adaptation.config_bandit`); the others are weight-update policies."""
HARMFUL_POLICY = "harmful"
"""The swap guard's benchmark: the static policy, plus one deliberately harmful update
(:func:`adaptation.rollback.shuffled_head`) published before request ``--harmful-at`` and watched
by the guard like any update."""
DEFAULT_REQUESTS_PER_PHASE = 40


# ---------------------------------------------------------------------------- the stream spec
class PhaseOrder(str, enum.Enum):
    """How a phase takes its questions: alternating between its categories, or in file order."""

    ROUND_ROBIN = "round_robin"
    FILE = "file"


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of a request stream.

    Attributes:
        name: the phase's label in the results (unique in the stream).
        source: ``spec_bench``, a packaged dataset (``humaneval``, ``asdiv``, ``translation``,
            ``nq_open``, ``xsum``; :data:`speculation.assets.PACKAGED_DATASETS`) or the path of a
            jsonl in Spec-Bench's question format (relative to the stream file).
        categories: keep only these categories of the source (empty = all). A packaged dataset's
            category is its own name.
        requests: requests in the phase. >= 1.
        order: :class:`PhaseOrder`.
    """

    name: str
    source: str
    categories: tuple[str, ...] = ()
    requests: int = DEFAULT_REQUESTS_PER_PHASE
    order: PhaseOrder = PhaseOrder.ROUND_ROBIN


@dataclass(frozen=True)
class StreamSpec:
    """A domain-shifting request stream: phases served in order (``--stream`` YAML)::

        name: domain_shift
        requests_per_phase: 40            # default of every phase's ``requests``
        phases:
          - {name: chat, source: spec_bench, categories: [writing, roleplay, humanities, stem]}
          - {name: code, source: humaneval}
    """

    phases: tuple[PhaseSpec, ...]
    name: str = "stream"

    @classmethod
    def from_yaml(cls, path: str | Path) -> StreamSpec:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--stream: {p} does not exist")
        try:
            doc = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--stream {p}: not valid YAML ({exc})") from None
        return cls.from_dict(doc, p.parent)

    @classmethod
    def from_dict(cls, doc: Any, base_dir: Path = Path(".")) -> StreamSpec:
        """Validate a stream document; every error names ``stream.<field>`` and what it allows."""
        if not isinstance(doc, dict):
            raise ConfigError(f"stream must be a mapping with 'phases', got {type(doc).__name__}")
        _no_unknown(doc, {"name", "requests_per_phase", "phases"}, "stream")
        default = doc.get("requests_per_phase", DEFAULT_REQUESTS_PER_PHASE)
        _check_count(default, "stream.requests_per_phase")
        name = doc.get("name", "stream")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"stream.name must be a non-empty string, got {name!r}")
        raw_phases = doc.get("phases")
        if not isinstance(raw_phases, list) or not raw_phases:
            raise ConfigError(f"stream.phases must be a non-empty list of phases, got {raw_phases!r}")
        known = (assets.SPEC_BENCH, *assets.PACKAGED_DATASETS)
        phases, seen = [], set()
        for i, raw in enumerate(raw_phases):
            where = f"stream.phases[{i}]"
            if not isinstance(raw, dict):
                raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
            _no_unknown(raw, {"name", "source", "categories", "requests", "order"}, where)
            pname = raw.get("name")
            if not isinstance(pname, str) or not pname:
                raise ConfigError(f"{where}.name must be a non-empty string, got {pname!r}")
            if pname in seen:
                raise ConfigError(f"{where}.name {pname!r} repeats an earlier phase; names must be unique")
            seen.add(pname)
            source = raw.get("source")
            if not isinstance(source, str) or not source:
                raise ConfigError(f"{where}.source must be one of {list(known)} or a question file, got {source!r}")
            if source not in known:
                path = (base_dir / source) if not Path(source).is_absolute() else Path(source)
                if not path.is_file():
                    raise ConfigError(f"{where}.source {source!r} is neither a dataset ({', '.join(known)}) "
                                      f"nor a file (looked for {path})")
                source = str(path)
            cats = raw.get("categories", [])
            if not isinstance(cats, list) or not all(isinstance(c, str) and c for c in cats):
                raise ConfigError(f"{where}.categories must be a list of non-empty strings, got {cats!r}")
            requests = raw.get("requests", default)
            _check_count(requests, f"{where}.requests")
            try:
                order = PhaseOrder(raw.get("order", PhaseOrder.ROUND_ROBIN.value))
            except ValueError:
                raise ConfigError(f"{where}.order must be one of {[o.value for o in PhaseOrder]}, "
                                  f"got {raw.get('order')!r}") from None
            phases.append(PhaseSpec(pname, source, tuple(cats), requests, order))
        return cls(tuple(phases), name)

    @classmethod
    def from_phase_names(cls, names: list[str], dataset: str, requests: int) -> StreamSpec:
        """The stream without ``--stream``: :data:`PHASE_CATEGORIES` taken from ``dataset``."""
        for p in names:
            if p not in PHASE_CATEGORIES:
                raise ConfigError(f"--phases: unknown phase {p!r}; choose from {sorted(PHASE_CATEGORIES)}")
        return cls(tuple(PhaseSpec(p, dataset, PHASE_CATEGORIES[p], requests) for p in names), "phases")

    def with_requests(self, requests: int) -> StreamSpec:
        """Every phase with ``requests`` requests (``--requests-per-phase`` over a stream file)."""
        return dataclasses.replace(self, phases=tuple(dataclasses.replace(p, requests=requests) for p in self.phases))


def _no_unknown(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _check_count(v: Any, where: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{where} must be an integer >= 1, got {v!r}")


def stream_questions(spec: StreamSpec, strict_categories: bool = True) -> list[tuple[str, str]]:
    """``(phase, first turn)`` per request, phase by phase. A ConfigError names a phase that is
    short, or (``strict_categories``: a stream file) a category its source does not have."""
    cache: dict[str, list[Any]] = {}
    out: list[tuple[str, str]] = []
    for i, ph in enumerate(spec.phases):
        if ph.source not in cache:
            cache[ph.source] = assets.load_questions(ph.source)
        questions = cache[ph.source]
        cats = ph.categories or tuple(dict.fromkeys(q.category for q in questions))
        missing = [c for c in cats if not any(q.category == c for q in questions)]
        if missing and (strict_categories or len(missing) == len(cats)):
            raise ConfigError(f"stream.phases[{i}].categories: {missing} not in {ph.source} "
                              f"(it has {sorted({q.category for q in questions})})")
        if ph.order is PhaseOrder.FILE:
            picked = [q for q in questions if q.category in cats]
        else:
            pools = [[q for q in questions if q.category == c] for c in cats]
            picked = [pool[j] for j in range(max(map(len, pools))) for pool in pools if j < len(pool)]
        if len(picked) < ph.requests:
            raise ConfigError(f"stream.phases[{i}].requests {ph.requests}: phase {ph.name!r} has only "
                              f"{len(picked)} questions in {ph.source}")
        out.extend((ph.name, q.turns[0]) for q in picked[: ph.requests])
    return out


# ---------------------------------------------------------------------------- CLI
def add_adapt_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``adapt-bench`` on the CLI's sub-parsers."""
    p = sub.add_parser("adapt-bench", help="online adaptation policies on a domain-shift stream")
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--drafter", default="eagle3", choices=DRAFTERS)
    p.add_argument("--config", default=None, help="YAML: drafter name -> options (as for bench)")
    p.add_argument("--policies", default="static,always,periodic,cost_aware",
                   help=f"comma-separated: static, always, periodic, cost_aware, {CONFIG_POLICY} (needs --config-arms), "
                        f"{HARMFUL_POLICY} (static plus one harmful update at --harmful-at; put static first)")
    p.add_argument("--stream", default=None, help="stream spec YAML (e.g. ray_configs/stream_domain_shift.yaml); "
                                                  "replaces --phases/--dataset")
    p.add_argument("--phases", default="chat,code,math,translation")
    p.add_argument("--dataset", default="spec_bench",
                   help="spec_bench, or a jsonl in Spec-Bench's question format whose categories include "
                        "the phases' (see PHASE_CATEGORIES)")
    p.add_argument("--requests-per-phase", type=int, default=None,
                   help=f"requests per phase (default {DEFAULT_REQUESTS_PER_PHASE}; overrides the stream file's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="keep only the last N prompt tokens (0 = whole prompts; for small-context models)")
    p.add_argument("--decide-every-steps", type=int, default=64, help="verify steps between rounds")
    p.add_argument("--horizon-s", type=float, default=60.0, help="gain horizon, seconds")
    p.add_argument("--budgets", default="0,32,128,512", help="bandit arms: optimizer steps (0 = skip)")
    p.add_argument("--explore-after-harm", action="store_true",
                   help="cost_aware: explore every budget even after a cheaper one's candidate lowered tau "
                        "(default: cheapest first, dearer budgets skipped after a harmful estimate)")
    p.add_argument("--retry-growth", type=float, default=2.0,
                   help="cost_aware: re-try an arm once the train part holds this many times the positions "
                        "of its latest estimate (inf = never)")
    p.add_argument("--min-train-positions", type=int, default=0,
                   help="train positions (tokens with features) buffered before any update")
    p.add_argument("--explore-budget", type=float, default=None,
                   help="cost_aware: share of serving wall time refused candidates may cost (training + "
                        "replay); a candidate beyond it is not trained (default: unbounded)")
    p.add_argument("--fixed-budget", type=int, default=32, help="steps of an always-update round")
    p.add_argument("--periodic-rounds", type=int, default=4)
    p.add_argument("--periodic-budget", type=int, default=128)
    p.add_argument("--guard-window", type=int, default=32, help="verify steps watched after a swap")
    p.add_argument("--guard-mode", choices=GUARD_MODES, default=GUARD_MODES[0],
                   help="paired: replay previous and new weights on the post-swap feedback (same text); "
                        "live: compare live tau before and after the swap (different text)")
    p.add_argument("--guard-margin", type=float, default=0.1, help="relative tau drop that rolls a swap back")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--recency-half-life", type=float, default=None,
                   help="requests back at which a buffered request's training-draw weight halves (default: uniform)")
    p.add_argument("--audit-window", type=int, default=None,
                   help="cost_aware: verify steps per audit window; when live tau drops from one window to the "
                        "next by the guard margin, the start and the updated weights are replayed on that window "
                        "and the start weights come back if the update is the cause (default: off)")
    p.add_argument("--accepted-keep", type=float, default=1.0,
                   help="share of accepted (non-mistake) positions in the update loss (mistakes always in)")
    p.add_argument("--unroll-steps", type=int, default=0, help="TTT steps / blocks per batch (0 = family default)")
    p.add_argument("--window-tokens", type=int, default=128, help="longest training window per sequence")
    p.add_argument("--heldout", type=int, default=4, help="held-out requests in the replay buffer")
    p.add_argument("--config-arms", default=None,
                   help=f"{CONFIG_POLICY}: arm file (the pareto_front.yaml `graftblock compare` writes)")
    p.add_argument("--config-ucb-scale", type=float, default=1.0, help=f"{CONFIG_POLICY}: UCB exploration scale c")
    p.add_argument("--no-full-information", action="store_true",
                   help=f"{CONFIG_POLICY}: do not score the other arms on the verified trajectory")
    p.add_argument("--harmful-at", type=int, default=None,
                   help=f"{HARMFUL_POLICY}: index of the request (0-based, over the whole stream) before which the "
                        "harmful update is published (default: the middle of the first phase)")
    p.add_argument("--harmful-seed", type=int, default=0, help=f"{HARMFUL_POLICY}: seed of the head's row permutation")
    add_json_arg(p, "adapt-bench")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--experiment", default="graftblock-adapt")
    p.set_defaults(func=cmd_adapt_bench)


@dataclass
class ServingClock:
    """A policy's own serving time: wall time minus the time other policies' requests took.

    adapt-bench interleaves the policies request by request. On the wall clock each policy would
    see about half its real traffic rate (N of the gain), and an exploration budget measured on
    the wall clock would be about twice as generous as intended. Each policy's controller and
    feedback sink run on its own clock instead, so both see the stream as if served alone.
    """

    foreign_s: float = 0.0

    def __call__(self) -> float:
        return time.time() - self.foreign_s


@dataclass
class _PolicyRun:
    name: str
    drafter: Any = None
    controller: Any = None
    sink: Any = None
    adapter: Any = None  # config_ucb: a ConfigAdapter (no drafter, controller or sink)
    tokens: list[list[int]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    arms: list[str] = field(default_factory=list)
    decided_by: list[int] = field(default_factory=list)  # controller decisions logged by the end of each request
    clock: ServingClock = field(default_factory=ServingClock)


def _encode(tokenizer, turns: list[tuple[str, str]], max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for phase, text in turns:
        ids = assets.encode_turn(tokenizer, [], text)
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


def _parse_args(args: argparse.Namespace) -> tuple[list[str], StreamSpec, tuple[int, ...]]:
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p in (CONFIG_POLICY, HARMFUL_POLICY):
            continue
        try:
            Policy(p)
        except ValueError:
            raise ConfigError(f"--policies: unknown policy {p!r}; choose from "
                              f"{[x.value for x in Policy] + [CONFIG_POLICY, HARMFUL_POLICY]}") from None
    if len(set(policies)) != len(policies):
        raise ConfigError(f"--policies names a policy twice: {args.policies!r}")
    if CONFIG_POLICY in policies and not args.config_arms:
        raise ConfigError(f"--policies {CONFIG_POLICY} needs --config-arms FILE (graftblock compare's pareto_front.yaml)")
    try:
        budgets = tuple(int(b) for b in args.budgets.split(","))
    except ValueError:
        raise ConfigError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    if args.max_prompt_tokens < 0:
        raise ConfigError(f"--max-prompt-tokens must be >= 0, got {args.max_prompt_tokens}")
    if args.requests_per_phase is not None and args.requests_per_phase < 1:
        raise ConfigError(f"--requests-per-phase must be >= 1, got {args.requests_per_phase}")
    if not policies:
        raise ConfigError("--policies must name at least one policy")
    if not args.retry_growth > 1:
        raise ConfigError(f"--retry-growth must be > 1 (inf = never re-try), got {args.retry_growth}")
    if args.min_train_positions < 0:
        raise ConfigError(f"--min-train-positions must be >= 0, got {args.min_train_positions}")
    if not 0 <= args.accepted_keep <= 1:
        raise ConfigError(f"--accepted-keep must be in [0, 1], got {args.accepted_keep}")
    if not 0 <= args.guard_margin < 1:
        raise ConfigError(f"--guard-margin must be in [0, 1), got {args.guard_margin}")
    if args.recency_half_life is not None and not args.recency_half_life > 0:
        raise ConfigError(f"--recency-half-life must be > 0, got {args.recency_half_life}")
    if args.explore_budget is not None and not 0 <= args.explore_budget <= 1:
        raise ConfigError(f"--explore-budget must be in [0, 1], got {args.explore_budget}")
    if args.audit_window is not None and args.audit_window < 2:
        raise ConfigError(f"--audit-window must be >= 2, got {args.audit_window}")
    if args.stream:
        stream = StreamSpec.from_yaml(args.stream)
        if args.requests_per_phase is not None:
            stream = stream.with_requests(args.requests_per_phase)
    else:
        phases = [p for p in args.phases.split(",") if p]
        if not phases:
            raise ConfigError("--phases must name at least one phase")
        stream = StreamSpec.from_phase_names(phases, args.dataset, args.requests_per_phase or DEFAULT_REQUESTS_PER_PHASE)
    if HARMFUL_POLICY in policies:
        if "static" not in policies:
            raise ConfigError(f"--policies {HARMFUL_POLICY} is measured against static: add static to --policies")
        if args.harmful_at is None:
            args.harmful_at = max(1, stream.phases[0].requests // 2)
        total = sum(p.requests for p in stream.phases)
        if not 1 <= args.harmful_at < total:
            raise ConfigError(f"--harmful-at must be in [1, {total - 1}] (a request of the stream after the first, "
                              f"so the guard has a live tau before the swap), got {args.harmful_at}")
    elif args.harmful_at is not None:
        raise ConfigError(f"--harmful-at needs the {HARMFUL_POLICY} policy in --policies")
    return policies, stream, budgets


def cmd_adapt_bench(args: argparse.Namespace) -> int:
    policies, stream_spec, budgets = _parse_args(args)
    turns = stream_questions(stream_spec, strict_categories=bool(args.stream))  # fail on a short phase before loading anything
    arms = load_arms(args.config_arms) if CONFIG_POLICY in policies else []
    config_bandit = ConfigBanditConfig(ucb_scale=args.config_ucb_scale, full_information=not args.no_full_information)
    if check_threads(args):
        torch.set_num_threads(args.threads)
    log = None
    if not args.no_mlflow:
        log = AdaptationLog(args.experiment, args.tracking_uri)
    target = load_target(args.model, args.dtype)
    stream = _encode(target.tokenizer, turns, args.max_prompt_tokens)
    weight_policies = [p for p in policies if p != CONFIG_POLICY]  # harmful included: static's weights
    spec = resolve_methods([args.drafter], load_yaml(args.config))[0] if weight_policies else None
    engine = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    base = dict(
        decide_every_steps=args.decide_every_steps, horizon_s=args.horizon_s, fixed_budget=args.fixed_budget,
        periodic_rounds=args.periodic_rounds, periodic_budget=args.periodic_budget,
        min_train_positions=args.min_train_positions, explore_budget=args.explore_budget,
        audit_window_steps=args.audit_window,
        bandit=BanditConfig(budgets=budgets, explore_after_harm=args.explore_after_harm,
                            retry_growth=args.retry_growth),
        guard=GuardConfig(window_steps=args.guard_window, margin=args.guard_margin, mode=args.guard_mode),
        online=OnlineConfig(lr=args.lr, accepted_keep=args.accepted_keep, unroll_steps=args.unroll_steps,
                            recency_half_life=args.recency_half_life,
                            window_tokens=args.window_tokens),
        buffer=BufferConfig(heldout_sequences=args.heldout),
    )
    if log is not None:
        log.log_params({"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "policies": args.policies,
                        "stream": _jsonable(stream_spec), "dataset": args.dataset,
                        "max_new_tokens": args.max_new_tokens, "controller": _jsonable(ControllerConfig(**base)),
                        **({"config_bandit": _jsonable(config_bandit), "config_arms": [a.name for a in arms]}
                           if arms else {})})
    runs: list[_PolicyRun] = []
    for name in policies:
        if name == CONFIG_POLICY:
            runs.append(_PolicyRun(name, adapter=ConfigAdapter(target, arms, config_bandit)))
            continue
        drafter = build_drafter(spec, target)
        clock = ServingClock()
        policy = Policy.STATIC if name == HARMFUL_POLICY else Policy(name)
        controller = AdaptationController(drafter, drafter.load_state_dict,
                                          ControllerConfig(policy=policy, **base), clock=clock)
        run = _PolicyRun(name, drafter, controller, FeedbackSink(controller.add, clock=clock), clock=clock)
        if log is not None:
            controller.on_decision = (lambda d, _n=name: log.log_decision(_n, d.outcome.value, d.metrics()))
        runs.append(run)

    for i, (phase, prompt) in enumerate(stream):
        for run in runs:
            if run.adapter is not None:
                t0 = time.perf_counter()
                served = run.adapter.serve(prompt, engine)  # the arms' scoring is charged to the request
                run.walls.append(time.perf_counter() - t0)
                res = served.result
                run.arms.append(served.decision.arm)
                if log is not None:
                    log.log_config_round(run.name, served.decision.arm,
                                         served.decision.metrics(run.adapter.arm_ids))
            else:
                if run.name == HARMFUL_POLICY and i == args.harmful_at:
                    run.sink.drain()  # the guard's pre-swap tau sees every step served so far
                    run.controller.apply(shuffled_head(run.controller.weights, args.harmful_seed), SKIP,
                                         run.controller.cost.cost(SKIP), injected=True)
                hook = run.sink.hook(i)

                def feedback(ctx, outcome, _hook=hook, _sink=run.sink):
                    _hook(ctx, outcome)
                    _sink.drain()  # rounds run here, between decode steps, on the serving cores

                t0 = time.perf_counter()
                res = generate_speculative(target, run.drafter, prompt, engine, feedback=feedback)
                run.walls.append(time.perf_counter() - t0)
                run.sink.end_request(i)
                run.decided_by.append(len(run.controller.decisions))
            for other in runs:  # this request's time is foreign to every other policy's clock
                if other is not run:
                    other.clock.foreign_s += run.walls[-1]
            run.tokens.append(res.tokens)
            run.taus.append(sum(s.tokens_gained for s in res.steps) / max(1, len(res.steps)))
            run.phases.append(phase)
        print(f"[{i + 1}/{len(stream)}] {phase}: " + "  ".join(
            f"{r.name} tau={r.taus[-1]:.2f} " + (f"arm={r.arms[-1]}" if r.adapter is not None else f"v{r.controller.version}")
            for r in runs), flush=True)

    result = _summarise(args, runs, stream_spec, budgets)
    out = json_path(args, "adapt-bench")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot = plot_tau(result, out.with_name(f"{out.stem}_tau.png"))
    if log is not None:
        skip = ("decisions", "tau_series", "tokens_per_s_series", "phase_series", "arm_series", "config_bandit")
        log.finish({k: {kk: vv for kk, vv in v.items() if kk not in skip}
                    for k, v in result["policies"].items()}, [out, plot])
    for name, p in result["policies"].items():
        print(f"{name:>10}: {p['tokens_per_s']:.2f} tok/s  tau {p['tau']:.3f}  updates {p['updates']}  "
              f"rollbacks {p['rollbacks']}  cost {p['cost_s']:.2f} s  lossless {p['lossless']}")
    print(f"wrote {out}")
    return 0


def plot_tau(result: dict[str, Any], path: Path, window: int = 4) -> Path:
    """tau per request for every policy (a trailing mean over ``window`` requests), phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    phase_series = next(iter(result["policies"].values()))["phase_series"]
    start = 0
    for k, phase in enumerate(result["phases"]):
        n = phase_series.count(phase)
        if k % 2:
            ax.axvspan(start - 0.5, start + n - 0.5, color="0.93", lw=0)
        ax.text(start + n / 2, 1.0, phase, ha="center", va="bottom", transform=ax.get_xaxis_transform(), fontsize=8)
        start += n
    for name, p in result["policies"].items():
        taus = p["tau_series"]
        smooth = [sum(taus[max(0, i - window + 1): i + 1]) / len(taus[max(0, i - window + 1): i + 1])
                  for i in range(len(taus))]
        ax.plot(range(len(taus)), smooth, label=f"{name} ({p['updates']} updates)", lw=1.2)
    ax.set_xlabel("request")
    ax.set_ylabel(f"tau (trailing mean of {window})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _command(args: argparse.Namespace) -> str:
    """The adapt-bench command line that reproduces ``args``: the run's identity, then every other
    option that differs from its default."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_adapt_parser(sub)
    defaults = vars(sub.choices["adapt-bench"].parse_args(["--json", "-"]))
    always = ("model", "dtype", "threads", "drafter", "config", "policies", "stream", "requests_per_phase",
              "max_new_tokens")
    rest = [k for k in vars(args) if k not in (*always, "json", "func") and k in defaults]
    parts = ["graftblock adapt-bench"]
    for k in (*always, *rest):
        v = getattr(args, k)
        if v is None or (k in rest and v == defaults[k]):
            continue
        flag = f"--{k.replace('_', '-')}"
        parts.append(flag if v is True else f"{flag} {shlex.quote(str(v))}")
    if args.json:
        parts.append(f"--json {shlex.quote(str(args.json))}")
    return " ".join(parts)


RECOVERY_WITHIN = 0.10
"""#13's recovery criterion: tau back within this share of its phase-end value."""
RECOVERY_WINDOW = 3
"""Requests in the trailing mean that is compared with the phase-end tau (one request's tau swings
with its text; static's own series moves by 15% from request to request)."""
RECOVERY_END_SHARE = 0.25
"""The phase-end tau: the mean over this share of the phase's last requests (at least
``RECOVERY_WINDOW`` of them)."""


def recovery_requests(taus: list[float], phases: list[str]) -> dict[str, int | None]:
    """Per phase after the first: how many requests into the phase tau recovered, i.e. the first
    request r (1-based) whose trailing mean over the last ``min(RECOVERY_WINDOW, r)`` requests of
    the phase reaches ``(1 - RECOVERY_WITHIN)`` times the phase-end tau (the mean of its last
    ``max(RECOVERY_WINDOW, ceil(RECOVERY_END_SHARE * n))`` requests). 1 means no dip; None when no request of the phase
    (or an empty phase) reaches it."""
    order = list(dict.fromkeys(phases))
    out: dict[str, int | None] = {}
    for ph in order[1:]:
        series = [t for t, p in zip(taus, phases) if p == ph]
        if not series:
            out[ph] = None
            continue
        tail = series[-max(RECOVERY_WINDOW, math.ceil(RECOVERY_END_SHARE * len(series))):]
        bar = (1 - RECOVERY_WITHIN) * sum(tail) / len(tail)
        out[ph] = next((r for r in range(1, len(series) + 1)
                        if sum(series[max(0, r - RECOVERY_WINDOW):r]) / min(RECOVERY_WINDOW, r) >= bar), None)
    return out


def _summarise(args: argparse.Namespace, runs: list[_PolicyRun], stream: StreamSpec,
               budgets: tuple[int, ...]) -> dict[str, Any]:
    ref = runs[0].tokens
    phases = [p.name for p in stream.phases]
    policies: dict[str, Any] = {}
    for run in runs:
        n_tok = sum(len(t) for t in run.tokens)
        speeds = [len(t) / w for t, w in zip(run.tokens, run.walls)]
        per_phase = {}
        for ph in phases:
            idx = [j for j, p in enumerate(run.phases) if p == ph]
            per_phase[ph] = {
                "tokens_per_s": sum(len(run.tokens[j]) for j in idx) / sum(run.walls[j] for j in idx),
                "tau": sum(run.taus[j] for j in idx) / len(idx), "requests": len(idx),
                "tau_series": [run.taus[j] for j in idx], "tokens_per_s_series": [speeds[j] for j in idx],
            }
        common = {"tokens_per_s": n_tok / sum(run.walls), "tau": sum(run.taus) / len(run.taus),
                  "lossless": run.tokens == ref, "per_phase": per_phase, "tau_series": run.taus,
                  "tokens_per_s_series": speeds, "wall_series": run.walls, "phase_series": run.phases,
                  "serving_s": sum(run.walls), "foreign_s": run.clock.foreign_s,
                  "recovery_requests": recovery_requests(run.taus, run.phases)}
        if run.adapter is not None:
            s = run.adapter.summary()
            policies[run.name] = {
                **common, "updates": 0, "rollbacks": 0, "gated": 0, "cost_s": s["score_s"],
                "regret": s["regret"], "best_fixed_arm": s["best_fixed_arm"], "arm_series": run.arms,
                "config_bandit": s, "decisions": _jsonable(run.adapter.decisions),
            }
            continue
        s = run.controller.summary()
        policies[run.name] = {
            **common, "updates": int(s["updates"]), "rollbacks": int(s["rollbacks"]), "gated": int(s["gated"]),
            "audits": int(s["audits"]), "reverts": int(s["reverts"]), "cost_s": s["cost_s"], "regret": s.get("regret_s"), "best_fixed_arm": s.get("best_fixed_arm"),
            "decisions": _jsonable(run.controller.decisions),
        }

    by_name = {r.name: r for r in runs}
    harmful = _harmful_summary(args, by_name[HARMFUL_POLICY], by_name["static"]) if HARMFUL_POLICY in by_name else None
    command = _command(args)
    return _jsonable({"kind": "adapt_bench", "command": command, "env": environment(),
                      "controller": {"decide_every_steps": args.decide_every_steps, "horizon_s": args.horizon_s,
                                     "budgets": list(budgets), "fixed_budget": args.fixed_budget,
                                     "periodic_rounds": args.periodic_rounds, "periodic_budget": args.periodic_budget,
                                     "guard_window": args.guard_window, "guard_mode": args.guard_mode,
                                     "guard_margin": args.guard_margin, "lr": args.lr,
                                     "accepted_keep": args.accepted_keep,
                                     "recency_half_life": args.recency_half_life,
                                     "explore_after_harm": args.explore_after_harm,
                                     "retry_growth": args.retry_growth,
                                     "min_train_positions": args.min_train_positions, "heldout": args.heldout,
                                     "explore_budget": args.explore_budget,
                                     "audit_window": args.audit_window},
                      "model": args.model, "dtype": args.dtype, "drafter": args.drafter, "stream": stream.name,
                      "phases": phases, "requests_per_phase": {p.name: p.requests for p in stream.phases},
                      "max_new_tokens": args.max_new_tokens, "lossless_reference": runs[0].name,
                      "policies": policies, **({"harmful": harmful} if harmful is not None else {})})


def _harmful_summary(args: argparse.Namespace, run: _PolicyRun, static: _PolicyRun) -> dict[str, Any]:
    """The harmful policy's swap against static on the same requests (module docstring's ``harmful``).

    The rollback request is the first whose serving logged the guard's ROLLED_BACK decision
    (the guard judges inside the decode loop's feedback hook). ``affected_tokens_per_s`` compares
    the requests from the swap to that one; ``phase_tokens_per_s`` the swap's whole phase."""
    at = args.harmful_at
    decisions = run.controller.decisions
    closing = next((k for k, d in enumerate(decisions) if d.injected and d.outcome is not Outcome.APPLIED), None)
    close = decisions[closing] if closing is not None else None
    until = next((i for i, n in enumerate(run.decided_by) if closing is not None and n > closing), len(run.tokens) - 1)
    phase = run.phases[at]

    def speed(r: _PolicyRun, idx: list[int]) -> float:
        return sum(len(r.tokens[j]) for j in idx) / sum(r.walls[j] for j in idx)

    in_phase = [j for j, p in enumerate(run.phases) if p == phase]
    affected = list(range(at, until + 1))
    before = [j for j in in_phase if j < at]  # the same weights in both: how far apart noise alone puts them
    extra_s = sum(run.walls[j] - static.walls[j] for j in affected)
    phase_s = sum(run.walls[j] for j in in_phase)
    return {"at_request": at, "phase": phase, "seed": args.harmful_seed,
            "rolled_back": close is not None and close.outcome is Outcome.ROLLED_BACK,
            "closed_as": None if close is None else close.outcome.value,
            "rollback_request": until if close is not None else None,
            "requests_to_rollback": until - at + 1 if close is not None else None,
            "watch_steps": args.guard_window, "guard_mode": args.guard_mode,
            "tau_pre": None if close is None else close.tau_pre,
            "tau_post": None if close is None else close.tau_post,
            "tau_replay_prev": None if close is None else close.tau_replay_prev,
            "tau_replay_new": None if close is None else close.tau_replay_new,
            "guard_replay_s": run.controller.guard_replay_cost_s,
            "phase_tokens_per_s": speed(run, in_phase) / speed(static, in_phase),
            "affected_tokens_per_s": speed(run, affected) / speed(static, affected),
            "affected_requests": len(affected),
            "before_swap_tokens_per_s": speed(run, before) / speed(static, before) if before else None,
            "before_swap_requests": len(before),
            "affected_extra_s": extra_s, "phase_serving_s": phase_s, "cost_share_of_phase": extra_s / phase_s}
