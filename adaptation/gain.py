"""The expected gain of a candidate update, estimated offline on held-out feedback (docs/algorithms.md §8).

**Replay** (HedgeSpec's observation: the verified trajectory scores any drafter after the fact).
The held-out feedback holds the target's committed chain ``x_0 .. x_L`` and its aux features at
every position. A drafter (a copy, with the old or the candidate weights) replays a span
``[c, e)``: ``begin`` with the features of ``x_0 .. x_{c-1}`` as its context and ``x_c`` as root, then
per step ``propose`` a tree, accept the longest root path that matches the chain (greedy
verification against the target's argmax chain, which the committed text is), ``observe`` the
accepted nodes' true features, and move the root to the bonus. Acceptance past position L-1 is
cut (no features there). No target forward runs and no live traffic is touched.

**Estimate.** Spans of ``chunk`` positions are the bootstrap units, replayed by both drafters
(paired): tau = sum gained / sum steps over the units, and, per bootstrap resample b,

    G_b   = N * t_step * (1 / tau_old_b - 1 / tau_new_b)          (seconds saved)
    N     = rate_ema (tokens/s) * horizon_s                          (tokens served in the horizon)

``G`` is the point estimate on all units and ``[G_lo, G_hi]`` the (alpha, 1 - alpha) quantiles of
``G_b``: ``G_lo`` is the lower confidence bound the gate compares with the cost.

**Break-even horizon.** Every ``G_b`` is linear in ``N``, so ``G_lo`` is too: at the measured
traffic rate, the gate (``G_lo > C``) would fire on the same replay for horizons longer than

    H* = H * C / G_lo          (H = the configured horizon; infinite when G_lo <= 0)

which is how long the updated drafter would have to serve before its lower-bound gain repays C.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from adaptation.cost_model import Ema
from adaptation.feedback import FeedbackRecord, FeedbackSequence
from adaptation.online import StateDict, TrainableDrafter
from speculation.config import ConfigError
from speculation.drafters.base import DraftContext, StepOutcome


@dataclass(frozen=True)
class ReplayConfig:
    """Held-out replay knobs.

    Attributes:
        chunk: positions per replay unit. >= 2.
        bootstrap: bootstrap resamples. >= 10.
        alpha: one-sided level of the confidence bounds. Range (0, 0.5).
        seed: seeds the resampling.
    """

    chunk: int = 32
    bootstrap: int = 400
    alpha: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 2:
            raise ConfigError(f"adapt.replay.chunk must be >= 2, got {self.chunk}")
        if self.bootstrap < 10:
            raise ConfigError(f"adapt.replay.bootstrap must be >= 10, got {self.bootstrap}")
        if not 0 < self.alpha < 0.5:
            raise ConfigError(f"adapt.replay.alpha must be in (0, 0.5), got {self.alpha}")


@dataclass(frozen=True)
class UnitReplay:
    """Tokens gained and verify steps of one replayed span."""

    gained: int
    steps: int


def replica(drafter: TrainableDrafter, state: StateDict | None = None) -> TrainableDrafter:
    """A private copy of ``drafter`` (sharing the target's embedding), with ``state`` loaded if given."""
    twin = copy.deepcopy(drafter, memo={id(drafter.embed_weight): drafter.embed_weight})
    if state is not None:
        twin.load_state_dict(state)
    return twin


@torch.inference_mode()
def replay_span(drafter: TrainableDrafter, seq: FeedbackSequence, start: int, end: int) -> UnitReplay:
    """Replay roots ``start .. end-1`` of ``seq`` (module docstring); ``1 <= start < end <= L``."""
    L = seq.length
    if not 1 <= start < end <= L:
        raise ValueError(f"replay span [{start}, {end}) outside [1, {L}]")
    toks = seq.tokens.tolist()
    aux = seq.aux.to(drafter.dtype)
    ctx = DraftContext(tokens=toks[: start + 1], prompt_len=start)
    drafter.begin(ctx, aux[:start])
    c = start
    gained = steps = 0
    while c < end:
        tree = drafter.propose(ctx).tree
        limit = L - 1 - c  # accepted drafts need features at their nodes
        accepted = tree.follow(toks[c + 1 : c + 1 + limit])
        m = len(accepted) - 1
        new = toks[c + 1 : c + m + 2]
        ctx.tokens.extend(new)
        drafter.observe(ctx, StepOutcome(
            tree=tree, accepted=accepted, accepted_tokens=toks[c : c + m + 1], bonus_token=toks[c + m + 1],
            aux_hidden=aux[c : c + m + 1],
        ))
        gained += m + 1
        steps += 1
        c += m + 1
    return UnitReplay(gained, steps)


def replay_units(drafter: TrainableDrafter, sequences: Iterable[FeedbackSequence], chunk: int) -> list[UnitReplay]:
    """Replay every ``chunk``-position span of every sequence (position 0 has no context: skipped)."""
    out = []
    for seq in sequences:
        for a in range(1, seq.length, chunk):
            out.append(replay_span(drafter, seq, a, min(seq.length, a + chunk)))
    return out


def tau_of(units: list[UnitReplay]) -> float:
    steps = sum(u.steps for u in units)
    return sum(u.gained for u in units) / steps if steps else math.nan


@dataclass(frozen=True)
class GainEstimate:
    """Held-out estimate of a candidate's gain (module docstring).

    Attributes:
        tau_old, tau_new: replayed tau of the live and the candidate weights.
        tau_new_lo, tau_new_hi: the candidate's tau confidence interval.
        gain_s, gain_lo_s, gain_hi_s: G and its confidence interval, seconds.
        horizon_tokens: N. step_s: t_step. units: bootstrap units.
    """

    tau_old: float
    tau_new: float
    tau_new_lo: float
    tau_new_hi: float
    gain_s: float
    gain_lo_s: float
    gain_hi_s: float
    horizon_tokens: float
    step_s: float
    units: int


def gain_seconds(horizon_tokens: float, step_s: float, tau_old: float, tau_new: float) -> float:
    """G = N * t_step * (1/tau_old - 1/tau_new)."""
    return horizon_tokens * step_s * (1.0 / tau_old - 1.0 / tau_new)


def break_even_horizon_s(gain_lo_s: float, cost_s: float, horizon_s: float) -> float:
    """H* = H * C / G_lo (module docstring): the shortest horizon at which ``G_lo`` reaches the
    cost ``C``; ``inf`` when ``G_lo <= 0`` (no horizon makes a harmful or neutral update pay)."""
    if not gain_lo_s > 0 or not math.isfinite(gain_lo_s):
        return math.inf
    return horizon_s * max(cost_s, 0.0) / gain_lo_s


def estimate_gain(
    old: list[UnitReplay], new: list[UnitReplay], horizon_tokens: float, step_s: float, config: ReplayConfig
) -> GainEstimate:
    """Paired bootstrap over units of G (module docstring)."""
    if len(old) != len(new):
        raise ValueError("old and new replays must cover the same units")
    if not old:
        nan = math.nan
        return GainEstimate(nan, nan, nan, nan, nan, -math.inf, math.inf, horizon_tokens, step_s, 0)
    go = torch.tensor([u.gained for u in old], dtype=torch.float64)
    so = torch.tensor([u.steps for u in old], dtype=torch.float64)
    gn = torch.tensor([u.gained for u in new], dtype=torch.float64)
    sn = torch.tensor([u.steps for u in new], dtype=torch.float64)
    tau_old, tau_new = float(go.sum() / so.sum()), float(gn.sum() / sn.sum())
    gen = torch.Generator().manual_seed(config.seed)
    idx = torch.randint(len(old), (config.bootstrap, len(old)), generator=gen)
    t_old = go[idx].sum(1) / so[idx].sum(1)
    t_new = gn[idx].sum(1) / sn[idx].sum(1)
    g = horizon_tokens * step_s * (1.0 / t_old - 1.0 / t_new)
    q = torch.tensor([config.alpha, 1 - config.alpha], dtype=torch.float64)
    g_lo, g_hi = torch.quantile(g, q).tolist()
    t_lo, t_hi = torch.quantile(t_new, q).tolist()
    if len(old) < 2:  # one unit: no spread to resample; refuse to claim a bound
        g_lo, g_hi, t_lo, t_hi = -math.inf, math.inf, 0.0, math.inf
    return GainEstimate(
        tau_old=tau_old, tau_new=tau_new, tau_new_lo=t_lo, tau_new_hi=t_hi,
        gain_s=gain_seconds(horizon_tokens, step_s, tau_old, tau_new), gain_lo_s=g_lo, gain_hi_s=g_hi,
        horizon_tokens=horizon_tokens, step_s=step_s, units=len(old),
    )


class TrafficRate:
    """Tokens served per second, EMA over intervals of at least ``min_interval_s`` (N's rate).

    ``observe(records)`` counts the tokens the records gained at their ``wall_time``s.
    """

    def __init__(self, alpha: float = 0.2, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self.rate = Ema(alpha)
        self._t0: float | None = None
        self._tokens = 0

    def observe(self, records: Iterable[FeedbackRecord]) -> None:
        for r in records:
            if self._t0 is None:
                self._t0 = r.wall_time
                continue
            self._tokens += r.tokens_gained
            dt = r.wall_time - self._t0
            if dt >= self.min_interval_s:
                self.rate.update(self._tokens / dt)
                self._t0, self._tokens = r.wall_time, 0

    def horizon_tokens(self, horizon_s: float) -> float:
        """N = rate * horizon (0 before the first measured interval)."""
        return self.rate.value * horizon_s if self.rate.known else 0.0
