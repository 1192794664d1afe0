"""Topology config, layer split and the Ray config files (no Ray cluster needed; < 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.topology import LOCAL_TOPOLOGY, PlacementStrategy, Topology, load_topology
from speculation.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_local_yaml_is_the_embedded_default():
    assert load_topology(LOCAL_TOPOLOGY) == Topology() == load_topology(None)


def test_gpu_topology_asks_one_gpu_per_shard():
    topo = load_topology(REPO / "ray_configs" / "topology_gpu.yaml")
    assert topo.shard_resources["GPU"] == 1
    assert topo.bundles()[: topo.shards] == [topo.shard_resources] * topo.shards
    assert topo.placement_strategy == PlacementStrategy.SPREAD


def test_without_the_drafter_bundle_the_group_holds_only_the_shards():
    topo = Topology(shards=2, shard_resources={"CPU": 1}, drafter_bundle=False)
    assert topo.bundles() == [{"CPU": 1}, {"CPU": 1}] and topo.total_resources() == {"CPU": 2}
    assert Topology(shards=2, shard_resources={"CPU": 1}).total_resources() == {"CPU": 2.25}


@pytest.mark.parametrize("layers,shards", [(30, 1), (30, 2), (30, 4), (30, 7), (4, 4), (5, 3)])
def test_layer_ranges_are_contiguous_and_balanced(layers, shards):
    ranges = Topology(shards=shards).layer_ranges(layers)
    assert len(ranges) == shards
    assert [i for r in ranges for i in r] == list(range(layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_more_shards_than_layers_is_a_clear_error():
    with pytest.raises(
        ConfigError, match=r"topology.shards = 5 exceeds the target's 4 layers; allowed: \[1, 4\]"
    ):
        Topology(shards=5).layer_ranges(4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"shards": 0}, r"topology.shards must be an integer >= 1"),
        ({"shards": 1.5}, r"topology.shards must be an integer"),
        ({"shard_resources": {}}, r"topology.shard_resources must be a non-empty mapping"),
        ({"shard_resources": {"CPU": -1}}, r"topology.shard_resources.CPU must be >= 0"),
        ({"shard_resources": {"GPU": 1.5}}, r"whole numbers"),
        ({"drafter_resources": {"CPU": "x"}}, r"topology.drafter_resources.CPU must be a finite number"),
        ({"drafter_bundle": "yes"}, r"topology.drafter_bundle must be true or false"),
        ({"placement_strategy": "NEAR"}, r"placement_strategy must be one of PACK, SPREAD"),
        ({"torch_threads": 0}, r"torch_threads must be an integer in \[1, 256\]"),
        ({"ready_timeout_s": 0}, r"ready_timeout_s must be in \(0, 3600\]"),
        ({"max_sequences": 0}, r"max_sequences must be an integer in \[1, 1024\]"),
    ],
)
def test_bad_topology_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Topology(**kwargs)


def test_unknown_topology_key_is_named(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("shards: 2\ngpus_per_shard: 1\n")
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) \['gpus_per_shard'\]; allowed: .*shard_resources"
    ):
        load_topology(p)


def test_total_resources_and_override():
    topo = Topology(shards=3, shard_resources={"CPU": 0.5}, drafter_resources={"CPU": 0.25})
    assert topo.total_resources() == {"CPU": 1.75}
    assert topo.with_shards(1).shards == 1 and topo.with_shards(None) is topo


def test_cluster_yaml_has_gpu_node_types():
    cfg = yaml.safe_load((REPO / "ray_configs" / "cluster.yaml").read_text())
    gpu_types = [n for n, t in cfg["available_node_types"].items() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types and cfg["head_node_type"] in cfg["available_node_types"]


def test_runtime_env_and_rayignore_exclude_heavy_paths():
    env = yaml.safe_load((REPO / "ray_configs" / "runtime_env.yaml").read_text())
    ignore = (REPO / ".rayignore").read_text().split()
    for path in (".venv/", "mlflow.db", "runs/", "mlruns/"):
        assert path in env["excludes"] and path in ignore


def test_actor_env_defaults_to_passive_openmp_and_is_validated():
    assert Topology().actor_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    with pytest.raises(ConfigError, match=r"topology.actor_env must map variable names to strings"):
        Topology(actor_env={"OMP_NUM_THREADS": 1})
