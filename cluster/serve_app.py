"""The serving application: an OpenAI-compatible FastAPI router in front of the engine replicas.

Two deployments (:func:`build_app`, ``serve.run(build_app(config))``):

- :class:`GraftblockRouter`, the HTTP ingress: one replica on the head node, no CPU reserved. It
  forwards each request to an engine replica through a deployment handle and relays the reply.
  When the engine replica is lost (its node died, its actor was killed) before the reply started,
  it retries on another replica (``serve.replica_retries``), and answers an OpenAI 503 body
  (``code: replica_unavailable``) when none is left; a stream cut after its first chunk ends with
  an OpenAI error event (``code: replica_lost``) and ``[DONE]``. Without the router, Ray Serve's
  proxy would answer its own plain-text 500.
- :class:`GraftblockServer`, the engine replicas (``num_replicas``): each one's request path is an
  :class:`~cluster.openai_service.OpenAIService`, whose :class:`~cluster.engine_loop.EngineLoop`
  thread owns the batched engine; its metrics and MLflow serving run are in ``cluster.serve_metrics``.

``/health`` is a replica's engine state plus ``replicas`` (running / target, from the Serve
controller): ``status`` becomes ``degraded`` while fewer replicas run than configured.
"""

import asyncio
import dataclasses
import enum
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine_loop import EngineState
from cluster.openai_api import APIError, ErrorType
from cluster.openai_service import OpenAIService, sse_event
from cluster.serve_config import ServeConfig, serve_config_from_dict
from cluster.serve_metrics import ServingReporter

log = logging.getLogger("graftblock.serve")


DEPLOYMENT_NAME = "graftblock"
"""The engine replicas' deployment."""
ROUTER_NAME = "graftblock-router"
"""The HTTP ingress deployment (one replica on the head node)."""
HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node only: the router goes where the HTTP proxy (``HeadOnly``) is."""

REPLICA_LOST: tuple[type[BaseException], ...] = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
"""What a handle call raises when the engine replica it went to is gone (node lost, actor killed);
``RayActorError`` covers ``ActorDiedError`` and ``ActorUnavailableError``."""

api = FastAPI(title="graftblock", docs_url=None, redoc_url=None, openapi_url=None)
"""The ingress app: routes are :class:`GraftblockRouter`'s methods; other paths get OpenAI error bodies."""


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(exc.status_code, str(exc.detail),
                   ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST)
    return JSONResponse(err.body(), status_code=exc.status_code)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


class Endpoint(str, enum.Enum):
    """What the router asks an engine replica for."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MODELS = "models"
    HEALTH = "health"
    METRICS = "metrics"
    OPENAPI = "openapi"


@dataclasses.dataclass(frozen=True)
class Reply:
    """An engine replica's answer, before the HTTP layer: a JSON body or a text body (``media_type``),
    or, with ``stream``, the head of a server-sent event stream whose chunks follow."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    media_type: str = "application/json"
    stream: bool = False

    @classmethod
    def error(cls, exc: APIError) -> "Reply":
        return cls(exc.status, exc.body(), dict(exc.headers))

    def response(self) -> Response:
        if self.media_type == "application/json":
            return JSONResponse(self.body, status_code=self.status, headers=self.headers or None)
        return Response(self.body, status_code=self.status, media_type=self.media_type, headers=self.headers or None)


def _lost(message: str, code: str) -> APIError:
    return APIError(503, message, ErrorType.OVERLOADED, code=code, headers={"Retry-After": "1"})


@serve.deployment(name=DEPLOYMENT_NAME, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=10.0,
                  health_check_timeout_s=30.0, max_constructor_retry_count=3)
class GraftblockServer:
    """One engine replica: an :class:`OpenAIService` (engine thread, metrics) and its MLflow serving run."""

    def __init__(self, config_dict: dict[str, Any]) -> None:
        cfg = serve_config_from_dict(config_dict)
        self.service = OpenAIService.from_config(cfg)
        self.reporter: ServingReporter | None = None
        self._closed = False
        if cfg.mlflow:
            replica = f"{os.uname().nodename}-{os.getpid()}"
            self.reporter = ServingReporter(self.service, cfg, replica)

    async def generate(self, endpoint: Endpoint, raw: bytes, authorization: str | None) -> AsyncIterator[Any]:
        """A completion (``endpoint`` chat or completions): one :class:`Reply`, then, if it streams, its
        SSE chunks (``str``). Called with ``stream=True`` by the router."""
        handler: Callable[[bytes], Awaitable[dict | AsyncIterator[str]]] = (
            self.service.chat if Endpoint(endpoint) is Endpoint.CHAT else self.service.completions)
        try:
            self.service.authorize(authorization)
            result = await handler(raw)
        except APIError as exc:
            yield Reply.error(exc)
            return
        if isinstance(result, dict):
            yield Reply(body=result)
            return
        yield Reply(stream=True, media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for chunk in result:
            yield chunk

    async def get(self, endpoint: Endpoint, authorization: str | None) -> Reply:
        """``/v1/models``, ``/health``, ``/metrics`` or ``/openapi.json`` of this replica."""
        endpoint = Endpoint(endpoint)
        if endpoint is Endpoint.HEALTH:
            status, body = self.service.health()
            return Reply(status, body)
        if endpoint is Endpoint.OPENAPI:
            return Reply(body=self.service.openapi())
        try:
            self.service.authorize(authorization)
        except APIError as exc:
            return Reply.error(exc)
        if endpoint is Endpoint.MODELS:
            return Reply(body=self.service.models())
        if endpoint is Endpoint.METRICS:
            # Prometheus text; with ``api_key`` set it needs the same bearer key as ``/v1`` (scrapers send
            # it with ``authorization: {credentials: ...}``). ``/health`` stays open for probes.
            return Reply(body=self.service.metrics.render(), media_type="text/plain; version=0.0.4")
        raise ValueError(f"GraftblockServer.get: {endpoint} is a generating endpoint")

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


@dataclasses.dataclass
class RouterCounters:
    """What the router did about lost engine replicas (``/health``'s ``router``)."""

    retried: int = 0
    """Requests re-sent because their replica was lost before it answered."""
    lost_streams: int = 0
    """Streams cut by a lost replica after their first chunk (ended with a ``replica_lost`` event)."""
    unavailable: int = 0
    """Requests answered 503 ``replica_unavailable`` (every try went to a lost replica)."""


@serve.deployment(name=ROUTER_NAME, graceful_shutdown_wait_loop_s=0.5, max_constructor_retry_count=3)
@serve.ingress(api)
class GraftblockRouter:
    """The HTTP ingress: forwards to an engine replica, retries a lost one, answers OpenAI bodies."""

    def __init__(self, engine: DeploymentHandle, replica_retries: int, num_replicas: int) -> None:
        self.engine = engine
        self.replica_retries = replica_retries
        self.num_replicas = num_replicas
        self.counters = RouterCounters()

    # -- routes ----------------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(Endpoint.CHAT, request)

    @api.post("/v1/completions")
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(Endpoint.COMPLETIONS, request)

    @api.get("/v1/models")
    async def models(self, request: HTTPRequest) -> Response:
        return (await self._get(Endpoint.MODELS, request)).response()

    @api.get("/openapi.json")
    async def openapi(self, request: HTTPRequest) -> Response:
        """The OpenAPI document of the routes (``cluster.openapi``); open, like ``/health``."""
        return (await self._get(Endpoint.OPENAPI, request)).response()

    @api.get("/metrics")
    async def metrics(self, request: HTTPRequest) -> Response:
        """One engine replica's Prometheus text (each replica counts its own requests)."""
        return (await self._get(Endpoint.METRICS, request)).response()

    @api.get("/health")
    async def health(self, request: HTTPRequest) -> Response:
        """A replica's engine state, plus ``replicas``: running and target counts from the controller."""
        reply = await self._get(Endpoint.HEALTH, request)
        body = dict(reply.body) if isinstance(reply.body, dict) else {"error": reply.body}
        running = await asyncio.to_thread(self._running_replicas)  # a controller RPC: off the event loop
        body["replicas"] = {"running": running, "target": self.num_replicas}
        body["router"] = dataclasses.asdict(self.counters)
        status = reply.status
        if status == 200 and running is not None and running < self.num_replicas:
            body["status"] = "degraded"  # still serving, on fewer replicas than configured
        if reply.status != 200 and "status" not in body:
            body["status"] = "unavailable"
        return JSONResponse(body, status_code=status)

    # -- forwarding --------------------------------------------------------------------------------
    async def _get(self, endpoint: Endpoint, request: HTTPRequest) -> Reply:
        auth = request.headers.get("authorization")
        for attempt in range(self.replica_retries + 1):
            try:
                return await self.engine.get.remote(endpoint, auth)
            except REPLICA_LOST as exc:
                log.warning("engine replica lost answering %s (attempt %d): %s", endpoint.value, attempt + 1,
                            type(exc).__name__)
                self.counters.retried += attempt < self.replica_retries
            except Exception as exc:  # a replica bug: still an OpenAI body
                log.exception("engine replica failed answering %s", endpoint.value)
                return Reply.error(APIError(500, f"{type(exc).__name__}: {exc}"[:500], ErrorType.SERVER))
        self.counters.unavailable += 1
        return Reply.error(_lost("no engine replica answered; retry shortly", "replica_unavailable"))

    async def _generate(self, endpoint: Endpoint, request: HTTPRequest) -> Response:
        raw, auth = await request.body(), request.headers.get("authorization")
        for attempt in range(self.replica_retries + 1):
            gen = self.engine.options(stream=True).generate.remote(endpoint, raw, auth)
            try:
                head: Reply = await gen.__anext__()
            except REPLICA_LOST as exc:
                # Nothing was sent to the client yet: the request can go to another replica as is.
                log.warning("engine replica lost before %s answered (attempt %d): %s", endpoint.value,
                            attempt + 1, type(exc).__name__)
                self.counters.retried += attempt < self.replica_retries
                continue
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as exc:  # a replica bug: still an OpenAI body, never the framework's 500 page
                log.exception("engine replica failed answering %s", endpoint.value)
                return _error_response(APIError(500, f"{type(exc).__name__}: {exc}"[:500], ErrorType.SERVER))
            if not head.stream:
                return head.response()
            return StreamingResponse(self._relay(gen), status_code=head.status, media_type=head.media_type,
                                     headers=head.headers)
        self.counters.unavailable += 1
        return _error_response(_lost(f"the engine replica serving this request was lost {self.replica_retries + 1} "
                                     "time(s); retry shortly", "replica_unavailable"))

    async def _relay(self, gen: Any) -> AsyncIterator[str]:
        """The replica's SSE chunks; a replica lost mid-stream ends the stream with an OpenAI error event.
        A client that disconnects cancels the replica's generator (which aborts the sequence)."""
        finished = False
        try:
            async for chunk in gen:
                yield chunk
            finished = True
        except REPLICA_LOST as exc:
            log.warning("engine replica lost mid-stream: %s", type(exc).__name__)
            self.counters.lost_streams += 1
            yield sse_event(_lost("the engine replica serving this stream was lost; retry the request",
                             "replica_lost").body())
            yield "data: [DONE]\n\n"
            finished = True
        except Exception as exc:  # headers are sent: report it in the stream instead of cutting it
            log.exception("relaying a stream failed")
            yield sse_event(APIError(500, f"{type(exc).__name__}: {exc}"[:500], ErrorType.SERVER).body())
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                gen.cancel()

    def _running_replicas(self) -> int | None:
        try:
            app = serve.get_replica_context().app_name
            deployment = serve.status().applications[app].deployments[DEPLOYMENT_NAME]
        except Exception:  # noqa: BLE001 - the controller unreachable: health must still answer
            log.exception("could not read the engine replicas' state from the Serve controller")
            return None
        return int(deployment.replica_states.get("RUNNING", 0))


def build_app(config: ServeConfig):
    """The Ray Serve application for ``config``: the router and ``config.num_replicas`` engine replicas."""
    engine = GraftblockServer.options(
        num_replicas=config.num_replicas,
        ray_actor_options=config.ray_actor_options(),
        max_ongoing_requests=config.max_ongoing_requests,
        graceful_shutdown_timeout_s=config.drain_timeout_s + 15.0,
    ).bind(config.replica_dict())
    return GraftblockRouter.options(
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=config.max_ongoing_requests * config.num_replicas + config.num_replicas,
        graceful_shutdown_timeout_s=config.drain_timeout_s + 20.0,
    ).bind(engine, config.replica_retries, config.num_replicas)
