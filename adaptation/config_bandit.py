"""Config adaptation: a UCB bandit over tree configurations, reward = measured tokens/s.

The formulas are in docs/algorithms.md §8 ("Config adaptation").

BanditSpec (ICML'25, ``sail-sg/BanditSpec``) picks speculation hyper-parameters with UCB on the
measured speed; HedgeSpec (arXiv 2510.20064) notes that the verified trajectory scores every
candidate after the fact. This module does both, over *tree configurations*; it is separate from
the weight-update bandit of :mod:`adaptation.bandit` (whose arms are optimizer-step budgets).

**Arms.** One per point of a sweep's Pareto front, the ``pareto_front.yaml`` that
``graftblock compare`` writes (:func:`load_arms` / :func:`write_arms`): a method plus its options
in ``graftblock bench --config`` syntax (K / block size, prune stages, graft budget, tree budget …).

**Reward.** Round t serves one request with arm ``a_t``; its reward is the request's measured
speed ``r_t(a_t) = n_t / w_t`` (generated tokens over wall seconds, prefill included).

**Choice (UCB1 over normalised reward).** With ``R`` the largest reward seen so far and
``r~ = r / R`` in [0, 1]::

    a_t = argmax_a  mean r~(a) + c * sqrt(2 ln t / n(a))        (arms with n(a) = 0 first, in order)

``n(a)`` counts the arm's observations (its pulls plus its counterfactual scores below), ``t`` the
rounds so far and ``c`` = ``ucb_scale``.

**Full information (HedgeSpec-style).** Under greedy verification the committed text is the
target's argmax chain whatever drafter ran (lossless), so any other arm ``a`` can be replayed on
it after the fact (:func:`replay_arm`): ``begin`` on the prompt, ``propose``, accept the longest
root path matching the chain, ``observe``, move to the bonus: the very steps it would have taken
live. Its counterfactual reward is::

    r^_t(a) = n_t / (prefill_s + sum_steps [draft_s(a) + c^(T)])

with ``draft_s(a)`` the replay's measured propose + observe (+ begin) seconds, ``prefill_s`` the
served request's (the same target forward for every arm) and ``c^(T)`` the verify seconds at tree
size T, piecewise linear through an EMA per tree size of the live steps' measured verify seconds
(:class:`VerifyCostTable`; flat beyond the measured sizes). Which arms are scored:

* :attr:`Scorability.TOKENS` (retrieval without a transition table, ``transition_topk: 0``: reads
  nothing but the text): every greedy round.
* :attr:`Scorability.FEATURES` (EAGLE-3, SpecBlock, Graft: read the target's aux hidden states):
  every greedy round in which the served request kept them at every committed position; the
  served drafter runs inside :class:`TrajectoryRecorder`, which asks the target for them when any
  arm needs them (a small extra cost charged to the served request).
* :attr:`Scorability.NONE`: arms whose drafter reads the target's top-k at every node of its *own*
  tree (``target_topk > 0``: retrieval's transition table, hence Graft over it): a replay of a
  different tree cannot know them, so such an arm learns only from its own pulls.
* No arm under sampling: accepting a different tree is random and needs the target's
  probabilities, which the trajectory does not keep; the bandit then gets bandit feedback only
  (plain UCB).

The chosen arm's reward is measured; the others' are model estimates (``c^(T)`` for sizes not
served is interpolated; replay drafting time is measured on the same cores, outside the live loop).

**Regret** against the best fixed arm in hindsight, in reward units (tokens/s summed over rounds)::

    regret = max_a sum_t r_t(a) - sum_t r_t(a_t)

``r_t(a)`` is the measured reward of the chosen arm, the counterfactual score where one was made,
and otherwise the arm's mean observed reward (imputed; the report says ``exact = False`` then).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from speculation.config import ConfigError, EngineConfig, load_yaml_mapping
from speculation.policy.cost import interp
from speculation.drafters import MethodSpec, build_drafter, resolve_methods
from speculation.drafters.base import DraftContext, Drafter, Proposal, StepOutcome
from speculation.engine.sequence import GenerationResult
from speculation.engine.solo import generate_speculative

PARETO_FILE = "pareto_front.yaml"
"""The arm file ``graftblock compare`` writes beside ``runs.json``."""


class Scorability(str, enum.Enum):
    """What a counterfactual replay of an arm needs from the served trajectory (module docstring)."""

    TOKENS = "tokens"
    FEATURES = "features"
    NONE = "none"


def arm_scorability(drafter: Drafter) -> Scorability:
    """NONE if the drafter reads the target's top-k at its tree's nodes, else FEATURES if it reads
    aux hidden states, else TOKENS."""
    if drafter.target_topk:
        return Scorability.NONE
    return Scorability.FEATURES if drafter.needs_aux else Scorability.TOKENS


# ---------------------------------------------------------------------------- arms
@dataclass(frozen=True)
class ConfigArm:
    """One tree configuration.

    Attributes:
        name: unique label (e.g. ``graft#12``: the sweep trial it came from).
        method: a drafter type or built-in variant (``graft``, ``specblock``, ``graft_specblock`` …).
        options: the method's options, ``graftblock bench --config`` syntax (may hold ``type``).
        metrics: what the sweep measured for it (speedup, mean_tree_size …), for reference only.
    """

    name: str
    method: str
    options: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"config arm name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"config arm {self.name!r}: method must be a non-empty string, got {self.method!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"config arm {self.name!r}: options must be a mapping, got {type(self.options).__name__}")

    def spec(self) -> MethodSpec:
        """The resolved, validated method (a ConfigError names the arm and the bad option)."""
        try:
            return resolve_methods([self.method], {self.method: dict(self.options)})[0]
        except ConfigError as exc:
            raise ConfigError(f"config arm {self.name!r}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "options": dict(self.options),
                "metrics": {k: float(v) for k, v in self.metrics.items() if v is not None}}


def write_arms(path: Path, arms: Sequence[ConfigArm], header: str = "") -> Path:
    """Write ``arms`` as an arm file (``{"arms": [{name, method, options, metrics}, ...]}``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump({"arms": [a.to_dict() for a in arms]}, sort_keys=False))
    return path


def load_arms(path: str | Path) -> list[ConfigArm]:
    """Arms from an arm file (:func:`write_arms`); each is resolved, errors name ``arms[i].field``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config arms file {p} does not exist (graftblock compare writes {PARETO_FILE})")
    doc = load_yaml_mapping(p, "config arms file", "arms: [{name, method, options}, ...]")
    if not isinstance(doc.get("arms"), list) or not doc["arms"]:
        raise ConfigError(f"{p}: arms must be a non-empty list of {{name, method, options}}")
    arms: list[ConfigArm] = []
    for i, raw in enumerate(doc["arms"]):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{p}: arms[{i}] must be a mapping, got {type(raw).__name__}")
        unknown = set(raw) - {"name", "method", "options", "metrics"}
        if unknown:
            raise ConfigError(f"{p}: arms[{i}] has unknown keys {sorted(unknown)}; allowed: name, method, options, metrics")
        for key in ("name", "method"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise ConfigError(f"{p}: arms[{i}].{key} must be a non-empty string, got {raw.get(key)!r}")
        options = raw.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{p}: arms[{i}].options must be a mapping, got {type(options).__name__}")
        arm = ConfigArm(raw["name"], raw["method"], dict(options), dict(raw.get("metrics") or {}))
        arm.spec()
        arms.append(arm)
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{p}: arm names must be unique, repeated: {dup}")
    return arms


# ---------------------------------------------------------------------------- the bandit
@dataclass(frozen=True)
class ConfigBanditConfig:
    """Attributes:
        ucb_scale: ``c``, the exploration bonus on normalised reward. >= 0.
        full_information: score the other arms on greedy trajectories (module docstring).
        cost_ema: EMA weight of a new verify-seconds sample per tree size. Range (0, 1].
    """

    ucb_scale: float = 1.0
    full_information: bool = True
    cost_ema: float = 0.3

    def __post_init__(self) -> None:
        if not self.ucb_scale >= 0:
            raise ConfigError(f"adapt.config_bandit.ucb_scale must be >= 0, got {self.ucb_scale}")
        if not 0 < self.cost_ema <= 1:
            raise ConfigError(f"adapt.config_bandit.cost_ema must be in (0, 1], got {self.cost_ema}")


@dataclass
class _ArmEstimate:
    observations: int = 0
    pulls: int = 0
    reward_sum: float = 0.0

    @property
    def mean(self) -> float:
        return self.reward_sum / self.observations if self.observations else 0.0


@dataclass(frozen=True)
class ConfigDecision:
    """One round, as logged.

    Attributes:
        round: 1-based round index. arm: the served arm. reward: its measured tokens/s.
        index: every arm's UCB index at the choice (inf for an unobserved arm).
        counterfactual: scored arms' estimated tokens/s this round (module docstring).
        score_s: seconds spent replaying the other arms.
    """

    round: int
    arm: str
    reward: float
    index: Mapping[str, float]
    counterfactual: Mapping[str, float]
    score_s: float = 0.0

    def metrics(self, arm_ids: Mapping[str, int]) -> dict[str, float]:
        out = {"arm": float(arm_ids[self.arm]), "reward_tokens_per_s": self.reward, "score_s": self.score_s,
               "scored_arms": float(len(self.counterfactual))}
        out.update({f"counterfactual.{k}": v for k, v in self.counterfactual.items()})
        return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class ConfigBandit:
    """UCB1 with optional full-information updates over named arms (module docstring)."""

    arms: tuple[str, ...]
    config: ConfigBanditConfig = field(default_factory=ConfigBanditConfig)
    rounds: int = 0
    scale: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ConfigError(f"config bandit arms must be non-empty and unique, got {list(self.arms)}")
        self.stats = {a: _ArmEstimate() for a in self.arms}

    def index(self) -> dict[str, float]:
        """Every arm's UCB index for the next round (inf before its first observation)."""
        t = self.rounds + 1
        out = {}
        for a, s in self.stats.items():
            if s.observations == 0:
                out[a] = math.inf
                continue
            mean = s.mean / self.scale if self.scale > 0 else 0.0
            out[a] = mean + self.config.ucb_scale * math.sqrt(2 * math.log(t) / s.observations)
        return out

    def choose(self) -> str:
        idx = self.index()
        return max(self.arms, key=lambda a: idx[a])  # max keeps the first of equal indices

    def record(self, arm: str, reward: float, counterfactual: Mapping[str, float] | None = None) -> None:
        """The measured reward of ``arm`` and estimated rewards of other arms (full information)."""
        if arm not in self.stats:
            raise KeyError(f"unknown arm {arm!r}; arms: {list(self.arms)}")
        row = {k: float(v) for k, v in (counterfactual or {}).items() if k != arm and math.isfinite(v)}
        row[arm] = float(reward)
        for a, r in row.items():
            s = self.stats[a]
            s.observations += 1
            s.reward_sum += r
            self.scale = max(self.scale, r)
        self.stats[arm].pulls += 1
        self.rounds += 1
        self.history.append(row)
        self.chosen.append(arm)

    def regret(self) -> dict[str, Any]:
        """Regret vs the best fixed arm in hindsight (module docstring), in tokens/s summed over rounds."""
        totals = {a: sum(row.get(a, self.stats[a].mean) for row in self.history) for a in self.arms}
        best = max(self.arms, key=lambda a: totals[a])
        got = sum(row[a] for row, a in zip(self.history, self.chosen))
        n = max(1, len(self.history))
        return {"regret": totals[best] - got, "regret_per_round": (totals[best] - got) / n,
                "best_fixed_arm": best, "best_fixed_total": totals[best], "policy_total": got,
                "exact": all(len(row) == len(self.arms) for row in self.history),
                "pulls": {a: s.pulls for a, s in self.stats.items()},
                "mean_reward": {a: s.mean for a, s in self.stats.items()}}


# ---------------------------------------------------------------------------- counterfactual scoring
class VerifyCostTable:
    """c^(T): EMA per tree size of measured verify seconds, piecewise linear between sizes (flat beyond)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self._by_size: dict[int, float] = {}

    def observe(self, tree_size: int, verify_s: float) -> None:
        old = self._by_size.get(tree_size)
        self._by_size[tree_size] = verify_s if old is None else old + self.alpha * (verify_s - old)

    @property
    def known(self) -> bool:
        return bool(self._by_size)

    def cost(self, tree_size: int) -> float:
        xs = sorted(self._by_size)
        return interp(xs, [self._by_size[x] for x in xs], tree_size, extrapolate=False)


@dataclass(frozen=True)
class Trajectory:
    """A served request's verified text and (if recorded) the target's features along it.

    Attributes:
        tokens: the committed chain, prompt included, ending with the last bonus token.
        prompt_len: P, prompt tokens at the front of ``tokens``.
        generated: n, tokens the request returned (the chain may run past them at a length cut).
        prefill_s: the served request's prefill seconds.
        prompt_aux: ``[P, 3H]`` aux features of the prompt, or None.
        aux: ``[len(tokens) - P - 1, 3H]`` aux features of ``tokens[P:-1]``, or None.
    """

    tokens: list[int]
    prompt_len: int
    generated: int
    prefill_s: float
    prompt_aux: torch.Tensor | None = None
    aux: torch.Tensor | None = None

    @property
    def has_features(self) -> bool:
        return (self.prompt_aux is not None and self.aux is not None
                and self.aux.shape[0] == len(self.tokens) - self.prompt_len - 1)


class TrajectoryRecorder:
    """The served drafter, wrapped: asks the target for aux features when ``record_features`` and
    keeps the prompt's and every step's, handing the inner drafter only what it asked for."""

    def __init__(self, inner: Drafter, record_features: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_aux = inner.needs_aux or record_features
        self.target_topk = inner.target_topk
        self.prompt_aux: torch.Tensor | None = None
        self.step_aux: list[torch.Tensor] = []
        self.ctx: DraftContext | None = None

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        self.ctx, self.prompt_aux, self.step_aux = ctx, prompt_aux, []
        self.inner.begin(ctx, prompt_aux if self.inner.needs_aux else None)

    def propose(self, ctx: DraftContext) -> Proposal:
        return self.inner.propose(ctx)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        self.inner.observe(ctx, outcome if self.inner.needs_aux else dataclasses.replace(outcome, aux_hidden=None))

    def feedback(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """The engine's feedback hook (called on every step, the last one included)."""
        if outcome.aux_hidden is not None:
            self.step_aux.append(outcome.aux_hidden.detach())

    def trajectory(self, result: GenerationResult) -> Trajectory:
        assert self.ctx is not None, "trajectory() before the request ran"
        aux = torch.cat(self.step_aux) if self.step_aux else None
        return Trajectory(list(self.ctx.tokens), self.ctx.prompt_len, len(result.tokens), result.prefill_s,
                          self.prompt_aux, aux)


@dataclass(frozen=True)
class ArmScore:
    """An arm replayed on a trajectory: its steps and the estimated speed.

    Attributes:
        steps: verify steps it would have taken. gained: tokens they append (cut at n; the
            first token, from prefill, is not a step's), as the live ``StepRecord.tokens_gained``.
        tree_sizes: its trees' sizes, root included. draft_s: replay seconds in begin/propose/observe.
        verify_s: sum of c^(T) over its trees. tokens_per_s: r^ (module docstring).
    """

    steps: int
    gained: int
    tree_sizes: tuple[int, ...]
    draft_s: float
    verify_s: float
    tokens_per_s: float

    @property
    def tau(self) -> float:
        return self.gained / self.steps if self.steps else math.nan


@torch.inference_mode()
def replay_arm(drafter: Drafter, traj: Trajectory, cost: VerifyCostTable) -> ArmScore:
    """Replay ``drafter`` on a greedy trajectory (module docstring); FEATURES drafters need
    ``traj.has_features``. A draft is accepted only where the chain goes on past it (its bonus exists)."""
    if arm_scorability(drafter) is Scorability.NONE:
        raise ValueError(f"arm {drafter.name!r} reads the target's top-k at its own tree's nodes: not replayable")
    if drafter.needs_aux and not traj.has_features:
        raise ValueError(f"arm {drafter.name!r} reads target features; the trajectory has none")
    chain, P = traj.tokens, traj.prompt_len
    ctx = DraftContext(tokens=chain[: P + 1], prompt_len=P)
    t0 = time.perf_counter()
    drafter.begin(ctx, traj.prompt_aux if drafter.needs_aux else None)
    draft_s = time.perf_counter() - t0
    c, generated, gained, sizes, verify_s = P, 1, 0, [], 0.0
    while generated < traj.generated:
        ta = time.perf_counter()
        tree = drafter.propose(ctx).tree
        draft_s += time.perf_counter() - ta
        accepted = tree.follow(chain[c + 1 : len(chain) - 1])
        m = len(accepted) - 1
        ctx.tokens.extend(chain[c + 1 : c + m + 2])
        gained += min(m + 1, traj.generated - generated)
        generated += m + 1
        sizes.append(len(tree))
        verify_s += cost.cost(len(tree))
        if generated < traj.generated:  # the engine does not let a drafter observe the last step
            aux = traj.aux[c - P : c - P + m + 1] if drafter.needs_aux else None
            tb = time.perf_counter()
            drafter.observe(ctx, StepOutcome(tree=tree, accepted=accepted,
                                             accepted_tokens=[tree.tokens[a] for a in accepted],
                                             bonus_token=chain[c + m + 1], aux_hidden=aux))
            draft_s += time.perf_counter() - tb
        c += m + 1
    total_s = traj.prefill_s + draft_s + verify_s
    return ArmScore(len(sizes), gained, tuple(sizes), draft_s, verify_s,
                    traj.generated / total_s if total_s > 0 else math.nan)


# ---------------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class ServedRequest:
    """One request served by :class:`ConfigAdapter`: its result, the round's decision, and the
    replay scores of the other arms (by name)."""

    result: GenerationResult
    decision: ConfigDecision
    scores: Mapping[str, ArmScore]


class ConfigAdapter:
    """Serves requests one by one, switching the drafter config between them (module docstring).

    Args:
        target: the target model (any :class:`~speculation.engine.sequence.TargetBackend`).
        arms: the tree configurations; one drafter is built per arm.
        config: the bandit's knobs.
    """

    def __init__(self, target: Any, arms: Sequence[ConfigArm], config: ConfigBanditConfig | None = None) -> None:
        self.config = config or ConfigBanditConfig()
        self.arms = {a.name: a for a in arms}
        self.arm_ids = {a.name: i for i, a in enumerate(arms)}
        self.drafters: dict[str, Drafter] = {}
        for a in arms:
            d = build_drafter(a.spec(), target)
            if d is None:
                raise ConfigError(f"config arm {a.name!r}: method {a.method!r} has no drafter (vanilla is not a tree config)")
            self.drafters[a.name] = d
        self.target = target
        self.bandit = ConfigBandit(tuple(self.arms), self.config)
        self.cost = VerifyCostTable(self.config.cost_ema)
        self.decisions: list[ConfigDecision] = []

    def scorability(self, name: str) -> Scorability:
        return arm_scorability(self.drafters[name])

    def serve(self, prompt: list[int], engine: EngineConfig) -> ServedRequest:
        """Choose an arm, serve ``prompt`` with it, score the other arms, record the round."""
        idx = self.bandit.index()
        arm = self.bandit.choose()
        full = self.config.full_information and engine.sampling.greedy and len(self.arms) > 1
        kinds = {n: self.scorability(n) for n in self.drafters if n != arm}
        features = full and Scorability.FEATURES in kinds.values()
        rec = TrajectoryRecorder(self.drafters[arm], record_features=features)
        res = generate_speculative(self.target, rec, prompt, engine, feedback=rec.feedback)
        for s in res.steps:
            self.cost.observe(s.tree_size, s.verify_s)
        reward = len(res.tokens) / res.wall_s if res.wall_s > 0 else 0.0
        scores: dict[str, ArmScore] = {}
        t0 = time.perf_counter()
        if full and len(res.tokens) > 1:
            traj = rec.trajectory(res)
            for name, kind in kinds.items():
                if kind is Scorability.TOKENS or (kind is Scorability.FEATURES and traj.has_features):
                    scores[name] = replay_arm(self.drafters[name], traj, self.cost)
        score_s = time.perf_counter() - t0
        counter = {k: v.tokens_per_s for k, v in scores.items()}
        self.bandit.record(arm, reward, counter)
        d = ConfigDecision(self.bandit.rounds, arm, reward, idx, counter, score_s)
        self.decisions.append(d)
        return ServedRequest(res, d, scores)

    def summary(self) -> dict[str, Any]:
        """Regret and pulls (:meth:`ConfigBandit.regret`) plus the arms and what can be scored."""
        return {**self.bandit.regret(), "score_s": sum(d.score_s for d in self.decisions),
                "arms": {n: {**a.to_dict(), "scorability": self.scorability(n).value} for n, a in self.arms.items()}}
