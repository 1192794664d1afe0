"""CLI glue for the Ray paths: ``--ray`` / ``--shards`` / ``--topology`` on ``bench`` and
``generate``, and the ``sweep`` and ``compare`` sub-commands. ``graftblock/cli.py`` calls in here, so
its own edits stay a few lines.

With ``--ray``, every non-vanilla method runs the same decode loop over a sharded target
(:class:`~cluster.backend.RayTargetBackend`) and a drafter worker
(:class:`~cluster.proxy.RayDrafterProxy`); vanilla (the baseline) still runs in process on the
same machine, so the speedup includes every cost the distributed path adds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from cluster.deploy import RayDeployment
from cluster.topology import load_topology
from speculation.config import ConfigError
from speculation.drafters import DrafterType, build_drafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from sweeps import compare, run


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """``--ray``, ``--shards N``, ``--topology FILE``."""
    p.add_argument(
        "--ray",
        action="store_true",
        help="run the methods over Ray actors (sharded target + drafter worker); vanilla stays in process",
    )
    p.add_argument(
        "--shards", type=int, default=None, help="target pipeline shards with --ray (default: topology's)"
    )
    p.add_argument(
        "--topology",
        default=None,
        help="topology YAML with --ray (default: the embedded one = ray_configs/local.yaml)",
    )


def topology_from_args(args: argparse.Namespace):
    """The validated topology, or None without ``--ray`` (``--shards``/``--topology`` need it)."""
    if not getattr(args, "ray", False):
        for flag in ("shards", "topology"):
            if getattr(args, flag, None) is not None:
                raise ConfigError(f"--{flag} needs --ray")
        return None
    if args.shards is not None and args.shards < 1:
        raise ConfigError(f"--shards must be >= 1, got {args.shards}")
    topology = load_topology(args.topology).with_shards(args.shards)
    if getattr(args, "threads", None):
        # Same torch threads in the actors as in the in-process baseline: a fair speedup.
        topology = dataclasses.replace(topology, torch_threads=args.threads)
    return topology


@contextlib.contextmanager
def deployment(args: argparse.Namespace, target) -> Iterator[Any]:
    """A :class:`~cluster.deploy.RayDeployment` for ``target``'s model (None without ``--ray``)."""
    topology = topology_from_args(args)
    if topology is None:
        yield None
        return

    dtype = str(target.dtype).removeprefix("torch.")
    with RayDeployment(
        topology,
        args.model,
        dtype,
        aux_layers=target.aux_layers,
        local_target=target,
    ) as dep:
        yield dep


@contextlib.contextmanager
def method_parts(args: argparse.Namespace, target) -> Iterator[Any]:
    """The ``method_parts`` hook for ``run_bench`` (None without ``--ray``)."""
    with deployment(args, target) as dep:
        yield None if dep is None else dep.method_parts


def generate(args: argparse.Namespace, target, spec, ids: list[int], engine):
    """``graftblock generate``: in process, or over Ray with ``--ray``."""
    with deployment(args, target) as dep:
        if dep is None:
            drafter = build_drafter(spec, target)
            return (
                generate_vanilla(target, ids, engine)
                if drafter is None
                else generate_speculative(target, drafter, ids, engine)
            )
        if spec.type == DrafterType.VANILLA:
            return generate_vanilla(dep.backend, ids, engine)
        return generate_speculative(dep.backend, dep.drafter(spec), ids, engine)


# --------------------------------------------------------------------------- sweep / compare
def cmd_sweep(args: argparse.Namespace) -> int:
    return run.run_from_args(args)


def cmd_compare(args: argparse.Namespace) -> int:
    return compare.run_from_args(args)


def add_subcommands(sub) -> None:
    """Register ``sweep`` and ``compare`` on the CLI's sub-parsers."""
    s = sub.add_parser("sweep", help="run (or resume) an Optuna sweep on Ray, every trial logged to MLflow")
    run.add_arguments(s)
    s.set_defaults(func=cmd_sweep)

    c = sub.add_parser(
        "compare", help="table, Pareto plot and best config of the runs of an MLflow experiment"
    )
    compare.add_arguments(c)
    c.set_defaults(func=cmd_compare)
