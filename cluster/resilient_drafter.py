"""Per-sequence drafters in a supervised :class:`~workers.drafter_worker.DrafterWorker` actor that
survive the worker dying or hanging (``serve.drafter_placement: worker``).

One :class:`DrafterWorkerSupervisor` per replica owns the worker actor; every sequence's drafter is
a :class:`ResilientDrafterProxy` over its own worker slot. Only the engine thread calls them.

Failure handling, per decode step:

1. Every ``ray.get`` waits at most ``call_timeout_s``; nothing on the step path blocks longer.
2. A call that fails (the actor died or is unavailable, or its slot is gone because Ray restarted
   it) or times out marks the worker RECOVERING. That sequence's step, and every step of every
   sequence until the worker is back, falls back to *no speculation*: the proposal is the root
   alone, so verification emits exactly the target's next token. Lossless by construction: every
   emitted token comes from the target's verify step, whatever the drafter did or failed to do.
3. A hung worker (timeout) is killed with ``no_restart=False`` so Ray restarts it; a dead one Ray
   restarts by itself (``max_restarts``). The supervisor probes ``incarnation()`` without blocking
   (``ray.wait(timeout=0)`` once per step) while decoding goes on.
4. When an incarnation answers, the supervisor's ``epoch`` increments. Each proxy, at its next
   ``propose``, re-hosts a fresh drafter in its slot and ``begin``s it from the sequence's committed
   tokens (``ctx.tokens``), then proposes in the same step: speculation resumes.
5. If Ray cannot restart it (the probe fails twice in a row: ``max_restarts`` used up) or the
   restart takes longer than ``restart_timeout_s``, a new actor is created.

Why no speculation rather than an in-process retrieval fallback: a shadow drafter kept in sync
would cost an ``observe`` per sequence on the engine thread at every step (paying for a rare fault
on every step), and one built only at the fault would need a ``begin`` over the whole context,
which is the rebuild done anyway a few seconds later when the worker is back. The root-only tree
is exact, costs nothing, and lasts only as long as the restart.

Limit: a drafter that needs the target's aux hidden states (EAGLE-3, SpecBlock, Graft over them)
cannot be rebuilt from tokens alone (its ``begin`` needs aux features of the whole context), so
its sequence stays without speculation after a fault; sequences admitted later speculate again.

Counts: every proposal made in a fallback carries ``stats[FALLBACK_STAT] = 1`` and a rebuilt one
``stats[REBUILD_STAT] = 1`` (the engine copies them into the step record: per-request counts);
:class:`DrafterCounters` and the ``on_event`` callback give the replica totals (Prometheus).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from cluster.serve_config import ServeConfig
from speculation.drafters.base import DraftContext, Drafter, Proposal, StepOutcome
from speculation.spec.tree import DraftTree
from workers.drafter_worker import UnknownSlotError, make_actor_class, pack_drafter

log = logging.getLogger("graftblock.drafter_worker")

FALLBACK_STAT = "drafter_fallback"
"""Proposal/step stat: 1.0 when the step ran without speculation because the worker was down."""
REBUILD_STAT = "drafter_rebuild"
"""Proposal/step stat: 1.0 when the sequence's drafter was rebuilt from its committed tokens."""


class WorkerState(str, enum.Enum):
    UP = "up"
    RECOVERING = "recovering"


class DrafterEvent(str, enum.Enum):
    """What the supervisor reports through ``on_event`` (one Prometheus label value each)."""

    FALLBACK_STEP = "fallback_step"
    """A sequence's step ran without speculation."""
    TIMEOUT = "timeout"
    """A worker call ran past ``call_timeout_s`` (the worker is killed and restarted)."""
    DIED = "died"
    """A worker call failed because the actor died or lost its slots."""
    RESTART = "restart"
    """A new worker incarnation answered (Ray restarted it, or it was re-created)."""
    RECREATE = "recreate"
    """Ray could not restart the worker in time: a new actor was created."""
    REBUILD = "rebuild"
    """A sequence's drafter was rebuilt in the worker from its committed tokens."""


@dataclasses.dataclass
class DrafterCounters:
    """Replica totals since start (read by the response stats and ``/health``)."""

    fallback_steps: int = 0
    timeouts: int = 0
    deaths: int = 0
    restarts: int = 0
    recreated: int = 0
    rebuilds: int = 0


@dataclasses.dataclass(frozen=True)
class ResilienceConfig:
    """Timeouts of the supervised drafter worker.

    Attributes:
        call_timeout_s: longest wait on one worker call (the pending begin/observe and the
            propose of one sequence's step). Range (0, 3600].
        restart_timeout_s: longest wait for Ray to restart a failed worker before a new actor is
            created; also bounds the first start. Range (0, 3600].
    """

    call_timeout_s: float = 5.0
    restart_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "restart_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0 < v <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {v!r}")


SpawnWorker = Callable[[int], Any]
"""``spawn(generation) -> DrafterWorker actor handle`` (generation 0, 1, ... for unique names)."""


class DrafterWorkerSupervisor:
    """Owns a replica's drafter-worker actor: liveness, restarts, re-creation, counters.

    Engine thread only, except :meth:`release_slot` (any thread; fire-and-forget).

    Args:
        spawn: creates the actor (``max_restarts`` set by the caller) for a generation number.
        config: the timeouts.
        on_event: called on the engine thread for every :class:`DrafterEvent`.
    """

    def __init__(self, spawn: SpawnWorker, config: ResilienceConfig,
                 on_event: Callable[[DrafterEvent], None] | None = None) -> None:
        self._spawn = spawn
        self.config = config
        self._on_event = on_event
        self.counters = DrafterCounters()
        self.generation = 0
        self.handle = spawn(0)
        self.incarnation: str = ray.get(self.handle.incarnation.remote(), timeout=config.restart_timeout_s)
        self.epoch = 0
        """Increments on every recovery; a proxy's slot is in sync only within one epoch."""
        self.state = WorkerState.UP
        self._probe = None
        self._probe_failures = 0
        self._down_since = 0.0

    @property
    def call_timeout_s(self) -> float:
        return self.config.call_timeout_s

    def _emit(self, event: DrafterEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    # -- health -------------------------------------------------------------------------------------
    def available(self) -> bool:
        """True when the worker is up; while recovering, polls the probe once (never blocks)."""
        if self.state is WorkerState.RECOVERING:
            self._poll()
        return self.state is WorkerState.UP

    def fail(self, timed_out: bool, exc: BaseException) -> None:
        """A worker call failed (``timed_out``: it ran past ``call_timeout_s``); start recovering."""
        if timed_out:
            self.counters.timeouts += 1
            self._emit(DrafterEvent.TIMEOUT)
        else:
            self.counters.deaths += 1
            self._emit(DrafterEvent.DIED)
        if self.state is WorkerState.RECOVERING:
            return
        log.warning("drafter worker failed (%s: %s); decoding without speculation until it is back",
                    "timeout" if timed_out else type(exc).__name__, exc)
        self.state = WorkerState.RECOVERING
        self._down_since = time.monotonic()
        self._probe_failures = 0
        if timed_out:  # hung: make Ray restart it (its queued calls are dropped with it)
            ray.kill(self.handle, no_restart=False)
        self._send_probe()

    def _send_probe(self) -> None:
        self._probe = self.handle.incarnation.remote()

    def _poll(self) -> None:
        if time.monotonic() - self._down_since > self.config.restart_timeout_s:
            self._recreate(f"no restart within restart_timeout_s = {self.config.restart_timeout_s:g} s")
            return
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return
        try:
            incarnation = ray.get(self._probe, timeout=self.config.call_timeout_s)
        except ActorUnavailableError:  # restarting: ask again
            self._send_probe()
            return
        except RayActorError as exc:
            self._probe_failures += 1
            if self._probe_failures >= 2:  # not a race with the death: Ray will not restart it
                self._recreate(f"the actor stays dead ({type(exc).__name__})")
            else:
                self._send_probe()
            return
        if incarnation != self.incarnation:
            self.counters.restarts += 1
            self._emit(DrafterEvent.RESTART)
        self.incarnation = incarnation
        self.epoch += 1
        self.state = WorkerState.UP
        self._probe = None
        log.warning("drafter worker back (incarnation %s, %.1f s after the fault); speculation resumes",
                    incarnation, time.monotonic() - self._down_since)

    def _recreate(self, why: str) -> None:
        log.warning("re-creating the drafter worker: %s", why)
        ray.kill(self.handle, no_restart=True)
        self.generation += 1
        self.handle = self._spawn(self.generation)
        self.counters.recreated += 1
        self._emit(DrafterEvent.RECREATE)
        self._down_since = time.monotonic()
        self._probe_failures = 0
        self._send_probe()

    # -- slots --------------------------------------------------------------------------------------
    def record_fallback(self) -> None:
        self.counters.fallback_steps += 1
        self._emit(DrafterEvent.FALLBACK_STEP)

    def record_rebuild(self) -> None:
        self.counters.rebuilds += 1
        self._emit(DrafterEvent.REBUILD)

    def release_slot(self, slot: str) -> None:
        """Free ``slot`` in the worker (fire-and-forget; a restarted worker has no slots anyway)."""
        if self.state is WorkerState.UP:
            self.handle.unload.remote(slot)

    def shutdown(self) -> None:
        ray.kill(self.handle, no_restart=True)


def _unload(supervisor_ref: "weakref.ref[DrafterWorkerSupervisor]", slot: str) -> None:
    supervisor = supervisor_ref()
    if supervisor is not None:
        supervisor.release_slot(slot)


class ResilientDrafterProxy:
    """The drafter protocol over one slot of a supervised worker; worker faults never raise here.

    ``begin``/``observe`` are submitted without waiting and checked with the next ``propose``
    (one caller, one actor: calls run in order), like :class:`cluster.proxy.RayDrafterProxy`.
    Errors the hosted drafter itself raises (a bug, not a fault) still propagate.

    Args:
        supervisor: the replica's worker supervisor.
        slot: this sequence's slot name (unique per replica).
        template: a drafter built in process for this sequence: its protocol attributes are read
            here and its pickle is what the worker hosts.
        build: builds a fresh drafter like ``template`` (for rebuilds after a restart).
    """

    def __init__(self, supervisor: DrafterWorkerSupervisor, slot: str, template: Drafter,
                 build: Callable[[], Drafter]) -> None:
        self.supervisor = supervisor
        self.slot = slot
        self.name: str = template.name
        self.needs_aux: bool = bool(template.needs_aux)
        self.target_topk: int = int(template.target_topk)
        self._payload: bytes | None = pack_drafter(template)
        self._build = build
        self._epoch: int | None = None
        """Supervisor epoch in which the worker slot was loaded and kept in sync; None = not loaded."""
        self._sent = 0
        self._pending: list = []
        weakref.finalize(self, _unload, weakref.ref(supervisor), slot).atexit = False

    def _delta(self, ctx: DraftContext) -> list[int]:
        new = ctx.tokens[self._sent:]
        self._sent = len(ctx.tokens)
        return list(new)

    def _load(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        """Host a fresh drafter in the slot and begin it on ``ctx`` (submitted, not awaited)."""
        payload = self._payload if self._payload is not None else pack_drafter(self._build())
        self._payload = None
        h = self.supervisor.handle
        self._pending = [h.host.remote(self.slot, payload),
                         h.begin.remote(self.slot, list(ctx.tokens), ctx.prompt_len, prompt_aux)]
        self._sent = len(ctx.tokens)
        self._epoch = self.supervisor.epoch

    def _fallback(self, ctx: DraftContext) -> Proposal:
        """This step without speculation: the root alone (the target's own next token)."""
        self._pending = []
        self.supervisor.record_fallback()
        return Proposal(tree=DraftTree(ctx.root_token), stats={FALLBACK_STAT: 1.0})

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        if self.supervisor.available():
            self._load(ctx, prompt_aux)

    def propose(self, ctx: DraftContext) -> Proposal:
        sup = self.supervisor
        if not sup.available():
            return self._fallback(ctx)
        rebuilt = False
        if self._epoch != sup.epoch:
            if self.needs_aux:  # begin needs aux features of the whole context: cannot rebuild
                return self._fallback(ctx)
            self._load(ctx, None)
            sup.record_rebuild()
            rebuilt = True
        ref = sup.handle.propose.remote(self.slot, self._delta(ctx))
        try:
            got = ray.get([*self._pending, ref], timeout=sup.call_timeout_s)
        except GetTimeoutError as exc:
            sup.fail(True, exc)
            return self._fallback(ctx)
        except (RayActorError, UnknownSlotError) as exc:
            sup.fail(False, exc)
            return self._fallback(ctx)
        finally:
            self._pending = []
        proposal: Proposal = got[-1]
        if rebuilt:
            proposal = dataclasses.replace(proposal, stats={**proposal.stats, REBUILD_STAT: 1.0})
        return proposal

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        sup = self.supervisor
        if self._epoch is None or self._epoch != sup.epoch or sup.state is not WorkerState.UP:
            return  # the slot is stale or gone: it is rebuilt from ctx.tokens at the next propose
        self._pending.append(sup.handle.observe.remote(self.slot, self._delta(ctx), outcome))


def supervised_factory(supervisor: DrafterWorkerSupervisor,
                       build: Callable[[], Drafter]) -> Callable[[], ResilientDrafterProxy]:
    """A ``BatchEngine`` drafter factory: each sequence gets ``build()``'s drafter hosted in its own
    slot of the supervised worker (built here, where the target is, then shipped)."""
    ids = itertools.count()

    def factory() -> ResilientDrafterProxy:
        return ResilientDrafterProxy(supervisor, f"seq-{next(ids)}", build(), build)

    return factory


def spawn_drafter_worker(vocab_size: int, *, name_prefix: str, num_cpus: float, max_restarts: int,
                         torch_threads: int = 1) -> SpawnWorker:
    """A :data:`SpawnWorker` for :class:`DrafterWorkerSupervisor`: a named ``DrafterWorker`` actor
    (``<name_prefix>-<generation>``, findable with ``ray.get_actor``) with ``num_cpus`` (a fraction
    is fine) and ``max_restarts``; calls are never retried (``max_task_retries=0``): a call in
    flight when the actor dies fails, and the supervisor falls back and rebuilds instead."""
    def spawn(generation: int):
        cls = make_actor_class(num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0,
                               name=f"{name_prefix}-{generation}")
        return cls.remote(vocab_size, torch_threads)

    return spawn


def supervisor_from_config(config: ServeConfig, vocab_size: int,
                           on_event: Callable[[DrafterEvent], None] | None = None) -> DrafterWorkerSupervisor:
    """The replica's supervised drafter worker for ``serve.drafter_placement: worker`` (blocks until
    the actor answers, at most ``drafter_restart_timeout_s``). The actor is named
    ``graftblock-drafter-worker-<host>-<pid>-<generation>`` in the replica's namespace."""
    spawn = spawn_drafter_worker(
        vocab_size, name_prefix=f"graftblock-drafter-worker-{os.uname().nodename}-{os.getpid()}",
        num_cpus=float(config.drafter_worker_cpus), max_restarts=config.drafter_worker_max_restarts)
    resilience = ResilienceConfig(call_timeout_s=float(config.drafter_call_timeout_s),
                                  restart_timeout_s=float(config.drafter_restart_timeout_s))
    return DrafterWorkerSupervisor(spawn, resilience, on_event)
