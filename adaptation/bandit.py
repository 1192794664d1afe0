"""The cost-aware bandit over update budgets, its conservative gate, and regret (docs/algorithms.md §8).

**Arms.** ``budgets`` = optimizer steps of an update, 0 = skip (e.g. 0 / 32 / 128 / 512).

**Choice (UCB over net reward, seconds).** Round t picks

    a_t = argmax_a  mean_r(a) + scale * sqrt(2 ln t / n(a))        (untried arms first)

with ``mean_r(skip) = 0`` exactly and no bonus (skip costs nothing and teaches nothing).

**Cheapest-first exploration.** Untried arms are explored in increasing budget, and an untried
arm is not explored while a cheaper arm's latest held-out estimate was *harmful*: its whole gain
interval below zero, ``G_hi < 0`` (the candidate's tau CI lies under the live tau). More
optimizer steps on the same feedback at the same learning rate move further in the same
direction, so a dearer arm would pay more to lose more. (Measured: on the domain-shift stream
the 32-, 128- and 512-step candidates all lowered tau, and exploring the 512-step arm cost 253 s,
more than the static policy's whole run.) A later non-harmful estimate of the cheaper arm lifts
the block. ``explore_after_harm: true`` restores plain UCB exploration.

**Re-trying as the data grows.** An arm's reward is conditional on the feedback it was trained
on: with a few hundred positions a candidate memorises them and loses held-out tau; with a few
thousand the same budget raises it (``benchmarks/online_knobs.py``). So an arm's statistics go
*stale* once the train part holds ``retry_growth`` times the positions of the arm's latest
estimate: a stale arm is treated as untried (explored cheapest-first, its old statistics and harm
flag dropped when its new reward arrives). Re-tries happen only while the train part keeps
growing: each one needs ``retry_growth`` times the positions of the last, so while the buffer
fills they are geometrically spaced. (The buffer is bounded in records, not positions, so a
shift to traffic with a higher tau can grow the positions again.) A stale arm that is blocked
by a cheaper harmful arm is not re-tried; it competes on its old statistics.

**Gate.** A trained candidate is applied only when the lower confidence bound of its held-out
gain beats its cost, ``G_lo > C(a)`` (:mod:`adaptation.gain`, :mod:`adaptation.cost_model`).

**Reward.** Applied: realised gain (live tau before vs after the swap, same formula as G) minus
C(a); trained but gated out: minus the training part of C(a) (it was spent); skip: 0.

**Regret** against the best fixed arm in hindsight: ``max_a sum_t r_t(a) - sum_t r_t(a_t)``.
``r_t(a)`` is known for the chosen arm (realised), for skip (0), and, for the other update arms,
from their own held-out estimate when one was made that round (``G - C``); otherwise it is
imputed by the arm's mean observed reward since its statistics were last reset (0 before any).
It is therefore an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from speculation.config import ConfigError

SKIP = 0
"""The skip arm's budget."""


@dataclass(frozen=True)
class BanditConfig:
    """Attributes:
        budgets: arm budgets in optimizer steps, increasing, starting with 0 (skip).
        ucb_scale: exploration bonus scale, seconds. >= 0.
        retry_growth: an arm goes stale (is re-tried as untried) once the train part holds this
            many times the positions of its latest estimate (module docstring). > 1; ``inf`` = never.
    """

    budgets: tuple[int, ...] = (SKIP, 32, 128, 512)
    ucb_scale: float = 1.0
    explore_after_harm: bool = False
    """Explore a dearer untried arm even after a cheaper arm's estimate was harmful (module doc)."""
    retry_growth: float = 2.0

    def __post_init__(self) -> None:
        b = self.budgets
        if not b or b[0] != SKIP or list(b) != sorted(set(b)):
            raise ConfigError(f"adapt.bandit.budgets must start with 0 (skip) and increase strictly, got {b}")
        if self.ucb_scale < 0:
            raise ConfigError(f"adapt.bandit.ucb_scale must be >= 0, got {self.ucb_scale}")
        if not isinstance(self.explore_after_harm, bool):
            raise ConfigError(f"adapt.bandit.explore_after_harm must be true or false, got {self.explore_after_harm!r}")
        if isinstance(self.retry_growth, bool) or not isinstance(self.retry_growth, (int, float)) \
                or not self.retry_growth > 1:
            raise ConfigError(f"adapt.bandit.retry_growth must be > 1 (inf = never re-try), got {self.retry_growth!r}")


def gate(gain_lo_s: float, cost_s: float) -> bool:
    """Apply an update only when the lower confidence bound of its gain exceeds its cost."""
    return gain_lo_s > cost_s


@dataclass
class ArmStats:
    pulls: int = 0
    reward_sum: float = 0.0
    harmful: bool = False
    """The arm's latest held-out estimate had its whole gain interval below zero."""
    positions: int = 0
    """Train positions behind the arm's latest reward (0: unknown / never pulled)."""

    def stale(self, positions: int, growth: float) -> bool:
        """Whether the train part (``positions``) has grown ``growth``-fold since the latest reward."""
        return self.pulls > 0 and self.positions > 0 and positions >= growth * self.positions

    @property
    def mean(self) -> float:
        return self.reward_sum / self.pulls if self.pulls else 0.0


@dataclass
class CostAwareBandit:
    """UCB over arms with pending rewards (an applied arm's reward arrives after the watch window)."""

    config: BanditConfig = field(default_factory=BanditConfig)
    stats: dict[int, ArmStats] = field(default_factory=dict)
    rounds: int = 0
    history: list[dict[int, float]] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    received: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for b in self.config.budgets:
            self.stats.setdefault(b, ArmStats())

    def choose(self, positions: int = 0) -> int:
        """The arm (budget) of the next round, with ``positions`` train positions buffered."""
        self.rounds += 1
        return self.peek(positions)

    def peek(self, positions: int = 0) -> int:
        """The arm :meth:`choose` would pick now, without counting a round (a round that cannot
        train yet reports it)."""
        t = self.rounds or 1
        best, best_v = SKIP, 0.0
        harm_below = False  # a cheaper arm's latest estimate was harmful
        for b in self.config.budgets[1:]:
            s = self.stats[b]
            blocked = harm_below and not self.config.explore_after_harm
            if s.pulls == 0:
                if blocked:
                    continue
                return b
            if s.stale(positions, self.config.retry_growth) and not blocked:
                return b  # re-tried as untried; a blocked stale arm competes on its old statistics
            harm_below = harm_below or s.harmful
            v = s.mean + self.config.ucb_scale * math.sqrt(2 * math.log(t) / s.pulls)
            if v > best_v:
                best, best_v = b, v
        return best

    def record(self, arm: int, reward: float, counterfactual: dict[int, float] | None = None,
               harmful: bool | None = None, positions: int = 0) -> None:
        """The realised reward of ``arm`` this round (and estimated rewards of other arms, if known);
        ``harmful``: whether this round's held-out estimate of ``arm`` had ``G_hi < 0`` (None: no
        estimate, the flag is kept); ``positions``: the train positions the arm was trained on (a
        stale arm's old statistics are dropped first)."""
        s = self.stats[arm]
        if arm != SKIP:
            if s.stale(positions, self.config.retry_growth):
                s.pulls, s.reward_sum, s.harmful = 0, 0.0, False
            s.positions = positions  # 0 = unknown: such statistics never go stale
        s.pulls += 1
        s.reward_sum += reward
        if harmful is not None:
            s.harmful = harmful
        row = {SKIP: 0.0, **(counterfactual or {}), arm: reward}
        self.history.append(row)
        self.chosen.append(arm)
        self.received.append(reward)

    def regret(self) -> dict[str, float]:
        """Regret vs the best fixed arm in hindsight (module docstring) and that arm's total."""
        totals = {}
        for b in self.config.budgets:
            fill = self.stats[b].mean
            totals[b] = sum(row.get(b, fill) for row in self.history)
        best = max(totals, key=lambda b: totals[b])
        got = sum(self.received)
        return {"regret_s": totals[best] - got, "best_fixed_arm": float(best),
                "best_fixed_total_s": totals[best], "policy_total_s": got}
