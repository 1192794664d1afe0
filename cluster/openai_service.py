"""The request path of one serving replica, independent of the HTTP framework.

:class:`OpenAIService` validates a request (``cluster.openai_api``), encodes the prompt (chat
template), submits it to the replica's :class:`~cluster.engine_loop.EngineLoop`, and turns the
engine's updates into a response or SSE chunks (``data: {...}``, ending ``data: [DONE]``). Every
wait on the engine thread has a timeout: the request deadline (``request_timeout_s``), a step
running past ``stall_timeout_s``, or a dead engine thread each become a clear error body, never a
hung connection. A request that ends early (client disconnect: the handler is cancelled; a stop
string) aborts its sequence, which frees its KV slot at once.

* Drafter placement (``drafter_placement: worker``): the per-sequence drafters live in one
  ``DrafterWorker`` actor behind ``cluster.resilient_drafter`` proxies; a dead or hung worker turns
  the affected steps into steps without speculation (never a wrong token, never a hung request),
  the worker is restarted and each sequence's drafter is rebuilt from its committed tokens.
* Learner (``cluster.serve_learner``): the engine's feedback hook ships one record per verify
  step to the shared learner actor (bounded, dropped rather than waited for); published weights
  are swapped into the replica's drafters by the engine thread between two steps.
"""

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from cluster.backend import ShardTimeoutError
from cluster.batch_backend import ShardLostError
from cluster.detokenize import IncrementalDecoder
from cluster.engine_loop import (POLL_S, EngineFactory, EngineFailure, EngineLoop, EngineState, ShutdownAbort,
                                 UpdateSink)
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
from cluster.openapi import openapi_schema
from cluster.resilient_drafter import (FALLBACK_STAT, REBUILD_STAT, DrafterWorkerSupervisor, supervised_factory,
                                       supervisor_from_config)
from cluster.serve_config import DrafterPlacement, ServeConfig
from cluster.serve_learner import ReplicaLearner, attach_learner
from cluster.serve_metrics import ServeMetrics
from cluster.serve_shards import ShardedServeTarget, check_shardable
from speculation import assets
from speculation.config import BatchConfig, ConfigError, SamplingConfig, from_dict
from speculation.drafters import drafter_factory, resolve_methods
from speculation.engine.batch import AdmissionError, BatchEngine, QueueFullError, Request, SequenceUpdate
from speculation.engine.sequence import FinishReason
from speculation.model.target import ContextLengthError, TargetModel
from speculation.policy.cost import measure_cost_model

log = logging.getLogger("graftblock.serve")


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
        self._openapi: dict | None = None

    @classmethod
    def from_config(cls, config: ServeConfig) -> "OpenAIService":
        """Load the target and tokenizer, build the drafter factory and the batched engine."""
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

    def openapi(self) -> dict:
        """The OpenAPI document of the routes, narrowed by this replica's limits (``cluster.openapi``)."""
        if self._openapi is None:
            self._openapi = openapi_schema(self.config.model_name, self.config.max_tokens, self.vocab_size,
                                           api_key_required=self.config.api_key is not None)
        return self._openapi

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
        sink = UpdateSink(asyncio.get_running_loop())
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

    async def _next(self, sink: UpdateSink, deadline: float) -> SequenceUpdate | BaseException:
        """The next item for this request, waiting in slices so a dead or stalled engine and the
        request deadline are noticed."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APIError(504, f"the request did not finish within request_timeout_s = "
                               f"{self.config.request_timeout_s:g} s", ErrorType.TIMEOUT, code="timeout")
            try:
                return await asyncio.wait_for(sink.queue.get(), timeout=min(remaining, POLL_S))
            except TimeoutError:
                pass
            if not self.engine.alive() and sink.queue.empty():
                raise self._engine_failed(f"the engine is not running ({self.engine.state.value}: "
                                          f"{self.engine.error})", self.engine.error)
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

    def _engine_failed(self, message: str, cause: BaseException | None) -> APIError:
        """The error for a request whose engine thread died of ``cause``.

        A lost target shard (Ray did not re-place it within ``shard_restart_timeout_s``, or it kept
        failing) is a transient loss of capacity: 503 ``shard_unavailable`` with ``Retry-After``, as
        for a lost replica; the replica restarts once the shard can be placed again. Any other
        cause is a server bug: 500 ``engine_failed``."""
        if isinstance(cause, (ShardLostError, ShardTimeoutError)):
            return APIError(503, message, ErrorType.OVERLOADED, code="shard_unavailable",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        return APIError(500, message, ErrorType.SERVER, code="engine_failed")

    def _as_api_error(self, exc: BaseException) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, AdmissionError):
            return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
        if isinstance(exc, QueueFullError):
            return APIError(429, str(exc), ErrorType.RATE_LIMIT, code="queue_full",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        if isinstance(exc, ShutdownAbort):
            return APIError(503, str(exc), ErrorType.OVERLOADED, code="shutting_down")
        if isinstance(exc, EngineFailure):
            return self._engine_failed(str(exc), exc.__cause__)
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
            return sse_event(c.model_dump(exclude_none=True, serialize_as_any=True))

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
            return sse_event(c.model_dump(exclude_none=True, serialize_as_any=True))

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
            yield sse_event(exc.body())
        except Exception as exc:  # headers are sent: report it in the stream instead of cutting it
            log.exception("streaming response failed")
            yield sse_event(APIError(500, f"{type(exc).__name__}: {exc}", ErrorType.SERVER).body())
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    """One server-sent event whose data is ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def batch_config(config: ServeConfig) -> BatchConfig:
    """The engine's :class:`BatchConfig`: ``max_sequences`` and, unless ``batch`` sets it, KV rows per
    slot for the longest prompt + ``max_tokens`` + one tree."""
    opts = dict(config.batch)
    opts["max_sequences"] = config.max_sequences
    opts["max_waiting"] = config.max_waiting
    if "max_tokens_per_sequence" not in opts:
        tree = opts.get("max_tree_tokens", BatchConfig.max_tree_tokens)
        opts["max_tokens_per_sequence"] = config.max_prompt_tokens + config.max_tokens + int(tree)
    return from_dict(BatchConfig, opts, where="serve.batch")
