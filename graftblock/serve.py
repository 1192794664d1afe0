"""``graftblock serve``: the OpenAI-compatible server on Ray Serve, until SIGINT/SIGTERM.

    graftblock serve --config ray_configs/serve_local.yaml [--host 127.0.0.1] [--port 8000]

Starts a local Ray instance unless the config names a cluster (``ray_address``), deploys
``cluster.serve_app.build_app(config)`` with Ray Serve's HTTP proxy on ``host:port``, and blocks.
On SIGINT/SIGTERM it shuts Serve down gracefully: each replica drains its in-flight requests
(bounded by ``drain_timeout_s``) and ends its MLflow serving run FINISHED.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

import ray
from ray import serve

import tracking
from cluster.openai_service import batch_config
from cluster.serve_app import build_app
from cluster.serve_config import load_serve_config
from graftblock.common import run_command
from speculation.config import ConfigError
from speculation.drafters import resolve_methods

APP_NAME = "graftblock"


def add_serve_parser(sub) -> None:
    """Register ``serve`` on the CLI's sub-parsers."""
    add_arguments(sub.add_parser("serve", help="OpenAI-compatible server on Ray Serve (runs until SIGINT/SIGTERM)"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``serve``."""
    p.add_argument("--config", default=None,
                   help="serving YAML (default: the embedded ray_configs/serve_local.yaml)")
    p.add_argument("--host", default=None, help="bind address (default: the config's, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port, 1..65535 (default: the config's, 8000)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log serving runs to MLflow")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the config's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable; VALUE is YAML; KEY may be dotted, e.g. "
                        "--set learner.policy=static --set max_sequences=2)")
    p.set_defaults(func=cmd_serve)


def resolve_config(args: argparse.Namespace):
    """The validated config with the flags applied; the tracking store checked now (not in a replica)
    and made absolute, the method and batch options validated before Ray starts."""
    cfg = load_serve_config(args.config, getattr(args, "sets", [])).with_overrides(host=args.host, port=args.port,
                                                         tracking_uri=args.tracking_uri)
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    if args.no_mlflow:
        cfg = dataclasses.replace(cfg, mlflow=False)
    resolve_methods([cfg.method], cfg.methods)
    batch_config(cfg)
    if cfg.mlflow:
        uri, _ = tracking.prepare(cfg.experiment, cfg.tracking_uri)
        cfg = dataclasses.replace(cfg, tracking_uri=uri)
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    started_ray = False
    if not ray.is_initialized():
        if cfg.ray_address is None:
            ray.init(address="local", num_cpus=cfg.ray_num_cpus, include_dashboard=False, log_to_driver=False)
            started_ray = True
        else:
            ray.init(address=cfg.ray_address, log_to_driver=False)
    stop = threading.Event()

    def _on_signal(signum, frame) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(proxy_location=cfg.proxy_location.value, http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"graftblock serve: {cfg.model_name} ({cfg.method}, {cfg.dtype.value}) on "
              f"http://{cfg.host}:{cfg.port}/v1 ready", flush=True)
        while not stop.wait(0.5):
            pass
        print("graftblock serve: shutting down (draining in-flight requests)", file=sys.stderr, flush=True)
    finally:
        try:
            # Delete the app first, while the HTTP proxy still runs: its replicas drain their in-flight
            # requests (bounded by drain_timeout_s), then their __del__ ends the MLflow runs. Only then
            # stop Serve (which kills the proxy at once).
            if serve.status().applications.get(APP_NAME) is not None:
                serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if started_ray:
                ray.shutdown()
    print("graftblock serve: stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m graftblock.serve ...`` (the same as ``graftblock serve ...``)."""
    p = argparse.ArgumentParser(prog="graftblock serve", description=__doc__.split("\n\n")[0].replace("``", ""))
    add_arguments(p)
    args = p.parse_args(argv)
    args.command = "serve"
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
