"""What an online update costs, in measured seconds of serving time (docs/algorithms.md §8, "Cost model").

(:mod:`speculation.policy.cost` is the verify-cost curve c(T) used for tree sizing; this module prices
*updates*.) For an arm that trains ``n`` optimizer steps:

    C(n)   = n * s_opt * kappa + s_sync           (what applying costs: the gate's C)
    E(n)   = C(n) + s_replay * kappa              (what trying the arm costs: the bandit's price)
    kappa  = clamp(1 - s_idle / s_busy, 0, 1)

* ``s_opt``: seconds per optimizer step on the learner's resources (EMA of measured steps);
* ``s_sync``: seconds of one weight sync, serialise + broadcast + the swap pause on the drafter
  workers (EMA of measured syncs); serving stalls for it;
* ``s_replay``: seconds of the replays that judge a candidate (the gate's held-out replay of the
  live and the candidate weights, and the paired swap guard's replay after an applied swap). It is
  spent before the gate decides, so it is not in the gate's ``C`` (a sunk cost does not change
  whether applying pays), but it is in the reward the bandit learns an arm's value from: an arm
  whose candidates are always refused costs its training *and* its replays;
* ``kappa``: contention, the fraction of serving throughput lost while the learner trains,
  measured from serving step times with the learner idle (``s_idle``) and busy (``s_busy``): over
  ``n * s_opt`` seconds of training, serving produces ``1 - kappa`` of its idle-rate output, so
  the loss in serving seconds is ``n * s_opt * kappa``. Until both are measured kappa is
  ``default_contention`` (1.0: training blocks serving, the honest price when the learner shares
  the decode thread, as the single-process twin does).

Serving step time ``s_idle`` is also the ``t_step`` of the gain formula (:mod:`adaptation.gain`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from speculation.config import ConfigError


@dataclass
class Ema:
    """Exponential moving average: ``v <- v + alpha (x - v)``, the first sample taken as is."""

    alpha: float = 0.2
    value: float = math.nan
    count: int = 0

    def update(self, x: float) -> float:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1
        return self.value

    @property
    def known(self) -> bool:
        return self.count > 0


@dataclass(frozen=True)
class CostConfig:
    """Cost-model knobs.

    Attributes:
        alpha: EMA weight of a new sample. Range (0, 1].
        default_contention: kappa before serving has been measured both idle and busy. Range [0, 1].
        default_step_s: seconds per optimizer step before the first measured one. > 0.
        default_sync_s: seconds per weight sync before the first measured one. >= 0.
    """

    alpha: float = 0.2
    default_contention: float = 1.0
    default_step_s: float = 1.0
    default_sync_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"adapt.cost.alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.default_contention <= 1:
            raise ConfigError(f"adapt.cost.default_contention must be in [0, 1], got {self.default_contention}")
        if self.default_step_s <= 0:
            raise ConfigError(f"adapt.cost.default_step_s must be > 0, got {self.default_step_s}")
        if self.default_sync_s < 0:
            raise ConfigError(f"adapt.cost.default_sync_s must be >= 0, got {self.default_sync_s}")


@dataclass(frozen=True)
class CostEstimate:
    """C(n) and its parts, seconds (module docstring). ``replay_s`` is the measured replay time
    of this candidate (0 until it has been replayed)."""

    steps: int
    train_s: float
    contention: float
    sync_s: float
    replay_s: float = 0.0

    @property
    def total_s(self) -> float:
        """C: the gate's price of applying."""
        return self.train_s * self.contention + self.sync_s

    @property
    def tried_s(self) -> float:
        """E: C plus the replays' serving time, the bandit's price of trying the arm."""
        return self.total_s + self.replay_s * self.contention


@dataclass
class UpdateCostModel:
    """Measured costs of updates (module docstring); feed it every measurement, ask :meth:`cost`."""

    config: CostConfig = field(default_factory=CostConfig)
    opt_step: Ema = field(init=False)
    sync: Ema = field(init=False)
    serve_idle: Ema = field(init=False)
    serve_busy: Ema = field(init=False)

    def __post_init__(self) -> None:
        a = self.config.alpha
        self.opt_step, self.sync, self.serve_idle, self.serve_busy = Ema(a), Ema(a), Ema(a), Ema(a)

    def observe_opt_steps(self, seconds: list[float] | tuple[float, ...]) -> None:
        for s in seconds:
            self.opt_step.update(s)

    def observe_sync(self, seconds: float) -> None:
        self.sync.update(seconds)

    def observe_serving_step(self, seconds: float, learner_busy: bool) -> None:
        (self.serve_busy if learner_busy else self.serve_idle).update(seconds)

    @property
    def step_s(self) -> float:
        return self.opt_step.value if self.opt_step.known else self.config.default_step_s

    @property
    def sync_s(self) -> float:
        return self.sync.value if self.sync.known else self.config.default_sync_s

    @property
    def contention(self) -> float:
        if not (self.serve_idle.known and self.serve_busy.known):
            return self.config.default_contention
        return min(1.0, max(0.0, 1.0 - self.serve_idle.value / self.serve_busy.value))

    @property
    def serving_step_s(self) -> float:
        """t_step: seconds of one idle serving step (nan before the first measurement)."""
        return self.serve_idle.value

    def cost(self, steps: int) -> CostEstimate:
        """C(steps); 0 for the skip arm (no training, no sync)."""
        if steps <= 0:
            return CostEstimate(0, 0.0, self.contention, 0.0)
        return CostEstimate(steps, steps * self.step_s, self.contention, self.sync_s)
