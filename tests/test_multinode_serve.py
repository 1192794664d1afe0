"""Serving on a real two-node Ray cluster on this machine (``cluster.local_cluster``, the same code
as ``make cluster-local``): a head and a worker node, each started with ``ray start``, one CPU and
its own custom resource each.

* ``graftblock serve`` joins the cluster (``ray_address``) with 2 replicas of one CPU each, so Ray
  must put one replica on each node; the state API shows where each replica runs.
* Concurrent requests, spread by Serve over both replicas, equal the single-process twin's greedy
  output token for token (fp32, the tiny Llama of ``tests/test_serve.py``).
* Losing the worker node (its raylet killed by PID) mid-request: requests retry on the head's
  replica or end with an OpenAI 503 body / ``replica_lost`` event, ``/health`` reports the loss, and
  the replica returns with the node.
* A target sharded one pipeline shard per node (``target_shards: 2``, one CPU each) equals the twin;
  losing the worker node mid-request ends every request within its timeout (exact or an OpenAI
  error), and answers are exact again once the node is back.
* Stopping the cluster leaves no process of it running (stopped by PID, never ``ray stop``).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.util.state import list_actors, list_nodes

from cluster.local_cluster import HEAD, LABEL_KEY, LocalCluster
from cluster.serve_app import DEPLOYMENT_NAME
from tests.ray_fixtures import local_cluster  # noqa: F401 (a fixture)
from tests.test_serve import AUTH, API_KEY, MODEL_NAME, Server, greedy, prompt_ids, twin, words  # noqa: F401 (twin: fixture over this module's server)

pytestmark = pytest.mark.slow


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
    return sorted(names.get(a.node_id) for a in actors  # the engine replicas, not the router
                  if a.class_name.startswith("ServeReplica:") and a.class_name.endswith(f":{DEPLOYMENT_NAME}"))


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


# --------------------------------------------------------------------------- losing the worker node
LOST_TOKENS = 1400


def _health(server) -> dict:
    import requests

    return requests.get(server.base + "/health", timeout=30).json()


def _wait_for(what: str, check, timeout: float, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def _stream(server, ids: list[int], first: threading.Event) -> dict:
    """One streamed completion: its text, the error event it ended with (if any), whether [DONE] came."""
    import requests

    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": LOST_TOKENS, "temperature": 0, "stream": True}
    out = {"text": "", "error": None, "done": False, "status": None}
    with requests.post(server.base + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["text"] += event["choices"][0]["text"]
            first.set()
    return out


def _whole(server, ids: list[int], max_tokens: int = LOST_TOKENS) -> tuple[int, dict]:
    import requests

    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=120)
    return r.status_code, r.json()


def test_losing_the_worker_node_mid_request_retries_or_fails_cleanly_and_the_replica_comes_back(
        local_cluster, server, twin):
    """Kill the worker node's raylet (by PID) while streamed and whole completions run on both replicas:
    every request ends within its timeout, either equal to the twin (retried on the head's replica, or
    it was there) or with an OpenAI 503 body / a ``replica_lost`` error event after an exact prefix;
    ``/health`` says ``degraded`` with one replica running; when the node returns, so does its replica."""
    assert _replica_nodes(local_cluster) == [HEAD, "worker"]
    prompts = [prompt_ids(300 + i) for i in range(6)]
    refs = [words(greedy(twin, ids, LOST_TOKENS)) for ids in prompts]
    before = _health(server)["router"]
    firsts = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream, server, prompts[i], firsts[i]) for i in range(3)]
        wholes = [pool.submit(_whole, server, prompts[i]) for i in range(3, 6)]
        assert all(f.wait(60) for f in firsts), "the streams never started"
        local_cluster.kill_raylet("worker")
        t_kill = time.monotonic()
        got_streams = [f.result(timeout=180) for f in streams]  # nothing hangs
        got_wholes = [f.result(timeout=180) for f in wholes]
    ended_s = time.monotonic() - t_kill

    for out, ref in zip(got_streams, refs[:3]):
        assert out["status"] == 200 and out["done"], out
        if out["error"] is None:
            assert out["text"] == ref
        else:  # cut by the lost replica: an OpenAI error event after an exact prefix
            assert out["error"]["code"] == "replica_lost" and out["error"]["type"] == "overloaded_error", out
            assert ref.startswith(out["text"]), (out["text"][:80], ref[:80])
    for (status, body), ref in zip(got_wholes, refs[3:]):
        if status == 200:
            assert body["choices"][0]["text"] == ref
        else:
            assert status == 503 and body["error"]["code"] == "replica_unavailable", (status, body)

    health = _wait_for("/health shows the lost replica",
                       lambda: (h := _health(server))["replicas"]["running"] == 1 and h, timeout=120)
    assert health["status"] == "degraded" and health["replicas"]["target"] == 2
    counters = health["router"]
    print(f"requests ended {ended_s:.1f} s after the kill; router {counters}; "
          f"cut streams {sum(o['error'] is not None for o in got_streams)}, "
          f"503s {sum(s != 200 for s, _ in got_wholes)}")
    touched = sum(counters[k] - before[k] for k in ("retried", "lost_streams", "unavailable"))
    assert touched >= 1, (before, counters)  # some request was on the lost replica, and the router saw it

    # Still serving, exactly, on the head's replica.
    status, body = _whole(server, prompts[0])
    assert status == 200 and body["choices"][0]["text"] == refs[0]

    # The node comes back: Serve places the missing replica on it again.
    local_cluster.start_node("worker")
    _wait_for("the replica back on the worker node", lambda: _replica_nodes(local_cluster) == [HEAD, "worker"],
              timeout=180, poll=1.0)
    health = _wait_for("/health back to running", lambda: (h := _health(server))["status"] == "running" and h,
                       timeout=120)
    assert health["replicas"] == {"running": 2, "target": 2}
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: _whole(server, prompts[i]), range(4)))
    assert [b["choices"][0]["text"] for s, b in after if s == 200] == refs[:4]


# --------------------------------------------------------------------------- a target sharded over both nodes
def _shard_nodes(cluster: LocalCluster) -> list[str]:
    names = {n.node_id: (n.labels or {}).get(LABEL_KEY) for n in list_nodes(address=cluster.dashboard_url, detail=True)}
    actors = list_actors(address=cluster.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return sorted(names.get(a.node_id) for a in actors if a.class_name.endswith("TargetShard"))


def test_a_target_sharded_one_shard_per_node_equals_the_twin_and_survives_losing_a_node(
        local_cluster, server, twin, tmp_path):
    """``target_shards: 2`` with one CPU per shard and one per node: Ray must put one pipeline shard on
    each node. Answers equal the twin; losing the worker node mid-request ends every request within its
    timeout (exact, or an error naming the lost shard); once the node is back, answers are exact again."""
    server.stop()  # the two-replica server holds both nodes' CPUs

    class ShardedServer(Server):
        OVERRIDES = {"ray_address": local_cluster.gcs_address, "ray_num_cpus": None, "num_replicas": 1,
                     "replica_resources": {"CPU": 0, f"graftblock_{HEAD}": 0.5}, "target_shards": 2,
                     "shard_cpus": 1, "shard_max_restarts": 5, "shard_restart_timeout_s": 10.0,
                     "stall_timeout_s": 60.0, "request_timeout_s": 90.0, "proxy_location": "HeadOnly"}

    srv = ShardedServer(tmp_path)
    try:
        srv.wait_ready(timeout=180.0)
        assert _shard_nodes(local_cluster) == [HEAD, "worker"]
        prompts = [prompt_ids(400 + i) for i in range(3)]
        refs = [words(greedy(twin, ids, LOST_TOKENS)) for ids in prompts]
        short = words(greedy(twin, prompts[1], 40))
        status, body = _whole(srv, prompts[1], 40)
        assert status == 200 and body["choices"][0]["text"] == short

        firsts = [threading.Event() for _ in range(2)]
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(_stream, srv, prompts[i], firsts[i]) for i in range(2)]
            whole = pool.submit(_whole, srv, prompts[2])
            assert all(f.wait(60) for f in firsts), "the streams never started"
            local_cluster.kill_raylet("worker")
            t_kill = time.monotonic()
            got = [f.result(timeout=150) for f in streams]  # nothing hangs past the request timeout
            w_status, w_body = whole.result(timeout=150)
        ended_s = time.monotonic() - t_kill
        for out, ref in zip(got, refs):
            if out["error"] is None and out["status"] == 200:
                assert out["done"] and out["text"] == ref
            else:
                assert ref.startswith(out["text"]), out["text"][:80]
                # The shard could not be re-placed (no node had its CPU): a transient 503, not a 500.
                assert out["error"] is not None and out["error"]["message"], out
                assert out["error"]["code"] == "shard_unavailable", out["error"]
        if w_status == 200:
            assert w_body["choices"][0]["text"] == refs[2]
        else:
            assert w_status == 503 and w_body["error"]["code"] == "shard_unavailable", (w_status, w_body)
            assert "shard" in w_body["error"]["message"], w_body
        print(f"sharded: requests ended {ended_s:.1f} s after the kill; streams "
              f"{[(o['status'], (o['error'] or {}).get('code')) for o in got]}, whole {w_status}")

        local_cluster.start_node("worker")
        _wait_for("both shards placed again", lambda: _shard_nodes(local_cluster) == [HEAD, "worker"],
                  timeout=240, poll=1.0)

        def exact_again():
            s, b = _whole(srv, prompts[1], 40)
            return s == 200 and b["choices"][0]["text"] == short

        _wait_for("an exact answer after the node returned", exact_again, timeout=240, poll=2.0)
    finally:
        srv.stop()
