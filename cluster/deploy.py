"""Bring up a sharded target and a drafter worker on Ray from a :class:`~cluster.topology.Topology`.

Order of checks, so bad input fails fast with a message instead of hanging:

1. the shard count against the target's layer count (:func:`speculation.assets.model_num_layers`:
   the model config only, no weights);
2. the topology's resources against ``ray.cluster_resources()`` (totals) and against every
   node (each bundle must fit on one node);
3. the placement group's ``ready()`` under ``topology.ready_timeout_s``.

Then one :class:`~workers.shard.TargetShard` actor per bundle loads its layers, and a
:class:`~workers.drafter_worker.DrafterWorker` is created on the last bundle when a drafter is
first asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.backend import RayTargetBackend
from cluster.proxy import RayDrafterProxy
from cluster.topology import Topology
from speculation import assets
from speculation.config import ConfigError, DType
from speculation.drafters import DrafterType, MethodSpec, build_drafter
from speculation.policy.cost import measure_cost_model
from workers.drafter_worker import make_actor_class as make_drafter_actor_class, pack_drafter
from workers.shard import ShardSpec, TargetInfo, make_actor_class


class ClusterResourceError(ValueError):
    """The cluster cannot host the topology (missing resources, or placement timed out).

    A ``ValueError``: the request is invalid for this cluster, and the CLI reports it as such.
    """


_EPS = 1e-9


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to Ray if not connected: ``address``, else ``RAY_ADDRESS``, else a new local cluster."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {"address": address, "log_to_driver": True}
    if address == "local":
        kwargs.update(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    ray.init(**kwargs)


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items()))


def check_cluster_fits(topology: Topology) -> None:
    """Raise :class:`ClusterResourceError` if the cluster lacks what ``topology`` asks for."""
    total = ray.cluster_resources()
    need = topology.total_resources()
    short = {k: v for k, v in need.items() if total.get(k, 0.0) + _EPS < v}
    if short:
        have = {k: total.get(k, 0.0) for k in short}
        drafter = f" + drafter {{{_fmt(topology.drafter_resources)}}}" if topology.drafter_bundle else ""
        raise ClusterResourceError(
            f"the topology asks for {_fmt(short)} in total ({topology.shards} shard(s) x "
            f"{{{_fmt(topology.shard_resources)}}}{drafter}) but the "
            f"cluster has {_fmt(have)}; lower topology.shard_resources / shards, or add nodes "
            "(set require_resources_now: false to wait for an autoscaler)"
        )
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for i, bundle in enumerate(topology.bundles()):
        if not any(all(node.get(k, 0.0) + _EPS >= v for k, v in bundle.items()) for node in nodes):
            who = f"shard {i}" if i < topology.shards else "the drafter worker"
            raise ClusterResourceError(
                f"no single node can host {who}'s bundle {{{_fmt(bundle)}}} (a bundle must fit on one node)"
            )


def _actor_options(
    bundle: dict[str, float], pg, index: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    opts: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
    }
    if "memory" in bundle:
        opts["memory"] = bundle["memory"]
    if custom:
        opts["resources"] = custom
    if env:
        opts["runtime_env"] = {"env_vars": dict(env)}
    return opts


def _model_ref(model: str) -> str:
    """A local directory becomes absolute (actors do not share the caller's working directory)."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.is_dir() else model


class RayDeployment:
    """A sharded target (and, on demand, a drafter worker) placed on the Ray cluster.

    Use as a context manager, or call :meth:`shutdown`; it kills the actors and removes the
    placement group.

    Args:
        topology: shards, resources, placement.
        model: packaged alias, local directory or Hugging Face id (every shard loads it itself).
        dtype: ``float32`` / ``bfloat16``.
        aux_layers: HF hidden-state indices for feature drafters (default ``[2, L/2, L-3]``).
        local_target: an in-process target of the same model, if the caller has one: drafters are
            then built against it (feature drafters need its weights) and shipped to the worker.
            Without it the worker builds drafters that need only the vocabulary size (retrieval).
        name_prefix: if set, shard k is the named actor ``<name_prefix>-shard-<k>`` (in the caller's
            namespace; ``ray.get_actor`` finds it), e.g. for a serving replica's ``/health`` and tests.
    """

    def __init__(
        self,
        topology: Topology,
        model: str,
        dtype: str | DType,
        aux_layers: tuple[int, int, int] | None = None,
        local_target=None,
        name_prefix: str | None = None,
    ) -> None:
        self.topology = topology
        self.local_target = local_target
        self.model = _model_ref(model)
        self.dtype = DType.parse(dtype)
        num_layers = assets.model_num_layers(self.model)
        ranges = topology.layer_ranges(num_layers)  # raises ConfigError when shards > layers
        ensure_ray()
        if topology.require_resources_now:
            check_cluster_fits(topology)
        self.pg = placement_group(topology.bundles(), strategy=topology.placement_strategy.value)
        try:
            ray.get(self.pg.ready(), timeout=topology.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise ClusterResourceError(
                f"the placement group for {topology.shards} shard(s) "
                f"({_fmt(topology.total_resources())} in total) "
                f"was not ready after {topology.ready_timeout_s:g}s: the cluster is busy or too small"
            ) from None
        self._worker = None
        self.shards: list = []
        try:
            bundles = topology.bundles()
            for k, r in enumerate(ranges):
                spec = ShardSpec(
                    model=self.model,
                    dtype=self.dtype.value,
                    index=k,
                    num_shards=topology.shards,
                    start=r.start,
                    end=r.stop,
                    torch_threads=topology.torch_threads,
                    max_sequences=topology.max_sequences,
                )
                opts = _actor_options(bundles[k], self.pg, k, topology.actor_env)
                if name_prefix is not None:
                    opts["name"] = f"{name_prefix}-shard-{k}"
                # Restarted by Ray after a crash; calls are not retried (the batched backend
                # re-prefills the shard's sequences and retries the whole step itself).
                cls = make_actor_class(**opts, max_restarts=topology.max_restarts, max_task_retries=0)
                self.shards.append(cls.remote(spec))
            infos: list[TargetInfo] = ray.get([s.target_info.remote() for s in self.shards])
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[-1]
        self.backend = RayTargetBackend(self.shards, self.info, aux_layers=aux_layers)

    # ------------------------------------------------------------------ drafters
    def _drafter_worker(self):
        if not self.topology.drafter_bundle:
            raise ConfigError("this deployment reserved no drafter bundle (topology.drafter_bundle: false); "
                              "its drafters run elsewhere")
        if self._worker is None:
            opts = _actor_options(
                self.topology.drafter_resources, self.pg, self.topology.shards, self.topology.actor_env
            )
            self._worker = make_drafter_actor_class(**opts).remote(self.info.vocab_size, self.topology.torch_threads)
        return self._worker

    def drafter(self, spec: MethodSpec) -> RayDrafterProxy:
        """A proxy over a fresh drafter for ``spec`` in the worker slot named ``spec.name``.

        A drafter whose config needs a verify curve (``verify_curve_size() > 0``) gets c(T)
        measured over the distributed target (the cost it will really pay), once per deployment
        and tree size.
        """
        if spec.type == DrafterType.VANILLA:
            raise ConfigError(f"method {spec.name!r} is vanilla: it has no drafter")
        cost_model = None
        size = spec.config.verify_curve_size()
        if size:
            cost_model = measure_cost_model(self.backend, max_size=size)
            self.backend.sync()
        worker = self._drafter_worker()
        if self.local_target is not None:
            # Built here, where the in-process target is (feature drafters read its embeddings
            # and config), then shipped to the worker; c(T) still comes from the actors.
            drafter = build_drafter(spec, self.local_target, cost_model)
            traits = ray.get(worker.host.remote(spec.name, pack_drafter(drafter)))
        else:
            traits = ray.get(worker.load.remote(spec.name, spec, cost_model))
        return RayDrafterProxy(worker, spec.name, traits)

    def host_drafter(self, slot: str, drafter) -> RayDrafterProxy:
        """A proxy over ``drafter`` (any protocol object, shipped to the worker) in ``slot``."""
        worker = self._drafter_worker()
        return RayDrafterProxy(worker, slot, ray.get(worker.host.remote(slot, pack_drafter(drafter))))

    def method_parts(self, spec: MethodSpec) -> tuple[RayTargetBackend, RayDrafterProxy]:
        """(backend, fresh drafter proxy) for ``spec``: the bench's hook for the actor path."""
        return self.backend, self.drafter(spec)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Kill the actors and remove the placement group (idempotent)."""
        actors = list(self.shards)
        if self._worker is not None:
            actors.append(self._worker)
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        self.shards = []
        self._worker = None
        if getattr(self, "pg", None) is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def __enter__(self) -> "RayDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

