"""Serving throughput on two Ray nodes against one node with the same total CPUs (#40).

    .venv/bin/python -m benchmarks.two_node_serve --clients 8 --max-requests 40 --max-tokens 64 \
        --json benchmarks/results/two_node_serve.json

Each layout is a ``cluster.local_cluster`` cluster on this machine (``ray start`` per node, stopped by
PID): ``one_node`` is a head with 2 CPUs, ``two_nodes`` a head and a worker with 1 CPU each. On each,
``graftblock serve`` (``--serve-config``, default ``ray_configs/serve_local.yaml``) joins the cluster
with 2 replicas of 1 CPU, so on ``two_nodes`` Ray must put one replica on each node, and
``benchmarks/serve_load.py``'s closed-loop streaming clients load it. Reported per layout: the
serve_load figures (output tok/s, TTFT, ITL, errors); and ``two_over_one``, the ratio of output tok/s.
The layouts run one after the other on the same host (one run each: a ratio of two sequential runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.serve_load import REPO, load_prompts, run_load, start_server
from cluster.local_cluster import LocalCluster, LocalClusterConfig
from cluster.serve_config import load_serve_config
from speculation.bench.runner import environment

LAYOUTS: dict[str, tuple[int, tuple[int, ...]]] = {"one_node": (2, ()), "two_nodes": (1, (1,))}
"""Layout name -> (head CPUs, worker nodes' CPUs): the same 2 CPUs in total."""


def run_layout(name: str, args: argparse.Namespace, prompts: list[str]) -> dict:
    head_cpus, workers = LAYOUTS[name]
    root = Path(tempfile.mkdtemp(prefix=f"two-node-{name}-"))
    cluster = LocalCluster(LocalClusterConfig(root=root, head_cpus=head_cpus, worker_cpus=workers,
                                              ray_bin=Path(sys.executable).parent / "ray"))
    cluster.start()
    proc = None
    try:
        sets = [f"ray_address={cluster.gcs_address}", "ray_num_cpus=null", "num_replicas=2",
                "replica_resources={CPU: 1}", "proxy_location=HeadOnly", *args.serve_set]
        cfg = load_serve_config(args.serve_config, sets)
        proc = start_server(args.serve_config, None, root / "server.log", no_mlflow=True, sets=sets)
        load_args = argparse.Namespace(
            base_url=f"http://{cfg.host}:{cfg.port}/v1", api_key=cfg.api_key, model=None, clients=args.clients,
            seconds=args.seconds, max_requests=args.max_requests, max_tokens=args.max_tokens, temperature=0.0,
            request_timeout=300.0)
        result = asyncio.run(run_load(load_args, prompts))
        result["nodes"] = {"head_cpus": head_cpus, "worker_cpus": list(workers)}
        return result
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        left = cluster.stop()
        if left:
            print(f"[two_node_serve] {name}: processes still running after stop: {left}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-config", default=str(REPO / "ray_configs" / "serve_local.yaml"))
    p.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--max-requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dataset", default="spec_bench")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("clients", "max_requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    prompts = load_prompts(args.dataset, args.max_requests)
    layouts = {name: run_layout(name, args, prompts) for name in LAYOUTS}
    cfg = load_serve_config(args.serve_config, args.serve_set)
    out = {"kind": "two_node_serve",
           "command": "python -m benchmarks.two_node_serve " + " ".join(argv if argv is not None else sys.argv[1:]),
           "server": {"model": cfg.model, "dtype": cfg.dtype.value, "method": cfg.method,
                      "max_sequences": cfg.max_sequences, "replicas": 2},
           "dataset": args.dataset, "layouts": layouts,
           "two_over_one": layouts["two_nodes"]["output_tokens_per_s"] / layouts["one_node"]["output_tokens_per_s"],
           "env": environment()}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if all(r["errors"] == 0 for r in layouts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
