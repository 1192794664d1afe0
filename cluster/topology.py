"""Where the distributed target and drafter run: the validated topology config.

A topology says how many pipeline shards the target is cut into, what each shard and the drafter
worker ask Ray for (one GPU per shard on a GPU cluster; a fraction of a CPU here), and how the
bundles are placed. ``ray_configs/local.yaml`` mirrors :class:`Topology`'s defaults (the embedded
default); ``ray_configs/topology_gpu.yaml`` is the GPU-cluster variant.

Layer split: shard k of S over L layers holds layers ``[k*L//S, (k+1)*L//S)`` (contiguous,
sizes differ by at most one). Shard 0 also holds the embeddings; the last shard also holds the
final norm and the LM head.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


from speculation.config import ConfigError, from_dict, load_yaml_mapping

#: The file that mirrors the embedded default topology.
LOCAL_TOPOLOGY = Path(__file__).resolve().parent.parent / "ray_configs" / "local.yaml"


class PlacementStrategy(str, enum.Enum):
    """Ray placement-group strategies (see ``ray.util.placement_group``)."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


def _check_resources(owner: str, res: Mapping[str, Any]) -> dict[str, float]:
    if not isinstance(res, Mapping) or not res:
        raise ConfigError(f"{owner} must be a non-empty mapping of Ray resource name -> amount, got {res!r}")
    out: dict[str, float] = {}
    for name, amount in res.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{owner}: resource names must be strings, got {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(float(amount)):
            raise ConfigError(f"{owner}.{name} must be a finite number, got {amount!r}")
        if amount < 0:
            raise ConfigError(f"{owner}.{name} must be >= 0, got {amount}")
        if name in ("CPU", "GPU") and amount > 1 and amount != int(amount):
            raise ConfigError(
                f"{owner}.{name}: amounts above 1 must be whole numbers (Ray's rule), got {amount}"
            )
        out[name] = float(amount)
    if sum(out.values()) == 0:
        raise ConfigError(f"{owner}: a bundle must ask for some resource (all amounts are 0)")
    return out


@dataclass(frozen=True)
class Topology:
    """How the target and the drafter are placed on a Ray cluster."""

    shards: int = 2
    """Pipeline shards of the target (contiguous layer ranges). Range [1, number of layers]."""
    shard_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.25})
    """Ray resources per shard bundle, e.g. ``{CPU: 0.25}`` here or ``{GPU: 1, CPU: 2}`` on GPUs."""
    drafter_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.25})
    """Ray resources of the drafter worker's bundle."""
    drafter_bundle: bool = True
    """Reserve the drafter worker's bundle in the placement group. Off for a target whose drafters
    run elsewhere (a serving replica's), so the group holds only the shards: a shard per node then
    needs exactly the nodes' shard resources."""
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    """How the bundles are placed across nodes."""
    torch_threads: int | None = 1
    """torch intra-op threads inside each actor (None = torch's default). Range [1, 256]."""
    ready_timeout_s: float = 60.0
    """Seconds to wait for the placement group before failing. Range (0, 3600]."""
    require_resources_now: bool = True
    """Fail fast when the cluster does not have the resources now (turn off under an autoscaler)."""
    max_sequences: int = 4
    """Live sequences (KV caches) kept per shard; the least recently used one is dropped. Range [1, 1024]."""
    max_restarts: int = 2
    """How many times Ray restarts a crashed shard actor (0 = never). The batched path
    (``cluster/batch_backend.py``) re-prefills the restarted shard's live sequences from their
    committed tokens and retries the step. Range [0, 100]."""
    actor_env: dict[str, str] = field(default_factory=lambda: {"OMP_WAIT_POLICY": "PASSIVE"})
    """Environment of the shard and drafter actor processes. The default stops idle OpenMP threads
    from spinning: pipeline shards wait most of the time, and spinning threads of a waiting shard
    steal the cores the working one needs (measured: see benchmarks/ray_overhead.py)."""

    def __post_init__(self) -> None:
        o = "topology"
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ConfigError(f"{o}.shards must be an integer >= 1, got {self.shards!r}")
        object.__setattr__(
            self, "shard_resources", _check_resources(f"{o}.shard_resources", self.shard_resources)
        )
        object.__setattr__(
            self, "drafter_resources", _check_resources(f"{o}.drafter_resources", self.drafter_resources)
        )
        if not isinstance(self.drafter_bundle, bool):
            raise ConfigError(f"{o}.drafter_bundle must be true or false, got {self.drafter_bundle!r}")
        try:
            object.__setattr__(self, "placement_strategy", PlacementStrategy(self.placement_strategy))
        except ValueError:
            allowed = ", ".join(s.value for s in PlacementStrategy)
            raise ConfigError(
                f"{o}.placement_strategy must be one of {allowed}, got {self.placement_strategy!r}"
            ) from None
        if self.torch_threads is not None and (
            isinstance(self.torch_threads, bool)
            or not isinstance(self.torch_threads, int)
            or not 1 <= self.torch_threads <= 256
        ):
            raise ConfigError(
                f"{o}.torch_threads must be an integer in [1, 256] or null, got {self.torch_threads!r}"
            )
        if (
            isinstance(self.ready_timeout_s, bool)
            or not isinstance(self.ready_timeout_s, (int, float))
            or not (0 < self.ready_timeout_s <= 3600)
        ):
            raise ConfigError(f"{o}.ready_timeout_s must be in (0, 3600], got {self.ready_timeout_s!r}")
        if (
            isinstance(self.max_sequences, bool)
            or not isinstance(self.max_sequences, int)
            or not (1 <= self.max_sequences <= 1024)
        ):
            raise ConfigError(
                f"{o}.max_sequences must be an integer in [1, 1024], got {self.max_sequences!r}"
            )
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or not (
            0 <= self.max_restarts <= 100
        ):
            raise ConfigError(f"{o}.max_restarts must be an integer in [0, 100], got {self.max_restarts!r}")
        if not isinstance(self.actor_env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.actor_env.items()
        ):
            raise ConfigError(f"{o}.actor_env must map variable names to strings, got {self.actor_env!r}")

    # ------------------------------------------------------------------ derived
    def check_layers(self, num_layers: int) -> None:
        """Raise :class:`ConfigError` if the target cannot be cut into ``shards`` pieces."""
        if self.shards > num_layers:
            raise ConfigError(
                f"topology.shards = {self.shards} exceeds the target's {num_layers} layers; "
                f"allowed: [1, {num_layers}] (each shard needs at least one layer)"
            )

    def layer_ranges(self, num_layers: int) -> list[range]:
        """Contiguous layer range of every shard (validated against ``num_layers``)."""
        self.check_layers(num_layers)
        s = self.shards
        return [range(k * num_layers // s, (k + 1) * num_layers // s) for k in range(s)]

    def bundles(self) -> list[dict[str, float]]:
        """Placement-group bundles: one per shard, then the drafter worker's (when ``drafter_bundle``)."""
        drafter = [dict(self.drafter_resources)] if self.drafter_bundle else []
        return [dict(self.shard_resources) for _ in range(self.shards)] + drafter

    def total_resources(self) -> dict[str, float]:
        """Sum of every bundle's resources."""
        total: dict[str, float] = {}
        for b in self.bundles():
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def with_shards(self, shards: int | None) -> "Topology":
        """A copy with ``shards`` replaced (None keeps this one's)."""
        if shards is None:
            return self

        return replace(self, shards=shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "shard_resources": dict(self.shard_resources),
            "drafter_resources": dict(self.drafter_resources),
            "drafter_bundle": self.drafter_bundle,
            "placement_strategy": self.placement_strategy.value,
            "torch_threads": self.torch_threads,
            "ready_timeout_s": self.ready_timeout_s,
            "require_resources_now": self.require_resources_now,
            "max_sequences": self.max_sequences,
            "max_restarts": self.max_restarts,
            "actor_env": dict(self.actor_env),
        }


def load_topology(path: str | Path | None = None) -> Topology:
    """The topology in ``path`` (YAML), or the embedded default when None."""
    if path is None:
        return Topology()
    p = Path(path)
    data = load_yaml_mapping(p, "topology", "field -> value")
    return from_dict(Topology, data, where=f"topology ({p.name})")
