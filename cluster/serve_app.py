"""The serving application: a Ray Serve deployment with an OpenAI-compatible FastAPI ingress.

Per replica::

    HTTP (FastAPI, asyncio) --add/abort--> command queue --> engine thread (owns the BatchEngine)
         ^                                                      | step() -> SequenceUpdates
         +---- per-request asyncio.Queue <-- call_soon_threadsafe +

* :class:`EngineLoop`: ONE thread owns the :class:`~speculation.engine.batch.BatchEngine`; ``add``,
  ``abort`` and ``step`` are only ever called there. Requests reach it through a thread-safe
  command queue; its updates reach each request's asyncio queue through
  ``loop.call_soon_threadsafe``. A request that arrives joins the running batch at the next step.
* :class:`OpenAIService`: the request path. Validates (``cluster.openai_api``), encodes the prompt
  (chat template), submits, and turns updates into a response or SSE chunks (``data: {...}``,
  ending ``data: [DONE]``). Every wait on the engine thread has a timeout: the request deadline
  (``request_timeout_s``), a step running past ``stall_timeout_s``, or a dead engine thread each
  become a clear error body, never a hung connection. A request that ends early (client
  disconnect: the handler is cancelled; a stop string) aborts its sequence, which frees its KV slot
  at once.
* :class:`ServeMetrics`: Prometheus counters and histograms (``/metrics``).
* Drafter placement (``drafter_placement: worker``): the per-sequence drafters live in one
  ``DrafterWorker`` actor behind ``cluster.resilient_drafter`` proxies; a dead or hung worker turns
  the affected steps into steps without speculation (never a wrong token, never a hung request),
  the worker is restarted and each sequence's drafter is rebuilt from its committed tokens.
* :func:`build_app`: the Ray Serve application (``serve.run(build_app(config))``).

* Learner (``cluster.serve_learner``): the engine's feedback hook ships one record per verify
  step to the shared learner actor (bounded, dropped rather than waited for); published weights
  are swapped into the replica's drafters by the engine thread between two steps.
"""


import asyncio
import dataclasses
import enum
import json
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.detokenize import IncrementalDecoder
from cluster.openai_api import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorType,
    ModelCard,
    ModelList,
    SpecStats,
    Usage,
    bad_request,
    encode_chat,
    encode_prompt,
    parse_request,
)
from cluster.resilient_drafter import (FALLBACK_STAT, REBUILD_STAT, DrafterWorkerSupervisor, supervised_factory,
                                       supervisor_from_config)
from cluster.serve_config import DrafterPlacement, ServeConfig, serve_config_from_dict
from cluster.serve_learner import ReplicaLearner, attach_learner
from cluster.serve_shards import ShardedServeTarget, check_shardable
from speculation.config import BatchConfig, ConfigError, SamplingConfig, from_dict
from speculation.engine.batch import AdmissionError, BatchEngine, QueueFullError, Request, SequenceUpdate
from speculation.engine.sequence import FinishReason
from speculation.model.target import ContextLengthError

log = logging.getLogger("graftblock.serve")

EngineFactory = Callable[[], BatchEngine]
"""Builds the replica's engine; called once, on the engine thread."""

_POLL_S = 0.5
"""Longest single wait on a request queue before the engine's health is re-checked."""


class EngineState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineFailure(RuntimeError):
    """The engine thread raised; every request it held gets this error (HTTP 500)."""


class ShutdownAbort(RuntimeError):
    """The server shut down before the request finished (drain deadline passed)."""


# --------------------------------------------------------------------------- engine thread
class _Sink:
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
    sink: _Sink


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
        self._sinks: dict[str, _Sink] = {}  # engine thread only
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
    def submit(self, request: Request, sink: _Sink) -> None:
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
            self._fail_all(EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _Stop]:
        cmds: list[_Add | _Abort | _Stop] = []
        if block:
            try:
                cmds.append(self._commands.get(timeout=_POLL_S))
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


# --------------------------------------------------------------------------- metrics
class ServeMetrics:
    """Prometheus metrics of one replica (its own registry, served at ``/metrics``)."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
    ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("graftblock_requests", "Finished requests by endpoint and outcome "
                                "(finish reason or error type)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("graftblock_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("graftblock_generation_tokens", "Generated tokens", ["method"], registry=r)
        self.ttft = Histogram("graftblock_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=self.LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("graftblock_inter_token_latency_seconds", "Seconds per output token after the "
                             "first (a step's interval spread over the tokens it produced)",
                             buckets=self.LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("graftblock_request_latency_seconds", "Request arrival to its last token",
                             buckets=self.LATENCY_BUCKETS, registry=r)
        self.acceptance = Histogram("graftblock_acceptance_length", "Tokens gained per verify step, bonus "
                                    "included (tau's distribution)", ["method"], buckets=self.ACCEPT_BUCKETS,
                                    registry=r)
        self.accepted = Counter("graftblock_accepted_draft_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.drafted = Counter("graftblock_draft_tokens", "Draft nodes proposed", ["method"], registry=r)
        self.running = Gauge("graftblock_running_requests", "Requests with at least one token, not finished",
                             registry=r)
        self.waiting = Gauge("graftblock_waiting_requests", "Requests submitted, no token yet", registry=r)
        self.drafter_events = Counter("graftblock_drafter_worker_events", "Drafter-worker faults and recovery "
                                      "(drafter_placement: worker): fallback_step, timeout, died, restart, recreate, "
                                      "rebuild (cluster.resilient_drafter.DrafterEvent)", ["event"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------- one request
@dataclasses.dataclass
class _Progress:
    """What a request has produced so far."""

    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    """Decoded text, cut before a matched stop string."""
    finish: str | None = None
    steps: int = 0
    gained: int = 0
    accepted: int = 0
    drafted: int = 0
    fallback_steps: int = 0
    """Steps without speculation because the drafter worker was down."""
    rebuilds: int = 0
    """Times this request's drafter was rebuilt from its committed tokens after a worker restart."""


class WorkerSpecStats(SpecStats):
    """The ``graftblock`` field with drafters in a worker (``drafter_placement: worker``)."""

    drafter_fallback_steps: int
    """This request's verify steps without speculation (the drafter worker was dead or hung)."""
    drafter_rebuilds: int
    """Times this request's drafter was rebuilt in the worker from its committed tokens."""
    drafter_worker_restarts: int
    """The replica's drafter-worker restarts so far (Ray restarts and re-creations)."""


@dataclasses.dataclass(frozen=True)
class _Job:
    endpoint: str
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    stop_strings: list[str]
    stop_token_ids: frozenset[int]
    arrived: float


class OpenAIService:
    """The request path of one replica, independent of the HTTP framework (FastAPI routes call it)."""

    drafter_supervisor: DrafterWorkerSupervisor | None = None
    """The replica's drafter worker (``drafter_placement: worker``), or None (drafters in process)."""
    sharded_target: ShardedServeTarget | None = None
    """The replica's target shard actors (``target_shards`` >= 1), or None (target in process)."""

    def __init__(self, config: ServeConfig, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 engine_factory: EngineFactory, method: str, check_fits: Callable[[int, int], None],
                 metrics: ServeMetrics | None = None, learner: ReplicaLearner | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.method = method
        self.check_fits = check_fits
        self.metrics = metrics or ServeMetrics()
        self.created = int(time.time())
        self.learner = learner
        """The replica's side of the online learner (``cluster.serve_learner``), or None."""
        self.engine = EngineLoop(engine_factory, between_steps=learner.apply_pending if learner else None)
        self.tokens_out = 0
        self.finished_requests = 0
        self.waiting_requests = 0
        self.verify_steps = 0
        self.tokens_gained = 0

    @classmethod
    def from_config(cls, config: ServeConfig) -> "OpenAIService":
        """Load the target and tokenizer, build the drafter factory and the batched engine."""
        import torch

        from speculation import assets
        from speculation.drafters import resolve_methods
        from speculation.model.target import TargetModel

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        spec = resolve_methods([config.method], config.methods)[0]
        batch = batch_config(config)
        sharded = None
        if config.target_shards:
            check_shardable(config, spec)
            tokenizer = assets.load_tokenizer(config.model)
            sharded = ShardedServeTarget(config, f"graftblock-target-{os.uname().nodename}-{os.getpid()}",
                                         tokenizer)
            target = sharded.target
        else:
            model, tokenizer = assets.load_model_and_tokenizer(config.model, config.dtype.torch)
            target = TargetModel(model, tokenizer)
        try:
            service = cls._build(config, spec, batch, target, tokenizer)
        except BaseException:
            if sharded is not None:
                sharded.shutdown()
            raise
        service.sharded_target = sharded
        return service

    @classmethod
    def _build(cls, config: ServeConfig, spec: Any, batch: BatchConfig, target: Any,
               tokenizer: Any) -> "OpenAIService":
        """The drafter factory, learner, drafter worker and batched engine over ``target``."""
        from speculation.policy.cost import measure_cost_model
        from speculation.drafters import drafter_factory

        factory = None
        if spec.config is not None:
            size = spec.config.verify_curve_size()
            cost = measure_cost_model(target, max_size=size) if size else None
            if cost is not None and config.target_shards:
                target.sync()  # the batch-1 calls of the measurement, checked before serving
            # One factory per replica: its requests share the c(T) and any cross-request store.
            factory = drafter_factory(spec, target, cost)

        metrics = ServeMetrics()
        factory, learner = attach_learner(config.learner, spec.name, factory,
                                          f"{os.uname().nodename}-{os.getpid()}", metrics.registry)
        feedback = learner.hook if learner is not None else None
        supervisor = None
        if factory is not None and config.drafter_placement is DrafterPlacement.WORKER:
            if learner is not None:
                raise ConfigError("serve.drafter_placement: worker cannot be combined with an active learner yet "
                                  "(its weight swaps reach in-process drafters only); use in_process")
            supervisor = supervisor_from_config(config, target.vocab_size,
                                                lambda e: metrics.drafter_events.labels(e.value).inc())
            factory = supervised_factory(supervisor, factory)
        service = cls(config, tokenizer, target.vocab_size, target.eos_token_ids,
                      lambda: BatchEngine(target, factory, batch, feedback=feedback), spec.name, target.check_fits,
                      metrics=metrics, learner=learner)
        service.drafter_supervisor = supervisor
        return service

    # -- endpoints ----------------------------------------------------------------------------------
    def authorize(self, header: str | None) -> None:
        key = self.config.api_key
        if key is None:
            return
        if not header or not header.startswith("Bearer ") or not secrets.compare_digest(header[7:], key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           ErrorType.AUTHENTICATION, code="invalid_api_key")

    def models(self) -> dict:
        return ModelList(data=[ModelCard(id=self.config.model_name, created=self.created)]).model_dump()

    def health(self) -> tuple[int, dict]:
        """``(HTTP status, body)``: 200 while the engine runs and is not stalled, else 503."""
        body = {"status": self.engine.state.value, "model": self.config.model_name, "method": self.method,
                "live_requests": self.engine.live, "engine_steps": self.engine.steps,
                "torch_threads": torch.get_num_threads()}
        if self.learner is not None:
            body["learner"] = self.learner.status()
        if self.drafter_supervisor is not None:
            body["drafter_worker"] = {"state": self.drafter_supervisor.state.value,
                                      **dataclasses.asdict(self.drafter_supervisor.counters)}
        if self.sharded_target is not None:
            body["target_shards"] = self.sharded_target.status()
        stalled = self.engine.stalled_for()
        if stalled > self.config.stall_timeout_s:
            body["status"] = "stalled"
            body["stalled_s"] = round(stalled, 1)
        ok = body["status"] == EngineState.RUNNING.value and self.engine.alive()
        return (200 if ok else 503), body

    def check_health(self) -> None:
        """Ray Serve's health check: raise when the engine is dead or stalled (Serve restarts us)."""
        status, body = self.health()
        if status != 200 and self.engine.state != EngineState.DRAINING:
            raise RuntimeError(f"engine unhealthy: {body}")

    async def chat(self, raw: bytes) -> dict | AsyncIterator[str]:
        req = parse_request(raw, ChatCompletionRequest)
        self._check_model(req.model)
        prompt_ids = encode_chat(self.tokenizer, req.messages)
        job = self._job("chat", "chatcmpl", req, prompt_ids, "messages")
        return await self._respond(job, req.stream, self._chat_chunks, self._chat_response)

    async def completions(self, raw: bytes) -> dict | AsyncIterator[str]:
        req = parse_request(raw, CompletionRequest)
        self._check_model(req.model)
        prompt_ids = encode_prompt(self.tokenizer, req.single_prompt(), self.vocab_size)
        job = self._job("completions", "cmpl", req, prompt_ids, "prompt")
        return await self._respond(job, req.stream, self._completion_chunks, self._completion_response)

    def shutdown(self) -> bool:
        """Drain in-flight requests (bounded by ``drain_timeout_s``) and stop the engine thread."""
        drained = self.engine.stop(self.config.drain_timeout_s)
        if self.learner is not None:
            self.learner.close()
        if self.drafter_supervisor is not None:
            self.drafter_supervisor.shutdown()
        if self.sharded_target is not None:
            self.sharded_target.shutdown()
        return drained

    # -- request preparation --------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.config.model_name}' (see GET /v1/models)", ErrorType.NOT_FOUND,
                           param="model", code="model_not_found")

    def _job(self, endpoint: str, prefix: str, req: Any, prompt_ids: list[int], prompt_param: str) -> _Job:
        cfg = self.config
        if len(prompt_ids) > cfg.max_prompt_tokens:
            raise bad_request(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most "
                              f"{cfg.max_prompt_tokens}", param=prompt_param, code="context_length_exceeded")
        if not prompt_ids:
            raise bad_request("the prompt is empty", param=prompt_param)
        max_new = req.requested_max_tokens()
        if max_new is None:
            max_new = cfg.default_max_tokens
        elif max_new > cfg.max_tokens:
            raise bad_request(f"max_tokens = {max_new} is above this server's limit of {cfg.max_tokens}",
                              param="max_tokens", code="invalid_value")
        try:
            self.check_fits(len(prompt_ids), max_new)
        except ContextLengthError as exc:
            raise bad_request(str(exc), param="max_tokens", code="context_length_exceeded") from None
        bad_ids = [t for t in req.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad_request(f"stop_token_ids out of the vocabulary [0, {self.vocab_size}): {bad_ids[:5]}",
                              param="stop_token_ids")
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        try:
            sampling = SamplingConfig(temperature=float(req.temperature), top_p=float(req.top_p),
                                      top_k=int(req.top_k), seed=int(seed))
        except ConfigError as exc:
            raise bad_request(str(exc)) from None
        return _Job(endpoint, f"{prefix}-{uuid.uuid4().hex}", prompt_ids, max_new, sampling, req.stop_strings(),
                    frozenset(req.stop_token_ids), time.monotonic())

    # -- driving one request ----------------------------------------------------------------------
    async def _respond(self, job: _Job, stream: bool, chunks: Callable[..., AsyncIterator[str]],
                       whole: Callable[[_Job, _Progress], dict]) -> dict | AsyncIterator[str]:
        """Submit ``job``; the whole response, or (streaming) an SSE iterator. Errors that happen
        before the first token (admission, timeout) raise here, so they become a 4xx/5xx status."""
        gen = self._updates(job)
        try:
            first = await gen.__anext__()
        except BaseException:
            await gen.aclose()
            raise
        if stream:
            return chunks(job, first, gen)
        progress = first
        try:
            async for progress in gen:
                pass
        finally:
            await gen.aclose()
        return whole(job, progress)

    async def _updates(self, job: _Job) -> AsyncIterator[tuple[_Progress, str]]:
        """Yield ``(progress, new text)`` per engine update until the request finishes.

        The finally clause aborts the sequence whenever the request ends before the engine finished
        it (client gone, stop string, timeout, error), freeing its KV slot at once.
        """
        cfg, m = self.config, self.metrics
        sink = _Sink(asyncio.get_running_loop())
        request = Request(request_id=job.request_id, prompt_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens,
                          sampling=job.sampling, stop_token_ids=job.stop_token_ids)
        self.engine.submit(request, sink)
        m.waiting.inc()
        self.waiting_requests += 1
        state = "waiting"
        deadline = job.arrived + cfg.request_timeout_s
        p = _Progress()
        decoder = IncrementalDecoder(self.tokenizer)  # O(new tokens) per step, not a full re-decode
        emitted = 0
        outcome = "error"
        last_t = None
        engine_done = False
        hold = max((len(s) for s in job.stop_strings), default=1) - 1
        try:
            while p.finish is None:
                item = await self._next(sink, deadline)
                if isinstance(item, BaseException):
                    raise self._as_api_error(item)
                now = time.monotonic()
                if state == "waiting":
                    m.waiting.dec()
                    self.waiting_requests -= 1
                    m.running.inc()
                    m.prompt_tokens.inc(len(job.prompt_ids))
                    state = "running"
                self._account(p, item, now, last_t, job)
                if item.new_tokens:
                    last_t = now
                if item.finished is not None:
                    engine_done = True
                    p.finish = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop",
                                FinishReason.ABORT: "abort"}[item.finished]
                # A final EOS / stop token is not part of the text (OpenAI's convention).
                new = item.new_tokens[:-1] if item.finished == FinishReason.STOP else item.new_tokens
                decoder.push(list(new))
                if item.finished is not None:
                    decoder.flush()
                text = decoder.text
                cut = self._find_stop(text, job.stop_strings, max(0, emitted - hold))
                if cut is not None:
                    text, p.finish = text[:cut], "stop"
                p.text = text
                ready = len(text) if p.finish is not None else self._stable_len(text, hold)
                if p.finish is not None:
                    outcome = p.finish  # set before the last yield: the consumer may close us there
                if ready > emitted or p.finish is not None:
                    delta = text[emitted:ready]
                    emitted = max(emitted, ready)
                    yield p, delta
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except APIError as exc:
            outcome = exc.type.value
            raise
        finally:
            if state == "waiting":
                m.waiting.dec()
                self.waiting_requests -= 1
            else:
                m.running.dec()
            if not engine_done:
                self.engine.abort(job.request_id)
            m.requests.labels(job.endpoint, outcome or "error").inc()
            if outcome in ("stop", "length"):
                m.e2e.observe(time.monotonic() - job.arrived)
                self.finished_requests += 1

    async def _next(self, sink: _Sink, deadline: float) -> SequenceUpdate | BaseException:
        """The next item for this request, waiting in slices so a dead or stalled engine and the
        request deadline are noticed."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, f"the request did not finish within request_timeout_s = "
                               f"{self.config.request_timeout_s:g} s", ErrorType.TIMEOUT, code="timeout")
            try:
                return await asyncio.wait_for(sink.queue.get(), timeout=min(remaining, _POLL_S))
            except TimeoutError:
                pass
            if not self.engine.alive() and sink.queue.empty():
                raise APIError(500, f"the engine is not running ({self.engine.state.value}: {self.engine.error})",
                               ErrorType.SERVER, code="engine_failed")
            stalled = self.engine.stalled_for()
            if stalled > self.config.stall_timeout_s:
                raise APIError(503, f"the engine has been stuck in one step for {stalled:.0f} s "
                               f"(stall_timeout_s = {self.config.stall_timeout_s:g})", ErrorType.SERVER,
                               code="engine_stalled")

    def _account(self, p: _Progress, u: SequenceUpdate, now: float, last_t: float | None, job: _Job) -> None:
        m = self.metrics
        n = len(u.new_tokens)
        if n:
            if not p.ids:
                m.ttft.observe(now - job.arrived)
            elif last_t is not None:
                per = (now - last_t) / n
                for _ in range(n):
                    m.itl.observe(per)
            p.ids.extend(u.new_tokens)
            m.generation_tokens.labels(self.method).inc(n)
            self.tokens_out += n
        if u.step is not None:
            self.verify_steps += 1
            self.tokens_gained += u.step.tokens_gained
            p.steps += 1
            p.gained += u.step.tokens_gained
            p.accepted += u.step.accepted
            p.drafted += u.step.drafted
            p.fallback_steps += int(u.step.stats.get(FALLBACK_STAT, 0))
            p.rebuilds += int(u.step.stats.get(REBUILD_STAT, 0))
            m.acceptance.labels(self.method).observe(u.step.tokens_gained)
            m.accepted.labels(self.method).inc(u.step.accepted)
            m.drafted.labels(self.method).inc(u.step.drafted)

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _stable_len(text: str, hold: int) -> int:
        """Characters safe to stream: hold back a possible stop-string prefix and a cut UTF-8 char."""
        n = len(text) - hold
        while n > 0 and text[n - 1] == "\ufffd":
            n -= 1
        return max(n, 0)

    def _as_api_error(self, exc: BaseException) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, AdmissionError):
            return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
        if isinstance(exc, QueueFullError):
            return APIError(503, str(exc), ErrorType.OVERLOADED, code="queue_full")
        if isinstance(exc, ShutdownAbort):
            return APIError(503, str(exc), ErrorType.OVERLOADED, code="shutting_down")
        if isinstance(exc, EngineFailure):
            return APIError(500, str(exc), ErrorType.SERVER, code="engine_failed")
        if isinstance(exc, ValueError):
            return bad_request(str(exc))
        return APIError(500, f"{type(exc).__name__}: {exc}", ErrorType.SERVER)

    # -- response shapes ----------------------------------------------------------------------------
    def _usage(self, job: _Job, p: _Progress) -> Usage:
        return Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=len(p.ids),
                     total_tokens=len(job.prompt_ids) + len(p.ids))

    def _stats(self, p: _Progress) -> SpecStats:
        tau = p.gained / p.steps if p.steps else 1.0
        sup = self.drafter_supervisor
        if sup is not None:
            return WorkerSpecStats(method=self.method, tau=tau, accepted_tokens=p.accepted, drafted_tokens=p.drafted,
                                   verify_steps=p.steps, drafter_fallback_steps=p.fallback_steps,
                                   drafter_rebuilds=p.rebuilds, drafter_worker_restarts=sup.counters.restarts)
        return SpecStats(method=self.method, tau=tau, accepted_tokens=p.accepted, drafted_tokens=p.drafted,
                         verify_steps=p.steps)

    @staticmethod
    def _reason(p: _Progress) -> str:
        return "stop" if p.finish == "abort" else (p.finish or "stop")

    def _chat_response(self, job: _Job, first: tuple[_Progress, str]) -> dict:
        p = first[0]
        return ChatCompletionResponse(
            id=job.request_id, created=int(time.time()), model=self.config.model_name,
            choices=[ChatChoice(message=ChatMessageOut(content=p.text), finish_reason=self._reason(p))],
            usage=self._usage(job, p), graftblock=self._stats(p)).model_dump(serialize_as_any=True)

    def _completion_response(self, job: _Job, first: tuple[_Progress, str]) -> dict:
        p = first[0]
        return CompletionResponse(
            id=job.request_id, created=int(time.time()), model=self.config.model_name,
            choices=[CompletionChoice(text=p.text, finish_reason=self._reason(p))],
            usage=self._usage(job, p), graftblock=self._stats(p)).model_dump(serialize_as_any=True)

    async def _chat_chunks(self, job: _Job, first: tuple[_Progress, str],
                           rest: AsyncIterator[tuple[_Progress, str]]) -> AsyncIterator[str]:
        created, model = int(time.time()), self.config.model_name

        def chunk(delta: ChatDelta, p: _Progress | None) -> str:
            c = ChatCompletionChunk(
                id=job.request_id, created=created, model=model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=self._reason(p) if p else None)],
                usage=self._usage(job, p) if p else None, graftblock=self._stats(p) if p else None)
            return _sse(c.model_dump(exclude_none=True, serialize_as_any=True))

        yield chunk(ChatDelta(role="assistant", content=""), None)
        async for text in self._sse_body(first, rest, lambda d: chunk(ChatDelta(content=d), None),
                                         lambda p, d: chunk(ChatDelta(content=d), p)):
            yield text

    async def _completion_chunks(self, job: _Job, first: tuple[_Progress, str],
                                 rest: AsyncIterator[tuple[_Progress, str]]) -> AsyncIterator[str]:
        created, model = int(time.time()), self.config.model_name

        def chunk(delta: str, p: _Progress | None) -> str:
            c = CompletionResponse(
                id=job.request_id, created=created, model=model,
                choices=[CompletionChoice(text=delta, finish_reason=self._reason(p) if p else None)],
                usage=self._usage(job, p) if p else None, graftblock=self._stats(p) if p else None)
            return _sse(c.model_dump(exclude_none=True, serialize_as_any=True))

        async for text in self._sse_body(first, rest, lambda d: chunk(d, None), lambda p, d: chunk(d, p)):
            yield text

    async def _sse_body(self, first: tuple[_Progress, str], rest: AsyncIterator[tuple[_Progress, str]],
                        middle: Callable[[str], str], last: Callable[[_Progress, str], str]) -> AsyncIterator[str]:
        """Content chunks, a final chunk with finish_reason + usage + stats, then ``[DONE]``; an error
        after the first token becomes an error event (the status line was already sent)."""
        try:
            item = first
            while True:
                p, delta = item
                if p.finish is not None:
                    yield last(p, delta)
                    break
                if delta:
                    yield middle(delta)
                item = await rest.__anext__()
        except APIError as exc:
            yield _sse(exc.body())
        except Exception as exc:  # headers are sent: report it in the stream instead of cutting it
            log.exception("streaming response failed")
            yield _sse(APIError(500, f"{type(exc).__name__}: {exc}", ErrorType.SERVER).body())
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def batch_config(config: ServeConfig) -> BatchConfig:
    """The engine's :class:`BatchConfig`: ``max_sequences`` and, unless ``batch`` sets it, KV rows per
    slot for the longest prompt + ``max_tokens`` + one tree."""
    opts = dict(config.batch)
    opts["max_sequences"] = config.max_sequences
    if "max_tokens_per_sequence" not in opts:
        tree = opts.get("max_tree_tokens", BatchConfig.max_tree_tokens)
        opts["max_tokens_per_sequence"] = config.max_prompt_tokens + config.max_tokens + int(tree)
    return from_dict(BatchConfig, opts, where="serve.batch")


# --------------------------------------------------------------------------- serving run
class _RunReporter:
    """Logs the replica's periodic metrics to its MLflow serving run from a small daemon thread."""

    def __init__(self, service: OpenAIService, config: ServeConfig, replica: str) -> None:
        from tracking.serving import ServingRun

        self.service, self.config = service, config
        self.run = ServingRun.open(config.experiment, config.tracking_uri, config.to_dict(), replica,
                                   run_name=f"serve-{replica}")
        self._stop = threading.Event()
        self._step = 0
        self._last = (time.monotonic(), 0)
        self._thread = threading.Thread(target=self._loop, name="graftblock-mlflow", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        s = self.service
        now, tokens = time.monotonic(), s.tokens_out
        dt = max(now - self._last[0], 1e-9)
        out = {"tokens_per_s": (tokens - self._last[1]) / dt, "live_requests": float(s.engine.live),
               "waiting_requests": float(s.waiting_requests),
               "finished_requests": float(s.finished_requests), "generated_tokens": float(tokens)}
        if s.verify_steps:
            out[f"{s.method}.tau"] = s.tokens_gained / s.verify_steps
        if s.learner is not None:
            out.update(s.learner.sample())
        self._last = (now, tokens)
        return out

    def _log_decisions(self) -> None:
        """Every learner decision as ``learner.<metric>`` (and ``learner.outcome.<name>`` = 1) at
        step = its index among the replica's decisions."""
        if self.service.learner is None:
            return
        for index, d in self.service.learner.take_decisions():
            self.run.log({**{f"learner.{k}": v for k, v in d.metrics().items()},
                          f"learner.outcome.{d.outcome.value}": 1.0}, index)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.metrics_interval_s):
            self._log()

    def _log(self) -> None:
        try:
            self.run.log(self.sample(), self._step)
            self._step += 1
            self._log_decisions()
        except Exception:  # a tracking hiccup must not take serving down; it is logged
            log.exception("could not log serving metrics to MLflow")

    def finish(self, failed: bool) -> None:
        from tracking.runs import RunStatus

        self._stop.set()
        self._thread.join(timeout=5.0)
        self._log()
        self.run.finish(RunStatus.FAILED if failed else RunStatus.FINISHED)


# --------------------------------------------------------------------------- the Ray Serve app
DEPLOYMENT_NAME = "graftblock"

api = FastAPI(title="graftblock", docs_url=None, redoc_url=None, openapi_url=None)
"""The ingress app: routes are :class:`GraftblockServer`'s methods; other paths get OpenAI error bodies."""


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(exc.status_code, str(exc.detail),
                   ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST)
    return JSONResponse(err.body(), status_code=exc.status_code)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _run_endpoint(service: OpenAIService, request: HTTPRequest,
                        handler: Callable[[bytes], Awaitable[dict | AsyncIterator[str]]]) -> Response:
    try:
        service.authorize(request.headers.get("authorization"))
        result = await handler(await request.body())
    except APIError as exc:
        return _error_response(exc)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@serve.deployment(name=DEPLOYMENT_NAME, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=10.0,
                  health_check_timeout_s=30.0, max_constructor_retry_count=3)
@serve.ingress(api)
class GraftblockServer:
    """One replica: an :class:`OpenAIService` (engine thread, metrics) and its MLflow serving run."""

    def __init__(self, config_dict: dict[str, Any]) -> None:
        cfg = serve_config_from_dict(config_dict)
        self.service = OpenAIService.from_config(cfg)
        self.reporter: _RunReporter | None = None
        self._closed = False
        if cfg.mlflow:
            replica = f"{os.uname().nodename}-{os.getpid()}"
            self.reporter = _RunReporter(self.service, cfg, replica)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await _run_endpoint(self.service, request, self.service.chat)

    @api.post("/v1/completions")
    async def completions(self, request: HTTPRequest) -> Response:
        return await _run_endpoint(self.service, request, self.service.completions)

    @api.get("/v1/models")
    async def models(self, request: HTTPRequest) -> Response:
        try:
            self.service.authorize(request.headers.get("authorization"))
        except APIError as exc:
            return _error_response(exc)
        return JSONResponse(self.service.models())

    @api.get("/health")
    async def health(self) -> Response:
        status, body = self.service.health()
        return JSONResponse(body, status_code=status)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return Response(self.service.metrics.render(), media_type="text/plain; version=0.0.4")

    def check_health(self) -> None:
        self.service.check_health()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Drain (bounded), stop the engine, end the serving run FINISHED (FAILED if the engine died)."""
        if self._closed:
            return
        self._closed = True
        drained = self.service.shutdown()
        if self.reporter is not None:
            self.reporter.finish(failed=self.service.engine.state == EngineState.FAILED)
        log.info("graftblock replica stopped (drained in time: %s)", drained)


def build_app(config: ServeConfig):
    """The Ray Serve application for ``config``: ``config.num_replicas`` replicas of :class:`GraftblockServer`."""
    return GraftblockServer.options(
        num_replicas=config.num_replicas,
        ray_actor_options=config.ray_actor_options(),
        max_ongoing_requests=config.max_ongoing_requests,
        graceful_shutdown_timeout_s=config.drain_timeout_s + 15.0,
    ).bind(config.replica_dict())
