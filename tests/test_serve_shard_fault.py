"""A killed target shard under a live server: ``serve.target_shards: 2`` (issue #14).

A ``graftblock serve`` subprocess (``tests.test_serve_faults.WorkerServer``'s steps: its own local
Ray instance, 127.0.0.1) over the tiny random Llama of ``tests/test_serve.py`` in fp32, greedy,
retrieval, whose target runs as two restartable ``TargetShard`` actors
(``cluster.serve_shards.ShardedServeTarget`` over ``cluster.batch_backend.RayBatchTarget``). The
helper driver of ``tests/test_serve_faults.py`` joins the server's Ray cluster and kills the last
shard by its per-replica actor name (``ray.kill(handle, no_restart=False)``):

* before the fault, a request over the shards equals the single-process twin and ``/health``
  lists two shards, no recovery;
* the kill lands while three streamed ``openai`` requests are decoding: Ray restarts the shard, the
  replica re-prefills the live sequences from their tokens, every request completes with output
  equal to the no-fault output (vanilla greedy of the twin) token for token, and ``/health``
  (read before any further request) shows the recovery; a later request is exact too;
* the config is validated (fields and ranges named) and feature drafters are refused over shards.

Runtime: ~40-50 s on 2 quiet CPUs (server start, one shard restart).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import torch

from tests.ray_fixtures import RAY_TEST_ENV
from tests.test_serve import API_KEY, MODEL_NAME, prompt_ids, words
from tests.test_serve_faults import FAULT_SERVER, ActorHelper, WorkerServer, _vanilla

REPO = Path(__file__).resolve().parent.parent
SHARD_PREFIX = "graftblock-target-"
KILL_TOKENS = 150
KILL_SEEDS = (21, 22, 23)
SOLO_SEED, LATER_SEED = 24, 25


class ShardServer(WorkerServer):
    """``WorkerServer`` (its Ray's GCS address) with the target over two shard actors, drafters in process."""

    OVERRIDES = {
        **FAULT_SERVER,
        "target_shards": 2, "shard_cpus": 0.25, "shard_max_restarts": 3, "shard_restart_timeout_s": 45.0,
    }


class ShardHelper(ActorHelper):
    """The test_serve_faults helper driver, acting on the replica's shard actors (``kill`` kills the
    highest-numbered one, ``<replica>-shard-1``)."""

    def __init__(self, gcs_address: str) -> None:  # noqa: D107 - another actor name prefix
        from tests import test_serve_faults

        self.proc = subprocess.Popen(
            [sys.executable, "-c", test_serve_faults._ACTOR_HELPER, gcs_address, SHARD_PREFIX], cwd=REPO,
            env={**os.environ, **RAY_TEST_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory, serve_subprocess):
    """(server, helper, vanilla references): references are computed while the server starts."""
    from speculation import assets
    from speculation.model.target import TargetModel

    srv = ShardServer(tmp_path_factory.mktemp("serve-shards"))
    helper = None
    try:
        model, tok = assets.load_model_and_tokenizer(str(srv.model_dir), torch.float32)
        twin = TargetModel(model, tok)
        refs = {s: _vanilla(twin, prompt_ids(s), KILL_TOKENS) for s in KILL_SEEDS}
        refs[SOLO_SEED] = _vanilla(twin, prompt_ids(SOLO_SEED), 40)
        refs[LATER_SEED] = _vanilla(twin, prompt_ids(LATER_SEED), 40)
        helper = ShardHelper(srv.gcs_address())
        srv.wait_ready()
        helper.wait_ready()
        yield srv, helper, refs
    finally:
        if helper is not None:
            helper.close()
        srv.stop()


@pytest.fixture(scope="module")
def client(env):
    import openai

    return openai.OpenAI(base_url=env[0].base + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)


def _shards(srv) -> dict:
    h = requests.get(srv.base + "/health", timeout=30)
    assert h.status_code == 200, h.text
    return h.json()["target_shards"]


def test_sharded_server_equals_twin(env, client):
    srv, _, refs = env
    r = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(SOLO_SEED)), max_tokens=40,
                                  temperature=0)
    assert r.choices[0].text == words(refs[SOLO_SEED])
    h = _shards(srv)
    assert h["shards"] == 2 and h["recoveries"] == 0 and h["batch_calls"] >= 1
    assert all(name.startswith(SHARD_PREFIX) for name in h["actors"])


def test_killed_shard_is_restarted_reprefilled_and_requests_complete_exactly(env, client):
    srv, helper, refs = env
    started = threading.Barrier(len(KILL_SEEDS) + 1, timeout=120)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            stream = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(seed)),
                                               max_tokens=KILL_TOKENS, temperature=0, stream=True)
            text, first = [], True
            for chunk in stream:
                text.append(chunk.choices[0].text)
                if first and chunk.choices[0].text:
                    first = False
                    started.wait()  # every request is decoding: now the shard is killed
            results[seed] = "".join(text)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            started.abort()

    before = _shards(srv)
    threads = [threading.Thread(target=run, args=(s,)) for s in KILL_SEEDS]
    for t in threads:
        t.start()
    started.wait()
    killed = helper.command("kill")
    assert killed.endswith("-shard-1"), killed
    for t in threads:
        t.join(150)
    assert not errors, errors
    for seed in KILL_SEEDS:
        assert results[seed] == words(refs[seed]), f"request {seed} differs from the no-fault output"
    after = _shards(srv)  # no request since the streams: a recovery now happened under them
    assert after["recoveries"] >= before["recoveries"] + 1, \
        f"no shard recovery under the requests: the kill of {killed} landed after they ended ({after})"
    r = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(LATER_SEED)), max_tokens=40,
                                  temperature=0)
    assert r.choices[0].text == words(refs[LATER_SEED])
    assert requests.get(srv.base + "/health", timeout=30).json()["status"] == "running"


def test_target_shards_config_is_validated():
    from cluster.serve_config import ConfigError, ServeConfig
    from cluster.serve_shards import check_shardable
    from speculation.drafters import resolve_methods

    assert ServeConfig().target_shards == 0 and ServeConfig(target_shards=2).to_dict()["target_shards"] == 2
    with pytest.raises(ConfigError, match=r"serve.target_shards must be an integer in \[0, 256\]"):
        ServeConfig(target_shards=-1)
    with pytest.raises(ConfigError, match=r"serve.shard_cpus must be a number in \(0, 64\]"):
        ServeConfig(shard_cpus=0)
    with pytest.raises(ConfigError, match=r"serve.shard_max_restarts must be an integer in \[0, 1000\]"):
        ServeConfig(shard_max_restarts=-2)
    with pytest.raises(ConfigError, match="shard_restart_timeout_s .* must be below serve.stall_timeout_s"):
        ServeConfig(target_shards=2, shard_restart_timeout_s=90.0, stall_timeout_s=60.0)
    for method in ("vanilla", "retrieval"):
        check_shardable(ServeConfig(target_shards=2), resolve_methods([method], {})[0])
    with pytest.raises(ConfigError, match=r"serve.target_shards = 2: method 'eagle3' \(eagle3\) needs the "
                                          r"target's weights"):
        check_shardable(ServeConfig(target_shards=2), resolve_methods(["eagle3"], {})[0])
