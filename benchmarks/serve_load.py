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
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    tokens: int = 0
    done: int = 0
    errors: list[str] = field(default_factory=list)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def _one(client, model: str, prompt: str, args, stats: Stats) -> None:
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


async def run_load(args, prompts: list[str]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0,
                                timeout=args.request_timeout)
    model = args.model or (await client.models.list()).data[0].id
    health = await _health(args)
    stats = Stats()
    sent = 0
    deadline = time.perf_counter() + args.seconds
    t_start = time.perf_counter()

    async def worker() -> None:
        nonlocal sent
        while time.perf_counter() < deadline and sent < args.max_requests:
            prompt = prompts[sent % len(prompts)]
            sent += 1
            try:
                await _one(client, model, prompt, args, stats)
            except Exception as exc:  # counted and reported, the run goes on
                stats.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(worker() for _ in range(args.clients)))
    wall = time.perf_counter() - t_start
    await client.close()
    return {
        "base_url": args.base_url, "model": model, "clients": args.clients, "seconds_limit": args.seconds,
        "max_requests": args.max_requests, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "wall_s": wall, "requests_sent": sent, "requests_done": stats.done, "errors": len(stats.errors),
        "error_messages": stats.errors[:10], "output_tokens": stats.tokens,
        "output_tokens_per_s": stats.tokens / wall if wall else 0.0,
        "ttft_p50_s": _pct(stats.ttft, 50), "ttft_p99_s": _pct(stats.ttft, 99),
        "itl_p50_s": _pct(stats.itl, 50), "itl_p99_s": _pct(stats.itl, 99),
        "tpot_mean_s": statistics.fmean(stats.tpot) if stats.tpot else None,
        "tau_mean": statistics.fmean(stats.tau) if stats.tau else None,
        "server_torch_threads": health.get("torch_threads"),
    }


async def _health(args) -> dict:
    """The server's ``GET /health`` body (``{}`` if it has none): it reports the replica's torch threads."""
    import urllib.error
    import urllib.request

    root = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def get() -> dict:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{root}/health", headers=headers), timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ValueError):
            return {}

    return await asyncio.to_thread(get)


def offline_baseline(serve_config: str, dataset: str, n_prompts: int, clients: int, max_tokens: int,
                     torch_threads: int | None = None) -> dict:
    """The offline batched engine on the server's own config, at ``clients`` concurrent sequences.

    Same model, dtype, method and batch options as the server (read from ``serve_config``), the
    same first ``n_prompts`` first turns, greedy, ``max_tokens`` each; closed-loop clients over
    :class:`~speculation.engine.BatchEngine` in this process (``run_concurrency``). It runs after
    the server has stopped, so the two never share the cores. ``torch_threads``: the replica's
    (``GET /health``), so both runs compute with the same number of threads.
    """
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    from cluster.serve_config import load_serve_config
    from speculation import assets
    from speculation.bench.runner import run_concurrency
    from speculation.config import BenchConfig, SamplingConfig
    from speculation.target import TargetModel

    cfg = load_serve_config(serve_config)
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
    from speculation import assets

    questions = assets.load_questions(dataset)
    return [q.turns[0] for q in questions][:limit]


def start_server(config: str, port: int | None, log_path: Path, no_mlflow: bool,
                 timeout: float = 300.0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "graftblock", "serve", "--config", config]
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
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--dataset", default="spec_bench", help="spec_bench | a packaged dataset | PATH.jsonl")
    p.add_argument("--json", default=None, help="write the result here (also printed)")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --serve-config: after the server stops, run the offline batched engine on the "
                        "same config, prompts and concurrency, and report serving/offline throughput")
    args = p.parse_args(argv)
    if args.offline_baseline and not args.serve_config:
        p.error("--offline-baseline needs --serve-config (the offline run uses the server's model, dtype and method)")
    for name in ("clients", "max_requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.seconds <= 3600:
        p.error("--seconds must be in (0, 3600]")
    proc = None
    if args.serve_config:
        from cluster.serve_config import load_serve_config

        cfg = load_serve_config(args.serve_config)
        port = args.port or cfg.port
        args.base_url = args.base_url or f"http://{cfg.host}:{port}/v1"
        args.api_key = args.api_key or cfg.api_key
        proc = start_server(args.serve_config, args.port, Path(os.environ.get("TMPDIR", "/tmp")) / "serve_load.log",
                            args.no_mlflow)
    if not args.base_url:
        p.error("give --base-url or --serve-config")
    host = urlparse(args.base_url).hostname
    if host not in LOOPBACK:
        p.error(f"--base-url must be a loopback address (this is a load generator), got {host!r}")
    try:
        prompts = load_prompts(args.dataset, args.max_requests)
        result = asyncio.run(run_load(args, prompts))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    result["dataset"] = args.dataset
    result["kind"] = "serve_load"
    result["command"] = "benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.serve_config:
        from cluster.serve_config import load_serve_config

        cfg = load_serve_config(args.serve_config)
        result["server"] = {"model": cfg.model, "dtype": cfg.dtype.value, "method": cfg.method,
                            "max_sequences": cfg.max_sequences}
    from speculation.bench.runner import environment

    result["env"] = environment()
    if args.offline_baseline:
        off = offline_baseline(args.serve_config, args.dataset, result["requests_done"], args.clients,
                               args.max_tokens, result.get("server_torch_threads"))
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
