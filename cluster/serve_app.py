"""The serving application: a Ray Serve deployment with an OpenAI-compatible FastAPI ingress.

One replica is a :class:`GraftblockServer`: its request path is an
:class:`~cluster.openai_service.OpenAIService`, whose :class:`~cluster.engine_loop.EngineLoop`
thread owns the batched engine; its metrics and MLflow serving run are in
``cluster.serve_metrics``. This module holds only the HTTP side: the routes, the OpenAI error
bodies for unknown paths, and :func:`build_app` (``serve.run(build_app(config))``).
"""

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine_loop import EngineState
from cluster.openai_api import APIError, ErrorType
from cluster.openai_service import OpenAIService
from cluster.serve_config import ServeConfig, serve_config_from_dict
from cluster.serve_metrics import ServingReporter

log = logging.getLogger("graftblock.serve")


DEPLOYMENT_NAME = "graftblock"

api = FastAPI(title="graftblock", docs_url=None, redoc_url=None, openapi_url=None)
"""The ingress app: routes are :class:`GraftblockServer`'s methods; other paths get OpenAI error bodies."""


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(exc.status_code, str(exc.detail),
                   ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST)
    return JSONResponse(err.body(), status_code=exc.status_code)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


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
        self.reporter: ServingReporter | None = None
        self._closed = False
        if cfg.mlflow:
            replica = f"{os.uname().nodename}-{os.getpid()}"
            self.reporter = ServingReporter(self.service, cfg, replica)

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
    async def metrics(self, request: HTTPRequest) -> Response:
        """Prometheus text; with ``api_key`` set it needs the same bearer key as ``/v1`` (scrapers send
        it with ``authorization: {credentials: ...}``). ``/health`` stays open for probes."""
        try:
            self.service.authorize(request.headers.get("authorization"))
        except APIError as exc:
            return _error_response(exc)
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
