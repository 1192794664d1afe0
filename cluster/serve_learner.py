"""The learner inside the server: per-replica feedback shipping and weight swaps around ONE shared learner actor.

Per replica (docs/algorithms.md §8; the rules in docs/architecture.md §2)::

    engine thread: step() --feedback hook--> FeedbackSink (bounded queue, put_nowait; full = dropped)
                                                 | sink thread: RemoteFeed (<= max_inflight feed calls;
                                                 v              more = dropped)
                                   named Learner actor (fractional CPU, max_restarts, threaded)
                                                 | AdaptationController: rounds, gate, guard, publish
                                                 v ray.put(state) once per publish + checkpoint on disk
    poll thread: ray.get(published(since), timeout) -> ray.get(weights ref, timeout) -> pending swap
    engine thread, between two steps: apply_pending() -> load_state_dict on every live drafter

* **Never blocking decode.** The engine thread only builds a compact record and ``put_nowait``s it
  (:class:`~adaptation.feedback.FeedbackSink`); Ray calls happen on the sink's and the poll
  thread, each ``ray.get`` with ``call_timeout_s``. A dead, restarting or hung learner costs
  feedback and updates, never a token: requests do not touch the learner at all.
* **Swaps between steps.** The poll thread only stages ``(version, digest, state)``; the engine
  thread applies it before its next step, to every live drafter of the replica (their next
  propose re-encodes the context with the new head) and to every drafter built afterwards.
  Verification is the target's, so output stays lossless whatever weights the drafter has.
* **A killed learner** is restarted by Ray (``max_restarts``) and reloads its last published
  weights and version from ``checkpoint_dir`` (:class:`workers.learner.Learner`); the replica
  notices the new incarnation, keeps its weights when the version and digest match, and goes on
  shipping feedback.
* **One learner per application.** Replicas get the named actor or create it (``get_if_exists``);
  its owner is the replica that created it, so it ends with the application (and with that
  replica: a replica that Serve replaces starts a fresh learner from the configured drafter). It
  runs on its creator's node, where its drafter and checkpoints are written.
* **Observability.** Prometheus (the replica's registry): decisions by outcome, swaps, rollbacks,
  dropped feedback by reason, learner restarts, unavailable calls, the live weights version.
  Decisions also reach the replica's MLflow serving run (:meth:`ReplicaLearner.take_decisions`).

A method that is not learnable (vanilla, retrieval, graft) gets no learner: :func:`attach_learner`
logs one line saying so and returns the factory unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CollectorRegistry, Counter, Gauge
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from adaptation.bandit import BanditConfig
from adaptation.controller import ControllerConfig, Decision, Outcome, Policy
from adaptation.feedback import BufferConfig, FeedbackRecord, FeedbackSink, SinkConfig
from adaptation.online import OnlineConfig, StateDict, TrainableDrafter
from adaptation.rollback import GuardConfig
from cluster.serve_config import LearnerServeConfig
from speculation.drafters.base import DraftContext, Drafter, StepOutcome
from workers.learner import RemoteFeed, VERSION_FILE, WEIGHTS_FILE, spawn_learner

log = logging.getLogger("graftblock.serve.learner")

LEARNER_NAMESPACE = "graftblock"
"""Ray namespace of the shared learner actor (replicas of any job find it there)."""

DrafterFactory = Callable[[], Drafter]

DROP_REASONS = ("queue_full", "inflight", "learner_error", "no_features")
"""Labels of ``graftblock_learner_feedback_dropped`` (see :class:`LearnerMetrics`)."""


def controller_config(cfg: LearnerServeConfig) -> ControllerConfig:
    """The learner's :class:`ControllerConfig` from the serving config's ``learner`` section."""
    return ControllerConfig(
        policy=Policy(cfg.policy), decide_every_steps=cfg.decide_every_steps, horizon_s=cfg.horizon_s,
        fixed_budget=cfg.fixed_budget, periodic_rounds=cfg.periodic_rounds, periodic_budget=cfg.periodic_budget,
        min_train_sequences=cfg.min_train_sequences, min_train_positions=cfg.min_train_positions,
        explore_budget=cfg.explore_budget, audit_window_steps=cfg.audit_window_steps,
        bandit=BanditConfig(budgets=tuple(cfg.budgets), retry_growth=float(cfg.retry_growth)),
        guard=GuardConfig(window_steps=cfg.guard_window, margin=float(cfg.guard_margin), mode=cfg.guard_mode),
        online=OnlineConfig(lr=cfg.lr, accepted_keep=float(cfg.accepted_keep), recency_half_life=cfg.recency_half_life),
        buffer=BufferConfig(heldout_sequences=cfg.heldout_sequences),
    )


class LearnerMetrics:
    """Prometheus metrics of the learner wiring, in the replica's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter("graftblock_learner_decisions", "Learner decisions by outcome (skipped, gated, "
                                 "applied, kept, rolled_back, audited, reverted)", ["outcome"], registry=r)
        self.swaps = Counter("graftblock_learner_swaps", "Published weights swapped into this replica's drafters",
                             registry=r)
        self.rollbacks = Counter("graftblock_learner_rollbacks", "Updates the learner's swap guard rolled back",
                                 registry=r)
        self.dropped = Counter("graftblock_learner_feedback_dropped", "Feedback records dropped instead of slowing "
                               "decode: queue_full (replica queue), inflight (too many feed calls outstanding), "
                               "learner_error (a feed call failed, e.g. the learner was killed), no_features (a step "
                               "without the target's aux features)", ["reason"],
                               registry=r)
        self.sent = Counter("graftblock_learner_feedback_sent", "Feedback records shipped to the learner", registry=r)
        self.restarts = Counter("graftblock_learner_restarts", "Learner actor restarts this replica noticed",
                                registry=r)
        self.unavailable = Counter("graftblock_learner_unavailable", "Learner calls that failed or timed out "
                                   "(call_timeout_s)", registry=r)
        self.version = Gauge("graftblock_learner_weights_version", "Version of the drafter weights this replica "
                             "serves (0 = the configured drafter's)", registry=r)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)  # exported at 0 from the start


class _StepFeedback:
    """The engine's ``feedback`` hook: one :class:`FeedbackRecord` per sequence per verify step.

    The batched engine passes one hook for every sequence; a sequence is told apart by its context
    object, and a step whose root is the first generated token starts a new id (a context's
    ``id()`` may be reused once it is freed). Ids carry the replica's name, so records of different
    replicas never mix in the shared learner's buffer. At most ``max_tracked`` contexts are
    remembered (least recently stepped forgotten first; far more than the live sequences).
    """

    def __init__(self, sink: FeedbackSink, replica: str, max_tracked: int = 4096) -> None:
        self.sink, self.replica, self.max_tracked = sink, replica, max_tracked
        self._seqs: OrderedDict[int, list] = OrderedDict()
        self._n = 0
        self.skipped = 0
        """Steps without aux features (no record can be built; never an error in decode)."""

    def __call__(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if outcome.aux_hidden is None:
            self.skipped += 1
            return
        key = id(ctx)
        first = len(ctx.tokens) - len(outcome.accepted_tokens) - 1 == ctx.prompt_len
        entry = self._seqs.get(key)
        if first or entry is None:
            self._n += 1
            entry = [f"{self.replica}/{self._n}", 0]
            self._seqs[key] = entry
        self._seqs.move_to_end(key)
        while len(self._seqs) > self.max_tracked:
            self._seqs.popitem(last=False)
        rid, step = entry
        entry[1] = step + 1
        self.sink.offer(FeedbackRecord.from_outcome(rid, step, ctx, outcome))


class ReplicaLearner:
    """One replica's side of the learner (module docstring).

    Args:
        cfg: the ``learner`` section.
        drafter: a drafter of the served method (the learner adapts a copy of it).
        replica: this replica's name (feedback ids).
        registry: the replica's Prometheus registry.
    """

    def __init__(self, cfg: LearnerServeConfig, drafter: TrainableDrafter, replica: str,
                 registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.metrics = LearnerMetrics(registry)
        self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in drafter.state_dict().items()}
        self.handle = _get_or_spawn_learner(cfg, drafter)

        self.feed = RemoteFeed(self.handle, cfg.max_inflight)
        self.sink = FeedbackSink(self.feed, SinkConfig(max_queue=cfg.max_queue, batch_records=cfg.batch_records))
        self.hook = _StepFeedback(self.sink, replica)
        self._drafters: weakref.WeakSet = weakref.WeakSet()  # engine thread only
        self._current: tuple[int, str, StateDict] | None = None  # engine thread only
        self._pending: tuple[int, str, StateDict] | None = None
        self._lock = threading.Lock()
        self._decisions: list[tuple[int, Decision]] = []
        self._decision_count = 0
        self._since = 0
        self._incarnation: str | None = None
        self._seen = (0, "")  # (version, digest) last staged
        self._counted = dict.fromkeys((*DROP_REASONS, "sent"), 0)
        self.available = True
        self.swaps = 0
        self.restarts = 0
        self.version = 0
        self._stop = threading.Event()
        self.sink.start()
        self._thread = threading.Thread(target=self._poll_loop, name="graftblock-learner-poll", daemon=True)
        self._thread.start()

    # -- engine thread --------------------------------------------------------------------------
    def wrap(self, factory: DrafterFactory) -> DrafterFactory:
        """The replica's drafter factory: every drafter it builds serves the current weights and is
        swapped with the replica's other live drafters."""

        def build() -> Drafter:
            drafter = factory()
            if self._current is not None:
                drafter.load_state_dict(self._current[2])
            self._drafters.add(drafter)
            return drafter

        return build

    def apply_pending(self) -> None:
        """Swap staged weights into every live drafter (call between two engine steps)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        version, digest, state = pending
        t0 = time.perf_counter()
        for drafter in list(self._drafters):
            drafter.load_state_dict(state)
        self._current = pending
        self.version = version
        self.swaps += 1
        self.metrics.swaps.inc()
        self.metrics.version.set(version)
        log.info("learner: swapped weights v%d (%s) into %d live drafter(s) in %.1f ms", version, digest[:12],
                 len(self._drafters), 1e3 * (time.perf_counter() - t0))

    # -- poll thread ----------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._stop.wait(self.cfg.poll_interval_s):
            self.poll_once()

    def poll_once(self) -> None:
        """Pull decisions and newly published weights (staged for the engine thread); count drops."""
        self._count_feedback()
        timeout = self.cfg.call_timeout_s
        try:
            report = ray.get(self.handle.published.remote(self._since), timeout=timeout)
            if report.incarnation != self._incarnation:
                if self._incarnation is not None:
                    self.restarts += 1
                    self.metrics.restarts.inc()
                    log.warning("learner: the actor restarted (restored its weights: %s, version %d)",
                                report.restored, report.version)
                self._incarnation = report.incarnation
                if self._since:  # a new incarnation numbers its decisions from 0
                    self._since = 0
                    report = ray.get(self.handle.published.remote(0), timeout=timeout)
            state = None
            if report.weights and (report.version, report.digest) != self._seen:
                state = ray.get(report.weights[0], timeout=timeout)
        except ray.exceptions.RayError as exc:  # dead, restarting or hung (GetTimeoutError): retry next poll
            self.metrics.unavailable.inc()
            if self.available:
                log.warning("learner: unavailable (%s: %s); serving goes on, updates wait",
                            type(exc).__name__, exc)
            self.available = False
            return
        if not self.available:
            log.info("learner: available again (version %d)", report.version)
        self.available = True
        self._since = report.total_decisions
        self._record(report.decisions)
        if state is not None:
            self._seen = (report.version, report.digest)
            if report.digest == (self._current[1] if self._current else ""):
                return  # a restarted learner republished the weights this replica already serves
            if {k: (tuple(v.shape), v.dtype) for k, v in state.items()} != self._shapes:
                log.error("learner: published weights v%d do not fit the served drafter; not swapped",
                          report.version)
                return
            with self._lock:
                self._pending = (report.version, report.digest, state)

    def _record(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.metrics.decisions.labels(d.outcome.value).inc()
            if d.outcome is Outcome.ROLLED_BACK:
                self.metrics.rollbacks.inc()
        with self._lock:
            for d in decisions:
                self._decisions.append((self._decision_count, d))
                self._decision_count += 1

    def _count_feedback(self) -> None:
        now = {"queue_full": self.sink.stats.dropped, "inflight": self.feed.dropped,
               "learner_error": self.feed.failed + self.sink.stats.consumer_errors,
               "no_features": self.hook.skipped, "sent": self.feed.sent}
        for key, value in now.items():
            delta = value - self._counted[key]
            if delta > 0:
                (self.metrics.sent if key == "sent" else self.metrics.dropped.labels(key)).inc(delta)
            self._counted[key] = value

    # -- reporting ------------------------------------------------------------------------------
    def take_decisions(self) -> list[tuple[int, Decision]]:
        """Decisions not yet taken, with their running index (the MLflow step)."""
        with self._lock:
            out, self._decisions = self._decisions, []
        return out

    def status(self) -> dict[str, Any]:
        """The learner block of ``/health``."""
        return {"actor": self.cfg.actor_name, "policy": self.cfg.policy, "available": self.available,
                "weights_version": self.version, "swaps": self.swaps, "restarts": self.restarts,
                "decisions": self._decision_count, "feedback_sent": self.feed.sent,
                "feedback_dropped": self.sink.stats.dropped + self.feed.dropped}

    def sample(self) -> dict[str, float]:
        """Periodic MLflow metrics of the serving run (``learner.*``)."""
        s = self.status()
        return {f"learner.{k}": float(v) for k, v in s.items() if isinstance(v, (int, float))}

    def close(self) -> None:
        """Stop polling and shipping (queued feedback is dropped: the learner may be gone)."""
        self._stop.set()
        self._thread.join(timeout=self.cfg.call_timeout_s + 5.0)
        self.sink.close(flush=False)


def _get_or_spawn_learner(cfg: LearnerServeConfig, drafter: TrainableDrafter) -> Any:
    """The application's learner actor: the running one by name, or a new one for ``drafter``
    (weights an earlier application left in ``checkpoint_dir`` are cleared first)."""
    try:
        return ray.get_actor(cfg.actor_name, namespace=LEARNER_NAMESPACE)
    except ValueError:
        pass
    directory = Path(cfg.checkpoint_dir)
    for name in (WEIGHTS_FILE, VERSION_FILE):
        (directory / name).unlink(missing_ok=True)
    # pinned to this node: its drafter and checkpoints are on this node's disk (restarts land here too)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle = spawn_learner(drafter, controller_config(cfg), directory, torch_threads=cfg.torch_threads,
                           name=cfg.actor_name, namespace=LEARNER_NAMESPACE, get_if_exists=True,
                           num_cpus=cfg.num_cpus, max_restarts=cfg.max_restarts, max_task_retries=0,
                           max_concurrency=4, scheduling_strategy=here)
    log.info("learner: actor %r (policy %s, %.2g CPU, max_restarts %d, checkpoints in %s)", cfg.actor_name,
             cfg.policy, cfg.num_cpus, cfg.max_restarts, directory)
    return handle


def attach_learner(cfg: LearnerServeConfig, method: str, factory: DrafterFactory | None, replica: str,
                   registry: CollectorRegistry) -> tuple[DrafterFactory | None, ReplicaLearner | None]:
    """Wire the learner into a replica: ``(drafter factory to serve with, the learner or None)``.

    None (and the factory unchanged) when the learner is disabled or ``method`` is not learnable;
    the latter is logged, since an enabled learner then does nothing.
    """
    if not cfg.enabled:
        return factory, None
    probe = factory() if factory is not None else None
    if not isinstance(probe, TrainableDrafter):
        log.warning("learner: method %r is not learnable (only the eagle3 and specblock heads are adapted "
                    "online); the learner is a no-op for this server", method)
        return factory, None
    learner = ReplicaLearner(cfg, probe, replica, registry)
    return learner.wrap(factory), learner
