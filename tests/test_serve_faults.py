"""Drafter-worker faults against a live server: ``drafter_placement: worker`` (issue #14).

A ``graftblock serve`` subprocess (its own local Ray instance, 127.0.0.1) over the tiny random
Llama of ``tests/test_serve.py`` in fp32, greedy, with the retrieval drafter hosted in a
``DrafterWorker`` actor behind ``cluster.resilient_drafter``. A helper process joins the server's
Ray cluster (its GCS address read from the raylet the server started) to act on the worker actor:

* ``ray.kill(worker, no_restart=False)`` while three streamed requests are in flight: each
  completes with output equal to vanilla greedy (the single-process twin) token for token, some
  steps ran without speculation; Ray restarts the worker and a later request speculates again
  (accepted tokens > 0, ``drafter_worker_restarts`` >= 1 in its ``graftblock`` field);
* a hung worker (the helper hosts a test drafter in its own slot whose ``propose`` sleeps, and
  calls it): a request completes exactly, well within the hang, its blocked steps fall back after
  ``drafter_call_timeout_s`` and the timeout is counted in ``/metrics``.

Runtime: ~60-80 s on 2 quiet CPUs (server start ~25 s, one worker restart).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from speculation.config import EngineConfig, SamplingConfig
from speculation.engine.solo import generate_vanilla
from tests.helpers import single_thread
from tests.ray_fixtures import RAY_TEST_ENV
from tests.test_serve import API_KEY, AUTH, MODEL_NAME, Server, prompt_ids, words

REPO = Path(__file__).resolve().parent.parent
WORKER_PREFIX = "graftblock-drafter-worker-"
CALL_TIMEOUT_S = 1.0
HANG_S = 120.0
KILL_TOKENS = 300
KILL_SEEDS = (11, 12, 13)
LATER_SEED, HANG_SEED = 14, 15


FAULT_SERVER = {
    "max_tokens": 1000, "request_timeout_s": 120.0, "drain_timeout_s": 10.0,
    "mlflow": False, "tracking_uri": None, "experiment": None, "metrics_interval_s": None,
    "learner": {"enabled": False},
}
"""Serve-config overrides of the fault-test servers: long requests and timeouts, no MLflow, no learner."""


class WorkerServer(Server):
    """``tests.test_serve.Server`` with the drafters in a worker actor (no MLflow, no learner)."""

    OVERRIDES = {
        **FAULT_SERVER,
        "drafter_placement": "worker", "drafter_worker_cpus": 0.25, "drafter_worker_max_restarts": 5,
        "drafter_call_timeout_s": CALL_TIMEOUT_S, "drafter_restart_timeout_s": 90.0,
    }

    def gcs_address(self, timeout: float = 120.0) -> str:
        """The GCS address of the Ray instance this server started (from its raylet's arguments)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    args = p.cmdline()
                except psutil.Error:
                    continue
                for a in args:
                    if a.startswith("--gcs-address="):
                        return a.split("=", 1)[1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"no raylet with --gcs-address under the server:\n{self.log_path.read_text()[-4000:]}")


# A driver on the server's Ray cluster that acts on the drafter worker, one command per stdin line.
_ACTOR_HELPER = r'''
import sys, time
import ray
from workers.drafter_worker import pack_drafter
from speculation.drafters.base import Proposal
from speculation.spec.tree import DraftTree

ray.init(address=sys.argv[1], log_to_driver=False)


class SleepingDrafter:
    """A test drafter whose propose blocks the worker (a hung actor method)."""
    name, needs_aux, target_topk = "sleeping", False, 0

    def __init__(self, seconds):
        self.seconds = seconds

    def begin(self, ctx, prompt_aux):
        pass

    def propose(self, ctx):
        time.sleep(self.seconds)
        return Proposal(tree=DraftTree(ctx.tokens[-1]))

    def observe(self, ctx, outcome):
        pass


def worker():
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(sys.argv[2])]
    last = max(named, key=lambda a: int(a["name"].rsplit("-", 1)[1]))
    return last["name"], ray.get_actor(last["name"], namespace=last["namespace"])


print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    name, h = worker()
    if cmd == "kill":
        ray.kill(h, no_restart=False)
    elif cmd == "hang":
        ray.get(h.host.remote("test-hang", pack_drafter(SleepingDrafter(float(args[0])))), timeout=60)
        ray.get(h.begin.remote("test-hang", [1], 1, None), timeout=60)
        h.propose.remote("test-hang", [])  # blocks the actor for args[0] seconds
        time.sleep(1.0)
    print("ok", name, flush=True)
'''


class ActorHelper:
    """The helper driver process (started at once; :meth:`wait_ready` before the first command)."""

    def __init__(self, gcs_address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ACTOR_HELPER, gcs_address, WORKER_PREFIX], cwd=REPO,
            env={**os.environ, **RAY_TEST_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        assert self.proc.stdout.readline().strip() == "ready", "the helper could not join the server's Ray"

    def command(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer.startswith("ok "), f"helper answered {answer!r} to {line!r}"
        return answer.split(" ", 1)[1]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _vanilla(target, ids: list[int], n: int) -> list[int]:
    with single_thread():
        return generate_vanilla(target, ids, EngineConfig(max_new_tokens=n, sampling=SamplingConfig())).tokens


@pytest.fixture(scope="module")
def env(tmp_path_factory, serve_subprocess):
    """(server, helper, vanilla references): references are computed while the server starts."""
    from speculation import assets
    from speculation.model.target import TargetModel

    srv = WorkerServer(tmp_path_factory.mktemp("serve-faults"))
    helper = None
    try:
        model, tok = assets.load_model_and_tokenizer(str(srv.model_dir), torch.float32)
        twin = TargetModel(model, tok)
        refs = {s: _vanilla(twin, prompt_ids(s), KILL_TOKENS) for s in KILL_SEEDS}
        refs[LATER_SEED] = _vanilla(twin, prompt_ids(LATER_SEED), 40)
        refs[HANG_SEED] = _vanilla(twin, prompt_ids(HANG_SEED), 60)
        helper = ActorHelper(srv.gcs_address())  # joins while the replica starts
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


def _health(srv) -> dict:
    return requests.get(srv.base + "/health", timeout=30).json()


def test_worker_placement_speculates_exactly(env, client):
    srv, _, refs = env
    r = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(LATER_SEED)), max_tokens=40,
                                  temperature=0)
    assert r.choices[0].text == words(refs[LATER_SEED])
    stats = r.model_extra["graftblock"]
    assert stats["accepted_tokens"] > 0 and stats["drafter_fallback_steps"] == 0
    assert stats["drafter_worker_restarts"] == 0
    h = _health(srv)
    assert h["drafter_worker"]["state"] == "up" and h["drafter_worker"]["restarts"] == 0


def test_killed_worker_requests_complete_exactly_and_speculation_resumes(env, client):
    srv, helper, refs = env
    started = threading.Barrier(len(KILL_SEEDS) + 1, timeout=120)
    results: dict[int, tuple[str, dict]] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            stream = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(seed)),
                                               max_tokens=KILL_TOKENS, temperature=0, stream=True)
            text, stats, first = [], None, True
            for chunk in stream:
                text.append(chunk.choices[0].text)
                if first and chunk.choices[0].text:
                    first = False
                    started.wait()  # every request is decoding: now the worker is killed
                stats = (chunk.model_extra or {}).get("graftblock") or stats
            results[seed] = ("".join(text), stats)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=run, args=(s,)) for s in KILL_SEEDS]
    for t in threads:
        t.start()
    started.wait()
    killed = helper.command("kill")
    for t in threads:
        t.join(150)
    assert not errors, errors
    for seed in KILL_SEEDS:
        text, stats = results[seed]
        assert text == words(refs[seed]), f"request {seed} differs from vanilla after the kill"
    assert sum(results[s][1]["drafter_fallback_steps"] for s in KILL_SEEDS) >= 1, \
        f"no step fell back: the kill of {killed} landed after the requests ended"

    deadline = time.monotonic() + 90
    while True:  # Ray restarts the worker; the supervisor notices at a step, so keep requests coming
        r = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(LATER_SEED)), max_tokens=40,
                                      temperature=0)
        assert r.choices[0].text == words(refs[LATER_SEED])
        stats = r.model_extra["graftblock"]
        if stats["drafter_worker_restarts"] >= 1 and stats["drafter_fallback_steps"] == 0:
            break
        assert time.monotonic() < deadline, f"the worker did not come back: {_health(srv)}"
        time.sleep(1.0)
    assert stats["accepted_tokens"] > 0  # speculation resumed
    h = _health(srv)["drafter_worker"]
    assert h["state"] == "up" and h["restarts"] >= 1 and h["fallback_steps"] >= 1
    metrics = requests.get(srv.base + "/metrics", headers=AUTH, timeout=30).text
    assert 'graftblock_drafter_worker_events_total{event="restart"}' in metrics
    assert 'graftblock_drafter_worker_events_total{event="fallback_step"}' in metrics


def test_hung_worker_becomes_fallback_not_a_hung_request(env, client):
    srv, helper, refs = env
    before = _health(srv)["drafter_worker"]
    helper.command(f"hang {HANG_S}")
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL_NAME, prompt=words(prompt_ids(HANG_SEED)), max_tokens=60,
                                  temperature=0)
    wall = time.monotonic() - t0
    assert r.choices[0].text == words(refs[HANG_SEED])
    stats = r.model_extra["graftblock"]
    assert stats["drafter_fallback_steps"] >= 1
    assert wall < 30.0, f"the request took {wall:.1f} s behind a worker hung for {HANG_S:g} s"
    after = _health(srv)["drafter_worker"]
    assert after["timeouts"] > before["timeouts"]
    assert 'graftblock_drafter_worker_events_total{event="timeout"}' in \
        requests.get(srv.base + "/metrics", headers=AUTH, timeout=30).text


def test_drafter_placement_config_is_validated():
    from cluster.serve_config import ConfigError, DrafterPlacement, ServeConfig

    assert ServeConfig(drafter_placement="worker").drafter_placement is DrafterPlacement.WORKER
    assert ServeConfig().to_dict()["drafter_placement"] == "in_process"
    with pytest.raises(ConfigError, match=r"serve.drafter_placement must be one of \['in_process', 'worker'\]"):
        ServeConfig(drafter_placement="gpu")
    with pytest.raises(ConfigError, match=r"serve.drafter_worker_cpus must be a number in \[0, 64\]"):
        ServeConfig(drafter_worker_cpus=-0.5)
    with pytest.raises(ConfigError, match=r"serve.drafter_worker_max_restarts must be an integer in \[0, 1000\]"):
        ServeConfig(drafter_worker_max_restarts=-1)
    with pytest.raises(ConfigError, match="drafter_call_timeout_s .* must be below serve.stall_timeout_s"):
        ServeConfig(drafter_placement="worker", drafter_call_timeout_s=30.0, stall_timeout_s=10.0)
