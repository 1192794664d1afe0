"""The learner inside the server: a live Ray Serve app on loopback with a learnable drafter.

The app (``cluster.serve_app.build_app``) runs in the session's Ray cluster (``ray_local``), so the
test can reach the shared named learner actor and ``ray.kill`` it. Tiny random Llama saved to disk
with the word tokenizer of ``tests/test_serve.py``, fp32, greedy, a random EAGLE-3 head; the
learner runs policy ``always`` with a tiny budget so it applies updates within a few requests.

* every output through the server equals vanilla greedy decoding of the single-process twin, before
  and after the learner's weights are swapped into the replica's drafters (streamed and concurrent
  requests included); the swaps, decisions and fed records are in ``/metrics``, ``/health`` and the
  MLflow serving run;
* ``ray.kill`` of the learner in the middle of a stream: the stream completes with the vanilla
  tokens, later requests too; the actor comes back (a new call answers) having reloaded its last
  published weights (version and digest), and the replica notices the restart.

Runtime: ~40-60 s on 2 CPUs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests
import torch

from speculation.config import EngineConfig, SamplingConfig
from speculation.engine.solo import generate_vanilla
from tests.helpers import single_thread, tiny_llama
from tests.ray_fixtures import ray_local  # noqa: F401
from tests.test_serve import VOCAB, free_port, prompt_ids, word_tokenizer, words

MODEL_NAME = "tiny"
APP_NAME = "graftblock-learner-test"
EAGLE3 = {"checkpoint": "random", "draft_vocab_size": VOCAB, "total_tokens": 12, "depth": 3, "top_k": 4}


@pytest.fixture(scope="module")
def app(ray_local, tmp_path_factory):  # noqa: F811
    from ray import serve

    from cluster.serve_app import build_app
    from cluster.serve_config import serve_config_from_dict

    tmp = tmp_path_factory.mktemp("serve-learner")
    model_dir = tmp / "model"
    tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048).save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    port = free_port()
    cfg = serve_config_from_dict({
        "model": str(model_dir), "served_model_name": MODEL_NAME, "dtype": "float32",
        "method": "eagle3", "methods": {"eagle3": EAGLE3}, "host": "127.0.0.1", "port": port,
        "max_prompt_tokens": 64, "max_tokens": 256, "default_max_tokens": 16, "max_sequences": 4,
        "request_timeout_s": 60.0, "torch_threads": 1, "replica_resources": {"CPU": 0},
        "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "serve-learner-test",
        "metrics_interval_s": 0.5,
        "learner": {"policy": "always", "decide_every_steps": 8, "fixed_budget": 2, "heldout_sequences": 1,
                    "min_train_sequences": 1, "batch_records": 4, "poll_interval_s": 0.2, "call_timeout_s": 5.0,
                    "num_cpus": 0.1, "max_restarts": 2, "actor_name": f"learner-{uuid.uuid4().hex[:8]}",
                    "checkpoint_dir": str(tmp / "learner")},
    })
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
        yield cfg, f"http://127.0.0.1:{port}", model_dir
    finally:
        if serve.status().applications.get(APP_NAME) is not None:
            serve.delete(APP_NAME)
        serve.shutdown()


@pytest.fixture(scope="module")
def twin(app):
    from speculation import assets
    from speculation.model.target import TargetModel

    model, tok = assets.load_model_and_tokenizer(str(app[2]), torch.float32)
    return TargetModel(model, tok)


@pytest.fixture(scope="module")
def client(app):
    import openai

    return openai.OpenAI(base_url=app[1] + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def vanilla(twin, ids: list[int], n: int) -> list[int]:
    with single_thread():
        return generate_vanilla(twin, ids, EngineConfig(max_new_tokens=n, sampling=SamplingConfig())).tokens


def complete(client, ids: list[int], n: int) -> str:
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=n, temperature=0)
    return resp.choices[0].text


def learner_health(base: str) -> dict:
    body = requests.get(base + "/health", timeout=30).json()
    assert "learner" in body, body
    return body["learner"]


def metric(base: str, name: str) -> float:
    """Sum of a Prometheus sample family's values in ``/metrics`` (0 if absent)."""
    total = 0.0
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def serve_until(client, twin, base: str, done, seed0: int, n: int = 20, limit: int = 16) -> int:
    """Send greedy requests (each checked against vanilla) until ``done(learner health)``."""
    for k in range(limit):
        ids = prompt_ids(seed0 + k)
        assert complete(client, ids, n) == words(vanilla(twin, ids, n))
        if done(learner_health(base)):
            return k + 1
        time.sleep(0.3)
    raise AssertionError(f"learner condition not reached after {limit} requests: {learner_health(base)}")


def _serve_load():
    """``benchmarks/serve_load.py`` as a module (benchmarks/ is a folder of scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_load.py"
    import sys

    if "serve_load" not in sys.modules:
        spec = importlib.util.spec_from_file_location("serve_load", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["serve_load"] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules["serve_load"]


# --------------------------------------------------------------------------- no server
def test_serve_load_reports_tau_per_phase_of_a_stream(capsys):
    sl = _serve_load()
    finished = [("chat", 10, 1.5, 1.0), ("code", 20, 2.0, 3.0), ("chat", 10, 1.7, 2.0), ("code", 20, None, 5.0)]
    out = sl.per_phase(finished, ["chat", "code", "math"], 0.0)
    assert list(out) == ["chat", "code"]  # stream order; a phase with no finished request is absent
    assert out["chat"] == {"requests": 2, "tokens": 20, "tau_mean": pytest.approx(1.6), "seconds": 2.0,
                           "tokens_per_s": 10.0}
    assert out["code"]["seconds"] == 3.0 and out["code"]["tau_mean"] == 2.0  # a request without tau is not averaged
    for argv, needle in ((["--requests-per-phase", "3"], "--requests-per-phase needs --stream"),
                         (["--stream", "x.yaml", "--offline-baseline"], "does not take --stream")):
        with pytest.raises(SystemExit):
            sl.main(["--base-url", "http://127.0.0.1:9/v1", *argv])
        assert needle in capsys.readouterr().err


def test_learner_config_errors_name_the_field_and_the_local_default():
    from cluster.serve_config import ConfigError, load_serve_config, serve_config_from_dict

    for bad, needle in [({"policy": "sometimes"}, "serve.learner.policy must be one of"),
                        ({"decide_every_steps": 0}, "serve.learner.decide_every_steps must be an integer in [1, "),
                        ({"budgets": [32, -1]}, "serve.learner.budgets[] must be an integer in [0, 100000]"),
                        ({"num_cpus": 100}, "serve.learner.num_cpus must be a number in [0, 64]"),
                        ({"call_timeout_s": 0}, "serve.learner.call_timeout_s must be a number of seconds"),
                        ({"lr": 2.0}, "serve.learner.lr must be a number in (0, 1]"),
                        ({"retry_growth": 1}, "serve.learner.retry_growth must be a number > 1"),
                        ({"accepted_keep": 1.5}, "serve.learner.accepted_keep must be a number in [0, 1]"),
                        ({"explore_budget": 2}, "serve.learner.explore_budget must be a number in [0, 1] or null"),
                        ({"guard_mode": "both"}, "serve.learner.guard_mode must be one of ['paired', 'live']"),
                        ({"guard_margin": 1.0}, "serve.learner.guard_margin must be a number in [0, 1)"),
                        ({"recency_half_life": 0}, "serve.learner.recency_half_life must be a number > 0 or null"),
                        ({"audit_window_steps": 1}, "serve.learner.audit_window_steps must be an integer in [2, 10000000]"),
                        ({"min_train_positions": -5}, "serve.learner.min_train_positions must be an integer in [0, "),
                        ({"bogus": 1}, "serve.learner: unknown key(s) ['bogus']")]:
        with pytest.raises(ConfigError) as e:
            serve_config_from_dict({"learner": bad})
        assert needle in str(e.value)
    local = load_serve_config(None)  # the embedded default: learner on, but its method is not learnable
    assert local.learner.enabled and local.method == "retrieval"
    assert serve_config_from_dict(local.replica_dict()) == local
    from cluster.serve_learner import controller_config

    ctl = controller_config(serve_config_from_dict({"learner": {"min_train_positions": 700, "retry_growth": 3.0, "accepted_keep": 0.5, "explore_budget": 0.1}}).learner)
    assert ctl.min_train_positions == 700 and ctl.bandit.retry_growth == 3.0 and ctl.online.accepted_keep == 0.5
    assert ctl.explore_budget == 0.1
    from adaptation.rollback import GuardMode
    from cluster.serve_config import GUARD_MODES
    from graftblock.adapt import GUARD_MODES as CLI_GUARD_MODES

    assert set(GUARD_MODES) == set(CLI_GUARD_MODES) == {m.value for m in GuardMode}
    guard = controller_config(serve_config_from_dict({"learner": {"guard_mode": "live", "guard_margin": 0.2}}).learner).guard
    assert guard.mode is GuardMode.LIVE and guard.margin == 0.2
    online = controller_config(serve_config_from_dict({"learner": {"recency_half_life": 8}}).learner).online
    assert online.recency_half_life == 8 and controller_config(serve_config_from_dict({}).learner).online.recency_half_life is None
    assert controller_config(serve_config_from_dict({}).learner).guard.mode is GuardMode.PAIRED
    assert controller_config(serve_config_from_dict({"learner": {"audit_window_steps": 128}}).learner).audit_window_steps == 128
    assert controller_config(serve_config_from_dict({}).learner).audit_window_steps is None


def test_a_method_that_is_not_learnable_gets_a_noop_learner_and_says_so(caplog):
    from prometheus_client import CollectorRegistry

    from cluster.serve_config import LearnerServeConfig
    from cluster.serve_learner import attach_learner
    from speculation.drafters import build_drafter, resolve_methods
    from tests.helpers import tiny_target

    target = tiny_target()
    spec = resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False}})[0]

    def factory():
        return build_drafter(spec, target)

    with caplog.at_level("WARNING", logger="graftblock.serve.learner"):
        served, learner = attach_learner(LearnerServeConfig(), "retrieval", factory, "r0", CollectorRegistry())
        assert (served, learner) == (factory, None)
        assert attach_learner(LearnerServeConfig(), "vanilla", None, "r0", CollectorRegistry()) == (None, None)
    assert "method 'retrieval' is not learnable" in caplog.text and "no-op" in caplog.text
    assert attach_learner(LearnerServeConfig(enabled=False), "retrieval", factory, "r0",
                          CollectorRegistry()) == (factory, None)


def test_feedback_hook_drops_under_backpressure_and_never_changes_the_batch_output():
    """The replica's engine hook on a real BatchEngine: a consumer that never returns (a hung
    learner) fills the bounded queue; records beyond it are dropped and counted, decode finishes,
    and the batched greedy output equals vanilla."""
    import threading

    from adaptation.feedback import FeedbackSink, SinkConfig
    from cluster.serve_learner import _StepFeedback
    from speculation.config import BatchConfig, Eagle3Config
    from speculation.drafters.eagle3 import build_eagle3_drafter
    from speculation.engine.batch import BatchEngine, Request
    from tests.helpers import tiny_target

    target = tiny_target()
    release, got = threading.Event(), []

    def hung_learner(batch):
        got.append(batch)
        release.wait(60)

    sink = FeedbackSink(hung_learner, SinkConfig(max_queue=4, batch_records=2)).start()
    hook = _StepFeedback(sink, "replica-a")
    cfg = Eagle3Config(**EAGLE3)
    engine = BatchEngine(target, lambda: build_eagle3_drafter(cfg, target), BatchConfig(max_sequences=3),
                         feedback=hook)
    prompts = [prompt_ids(600 + i) for i in range(3)]
    try:
        with single_thread():
            t0 = time.monotonic()
            out = engine.run([Request(f"r{i}", p, 24, SamplingConfig()) for i, p in enumerate(prompts)])
            elapsed = time.monotonic() - t0
            refs = [vanilla(target, p, 24) for p in prompts]
        assert [out[f"r{i}"].tokens for i in range(3)] == refs
        steps = sum(len(out[f"r{i}"].steps) for i in range(3))
        assert sink.stats.emitted == steps and sink.stats.dropped >= steps - 4 - 2 > 0
        assert elapsed < 60  # decode did not wait for the consumer (it blocks for 60 s)
        ids = {r.request_id for batch in got for r in batch}
        assert ids and all(i.startswith("replica-a/") for i in ids)
    finally:
        release.set()
        sink.close(flush=False)


# --------------------------------------------------------------------------- live server
def test_outputs_equal_vanilla_across_weight_swaps(app, client, twin):
    cfg, base, _ = app
    assert learner_health(base)["weights_version"] == 0
    serve_until(client, twin, base, lambda h: h["swaps"] >= 1, seed0=100)
    h = learner_health(base)
    assert h["weights_version"] >= 1 and h["available"]
    # after the swap: streamed, and concurrent requests in one batch, still vanilla token for token
    ids = prompt_ids(7)
    chunks = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == words(vanilla(twin, ids, 30))
    prompts = [prompt_ids(200 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: complete(client, p, 24), prompts))
    assert outs == [words(vanilla(twin, p, 24)) for p in prompts]
    # a second swap (longer requests: it may land mid-generation), outputs unchanged
    v = learner_health(base)["weights_version"]
    serve_until(client, twin, base, lambda h: h["weights_version"] > v, seed0=300, n=48)

    assert metric(base, "graftblock_learner_swaps_total") >= 2
    assert metric(base, 'graftblock_learner_decisions_total{outcome="applied"}') >= 2
    assert metric(base, "graftblock_learner_feedback_sent_total") > 0
    # the load generator's scrape of the same counters (benchmarks/serve_load.py --stream)
    counters = asyncio.run(_serve_load()._learner_counters(SimpleNamespace(base_url=base + "/v1", api_key=None)))
    assert counters["swaps"] >= 2 and counters["decisions"]["applied"] >= 2 and counters["weights_version"] >= 2
    assert counters["feedback_sent"] > 0
    text = requests.get(base + "/metrics", timeout=30).text
    for reason in ("queue_full", "inflight", "learner_error"):  # drops are counted, not hidden
        assert f'graftblock_learner_feedback_dropped_total{{reason="{reason}"}}' in text
    # decisions are metrics of the replica's MLflow serving run
    import mlflow

    mc = mlflow.MlflowClient(tracking_uri=cfg.tracking_uri)
    deadline = time.monotonic() + 20
    while True:
        runs = mc.search_runs([mc.get_experiment_by_name(cfg.experiment).experiment_id])
        hist = mc.get_metric_history(runs[0].info.run_id, "learner.outcome.applied") if runs else []
        if len(hist) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(hist) >= 2 and runs[0].data.params["learner.policy"] == "always"
    assert "learner.weights_version" in mc.get_run(runs[0].info.run_id).data.metrics


def test_killed_learner_serving_goes_on_and_it_restarts_from_its_last_weights(app, client, twin, ray_local):  # noqa: F811
    import ray

    from workers.learner import wait_until_ready

    cfg, base, _ = app
    handle = ray.get_actor(cfg.learner.actor_name, namespace="graftblock")
    if learner_health(base)["weights_version"] < 1:  # run alone: get a published version first
        serve_until(client, twin, base, lambda h: h["weights_version"] >= 1, seed0=400)
    before = ray.get(handle.published.remote(0), timeout=30)
    assert before.version >= 1 and before.digest

    ids = prompt_ids(11)
    stream = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=120, temperature=0, stream=True)
    text = []
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].text)
        if i == 2:
            ray.kill(handle, no_restart=False)  # mid-stream: Ray restarts it (max_restarts)
    assert "".join(text) == words(vanilla(twin, ids, 120))
    assert complete(client, prompt_ids(12), 20) == words(vanilla(twin, prompt_ids(12), 20))

    wait_until_ready(handle, timeout_s=90)  # a new call succeeds
    after = ray.get(handle.published.remote(0), timeout=30)
    assert after.incarnation != before.incarnation and after.restored
    assert after.restored_version >= before.version
    if after.restored_version == before.version:  # no round ran between the read and the kill
        assert after.restored_digest == before.digest
    # the replica notices the restart, and serving (with feedback to the new incarnation) goes on
    serve_until(client, twin, base, lambda h: h["restarts"] >= 1 and h["available"]
                and h["weights_version"] >= before.version, seed0=500)
    assert metric(base, "graftblock_learner_restarts_total") >= 1
