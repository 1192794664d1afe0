"""Load test of a live ``graftblock serve``: N concurrent streaming ``openai`` clients for T seconds.

    # against a running server (loopback only)
    .venv/bin/python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --model smollm2-135m \
        --clients 8 --seconds 120 --max-requests 400 --max-tokens 128 --json benchmarks/results/serve_load.json
    # or let the script start and stop the server itself
    .venv/bin/python benchmarks/serve_load.py --serve-config ray_configs/serve_local.yaml --clients 8 ...

Closed loop: each client sends a chat request (``stream: true``, greedy unless ``--temperature``)
with the next Spec-Bench first turn (or ``--dataset``), reads it to ``[DONE]``, and sends the next,
until ``--seconds`` pass or ``--max-requests`` were sent (both bound the run). Reported (JSON):

* ``output_tokens_per_s``: completion tokens of finished requests / wall seconds of the run;
* ``ttft_p50_s`` / ``ttft_p99_s``: request sent -> first content chunk;
* ``itl_p50_s`` / ``itl_p99_s``: gaps between successive content chunks (a speculative step may
  bring several tokens in one chunk);
* ``tpot_mean_s``: per request (last - first content chunk) / (completion tokens - 1), averaged;
* ``tau_mean``: the server's ``graftblock.tau`` averaged over requests; ``errors`` with messages;
* ``server_torch_threads``: the replica's torch threads (``GET /health``);
* with ``--stream FILE`` (a domain-shift stream, ``graftblock adapt-bench``'s format): the prompts
  are the stream's, sent in stream order, and ``per_phase`` reports requests, tokens and mean tau
  per phase (a request belongs to the phase of its prompt), ``tau_series`` the server's tau per
  request in completion order, and ``learner`` the learner's counters scraped from ``/metrics`` at
  the end (decisions by outcome, swaps, rollbacks, weights version): serving with the learner on;
* with ``--offline-baseline``: ``offline`` (the in-process batched engine on the server's config at
  the same concurrency and torch threads, after the server stopped) and ``serving_over_offline``
  (the ratio of the two throughputs: 1 − it is the serving overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve_config import load_serve_config
from graftblock.adapt import StreamSpec, stream_questions
from speculation import assets
from speculation.bench.runner import environment, run_concurrency
from speculation.config import BenchConfig, SamplingConfig
from speculation.model.target import TargetModel

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    finished: list[tuple[str, int, float | None, float]] = field(default_factory=list)
    """(phase, completion tokens, tau, finish time) per finished request, in completion order."""
    tokens: int = 0
    done: int = 0
    errors: list[str] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs`` by the nearest rank; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def _one(client, model: str, prompt: str, args, stats: Stats, phase: str = "") -> None:
    t0 = time.perf_counter()
    first = last = None
    usage = spec = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
        temperature=args.temperature, stream=True)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now
                stats.ttft.append(now - t0)
            else:
                stats.itl.append(now - last)
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
            spec = (chunk.model_extra or {}).get("graftblock")
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    stats.tokens += usage.completion_tokens
    stats.done += 1
    if first is not None and usage.completion_tokens > 1:
        stats.tpot.append((last - first) / (usage.completion_tokens - 1))
    if spec:
        stats.tau.append(float(spec["tau"]))
    stats.finished.append((phase, usage.completion_tokens, float(spec["tau"]) if spec else None, time.perf_counter()))


async def run_load(args, prompts: list[str], phases: list[str] | None = None) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0,
                                timeout=args.request_timeout)
    model = args.model or (await client.models.list()).data[0].id
    health = await _health(args)
    stats = Stats()
    sent = 0
    deadline = time.perf_counter() + args.seconds
    t_start = time.perf_counter()

    limit = min(args.max_requests, len(prompts)) if phases else args.max_requests  # a stream runs once, in order

    async def worker() -> None:
        nonlocal sent
        while time.perf_counter() < deadline and sent < limit:
            i = sent % len(prompts)
            sent += 1
            try:
                await _one(client, model, prompts[i], args, stats, phases[i] if phases else "")
            except Exception as exc:  # counted and reported, the run goes on
                stats.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(worker() for _ in range(args.clients)))
    wall = time.perf_counter() - t_start
    await client.close()
    extra = {}
    if phases:
        extra = {"per_phase": per_phase(stats.finished, list(dict.fromkeys(phases)), t_start),
                 "tau_series": [t for _, _, t, _ in stats.finished],
                 "phase_series": [ph for ph, _, _, _ in stats.finished],
                 "learner": await _learner_counters(args)}
    return {
        "base_url": args.base_url, "model": model, "clients": args.clients, "seconds_limit": args.seconds,
        "max_requests": args.max_requests, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "wall_s": wall, "requests_sent": sent, "requests_done": stats.done, "errors": len(stats.errors),
        "error_messages": stats.errors[:10], "output_tokens": stats.tokens,
        "output_tokens_per_s": stats.tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(stats.ttft, 50), "ttft_p99_s": percentile(stats.ttft, 99),
        "itl_p50_s": percentile(stats.itl, 50), "itl_p99_s": percentile(stats.itl, 99),
        "tpot_mean_s": statistics.fmean(stats.tpot) if stats.tpot else None,
        "tau_mean": statistics.fmean(stats.tau) if stats.tau else None,
        "server_torch_threads": health.get("torch_threads"),
        **extra,
    }


def per_phase(finished: list[tuple[str, int, float | None, float]], order: list[str], t_start: float) -> dict:
    """Requests, tokens, mean tau and tokens/s per phase. A phase's seconds run from the previous
    phase's last finish (the run's start for the first) to its own last finish."""
    out: dict[str, dict] = {}
    prev_end = t_start
    for ph in order:
        rows = [r for r in finished if r[0] == ph]
        if not rows:
            continue
        end = max(r[3] for r in rows)
        taus = [r[2] for r in rows if r[2] is not None]
        tokens = sum(r[1] for r in rows)
        out[ph] = {"requests": len(rows), "tokens": tokens, "tau_mean": statistics.fmean(taus) if taus else None,
                   "seconds": end - prev_end, "tokens_per_s": tokens / (end - prev_end) if end > prev_end else None}
        prev_end = max(prev_end, end)
    return out


async def _learner_counters(args) -> dict:
    """The learner's counters from the server's Prometheus ``/metrics`` (``{}`` if unreachable)."""
    def parse() -> dict:
        text = _get(args, "/metrics")
        if text is None:  # unreachable: the counters are missing, the run's figures stand
            return {}
        out: dict = {"decisions": {}}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == "graftblock_learner_decisions_total":
                    out["decisions"][sample.labels.get("outcome", "")] = sample.value
                elif sample.name in ("graftblock_learner_swaps_total", "graftblock_learner_rollbacks_total",
                                     "graftblock_learner_weights_version", "graftblock_learner_feedback_dropped_total",
                                     "graftblock_learner_feedback_sent_total"):
                    key = sample.name.removeprefix("graftblock_learner_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    return await asyncio.to_thread(parse)


def _get(args, path: str) -> str | None:
    """``GET <server root><path>`` with the API key, or None when it fails (URLError, timeout, reset)."""
    root = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(root + path, headers=headers), timeout=30) as r:
            return r.read().decode()
    except OSError:
        return None


async def _health(args) -> dict:
    """The server's ``GET /health`` body (``{}`` if it has none): it reports the replica's torch threads."""

    def get() -> dict:
        text = _get(args, "/health")
        try:
            return json.loads(text) if text is not None else {}
        except ValueError:
            return {}

    return await asyncio.to_thread(get)


def offline_baseline(serve_config: str, dataset: str, n_prompts: int, clients: int, max_tokens: int,
                     torch_threads: int | None = None, sets: list[str] | None = None) -> dict:
    """The offline batched engine on the server's own config, at ``clients`` concurrent sequences.

    Same model, dtype, method and batch options as the server (read from ``serve_config``), the
    same first ``n_prompts`` first turns, greedy, ``max_tokens`` each; closed-loop clients over
    :class:`~speculation.engine.batch.BatchEngine` in this process (``run_concurrency``). It runs after
    the server has stopped, so the two never share the cores. ``torch_threads``: the replica's
    (``GET /health``), so both runs compute with the same number of threads.
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)

    cfg = load_serve_config(serve_config, sets or [])
    questions = assets.load_questions(dataset)[: max(n_prompts, clients)]
    model, tokenizer = assets.load_model_and_tokenizer(cfg.model, cfg.dtype.torch)
    target = TargetModel(model, tokenizer)
    bench = BenchConfig(methods=(cfg.method,), model=cfg.model, dtype=cfg.dtype.value, dataset=dataset,
                        max_new_tokens=max_tokens, sampling=SamplingConfig(), warmup=0, max_turns=1)
    level = run_concurrency(bench, target, questions, [clients], cfg.methods or None,
                            goodput=bool(cfg.batch.get("goodput", False)))[str(clients)]
    name = cfg.method if cfg.method in level["methods"] else "vanilla"
    return {"method": name, "n_prompts": len(questions), **level["methods"][name],
            "torch_threads": torch.get_num_threads()}


def load_prompts(dataset: str, limit: int) -> list[str]:
    questions = assets.load_questions(dataset)
    return [q.turns[0] for q in questions][:limit]


def load_stream(path: str, requests_per_phase: int | None) -> list[tuple[str, str]]:
    """``(phase, first turn)`` per request of a stream file (validated as adapt-bench validates it)."""
    spec = StreamSpec.from_yaml(path)
    if requests_per_phase is not None:
        if requests_per_phase < 1:
            raise SystemExit(f"--requests-per-phase must be >= 1, got {requests_per_phase}")
        spec = spec.with_requests(requests_per_phase)
    return stream_questions(spec)


def start_server(config: str, port: int | None, log_path: Path, no_mlflow: bool,
                 timeout: float = 300.0, sets: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "graftblock", "serve", "--config", config]
    for item in sets or []:
        cmd += ["--set", item]
    if no_mlflow:
        cmd.append("--no-mlflow")
    if port is not None:
        cmd += ["--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}")
        if "ready" in log_path.read_text():
            return proc
        time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="server's /v1 URL (loopback only); default from --serve-config")
    p.add_argument("--serve-config", default=None, help="start `graftblock serve --config FILE` for the run")
    p.add_argument("--port", type=int, default=None, help="port for the started server")
    p.add_argument("--no-mlflow", action="store_true", help="the started server logs no serving run")
    p.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --serve-config: a `graftblock serve --set` override (repeatable)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--dataset", default="spec_bench", help="spec_bench | a packaged dataset | PATH.jsonl")
    p.add_argument("--stream", default=None,
                   help="a domain-shift stream YAML (adapt-bench's format): its prompts in order, tau per phase, "
                        "the learner's counters (replaces --dataset; --max-requests still bounds the run)")
    p.add_argument("--requests-per-phase", type=int, default=None, help="with --stream: requests per phase")
    p.add_argument("--json", default=None, help="write the result here (also printed)")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --serve-config: after the server stops, run the offline batched engine on the "
                        "same config, prompts and concurrency, and report serving/offline throughput")
    args = p.parse_args(argv)
    if args.stream and args.offline_baseline:
        p.error("--offline-baseline runs the dataset's prompts; it does not take --stream")
    if args.requests_per_phase is not None and not args.stream:
        p.error("--requests-per-phase needs --stream")
    if args.serve_set and not args.serve_config:
        p.error("--serve-set needs --serve-config (it overrides the started server's config)")
    if args.offline_baseline and not args.serve_config:
        p.error("--offline-baseline needs --serve-config (the offline run uses the server's model, dtype and method)")
    for name in ("clients", "max_requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.seconds <= 3600:
        p.error("--seconds must be in (0, 3600]")
    proc = None
    turns = load_stream(args.stream, args.requests_per_phase) if args.stream else None  # a bad file fails first
    if args.serve_config:
        cfg = load_serve_config(args.serve_config, args.serve_set)
        port = args.port or cfg.port
        args.base_url = args.base_url or f"http://{cfg.host}:{port}/v1"
        args.api_key = args.api_key or cfg.api_key
        proc = start_server(args.serve_config, args.port, Path(os.environ.get("TMPDIR", "/tmp")) / "serve_load.log",
                            args.no_mlflow, sets=args.serve_set)
    if not args.base_url:
        p.error("give --base-url or --serve-config")
    host = urlparse(args.base_url).hostname
    if host not in LOOPBACK:
        p.error(f"--base-url must be a loopback address (this is a load generator), got {host!r}")
    try:
        phases = None
        if turns is not None:
            phases, prompts = [ph for ph, _ in turns][: args.max_requests], [t for _, t in turns][: args.max_requests]
        else:
            prompts = load_prompts(args.dataset, args.max_requests)
        result = asyncio.run(run_load(args, prompts, phases))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    result["dataset"] = args.stream or args.dataset
    result["kind"] = "serve_load"
    result["command"] = "benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.serve_config:
        cfg = load_serve_config(args.serve_config, args.serve_set)
        result["server"] = {"model": cfg.model, "dtype": cfg.dtype.value, "method": cfg.method,
                            "max_sequences": cfg.max_sequences}
        if cfg.learner.enabled and cfg.method in ("eagle3", "specblock"):
            result["server"]["learner_policy"] = cfg.learner.policy

    result["env"] = environment()
    if args.offline_baseline:
        off = offline_baseline(args.serve_config, args.dataset, result["requests_done"], args.clients,
                               args.max_tokens, result.get("server_torch_threads"), args.serve_set)
        result["offline"] = off
        result["serving_over_offline"] = result["output_tokens_per_s"] / off["tokens_per_s"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
