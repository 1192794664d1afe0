"""The engine thread of one serving replica: ONE thread owns the :class:`~speculation.engine.batch.BatchEngine`.

::

    HTTP (asyncio) --add/abort--> command queue --> engine thread (owns the BatchEngine)
         ^                                              | step() -> SequenceUpdates
         +---- per-request asyncio.Queue <-- call_soon_threadsafe +

``add``, ``abort`` and ``step`` are only ever called on that thread. Requests reach it through a
thread-safe command queue; its updates reach each request's asyncio queue through
``loop.call_soon_threadsafe`` (:class:`UpdateSink`). A request that arrives joins the running
batch at the next step. :attr:`EngineLoop.step_started` and :attr:`EngineLoop.state` let waiters
detect a stalled or dead engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable

from cluster.openai_api import APIError, ErrorType
from speculation.engine.batch import AdmissionError, BatchEngine, QueueFullError, Request, SequenceUpdate

log = logging.getLogger("graftblock.serve")

EngineFactory = Callable[[], BatchEngine]
"""Builds the replica's engine; called once, on the engine thread."""

POLL_S = 0.5
"""Longest single wait on a request queue before the engine's health is re-checked."""


class EngineState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineFailure(RuntimeError):
    """The engine thread raised; every request it held gets this error, its cause the exception
    (HTTP 503 ``shard_unavailable`` for a lost target shard, else 500 ``engine_failed``)."""


class ShutdownAbort(RuntimeError):
    """The server shut down before the request finished (drain deadline passed)."""


# --------------------------------------------------------------------------- engine thread
class UpdateSink:
    """Delivers engine-thread items (updates or exceptions) to one request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: "asyncio.Queue[SequenceUpdate | BaseException]" = asyncio.Queue()

    def push(self, item: SequenceUpdate | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the request's event loop is closed (server shutting down)
            pass


@dataclasses.dataclass(frozen=True)
class _Add:
    request: Request
    sink: UpdateSink


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    drain_timeout_s: float


class EngineLoop:
    """One thread that owns a :class:`BatchEngine` and drives it: drain commands, then ``step()``.

    Only this thread calls the engine. Public methods are thread-safe and never block on the
    engine; :attr:`step_started` / :attr:`state` let waiters detect a stalled or dead engine.
    """

    def __init__(self, engine_factory: EngineFactory, start_timeout_s: float = 600.0,
                 between_steps: Callable[[], None] | None = None) -> None:
        self._factory = engine_factory
        self._between_steps = between_steps
        """Runs on the engine thread before every step (the learner's weight swaps)."""
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, UpdateSink] = {}  # engine thread only
        self._ready = threading.Event()
        self.state = EngineState.STARTING
        self.error: BaseException | None = None
        self.step_started: float | None = None
        """``time.monotonic()`` when the step in progress began; None between steps."""
        self.live = 0
        """Requests the engine holds (waiting or decoding)."""
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="graftblock-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise TimeoutError(f"the engine did not start within {start_timeout_s:.0f} s")
        if self.error is not None:
            raise EngineFailure(f"the engine failed to start: {self.error}") from self.error

    # -- callers (any thread) -------------------------------------------------------------------
    def submit(self, request: Request, sink: UpdateSink) -> None:
        if self.state != EngineState.RUNNING:
            raise APIError(503, f"the server is {self.state.value}; not accepting requests",
                           ErrorType.OVERLOADED)
        self._commands.put(_Add(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, drain_timeout_s: float) -> bool:
        """Stop accepting requests, let in-flight ones finish for ``drain_timeout_s``, abort the rest
        and end the thread. True if the thread ended in time."""
        if self.state in (EngineState.RUNNING, EngineState.STARTING):
            self.state = EngineState.DRAINING
        self._commands.put(_Stop(drain_timeout_s))
        self._thread.join(drain_timeout_s + 10.0)
        return not self._thread.is_alive()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # reported to the constructor, which raises it
            self.error, self.state = exc, EngineState.FAILED
            self._ready.set()
            return
        self.state = EngineState.RUNNING
        self._ready.set()
        drain_deadline: float | None = None
        try:
            while True:
                cmds = self._take_commands(block=not engine.has_work() and drain_deadline is None)
                for cmd in cmds:
                    if isinstance(cmd, _Stop):
                        drain_deadline = time.monotonic() + cmd.drain_timeout_s
                    else:
                        self._apply(engine, cmd)
                if drain_deadline is not None:
                    if not engine.has_work():
                        break
                    if time.monotonic() > drain_deadline:
                        self._fail_all(ShutdownAbort("the server shut down before this request finished"))
                        break
                if engine.has_work():
                    if self._between_steps is not None:
                        self._between_steps()
                    self.step_started = time.monotonic()
                    updates = engine.step()
                    self.step_started = None
                    self.steps += 1
                    self._dispatch(updates)
            self.state = EngineState.STOPPED
        except BaseException as exc:
            log.exception("engine thread failed")
            self.error, self.state = exc, EngineState.FAILED
            self.step_started = None
            failure = EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc  # the service maps the cause to a status (a lost shard is a 503)
            self._fail_all(failure)

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _Stop]:
        cmds: list[_Add | _Abort | _Stop] = []
        if block:
            try:
                cmds.append(self._commands.get(timeout=POLL_S))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, engine: BatchEngine, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            if self.state != EngineState.RUNNING:
                cmd.sink.push(APIError(503, "the server is shutting down", ErrorType.OVERLOADED))
                return
            try:
                engine.add(cmd.request)
            except (AdmissionError, QueueFullError) as exc:
                cmd.sink.push(exc)
                return
            except ValueError as exc:  # duplicate id or an invalid request
                cmd.sink.push(exc)
                return
            self._sinks[cmd.request.request_id] = cmd.sink
            self.live = len(self._sinks)
        elif cmd.request_id in self._sinks:
            engine.abort(cmd.request_id)  # an ABORT update follows at the next step

    def _dispatch(self, updates: list[SequenceUpdate]) -> None:
        for u in updates:
            sink = self._sinks.get(u.request_id)
            if sink is None:
                continue
            sink.push(u)
            if u.finished is not None:
                del self._sinks[u.request_id]
        self.live = len(self._sinks)

    def _fail_all(self, exc: BaseException) -> None:
        for sink in self._sinks.values():
            sink.push(exc)
        self._sinks.clear()
        self.live = 0
