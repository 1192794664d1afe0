"""A serving replica's target over ``TargetShard`` actors (``serve.target_shards: N``, N >= 1).

:class:`ShardedServeTarget` places N pipeline shards with :class:`~cluster.deploy.RayDeployment`
(a placement group of ``N x {CPU: shard_cpus}`` plus its drafter bundle, shards restartable with
``shard_max_restarts``, named ``<replica>-shard-<k>``) and wraps them in
:class:`~cluster.batch_backend.RayBatchTarget`, the slot API the replica's
:class:`~speculation.engine.batch.BatchEngine` drives unchanged: one call per shard per engine step for
every live sequence. A shard that Ray restarts gets the live sequences re-prefilled from their
committed tokens and the step is retried (fp32 greedy: the output is the no-fault output). The
replica shows ``status()`` in ``/health`` and calls ``shutdown()`` when it stops.

Only methods whose drafter needs no target weights run over shards (``vanilla``, ``retrieval``):
EAGLE-3, SpecBlock and Graft read the target's embeddings / LM head in the replica's process, which
a sharded replica does not hold; they are refused with a :class:`~speculation.config.ConfigError`.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.batch_backend import RayBatchTarget, ShardCallConfig
from cluster.deploy import RayDeployment
from cluster.serve_config import ServeConfig
from cluster.topology import Topology
from speculation.config import ConfigError
from speculation.drafters import DrafterType, MethodSpec

log = logging.getLogger(__name__)

SHARDABLE_METHODS = frozenset({DrafterType.VANILLA, DrafterType.RETRIEVAL})
"""Drafter types that need no target weights in the replica (so they run over shard actors)."""

SHARD_MAX_RECOVERIES = 3
"""Fault recoveries (re-prefill + retry) per engine step before its requests fail."""


def check_shardable(config: ServeConfig, spec: MethodSpec) -> None:
    """Raise :class:`ConfigError` if ``spec`` cannot run over ``config.target_shards`` shard actors."""
    if config.target_shards and spec.type not in SHARDABLE_METHODS:
        allowed = sorted(t.value for t in SHARDABLE_METHODS)
        raise ConfigError(
            f"serve.target_shards = {config.target_shards}: method {spec.name!r} ({spec.type.value}) "
            f"needs the target's weights in the replica, which shard actors do not provide; use "
            f"target_shards: 0 or a method of type {allowed}")


class ShardedServeTarget:
    """The replica's shard actors and the batched target over them.

    Args:
        config: the serving config (``target_shards`` >= 1, ``shard_*`` options, ``model``, ``dtype``).
        name_prefix: unique per replica; shard k is the named actor ``<name_prefix>-shard-<k>``.
        tokenizer: the model's tokenizer (loaded by the replica; the shards load only weights).
    """

    def __init__(self, config: ServeConfig, name_prefix: str, tokenizer: Any) -> None:
        if config.target_shards < 1:
            raise ConfigError(
                f"serve.target_shards must be >= 1 for a sharded target, got {config.target_shards}")
        topology = Topology(shards=config.target_shards, shard_resources={"CPU": float(config.shard_cpus)},
                            drafter_bundle=False,  # the replica's drafters run in it or in its DrafterWorker
                            max_sequences=config.max_sequences, max_restarts=config.shard_max_restarts,
                            torch_threads=config.torch_threads)
        self.deployment = RayDeployment(topology, config.model, config.dtype, name_prefix=name_prefix)
        self.name_prefix = name_prefix
        calls = ShardCallConfig(call_timeout_s=float(config.stall_timeout_s),
                                restart_timeout_s=float(config.shard_restart_timeout_s),
                                max_recoveries=SHARD_MAX_RECOVERIES)
        try:
            self.target = RayBatchTarget(self.deployment.shards, self.deployment.info, tokenizer=tokenizer,
                                         calls=calls)
        except BaseException:
            self.deployment.shutdown()
            raise
        log.info("target over %d shard actor(s) %s-shard-*: %s", config.target_shards, name_prefix,
                 self.deployment.topology.layer_ranges(self.deployment.info.num_layers))

    def status(self) -> dict[str, Any]:
        """The ``target_shards`` section of ``/health``: shard count, actor names, recoveries
        (shard restarts whose sequences were re-prefilled), batched steps sent."""
        return {"shards": len(self.target.shards),
                "actors": [f"{self.name_prefix}-shard-{k}" for k in range(len(self.target.shards))],
                "recoveries": self.target.recoveries, "batch_calls": self.target.batch_calls}

    def shutdown(self) -> None:
        """Kill the shard actors and free their placement group (idempotent)."""
        self.deployment.shutdown()
