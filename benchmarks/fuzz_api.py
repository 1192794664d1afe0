"""Fuzz a live ``graftblock serve`` from its own OpenAPI document with schemathesis.

    # the long profile (`make fuzz`): starts the server on SmolLM2, >= 1,000 cases, writes the JSON
    .venv/bin/python -m benchmarks.fuzz_api --serve-config ray_configs/serve_fuzz.yaml \
        --examples 140 --json benchmarks/results/fuzz_api.json
    # against a server that is already running (loopback only)
    .venv/bin/python -m benchmarks.fuzz_api --base-url http://127.0.0.1:8000 --api-key KEY --examples 20

Every operation of ``GET /openapi.json`` (``cluster.openapi``) is driven by hypothesis through
schemathesis's strategies, ``--examples`` cases per operation and generation mode: positive cases
(schema-valid requests, which generate tokens) and negative ones (schema-violating bodies, which must be
refused). Each response is checked:

* no 5xx, ever (``not_a_server_error``);
* the status code and the body conform to the document (``status_code_conformance``,
  ``content_type_conformance``, ``response_schema_conformance``); a negative case gets a 4xx
  (``negative_data_rejection``);
* every 4xx is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``, and a 400
  names the parameter (``error.param``) unless the body was not a JSON object at all;

and ``GET /health`` must answer 200 after the run. Failures are collected (not shrunk), so one run
reports every distinct failing check with a reproducing ``curl`` command.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from benchmarks.serve_load import LOOPBACK, REPO, start_server
from cluster.serve_config import load_serve_config
from speculation.bench.runner import environment

CHECKS: tuple[CheckFunction, ...] = (
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
)
"""Schemathesis's checks run on every response (``negative_data_rejection`` is added for negative cases)."""

JSON_BODY_CODES = frozenset({"invalid_json"})
"""``error.code`` of a 400 for a body that is not a JSON object: it has no parameter to name."""


@dataclasses.dataclass(frozen=True)
class FuzzConfig:
    """One fuzz run against ``base_url`` (scheme, host and port; loopback only)."""

    base_url: str
    api_key: str | None = None
    examples: int = 20
    """Cases per operation and generation mode. Range [1, 100000]."""
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    seed: int = 0
    request_timeout_s: float = 120.0
    """One request's timeout (a positive case generates up to the server's ``max_tokens``). Range (0, 3600]."""

    def __post_init__(self) -> None:
        host = urlparse(self.base_url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"fuzz.base_url must be a loopback address (this is a fuzzer), got {host!r}")
        if not isinstance(self.examples, int) or not 1 <= self.examples <= 100_000:
            raise ValueError(f"fuzz.examples must be an integer in [1, 100000], got {self.examples!r}")
        if not self.modes:
            raise ValueError("fuzz.modes must name at least one generation mode (positive, negative)")
        if not 0 < self.request_timeout_s <= 3600:
            raise ValueError(f"fuzz.request_timeout_s must be in (0, 3600], got {self.request_timeout_s!r}")


@dataclasses.dataclass
class FuzzReport:
    """What one run saw: cases and statuses per operation and mode, failures, health afterwards."""

    cases: int = 0
    statuses: dict[str, Counter] = dataclasses.field(default_factory=dict)
    """``"POST /v1/completions positive"`` -> status code -> responses."""
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One entry per (operation, check, message): the first reproducing curl command and how often it failed."""
    healthy_after: bool = False
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500)

    def to_json(self) -> dict[str, Any]:
        total = Counter()
        for c in self.statuses.values():
            total.update(c)
        return {
            "cases": self.cases, "server_errors": self.server_errors, "failures": self.failures,
            "healthy_after": self.healthy_after, "seconds": round(self.seconds, 1),
            "status_counts": {str(k): v for k, v in sorted(total.items())},
            "by_operation": {op: {str(k): v for k, v in sorted(c.items())} for op, c in self.statuses.items()},
        }


def openai_error_body(response: Any) -> None:
    """A 4xx carries OpenAI's error body; a 400 names its parameter (unless the body was not JSON)."""
    if not 400 <= response.status_code < 500:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        raise AssertionError(f"{response.status_code} body is not an OpenAI error body: {body!r}")
    if not isinstance(err["message"], str) or not err["message"]:
        raise AssertionError(f"{response.status_code} error without a message: {body!r}")
    if response.status_code == 400 and err["code"] not in JSON_BODY_CODES and not err["param"]:
        raise AssertionError(f"400 does not name the parameter: {err['message']!r}")


def _first_line(exc: BaseException) -> str:
    """``"<check title>: <first line of its message>"`` of a schemathesis failure (or any assertion)."""
    title = getattr(exc, "title", None) or type(exc).__name__
    lines = (getattr(exc, "message", None) or str(exc)).strip().splitlines()
    return f"{title}: {lines[0] if lines else ''}"


def _check_all(case: Any, response: Any, mode: GenerationMode) -> list[str]:
    """Messages of the checks ``response`` fails (empty when it passes all)."""
    failed: list[str] = []
    checks: list[CheckFunction] = list(CHECKS)
    if mode is GenerationMode.NEGATIVE:
        checks.append(openapi_checks.negative_data_rejection)
    try:
        case.validate_response(response, checks=checks)
    except FailureGroup as group:  # every failed check of the response, together
        failed.extend(_first_line(e) for e in group.exceptions)
    except AssertionError as exc:  # one failed check
        failed.append(_first_line(exc))
    try:
        openai_error_body(response)
    except AssertionError as exc:
        failed.append(f"openai_error_body: {exc}")
    return failed


def _drive(op: Any, mode: GenerationMode, cfg: FuzzConfig, session: requests.Session,
           on_response: Callable[[Any, Any], None]) -> None:
    """Run ``cfg.examples`` hypothesis cases of ``op`` in ``mode`` (no shrinking: failures are recorded)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None

    @hypothesis_seed(cfg.seed)
    @settings(max_examples=cfg.examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=op.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        response = case.call(base_url=cfg.base_url, session=session, headers=headers,
                             timeout=cfg.request_timeout_s)
        on_response(case, response)

    one()


def fuzz(cfg: FuzzConfig, log: Callable[[str], None] = functools.partial(print, flush=True)) -> FuzzReport:
    """Fuzz every operation of the server's OpenAPI document; see the module docstring for the checks."""
    report = FuzzReport()
    t0 = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{cfg.base_url}/openapi.json", timeout=30)
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in cfg.modes:
                key = f"{op.label} {mode.value}"
                statuses = report.statuses.setdefault(key, Counter())

                def on_response(case: Any, response: Any, mode: GenerationMode = mode,
                                statuses: Counter = statuses, label: str = op.label) -> None:
                    report.cases += 1
                    statuses[response.status_code] += 1
                    for message in _check_all(case, response, mode):
                        entry = seen.get((label, message))
                        if entry is None:
                            entry = seen[(label, message)] = {
                                "operation": label, "mode": mode.value, "check": message,
                                "status": response.status_code, "count": 0,
                                "curl": case.as_curl_command(headers={"Authorization": "Bearer ***"}
                                                             if cfg.api_key else None)}
                            report.failures.append(entry)
                        entry["count"] += 1

                try:
                    _drive(op, mode, cfg, session, on_response)
                except (schemathesis.errors.SchemathesisError, Unsatisfiable) as exc:
                    # a negative mode for an operation without parameters: nothing to negate
                    log(f"[fuzz] {key}: no cases ({type(exc).__name__}: {exc})")
                log(f"[fuzz] {key}: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}")
    report.healthy_after = _healthy(cfg.base_url)
    report.seconds = time.monotonic() - t0
    return report


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=10) as resp:
            return resp.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="the server's origin, e.g. http://127.0.0.1:8000")
    p.add_argument("--serve-config", default=None, help="start `graftblock serve --config FILE` for the run")
    p.add_argument("--api-key", default=None, help="bearer key (default: the started server's api_key)")
    p.add_argument("--examples", type=int, default=20, help="cases per operation and generation mode")
    p.add_argument("--modes", default="positive,negative", help="comma-separated: positive, negative")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    try:
        modes = tuple(GenerationMode(m.strip()) for m in args.modes.split(",") if m.strip())
    except ValueError:
        p.error(f"--modes must be a comma-separated list of positive, negative; got {args.modes!r}")
    proc = None
    server: dict[str, Any] = {}
    if args.serve_config:
        cfg = load_serve_config(args.serve_config)
        args.base_url = args.base_url or f"http://{cfg.host}:{cfg.port}"
        args.api_key = args.api_key or cfg.api_key
        server = {"model": cfg.model, "dtype": cfg.dtype.value, "method": cfg.method,
                  "max_tokens": cfg.max_tokens, "max_prompt_tokens": cfg.max_prompt_tokens}
        proc = start_server(args.serve_config, None, REPO / "runs" / "fuzz_api.log", no_mlflow=True)
    if not args.base_url:
        p.error("give --base-url or --serve-config")
    try:
        fcfg = FuzzConfig(base_url=args.base_url.rstrip("/"), api_key=args.api_key, examples=args.examples,
                          modes=modes, seed=args.seed)
    except ValueError as exc:
        p.error(str(exc))
    try:
        report = fuzz(fcfg)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    result = {"kind": "fuzz_api", "command": "python -m benchmarks.fuzz_api " + " ".join(argv if argv is not None else sys.argv[1:]),
              "examples_per_operation_mode": args.examples, "modes": [m.value for m in modes], "seed": args.seed,
              "server": server, **report.to_json(), "env": environment()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if not report.failures and report.healthy_after else 1


if __name__ == "__main__":
    sys.exit(main())
