"""The online-adaptation loop, Ray-free: feedback in, priced decisions out, weights published.

:class:`AdaptationController` is the single-process twin of ``workers.learner.Learner`` (which
wraps it in a Ray actor). It consumes feedback records (:mod:`adaptation.feedback`) and every
``decide_every_steps`` recorded verify steps runs one round of its policy:

* ``static``: never updates (the baseline).
* ``always``: trains ``fixed_budget`` steps every round and applies the result unconditionally.
* ``periodic``: every ``periodic_rounds`` rounds trains ``periodic_budget`` steps and applies it
  unconditionally (OSD / Aurora: a fixed sync interval, no gate).
* ``cost_aware``: the bandit (:mod:`adaptation.bandit`) picks a budget; a candidate trained on a
  copy is replayed on the held-out feedback (:mod:`adaptation.gain`) and applied only when
  ``G_lo > C`` (:mod:`adaptation.cost_model`); an applied update is watched by the swap guard
  (:mod:`adaptation.rollback`) and its realised reward is credited to its arm when the window
  closes (or a rollback republishes the previous weights). In the guard's paired mode the
  realised gain is priced on the window's own traffic, previous vs new weights replayed on the
  same text: ``G_real = N * t_step * (1/tau_prev - 1/tau_new)``; in live mode on the live windows
  before and after the swap. With ``audit_window_steps`` a kept update is audited when live tau
  drops between consecutive windows: the start and the live weights are replayed on the window
  that dropped, and the start weights are republished if the update is the cause.

Publishing is a callable (``publish(state)``): in process it loads the drafter's weights, on Ray
it puts them in the object store once and calls ``swap_weights`` on every drafter worker. Its
wall time is the measured sync cost. No new round starts while a swap is being watched.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from adaptation.bandit import SKIP, BanditConfig, CostAwareBandit, gate
from adaptation.cost_model import CostConfig, CostEstimate, UpdateCostModel
from adaptation.feedback import BufferConfig, FeedbackRecord, FeedbackSequence, ReplayBuffer
from adaptation.gain import (
    GainEstimate,
    ReplayConfig,
    TrafficRate,
    UnitReplay,
    break_even_horizon_s,
    estimate_gain,
    gain_seconds,
    replay_units,
    replica,
    tau_of,
)
from adaptation.online import OnlineConfig, OnlineUpdater, StateDict, TrainableDrafter
from adaptation.rollback import GuardConfig, GuardVerdict, SwapGuard, window_sequences
from speculation.config import ConfigError

PROBE_STEPS = 2
"""Optimizer steps timed before the first candidate when an exploration budget is set."""

Publisher = Callable[[StateDict], None]
"""Pushes weights to the serving drafters (returns when they are swapped in)."""


class Policy(str, enum.Enum):
    STATIC = "static"
    ALWAYS = "always"
    PERIODIC = "periodic"
    COST_AWARE = "cost_aware"


class Outcome(str, enum.Enum):
    """What a round did."""

    SKIPPED = "skipped"  # skip arm, static policy, or not enough feedback yet (then ``arm`` is the
    # budget that would have run; nothing was trained or spent)
    GATED = "gated"  # trained, G_lo <= C: not applied
    APPLIED = "applied"
    KEPT = "kept"  # guard window closed: update kept
    ROLLED_BACK = "rolled_back"
    AUDITED = "audited"  # the live (updated) weights replayed against the start weights: kept
    REVERTED = "reverted"  # ... and found worse: the start weights republished


@dataclass(frozen=True)
class ControllerConfig:
    """Attributes:
        policy: the update policy (module docstring).
        decide_every_steps: verify steps recorded between rounds. >= 1.
        horizon_s: the gain horizon (N = traffic rate * horizon). > 0.
        fixed_budget: optimizer steps of an ``always`` update. >= 1.
        periodic_rounds: rounds between ``periodic`` updates. >= 1.
        periodic_budget: optimizer steps of a ``periodic`` update. >= 1.
        min_train_sequences: finished requests in the train part before any update. >= 1.
        min_train_positions: train positions (tokens with features) before any update. >= 0.
            Below a few hundred, a candidate memorises its feedback and lowers held-out tau
            (``benchmarks/online_knobs.py``), so exploring then only spends.
        explore_budget: share of the serving wall time (since the first feedback record) that
            candidates the gate refused may have cost, training and held-out replay together;
            a round whose candidate would exceed it is skipped. Bounds what cost_aware can lose
            to static by exploring. None = unbounded. Range [0, 1].
        audit_window_steps: cost_aware only; None = off. The swap guard judges an update on the
            text right after it; the audit catches one that later text (a new domain) turns
            against. While the live weights are not the ones the controller started with, live
            tau is read over consecutive windows of this many verify steps (free: the records
            carry it). When a window's tau falls below the previous window's by the guard's
            margin, the start and the live weights are replayed on that window's text, and the
            start weights are republished if ``tau_live < tau_start * (1 - guard.margin)``. A drop
            that the start weights share is the text getting harder: the update stays. Its replays
            are priced like the guard's. >= 2.
        buffer, online, replay, cost, bandit, guard: the parts' configs.
    """

    policy: Policy = Policy.COST_AWARE
    decide_every_steps: int = 64
    horizon_s: float = 60.0
    fixed_budget: int = 32
    periodic_rounds: int = 4
    periodic_budget: int = 128
    min_train_sequences: int = 1
    min_train_positions: int = 0
    explore_budget: float | None = None
    audit_window_steps: int | None = None
    buffer: BufferConfig = field(default_factory=BufferConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    bandit: BanditConfig = field(default_factory=BanditConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        for name in ("decide_every_steps", "fixed_budget", "periodic_rounds", "periodic_budget", "min_train_sequences"):
            if getattr(self, name) < 1:
                raise ConfigError(f"adapt.{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.min_train_positions, bool) or not isinstance(self.min_train_positions, int) \
                or self.min_train_positions < 0:
            raise ConfigError(f"adapt.min_train_positions must be an integer >= 0, got {self.min_train_positions!r}")
        if self.explore_budget is not None and (isinstance(self.explore_budget, bool)
                                                or not isinstance(self.explore_budget, (int, float))
                                                or not 0 <= self.explore_budget <= 1):
            raise ConfigError(f"adapt.explore_budget must be a number in [0, 1] or null, got {self.explore_budget!r}")
        if not self.horizon_s > 0:
            raise ConfigError(f"adapt.horizon_s must be > 0, got {self.horizon_s}")
        w = self.audit_window_steps
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 2):
            raise ConfigError(f"adapt.audit_window_steps must be an integer >= 2 or null, got {w!r}")


@dataclass(frozen=True)
class Decision:
    """One round or guard event, as logged (MLflow metrics through ``tracking.adaptation``).

    ``gain`` is None when no candidate was replayed; ``realised_gain_s``/``reward_s`` are set on
    KEPT / ROLLED_BACK events (and on GATED rounds, the reward). ``tau_pre``/``tau_post`` are the
    live taus of the windows before and after a swap; ``tau_replay_prev``/``tau_replay_new`` the
    paired guard's replay of the previous and the new weights on the after-window (nan in live mode).
    ``break_even_horizon_s``: on a round whose candidate was replayed, the horizon at which the gate
    would have fired on the same replay (:func:`adaptation.gain.break_even_horizon_s`; inf when
    ``G_lo <= 0``, nan when nothing was replayed).
    """

    round: int
    policy: Policy
    arm: int
    outcome: Outcome
    cost: CostEstimate
    gain: GainEstimate | None = None
    train_s: float = 0.0
    sync_s: float = 0.0
    loss: float = math.nan
    tau_pre: float = math.nan
    tau_post: float = math.nan
    tau_replay_prev: float = math.nan
    tau_replay_new: float = math.nan
    break_even_horizon_s: float = math.nan
    realised_gain_s: float = math.nan
    reward_s: float = math.nan
    injected: bool = False
    wall_time: float = 0.0

    @property
    def spent_s(self) -> float:
        """Serving seconds this round spent: a gated candidate its training and replay, an applied
        one also its sync (the guard's replay is counted when the watch closes); else 0."""
        if self.outcome is Outcome.GATED:
            return self.cost.tried_s - self.cost.sync_s
        return self.cost.tried_s if self.outcome is Outcome.APPLIED else 0.0

    def metrics(self) -> dict[str, float]:
        out = {"arm": float(self.arm), "cost_s": self.cost.total_s, "cost_train_s": self.cost.train_s,
               "cost_contention": self.cost.contention, "cost_sync_s": self.cost.sync_s,
               "cost_replay_s": self.cost.replay_s,
               "train_s": self.train_s, "sync_s": self.sync_s, "loss": self.loss,
               "tau_pre": self.tau_pre, "tau_post": self.tau_post,
               "tau_replay_prev": self.tau_replay_prev, "tau_replay_new": self.tau_replay_new,
               "break_even_horizon_s": self.break_even_horizon_s,
               "realised_gain_s": self.realised_gain_s, "reward_s": self.reward_s}
        if self.injected:
            out["injected"] = 1.0
        if self.gain is not None:
            g = self.gain
            out.update({"tau_old": g.tau_old, "tau_new": g.tau_new, "tau_new_lo": g.tau_new_lo,
                        "tau_new_hi": g.tau_new_hi, "gain_s": g.gain_s, "gain_lo_s": g.gain_lo_s,
                        "gain_hi_s": g.gain_hi_s, "horizon_tokens": g.horizon_tokens})
        return {k: v for k, v in out.items() if math.isfinite(v)}


class AdaptationController:
    """Feedback -> rounds -> published weights (module docstring).

    Args:
        drafter: a drafter with the live weights (the controller keeps a private replica; the
            live drafters are reached only through ``publish``).
        publish: pushes a state dict to the serving drafters.
        config: knobs.
        weights: the live weights, if not the drafter's (a restarted learner's last published).
        clock: seconds, the time base of the feedback records' ``wall_time`` (``time.time`` in
            serving; a benchmark that interleaves policies gives each its own serving clock, so
            the traffic rate and the exploration budget see the time the policy served).
    """

    def __init__(self, drafter: TrainableDrafter, publish: Publisher, config: ControllerConfig | None = None,
                 weights: StateDict | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or ControllerConfig()
        self.clock = clock
        self.publish_fn = publish
        self.buffer = ReplayBuffer(self.config.buffer)
        self.updater = OnlineUpdater(drafter, self.config.online)
        self.cost = UpdateCostModel(self.config.cost)
        self.rate = TrafficRate()
        self.bandit = CostAwareBandit(self.config.bandit)
        self.guard = SwapGuard(self.config.guard)
        self._replica = replica(drafter)
        self.weights: StateDict = weights if weights is not None else drafter.state_dict()
        self.start_weights: StateDict = self.weights  # what an audit reverts to
        self.version = 0
        self.decisions: list[Decision] = []
        self.on_decision: Callable[[Decision], None] | None = None
        self._steps_since = 0
        self._rounds = 0
        self._pending: _PendingSwap | None = None
        self._last_wall: dict[object, float] = {}
        self._busy: list[tuple[float, float]] = []
        self._first_wall: float | None = None  # wall time of the first feedback record
        self.refused_s = 0.0  # training + replay seconds of candidates the gate refused
        self.guard_replay_cost_s = 0.0  # serving seconds the paired guard's replays cost
        self.probe_cost_s = 0.0  # serving seconds the step-cost probe cost
        self.audit_cost_s = 0.0  # serving seconds the audits' replays cost
        self._audit_window: list[FeedbackRecord] = []
        self._audit_ref = math.nan  # live tau of the previous audit window
        # The live weights' replay of a held-out request, kept until the weights change: rounds
        # overlap in held-out requests, so the old side is replayed once per request and version.
        self._live_replays: dict[tuple, list[UnitReplay]] = {}
        self._live_replays_of: StateDict | None = None  # the weights they were replayed with
        self.live_replay_hits = 0
        self._lock = threading.RLock()
        self.horizon_tokens_override: float | None = None

    # ------------------------------------------------------------------ feedback
    def add(self, records: list[FeedbackRecord]) -> list[Decision]:
        """Take a batch of feedback; runs the guard and, when due, a round. Returns new decisions."""
        with self._lock:
            before = len(self.decisions)
            self.buffer.add(records)
            if records and self._first_wall is None:
                self._first_wall = min(r.wall_time for r in records)
            self.rate.observe(records)
            for r in records:
                self._serving_time(r)
                verdict = self.guard.observe(r)
                if verdict is GuardVerdict.REPLAY:
                    self._close_watch(*self._paired_verdict())
                elif verdict in (GuardVerdict.KEEP, GuardVerdict.ROLLBACK):
                    self._close_watch(verdict)
                self._watch_for_audit(r)
            self._steps_since += len(records)
            if self._steps_since >= self.config.decide_every_steps and not self.guard.watching:
                self._steps_since = 0
                self.round()
            return self.decisions[before:]

    def _serving_time(self, r: FeedbackRecord) -> None:
        prev = self._last_wall.get(r.request_id)
        self._last_wall[r.request_id] = r.wall_time
        if prev is None or r.step == 0:
            return
        busy = any(a < r.wall_time and prev < b for a, b in self._busy[-8:])
        self.cost.observe_serving_step(r.wall_time - prev, busy)

    def horizon_tokens(self) -> float:
        if self.horizon_tokens_override is not None:
            return self.horizon_tokens_override
        return self.rate.horizon_tokens(self.config.horizon_s)

    # ------------------------------------------------------------------ rounds
    def round(self) -> Decision:
        """One decision round of the configured policy (module docstring)."""
        with self._lock:
            self._rounds += 1
            cfg = self.config
            train = self.buffer.train_sequences()
            positions = sum(s.length for s in train)
            if len(train) < cfg.min_train_sequences or positions < cfg.min_train_positions:
                # not enough feedback yet: report the arm that would run, count no bandit round
                arm = self._arm(positions, peek=True)
                return self._log(Decision(self._rounds, cfg.policy, arm, Outcome.SKIPPED, self.cost.cost(SKIP)))
            if cfg.policy is Policy.COST_AWARE:
                next_arm = self._arm(positions, peek=True)
                if next_arm != SKIP and cfg.explore_budget and not self.cost.opt_step.known:
                    self._probe_step_cost(train)
                if not self._within_explore_budget(next_arm):
                    # the refused candidates have cost their share of serving time: no new one now
                    return self._log(Decision(self._rounds, cfg.policy, next_arm, Outcome.SKIPPED, self.cost.cost(SKIP)))
            arm = self._arm(positions)
            if arm == SKIP:
                if cfg.policy is Policy.COST_AWARE:
                    self.bandit.record(SKIP, 0.0)
                return self._log(Decision(self._rounds, cfg.policy, arm, Outcome.SKIPPED, self.cost.cost(SKIP)))
            t0 = self.clock()
            result = self.updater.train(self.weights, train, arm)
            self._busy.append((t0, self.clock()))
            self.cost.observe_opt_steps(result.step_seconds)
            cost = self.cost.cost(arm)
            train_s = sum(result.step_seconds)
            if cfg.policy is not Policy.COST_AWARE:
                sync_s = self._publish(result.state)
                return self._log(Decision(self._rounds, cfg.policy, arm, Outcome.APPLIED, cost, None, train_s, sync_s,
                                          result.mean_loss))
            r0 = self.clock()
            est = self.estimate(result.state)
            self._busy.append((r0, self.clock()))
            cost = dataclasses.replace(cost, replay_s=self.clock() - r0)
            if not gate(est.gain_lo_s, cost.total_s):
                self.refused_s += train_s + cost.replay_s
                reward = cost.sync_s - cost.tried_s  # trained and replayed, never synced
                self.bandit.record(arm, reward, {arm: reward}, harmful=est.gain_hi_s < 0, positions=positions)
                return self._log(Decision(self._rounds, cfg.policy, arm, Outcome.GATED, cost, est, train_s,
                                          loss=result.mean_loss, reward_s=reward,
                                          break_even_horizon_s=self._break_even(est, cost)))
            return self.apply(result.state, arm, cost, est, train_s, result.mean_loss, positions)

    def apply(self, state: StateDict, arm: int, cost: CostEstimate, est: GainEstimate | None = None,
              train_s: float = 0.0, loss: float = math.nan, positions: int = 0, injected: bool = False) -> Decision:
        """Publish ``state`` as an update of arm ``arm`` and watch it with the swap guard (the
        previous weights are kept for a rollback; the arm's reward is credited when the window closes).

        ``injected``: weights that did not come from the policy's own training (a benchmark's
        deliberately harmful update, :func:`adaptation.rollback.shuffled_head`). The guard watches
        and rolls them back like any update, but the bandit is not credited: no arm chose them."""
        with self._lock:
            tau_pre = self.buffer.live_tau(self.config.guard.window_steps)
            previous = self.weights
            sync_s = self._publish(state)
            self.guard.arm(previous, tau_pre)
            self._pending = _PendingSwap(arm, cost, est, positions, injected)
            return self._log(Decision(self._rounds, self.config.policy, arm, Outcome.APPLIED, cost, est, train_s,
                                      sync_s, loss, tau_pre=tau_pre, injected=injected,
                                      break_even_horizon_s=self._break_even(est, cost)))

    def _break_even(self, est: GainEstimate | None, cost: CostEstimate) -> float:
        """The horizon at which ``est`` would pass the gate against ``cost`` (nan without a replay)."""
        if est is None:
            return math.nan
        return break_even_horizon_s(est.gain_lo_s, cost.total_s, self.config.horizon_s)

    def _probe_step_cost(self, train: list[FeedbackSequence]) -> None:
        """Time :data:`PROBE_STEPS` optimizer steps (result discarded) so the exploration budget
        prices the first candidate at the measured step cost, not the prior ``default_step_s``
        (which on a slow host can hold off the first candidate for minutes, on a fast one let it
        overspend). Their seconds count as refused exploration."""
        t0 = self.clock()
        result = self.updater.train(self.weights, train, PROBE_STEPS)
        t1 = self.clock()
        self._busy.append((t0, t1))
        self.cost.observe_opt_steps(result.step_seconds)
        self.refused_s += t1 - t0
        self.probe_cost_s += (t1 - t0) * self.cost.contention

    def _within_explore_budget(self, arm: int) -> bool:
        """Whether a candidate of ``arm`` may be trained: refused candidates so far plus this one's
        expected training seconds stay within ``explore_budget`` of the serving wall time."""
        budget = self.config.explore_budget
        if budget is None or arm == SKIP:
            return True
        elapsed = self.clock() - self._first_wall if self._first_wall is not None else 0.0
        return self.refused_s + self.cost.cost(arm).train_s <= budget * elapsed

    def _arm(self, positions: int, peek: bool = False) -> int:
        cfg = self.config
        if cfg.policy is Policy.STATIC:
            return SKIP
        if cfg.policy is Policy.ALWAYS:
            return cfg.fixed_budget
        if cfg.policy is Policy.PERIODIC:
            return cfg.periodic_budget if self._rounds % cfg.periodic_rounds == 0 else SKIP
        return self.bandit.peek(positions) if peek else self.bandit.choose(positions)

    def estimate(self, candidate: StateDict) -> GainEstimate:
        """Replay the held-out feedback with the live and the candidate weights (:mod:`adaptation.gain`)."""
        held = self.buffer.heldout_sequences()
        chunk = self.config.replay.chunk
        old = self._live_replay(held)
        self._replica.load_state_dict(candidate)
        new = replay_units(self._replica, held, chunk)
        step_s = self.cost.serving_step_s
        return estimate_gain(old, new, self.horizon_tokens(), step_s if math.isfinite(step_s) else 0.0,
                             self.config.replay)

    def _live_replay(self, held: list[FeedbackSequence]) -> list[UnitReplay]:
        """The live weights' replay units of ``held``: cached per request text until the weights
        change (the replay is deterministic for fixed weights and text)."""
        if self._live_replays_of is not self.weights:
            self._live_replays, self._live_replays_of = {}, self.weights
        chunk = self.config.replay.chunk
        keys = [_replay_key(seq) for seq in held]
        missing = [(key, seq) for key, seq in zip(keys, held) if key not in self._live_replays]
        self.live_replay_hits += len(held) - len(missing)
        if missing:
            self._replica.load_state_dict(self.weights)
            for key, seq in missing:
                self._live_replays[key] = replay_units(self._replica, [seq], chunk)
        live = set(keys)  # forget requests that left the held-out part
        self._live_replays = {k: v for k, v in self._live_replays.items() if k in live}
        return [unit for key in keys for unit in self._live_replays[key]]

    def _publish(self, state: StateDict) -> float:
        t0 = time.perf_counter()
        self.publish_fn(state)
        dt = time.perf_counter() - t0
        self.cost.observe_sync(dt)
        self.weights = state
        self.version += 1
        return dt

    def _paired_verdict(self) -> tuple[GuardVerdict, float, float]:
        """Replay the previous and the live weights on the guard window's feedback (same text);
        the replay's seconds join the pending update's cost."""
        assert self.guard.previous is not None and self._pending is not None
        tau_prev, tau_new, guard_s = self._replay_pair(self.guard.previous, self.weights,
                                                       self.guard.window_sequences())
        pending = self._pending
        self.guard_replay_cost_s += guard_s * pending.cost.contention
        pending.cost = dataclasses.replace(pending.cost, replay_s=pending.cost.replay_s + guard_s)
        return self.guard.judge(tau_prev, tau_new), tau_prev, tau_new

    def _replay_pair(self, first: StateDict, second: StateDict,
                     held: list[FeedbackSequence]) -> tuple[float, float, float]:
        """Replayed tau of ``first`` and of ``second`` on the same ``held`` text, and the seconds
        both replays took (recorded as busy time, for contention)."""
        r0 = self.clock()
        taus = []
        for weights in (first, second):
            self._replica.load_state_dict(weights)
            taus.append(tau_of(replay_units(self._replica, held, self.config.replay.chunk)))
        r1 = self.clock()
        self._busy.append((r0, r1))
        return taus[0], taus[1], r1 - r0

    def _watch_for_audit(self, record: FeedbackRecord) -> None:
        """Collect live steps into audit windows; audit when a window's tau drops (config docstring)."""
        size = self.config.audit_window_steps
        if size is None or self.config.policy is not Policy.COST_AWARE:
            return
        if self.guard.watching or self.weights is self.start_weights:
            if self._audit_window or not math.isnan(self._audit_ref):
                self._audit_window, self._audit_ref = [], math.nan
            return
        self._audit_window.append(record)
        if len(self._audit_window) < size:
            return
        window, self._audit_window = self._audit_window, []
        tau = sum(r.tokens_gained for r in window) / len(window)
        dropped = tau < self._audit_ref * (1 - self.config.guard.margin)  # False while the reference is nan
        self._audit_ref = tau
        if dropped:
            self.audit(window_sequences(window))

    def audit(self, held: list[FeedbackSequence]) -> Decision | None:
        """Replay the start and the live weights on ``held``; republish the start weights if the
        live ones fall below them by the guard's margin. None when nothing is replayable."""
        with self._lock:
            if not held:
                return None
            tau_start, tau_live, replay_s = self._replay_pair(self.start_weights, self.weights, held)
            cost = dataclasses.replace(self.cost.cost(SKIP), replay_s=replay_s)
            self.audit_cost_s += cost.replay_s * cost.contention
            verdict = self.guard.judge(tau_start, tau_live)
            sync_s = self._publish(self.start_weights) if verdict is GuardVerdict.ROLLBACK else 0.0
            outcome = Outcome.REVERTED if verdict is GuardVerdict.ROLLBACK else Outcome.AUDITED
            return self._log(Decision(self._rounds, self.config.policy, SKIP, outcome, cost, sync_s=sync_s,
                                      tau_replay_prev=tau_start, tau_replay_new=tau_live))

    def _close_watch(self, verdict: GuardVerdict, tau_replay_prev: float = math.nan,
                     tau_replay_new: float = math.nan) -> None:
        assert self._pending is not None
        pending, self._pending = self._pending, None
        arm, cost, est = pending.arm, pending.cost, pending.est
        tau_pre, tau_post = self.guard.tau_pre, self.guard.tau_post
        step_s = self.cost.serving_step_s
        paired = math.isfinite(tau_replay_prev) and math.isfinite(tau_replay_new)
        before, after = (tau_replay_prev, tau_replay_new) if paired else (tau_pre, tau_post)
        realised = gain_seconds(self.horizon_tokens(), step_s if math.isfinite(step_s) else 0.0, before, after)
        previous = self.guard.release()
        sync_s = 0.0
        if verdict is GuardVerdict.ROLLBACK:
            assert previous is not None
            sync_s = self._publish(previous)
        reward = realised - cost.tried_s
        if not pending.injected:
            self.bandit.record(arm, reward, {arm: reward}, harmful=None if est is None else est.gain_hi_s < 0,
                               positions=pending.positions)
        outcome = Outcome.ROLLED_BACK if verdict is GuardVerdict.ROLLBACK else Outcome.KEPT
        self._log(Decision(self._rounds, self.config.policy, arm, outcome, cost, est, sync_s=sync_s,
                           tau_pre=tau_pre, tau_post=tau_post, tau_replay_prev=tau_replay_prev,
                           tau_replay_new=tau_replay_new, realised_gain_s=realised, reward_s=reward,
                           injected=pending.injected))

    def _log(self, d: Decision) -> Decision:
        d = _with_time(d)
        self.decisions.append(d)
        if self.on_decision is not None:
            self.on_decision(d)
        return d

    def summary(self) -> dict[str, float]:
        """Counts and the bandit's regret (cost-aware only)."""
        n = {o: sum(d.outcome is o for d in self.decisions) for o in Outcome}
        out = {"rounds": float(self._rounds), "updates": float(n[Outcome.APPLIED]),
               "rollbacks": float(n[Outcome.ROLLED_BACK]), "gated": float(n[Outcome.GATED]),
               "audits": float(n[Outcome.AUDITED] + n[Outcome.REVERTED]), "reverts": float(n[Outcome.REVERTED]),
               "cost_s": (sum(d.spent_s for d in self.decisions) + self.guard_replay_cost_s + self.probe_cost_s
                          + self.audit_cost_s),
               "weights_version": float(self.version), "refused_s": self.refused_s}
        if self.config.policy is Policy.COST_AWARE:
            out.update(self.bandit.regret())
        return out


@dataclass
class _PendingSwap:
    """An applied update the swap guard is watching: what its arm is credited when the watch closes."""

    arm: int
    cost: CostEstimate
    est: GainEstimate | None
    positions: int  # train positions it was trained on (the bandit's staleness measure)
    injected: bool  # not the policy's own update: the bandit is not credited


def _replay_key(seq: FeedbackSequence) -> tuple:
    """A held-out request's identity for the replay cache: its tokens and its features' sum (two
    requests with the same generated text after different prompts have different features)."""
    return (tuple(seq.tokens.tolist()), seq.length, float(seq.aux.double().sum()))


def _with_time(d: Decision) -> Decision:
    return dataclasses.replace(d, wall_time=time.time())
