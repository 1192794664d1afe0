"""Ramp load on a live ``graftblock serve`` with locust: goodput, TTFT, ITL and errors per stage.

    # starts the server (SmolLM2 fp32, ray_configs/serve_local.yaml), ramps 1 -> 4x saturation, stops it
    .venv/bin/python -m benchmarks.load_locust --serve-config ray_configs/serve_local.yaml \
        --stage-seconds 40 --max-tokens 64 --json benchmarks/results/load_locust.json
    # against a running server (loopback only)
    .venv/bin/python -m benchmarks.load_locust --base-url http://127.0.0.1:8000 --saturation 8

Each locust user is a closed loop of streamed greedy chat completions (``stream: true``), prompts
from Spec-Bench's first turns (or ``--dataset``). The run is a sequence of stages; stage ``i`` holds
``users_i`` users for ``--stage-seconds``. By default the stages are
``1, S/2, S, 2S, 3S, 4S`` users, where the saturating concurrency ``S`` is what the server decodes
together (``max_sequences x num_replicas`` of its config, or ``--saturation``): beyond it requests wait
in the admission queue. Per stage (a request counts in the stage it finished in):

* ``goodput_tokens_per_s``: completion tokens of requests that finished with ``[DONE]`` and no error
  event, over the stage's seconds;
* ``ttft_p50_s`` / ``ttft_p99_s``: request sent -> first content chunk;
* ``itl_p50_s`` / ``itl_p99_s``: gaps between successive content chunks;
* ``errors``: responses by HTTP status (and ``stream_error:<code>`` for an error event in a stream,
  ``connection`` for a request that got no response).

After the last stage no new request is sent and the in-flight ones finish (``lost`` counts those that
did not within ``--drain-seconds``). The verdict at 2S (``targets``): no 5xx, nothing lost, and
``itl_p99`` at most 3x its value with one user.
"""

from __future__ import annotations

# locust monkey-patches the standard library with gevent when imported: it must come first.
import locust  # noqa: I001
from locust import HttpUser, constant, task
from locust.env import Environment

import argparse
import functools
import itertools
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent

from benchmarks.load_stats import LoadConfig, Recorder, StageStats, default_stages, verdict
from benchmarks.serve_load import REPO, load_prompts, start_server
from cluster.serve_config import load_serve_config
from speculation.bench.runner import environment

def _user_class(cfg: LoadConfig, rec: Recorder) -> type[HttpUser]:
    prompts = itertools.cycle(cfg.prompts)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}

    class ChatUser(HttpUser):
        """A closed-loop client: one streamed greedy chat completion after the other."""

        host = cfg.base_url
        wait_time = constant(0)

        @task
        def chat(self) -> None:
            if rec.draining:
                gevent.sleep(0.1)
                return
            body = {"model": cfg.model, "messages": [{"role": "user", "content": next(prompts)}],
                    "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            rec.in_flight += 1
            rec.sent += 1
            t0 = time.perf_counter()
            first = last = None
            gaps: list[float] = []
            tokens, error, done = 0, None, False
            try:
                with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                                      catch_response=True, name="chat (stream)",
                                      timeout=cfg.request_timeout_s) as r:
                    if r.status_code != 200:
                        error = str(r.status_code)
                        r.failure(f"HTTP {r.status_code}")
                    else:
                        for line in r.iter_lines(decode_unicode=True):
                            if not line or not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                done = True
                                break
                            event = json.loads(data)
                            if "error" in event:
                                error = f"stream_error:{event['error'].get('code')}"
                                continue
                            if event.get("usage"):
                                tokens = int(event["usage"]["completion_tokens"])
                            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                                now = time.perf_counter()
                                if first is None:
                                    first = now
                                else:
                                    gaps.append(now - last)
                                last = now
                        if error or not done:
                            r.failure(error or "stream ended without [DONE]")
                            error = error or "no_done"
                        else:
                            r.success()
            except Exception as exc:  # noqa: BLE001 - a request that got no response is counted, not fatal
                error = f"connection:{type(exc).__name__}"
            finally:
                rec.in_flight -= 1
            stage = rec.stage
            if error:
                stage.errors[error] += 1
                return
            stage.finished += 1
            stage.tokens += tokens
            if first is not None:
                stage.ttft.append(first - t0)
            stage.itl.extend(gaps)

    return ChatUser


def run_load(cfg: LoadConfig, log: Callable[[str], None] = functools.partial(print, flush=True)) -> dict[str, Any]:
    """Run the stages of ``cfg`` against the server; the per-stage results and the drain."""
    rec = Recorder()
    env = Environment(user_classes=[_user_class(cfg, rec)], host=cfg.base_url)
    runner = env.create_local_runner()
    try:
        for users in cfg.stages:
            rec.stages.append(StageStats(users))
            t0 = time.perf_counter()
            runner.start(users, spawn_rate=max(users, 1))
            gevent.sleep(cfg.stage_seconds)
            rec.stage.seconds = time.perf_counter() - t0
            s = rec.stage.to_json()
            log(f"[load] {users} users: {s['requests_ok']} ok, goodput {s['goodput_tokens_per_s']:.1f} tok/s, "
                f"ttft p99 {s['ttft_p99_s']}, itl p99 {s['itl_p99_s']}, errors {s['errors']}")
        rec.draining = True  # finish what is in flight, send nothing new
        t0 = time.perf_counter()
        while rec.in_flight and time.perf_counter() - t0 < cfg.drain_seconds:
            gevent.sleep(0.2)
        lost = rec.in_flight
    finally:
        runner.quit()
    return {"stages": [s.to_json() for s in rec.stages], "requests_sent": rec.sent, "lost": lost}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="the server's origin, e.g. http://127.0.0.1:8000")
    p.add_argument("--serve-config", default=None, help="start `graftblock serve --config FILE` for the run")
    p.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the started server's)")
    p.add_argument("--saturation", type=int, default=None,
                   help="saturating concurrency S (default: max_sequences x num_replicas of --serve-config)")
    p.add_argument("--stages", default=None, help="comma-separated user counts (default 1,S/2,S,2S,3S,4S)")
    p.add_argument("--stage-seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dataset", default="spec_bench")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts, cycled")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    proc, server = None, {}
    if args.serve_config:
        scfg = load_serve_config(args.serve_config, args.serve_set)
        args.base_url = args.base_url or f"http://{scfg.host}:{scfg.port}"
        args.api_key = args.api_key or scfg.api_key
        args.model = args.model or scfg.model_name
        args.saturation = args.saturation or scfg.max_sequences * scfg.num_replicas
        server = {"model": scfg.model, "dtype": scfg.dtype.value, "method": scfg.method,
                  "max_sequences": scfg.max_sequences, "num_replicas": scfg.num_replicas,
                  "max_waiting": scfg.max_waiting,
                  "prefill_chunk_tokens": scfg.batch.get("prefill_chunk_tokens"),
                  "prefill_step_tokens": scfg.batch.get("prefill_step_tokens")}
    if not args.base_url or not args.model or not args.saturation:
        p.error("give --serve-config, or --base-url with --model and --saturation")
    stages = (tuple(int(x) for x in args.stages.split(",")) if args.stages else default_stages(args.saturation))
    try:
        cfg = LoadConfig(base_url=args.base_url.rstrip("/"), prompts=tuple(load_prompts(args.dataset, args.prompts)),
                         model=args.model, stages=stages, stage_seconds=args.stage_seconds,
                         max_tokens=args.max_tokens, api_key=args.api_key)
    except ValueError as exc:
        p.error(str(exc))
    if args.serve_config:
        proc = start_server(args.serve_config, None, REPO / "runs" / "load_locust.log", no_mlflow=True,
                            sets=args.serve_set)
    try:
        result = run_load(cfg)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    out = {"kind": "load_locust",
           "command": "python -m benchmarks.load_locust " + " ".join(argv if argv is not None else sys.argv[1:]),
           "locust": locust.__version__, "saturation": args.saturation, "stage_seconds": args.stage_seconds,
           "max_tokens": args.max_tokens, "dataset": args.dataset, "server": server, **result,
           "targets": verdict(result, args.saturation), "env": environment()}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
