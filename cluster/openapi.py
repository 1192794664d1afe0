"""The server's OpenAPI 3.1 document, built from the request/response models of ``cluster.openai_api``.

The routes read their bodies themselves (so that every error is an OpenAI error body, not FastAPI's),
which leaves FastAPI's own generated schema without request bodies. This module writes the document
the routes actually implement, from the same pydantic models that validate the requests, and narrows
it by the replica's config so that a schema-valid request is one the server accepts:

- ``model`` is the served model name (an other name is a 404, not a schema case);
- ``max_tokens`` / ``max_completion_tokens`` lie in ``[1, config.max_tokens]``;
- token ids (``prompt`` as ids, ``stop_token_ids``) lie in ``[0, vocab_size)``.

What the schema cannot express (a prompt longer than ``max_prompt_tokens`` once tokenized, a prompt
plus ``max_tokens`` past the model's context, an unsupported OpenAI field set to a non-neutral
value) is a documented 400. ``GET /openapi.json`` serves the document without a key: it holds no
secret, and a client (or ``benchmarks/fuzz_api.py``) needs it before it has one.
"""

from __future__ import annotations

import copy
from typing import Any

from cluster.openai_api import (
    UNSUPPORTED_DEFAULTS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)

OPENAPI_VERSION = "3.1.0"
SCHEMAS_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
"""OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

_ERROR_STATUSES: dict[str, str] = {
    "400": "Invalid request: the body names the parameter (``error.param``)",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "429": "The admission queue is full (``Retry-After`` says when to retry)",
    "503": "The engine is draining, stalled or its replica is gone",
    "504": "The request did not finish within ``request_timeout_s``",
}


def _model_schemas(models: list[type]) -> dict[str, Any]:
    """JSON schemas of ``models`` with their nested definitions hoisted into ``components.schemas``."""
    out: dict[str, Any] = {}
    for m in models:
        schema = m.model_json_schema(ref_template=SCHEMAS_REF)
        for name, sub in schema.pop("$defs", {}).items():
            out[name] = sub
        out[m.__name__] = schema
    return out


def _narrow_int(prop: dict[str, Any], low: int, high: int) -> None:
    """Set ``[low, high]`` bounds on an integer (or ``integer | null``) property in place."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["minimum"], branch["maximum"] = low, high
            branch.pop("exclusiveMinimum", None)
            branch.pop("exclusiveMaximum", None)


def _token_ids(items: dict[str, Any], vocab_size: int) -> None:
    """Bound every ``integer`` (also inside arrays and unions) of a token-id property to the vocabulary."""
    if items.get("type") == "integer":
        items["minimum"], items["maximum"] = 0, vocab_size - 1
    for key in ("anyOf", "oneOf"):
        for branch in items.get(key, []):
            _token_ids(branch, vocab_size)
    if isinstance(items.get("items"), dict):
        _token_ids(items["items"], vocab_size)


def _narrow_request(schema: dict[str, Any], model_name: str, max_tokens: int, vocab_size: int) -> None:
    props = schema["properties"]
    props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            _narrow_int(props[name], 1, max_tokens)
    _token_ids(props["stop_token_ids"], vocab_size)
    stop = {"type": "string", "minLength": 1}
    props["stop"] = {"title": "Stop", "anyOf": [stop, {"type": "array", "items": stop, "maxItems": 4}, {"type": "null"}]}
    for name, neutral in UNSUPPORTED_DEFAULTS.items():  # accepted only at the value that changes nothing
        if name in props:
            original = props[name]
            nullable = neutral is None or not original.get("type") or any(
                b.get("type") == "null" for b in original.get("anyOf", []))
            values = [v for v in (neutral, *([False] if name == "logprobs" else [])) if v is not None]
            props[name] = {"anyOf": [*([{"type": "null"}] if nullable else []), *({"const": v} for v in values)],
                           "description": f"Not implemented: only {neutral!r}{' (or null)' if nullable else ''} "
                                          "is accepted"}
    if "prompt" in props:
        # one prompt: a non-empty string, non-empty token ids, or a batch of exactly one of them
        ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
        text = {"type": "string", "minLength": 1}
        props["prompt"] = {"title": "Prompt", "anyOf": [
            text, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": ids}]}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": SCHEMAS_REF.format(model=ref)}}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": _ERROR_STATUSES[s], "content": _json("Error")} for s in statuses}


def _sse_event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a streamed response: ``data:`` a JSON ``chunk`` (or, when the engine fails
    mid-stream, an error body), then a last ``data: [DONE]``."""
    payload = {"anyOf": [{"$ref": SCHEMAS_REF.format(model=chunk)}, {"$ref": SCHEMAS_REF.format(model="Error")}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _generate(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"A {response}; with ``stream: true`` server-sent events of {chunk} objects",
                    "content": {**_json(response), "text/event-stream": {"schema": _sse_event(chunk)}}},
            **_errors("400", "401", "404", "429", "503", "504"),
        },
    }}


def openapi_schema(model_name: str, max_tokens: int, vocab_size: int, *, api_key_required: bool) -> dict[str, Any]:
    """The OpenAPI document of one replica serving ``model_name`` (limits from its ``ServeConfig``).

    ``api_key_required`` adds the bearer scheme to the ``/v1`` operations and ``/metrics`` (the routes
    check it only when the config sets ``api_key``); ``/health`` and ``/openapi.json`` stay open.
    """
    if vocab_size < 1 or max_tokens < 1:
        raise ValueError(f"openapi_schema: vocab_size and max_tokens must be >= 1, got {vocab_size}, {max_tokens}")
    schemas = _model_schemas([ChatCompletionRequest, CompletionRequest, ChatCompletionResponse,
                              ChatCompletionChunk, CompletionResponse, ModelList])
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        _narrow_request(schemas[name], model_name, max_tokens, vocab_size)
    schemas["Error"] = copy.deepcopy(ERROR_SCHEMA)
    secured = [{"bearer": []}] if api_key_required else []
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generate("Chat completion", "ChatCompletionRequest", "ChatCompletionResponse",
                                          "ChatCompletionChunk"),
        "/v1/completions": _generate("Text completion", "CompletionRequest", "CompletionResponse",
                                     "CompletionResponse"),
        "/v1/models": {"get": {"summary": "The served model", "security": secured, "responses": {
            "200": {"description": "One model card", "content": _json("ModelList")}, **_errors("401")}}},
        "/health": {"get": {"summary": "Engine state (200 running, 503 otherwise)", "security": [], "responses": {
            "200": {"description": "Running", "content": {"application/json": {"schema": {"type": "object"}}}},
            "503": {"description": "Draining, stalled or failed",
                    "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": secured, "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors("401")}}},
    }
    if not api_key_required:
        for op in ("/v1/chat/completions", "/v1/completions"):
            paths[op]["post"]["security"] = []
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "graftblock", "version": "1",
                 "description": "OpenAI-compatible completions with speculative decoding (lossless)."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
