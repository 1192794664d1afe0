"""The server's OpenAPI document (``cluster.openapi``) and the fuzzer's checks (``benchmarks/fuzz_api.py``),
without a server: the document agrees with the request validator, and each check fails on the response it
guards against. The live fuzz run is ``tests/test_serve.py`` (short profile) and ``make fuzz`` (long)."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.core.transport import Response

from benchmarks.fuzz_api import FuzzConfig, _check_all
from cluster.openai_api import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from cluster.openapi import openapi_schema

MODEL, MAX_TOKENS, VOCAB = "m", 8, 50
DOC = openapi_schema(MODEL, MAX_TOKENS, VOCAB, api_key_required=True)
SCHEMA = schemathesis.openapi.from_dict(DOC)
OPS = {r.ok().label: r.ok() for r in SCHEMA.get_all_operations()}
CASES = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SEED = 20261207
"""A fixed seed: the same cases in every checkout (``derandomize`` draws per checkout)."""


def test_every_route_is_documented_and_the_key_is_required_where_the_server_checks_it():
    assert set(OPS) == {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health",
                        "GET /metrics"}
    paths = DOC["paths"]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/metrics", "get")):
        assert paths[path][method]["security"] == [{"bearer": []}], path
    assert paths["/health"]["get"]["security"] == []
    open_doc = openapi_schema(MODEL, MAX_TOKENS, VOCAB, api_key_required=False)
    assert all(op.get("security") == [] for p in open_doc["paths"].values() for op in p.values())


def test_the_document_is_narrowed_by_the_replica_limits():
    props = DOC["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["model"]["enum"] == [MODEL]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS} in props["max_tokens"]["anyOf"]
    assert props["stop_token_ids"]["items"] == {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
    assert props["n"]["anyOf"] == [{"type": "null"}, {"const": 1}]  # unsupported: only the neutral value
    with pytest.raises(ValueError, match="vocab_size"):
        openapi_schema(MODEL, MAX_TOKENS, 0, api_key_required=False)


@pytest.mark.parametrize("label,model", [("POST /v1/completions", CompletionRequest),
                                         ("POST /v1/chat/completions", ChatCompletionRequest)])
def test_a_schema_valid_body_passes_the_request_validator(label, model):
    """The document is no wider than ``parse_request``: what schemathesis generates as valid is accepted."""

    @CASES
    @seed(SEED)
    @given(case=OPS[label].as_strategy(GenerationMode.POSITIVE))
    def check(case):
        req = parse_request(json.dumps(case.body).encode(), model)
        assert req.model == MODEL
        m = req.requested_max_tokens()
        assert m is None or 1 <= m <= MAX_TOKENS
        assert all(0 <= t < VOCAB for t in req.stop_token_ids)

    check()


def _response(status: int, body, content_type: str = "application/json") -> Response:
    """A response as schemathesis's transport hands it to the checks (no server needed)."""
    request = requests.Request("POST", "http://127.0.0.1:1/v1/completions", json={}).prepare()
    return Response(status_code=status, headers={"content-type": [content_type]}, content=json.dumps(body).encode(),
                    request=request, elapsed=0.0, message="", encoding="utf-8", http_version="1.1", verify=True)


def _one_case():
    drawn = []

    @settings(max_examples=1, database=None, suppress_health_check=list(HealthCheck))
    @seed(SEED)
    @given(case=OPS["POST /v1/completions"].as_strategy(GenerationMode.POSITIVE))
    def take(case):
        drawn.append(case)

    take()
    return drawn[0]


ERR = {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}


@pytest.mark.parametrize("status,body,needle", [
    (500, {"error": {**ERR, "type": "server_error"}}, "Server error"),
    (400, {"detail": "bad"}, "not an OpenAI error body"),
    (400, {"error": {**ERR, "param": None}}, "does not name the parameter"),
    (422, {"error": {**ERR}}, "Undocumented status code"),
    (200, {"id": 3}, "Response violates schema"),
])
def test_each_check_fails_on_the_response_it_guards_against(status, body, needle):
    failed = _check_all(_one_case(), _response(status, body), GenerationMode.POSITIVE)
    assert any(needle in f for f in failed), failed


def test_a_conforming_error_passes_every_check():
    assert _check_all(_one_case(), _response(400, {"error": ERR}), GenerationMode.POSITIVE) == []
    bad_json = {"error": {**ERR, "param": None, "code": "invalid_json"}}  # a non-JSON body has no parameter
    assert _check_all(_one_case(), _response(400, bad_json), GenerationMode.POSITIVE) == []


@pytest.mark.parametrize("kwargs,needle", [
    ({"base_url": "http://10.0.0.1:8000"}, "loopback"),
    ({"examples": 0}, "fuzz.examples"),
    ({"modes": ()}, "fuzz.modes"),
    ({"request_timeout_s": 0}, "fuzz.request_timeout_s"),
])
def test_fuzz_config_is_validated(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        FuzzConfig(**{"base_url": "http://127.0.0.1:8000", **kwargs})


def test_unsupported_fields_at_a_neutral_value_are_accepted_and_otherwise_named():
    body = {"model": MODEL, "prompt": "x", "n": 1, "logprobs": False, "presence_penalty": 0.0}
    assert parse_request(json.dumps(body).encode(), CompletionRequest).n == 1
    with pytest.raises(APIError) as e:
        parse_request(json.dumps({**body, "n": 2}).encode(), CompletionRequest)
    assert e.value.status == 400 and e.value.param == "n"
