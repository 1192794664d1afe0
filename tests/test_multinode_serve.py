"""Serving on a real two-node Ray cluster on this machine (``cluster.local_cluster``, the same code
as ``make cluster-local``): a head and a worker node, each started with ``ray start``, one CPU and
its own custom resource each.

* ``graftblock serve`` joins the cluster (``ray_address``) with 2 replicas of one CPU each, so Ray
  must put one replica on each node; the state API shows where each replica runs.
* Concurrent requests, spread by Serve over both replicas, equal the single-process twin's greedy
  output token for token (fp32, the tiny Llama of ``tests/test_serve.py``).
* Stopping the cluster leaves no process of it running (stopped by PID, never ``ray stop``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.util.state import list_actors, list_nodes

from cluster.local_cluster import HEAD, LABEL_KEY, LocalCluster, LocalClusterConfig
from tests.test_serve import API_KEY, MODEL_NAME, Server, greedy, prompt_ids, twin, words  # noqa: F401 (twin: fixture over this module's server)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    cluster = LocalCluster(LocalClusterConfig(root=tmp_path_factory.mktemp("cluster"), head_cpus=1,
                                              worker_cpus=(1,)))
    cluster.start()
    try:
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"processes of the local cluster still running: {left}"


@pytest.fixture(scope="module")
def server(local_cluster, tmp_path_factory, serve_subprocess):
    class TwoNodeServer(Server):
        OVERRIDES = {"ray_address": local_cluster.gcs_address, "ray_num_cpus": None, "num_replicas": 2,
                     "replica_resources": {"CPU": 1}, "proxy_location": "HeadOnly"}

    srv = TwoNodeServer(tmp_path_factory.mktemp("serve"))
    try:
        srv.wait_ready(timeout=180.0)
        yield srv
    finally:
        srv.stop()


def _replica_nodes(cluster: LocalCluster) -> list[str]:
    """Node names (our ``graftblock.node`` label) of the live Serve replicas of the app."""
    names = {n.node_id: (n.labels or {}).get(LABEL_KEY) for n in list_nodes(address=cluster.dashboard_url, detail=True)}
    actors = list_actors(address=cluster.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return sorted(names.get(a.node_id) for a in actors if a.class_name.startswith("ServeReplica:"))


def test_two_nodes_register_with_their_own_resources(local_cluster):
    nodes = {(n.labels or {}).get(LABEL_KEY): n for n in list_nodes(address=local_cluster.dashboard_url, detail=True)
             if n.state == "ALIVE"}
    assert sorted(nodes) == [HEAD, "worker"]
    for name, node in nodes.items():
        assert node.resources_total["CPU"] == 1
        assert node.resources_total[f"graftblock_{name}"] == 1


def test_replicas_spread_over_both_nodes_and_equal_the_twin(local_cluster, server, twin):
    import openai

    assert _replica_nodes(local_cluster) == [HEAD, "worker"]  # one CPU per node: one replica on each
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)
    prompts = [prompt_ids(100 + i) for i in range(8)]

    def one(ids: list[int]) -> str:
        r = client.completions.create(model=MODEL_NAME, prompt=words(ids), max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert got == [words(greedy(twin, ids, 24)) for ids in prompts]
