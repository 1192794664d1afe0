"""The OpenAI-compatible server: a live ``graftblock serve`` on loopback, driven by the real ``openai`` client.

The server runs as a subprocess (its own local Ray instance, Ray Serve's HTTP proxy on a free
127.0.0.1 port) over a tiny random Llama saved to disk with a whitespace word tokenizer and a real
chat template, in fp32, with the retrieval drafter and chunked prefill (as the shipped
``serve_local.yaml``; the twin chunks alike), and KV slots sized per request. Its greedy outputs
are compared token for token with the single-process twin (``generate_vanilla`` /
``generate_speculative`` on the same saved model). The word tokenizer makes text equality the same as token equality.

* non-streamed and streamed chat and completions equal the twin; usage and the ``graftblock``
  statistics field are filled in; concurrent requests each equal their solo output;
* ``stop`` strings, ``stop_token_ids``, ``seed``;
* bad input: 4xx with OpenAI error bodies (malformed JSON, unknown model, empty messages,
  oversize prompt, negative / too large ``max_tokens``, unsupported fields, missing API key);
* ``/health`` and ``/metrics``; a client that disconnects mid-stream frees its sequence at once;
* SIGTERM drains an in-flight request and ends the MLflow serving run FINISHED;
* in process (no HTTP): a stalled engine and a slow engine become clear errors, not hangs.

Runtime: ~60-90 s on 2 CPUs (server start ~25 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import pytest
import torch
import yaml

from speculation.config import BatchConfig, EngineConfig, SamplingConfig
from speculation.engine.solo import generate_speculative, generate_vanilla
from tests.helpers import single_thread, tiny_llama
from tests.ray_fixtures import RAY_TEST_ENV

REPO = Path(__file__).resolve().parent.parent
VOCAB = 64
MODEL_NAME = "tiny"
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_PROMPT = 64
MAX_TOKENS = 1500
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 't1 ' if m['role'] == 'user' else ('t2 ' if m['role'] == 'assistant' else 't3 ') }}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)


def word_tokenizer():
    """Word-level tokenizer over t0..t63 that splits on whitespace, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``graftblock serve`` subprocess (own session, so its Ray processes are its own group).

    The tiny random Llama with the word tokenizer, fp32, retrieval, MLflow in a sqlite store under
    ``tmp``; a subclass changes the serve config through ``OVERRIDES`` (keys set to ``None`` are
    removed), so every live-server test module starts its server the same way.
    """

    OVERRIDES: dict = {}

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model_dir = tmp / "model"
        tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048).save_pretrained(self.model_dir)
        word_tokenizer().save_pretrained(self.model_dir)
        self.port = free_port()
        self.tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        config = {
            "model": str(self.model_dir), "served_model_name": MODEL_NAME, "dtype": "float32",
            "method": "retrieval", "methods": {"retrieval": {"budget": 8, "cost_aware": False}},
            "host": "127.0.0.1", "port": self.port, "api_key": API_KEY,
            "max_prompt_tokens": MAX_PROMPT, "max_tokens": MAX_TOKENS, "default_max_tokens": 16,
            "max_sequences": 4, "request_timeout_s": 60.0, "drain_timeout_s": 30.0, "torch_threads": 1,
            "replica_resources": {"CPU": 0}, "ray_num_cpus": 2, "tracking_uri": self.tracking_uri,
            "experiment": "serve-test", "metrics_interval_s": 1.0,
            **self.OVERRIDES,
        }
        self.config = {k: v for k, v in config.items() if v is not None}
        self.config_path = tmp / "serve.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = tmp / "server.log"
        self._launch()

    def _launch(self) -> None:
        env = {**os.environ, **RAY_TEST_ENV}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graftblock", "serve", "--config", str(self.config_path)],
            cwd=self.tmp, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def _relaunch_on_a_new_port(self) -> None:
        """The free port was taken between ``free_port`` and Ray Serve's bind (seen once in CI, stop 54):
        start again on another one."""
        self.log.close()
        self.port = free_port()
        self.config["port"] = self.port
        self.config_path.write_text(yaml.safe_dump(self.config))
        self._launch()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        retried = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not retried and "Failed to bind to address" in self.log_path.read_text():
                    retried = True
                    self._relaunch_on_a_new_port()
                    continue
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            if "ready" in self.log_path.read_text():
                return
            time.sleep(0.5)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server's own session: its Ray processes
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


PREFILL_CHUNK = 8
"""This module's server chunks prefills, as the shipped ``serve_local.yaml`` does (by 8 here, so a
24-token prompt takes 3 steps, at most 2 chunks a step); its twin chunks alike. The other
live-server modules keep whole-prompt prefills, so both paths are served against a twin."""


KV_TOKEN_BUDGET = 4096
"""This module's server also sizes KV slots per request (``batch.kv_token_budget``): 4096 rows for
4 slots of up to 1,628 (a 1500-token request and a short one fit together; four fixed slots would
hold 6,512). The other live-server modules keep fixed slots."""


class ChunkedServer(Server):
    OVERRIDES = {"batch": {"prefill_chunk_tokens": PREFILL_CHUNK, "prefill_step_tokens": 2 * PREFILL_CHUNK,
                           "kv_token_budget": KV_TOKEN_BUDGET}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_subprocess):
    srv = ChunkedServer(tmp_path_factory.mktemp("serve"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def twin(server):
    """The single-process twin: the same saved model, in fp32, one torch thread."""
    from speculation import assets
    from speculation.model.target import TargetModel

    model, tok = assets.load_model_and_tokenizer(str(server.model_dir), torch.float32)
    return TargetModel(model, tok)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60.0)


def greedy(twin, ids: list[int], n: int, chunk: int | None = None) -> list[int]:
    """Vanilla greedy on the twin; ``chunk``: prefilled in chunks of that many tokens."""
    with single_thread():
        cfg = EngineConfig(max_new_tokens=n, sampling=SamplingConfig(), prefill_chunk_tokens=chunk)
        return generate_vanilla(twin, ids, cfg).tokens


def expected(twin, ids: list[int], n: int) -> list[int]:
    """The twin's answer for this module's (chunked) server."""
    return greedy(twin, ids, n, chunk=PREFILL_CHUNK)


def prompt_ids(seed: int, n: int = 24) -> list[int]:
    """Repetitive prompts, so the retrieval drafter has something to propose."""
    base = [(seed * 7 + 3 * k) % (VOCAB - 8) + 8 for k in range(4)]
    return (base * n)[:n]


# --------------------------------------------------------------------------- exactness
def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    h = requests.get(server.base + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "running" and h.json()["method"] == "retrieval"
    assert h.json()["torch_threads"] == 1  # serve.torch_threads, applied in the replica
    r = requests.post(server.base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "t9"}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    m = requests.get(server.base + "/metrics", timeout=30)  # metrics are not exposed without the key
    assert m.status_code == 401 and m.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server.base + "/metrics", headers=AUTH, timeout=30).status_code == 200


def test_completions_equal_single_process_twin(server, client, twin):
    ids = prompt_ids(1)
    ref = expected(twin, ids, 40)
    from speculation.drafters import build_drafter, resolve_methods

    spec = resolve_methods(["retrieval"], server.config["methods"])[0]
    with single_thread():
        spec_out = generate_speculative(twin, build_drafter(spec, twin), ids, EngineConfig(max_new_tokens=40))
    assert spec_out.tokens == ref  # the twin itself is lossless

    resp = client.completions.create(model=MODEL_NAME, prompt=words(ids), max_tokens=40, temperature=0)
    assert resp.choices[0].text == words(ref)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (24, 40, 64)
    stats = resp.model_extra["graftblock"]
    assert stats["method"] == "retrieval" and stats["verify_steps"] >= 1
    assert stats["tau"] == pytest.approx((40 - 1) / stats["verify_steps"])  # first token comes from prefill
    # token-id prompt, streamed
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == words(ref)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].model_extra["graftblock"]["method"] == "retrieval"


def test_chat_equals_single_process_twin(server, client, twin):
    messages = [{"role": "system", "content": "t5 t6"}, {"role": "user", "content": words(prompt_ids(2, 12))}]
    ids = twin.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[:3] == [3, 5, 6] and ids[-1] == 4  # the template ran
    ref = expected(twin, list(ids), 32)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0)
    assert resp.choices[0].message.content == words(ref)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 32
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == words(ref)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.total_tokens == len(ids) + 32


def test_concurrent_requests_each_equal_their_solo_output(server, client, twin):
    prompts = [prompt_ids(s, 10 + 2 * s) for s in range(6)]
    lengths = [24 + 4 * s for s in range(6)]
    refs = [expected(twin, p, n) for p, n in zip(prompts, lengths)]

    def one(i: int) -> str:
        if i % 2:
            chunks = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=lengths[i],
                                               temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=lengths[i],
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, range(6)))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out == words(ref), f"request {i} differs from its solo output"


def test_stop_strings_stop_token_ids_and_seed(server, client, twin):
    ids = prompt_ids(3)
    ref = expected(twin, ids, 30)
    k = next(i for i in range(5, 30) if ref[i] not in ref[:i])  # a word whose first occurrence is at k
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, temperature=0,
                                     stop=[f" t{ref[k]}"])
    assert resp.choices[0].text == words(ref[:k]) and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, temperature=0,
                                            stop=f" t{ref[k]}", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == words(ref[:k])
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, temperature=0,
                                     extra_body={"stop_token_ids": [ref[k]]})
    assert resp.choices[0].text == words(ref[:k]) and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == k + 1  # the stop token was generated, not shown
    # sampling: a seed makes the output reproducible; different seeds differ (64-way random model)
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=24, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 40}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", b'[1, 2]', 400, None, "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "t1"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["t9"] * (MAX_PROMPT + 1))}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens",
     "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "t1"}], "logprobs": True},
     400, "logprobs", "unsupported_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "frobnicate": 1}, 400, "frobnicate",
     "unrecognized_argument"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "temperature": 3.0}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": ["t1", "t2"]}, 400, "prompt", "unsupported_parameter"),
])
def test_bad_input_gets_openai_error_body(server, path, body, status, param, code):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(server.base + path, data=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_openai_client_raises_on_unsupported(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="'n' = 3 is not supported"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "t1"}], n=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="t1")


# --------------------------------------------------------------------------- disconnect, metrics
def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if want else name
    total = 0.0
    for line in text.splitlines():
        if line.startswith(key + " "):
            total += float(line.split()[-1])
    return total


def test_client_disconnect_frees_its_sequence(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = requests.get(server.base + "/metrics", headers=AUTH, timeout=30).text
    # Sampled at temperature 1, so retrieval accepts almost nothing and the 1500 tokens take ~1,450 verify
    # steps (4.3 s here). Greedy on this repetitive prompt accepts ~7 tokens a step and ends in 0.8 s,
    # which a disconnect crossing the proxy, router and replica did not always beat (CI, stop 53).
    body = {"model": MODEL_NAME, "prompt": prompt_ids(4), "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3,
            "stream": True}
    with requests.post(server.base + "/v1/completions", json=body, headers=headers, stream=True, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines(decode_unicode=True)
        got = [next(lines) for _ in range(6)]
        assert any(g.startswith("data: {") for g in got)
    # the server notices the disconnect, aborts the sequence and frees its slot
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        h = requests.get(server.base + "/health", timeout=30).json()
        if h["live_requests"] == 0:
            break
        time.sleep(0.2)
    assert h["live_requests"] == 0
    after = requests.get(server.base + "/metrics", headers=AUTH, timeout=30).text
    made = _metric(after, "graftblock_generation_tokens_total", method="retrieval") - \
        _metric(before, "graftblock_generation_tokens_total", method="retrieval")
    assert 0 < made < MAX_TOKENS, made  # it stopped early: the abort, not the length limit
    assert _metric(after, "graftblock_requests_total", endpoint="completions", outcome="cancelled") >= 1


def test_metrics_endpoint(server, client):
    client.completions.create(model=MODEL_NAME, prompt=prompt_ids(5), max_tokens=8, temperature=0)
    text = requests.get(server.base + "/metrics", headers=AUTH, timeout=30).text
    assert _metric(text, "graftblock_requests_total", endpoint="completions", outcome="length") >= 1
    assert _metric(text, "graftblock_time_to_first_token_seconds_count") >= 1
    assert _metric(text, "graftblock_inter_token_latency_seconds_count") >= 1
    assert _metric(text, "graftblock_acceptance_length_count", method="retrieval") >= 1
    assert _metric(text, "graftblock_prompt_tokens_total") >= 24
    assert "graftblock_running_requests" in text and "graftblock_waiting_requests" in text


# --------------------------------------------------------------------------- fuzzing (the short profile)
def test_fuzzed_api_has_no_5xx_every_4xx_is_an_openai_error_and_the_server_stays_healthy(server, client, twin):
    """schemathesis from the server's own ``/openapi.json``: 15 cases per operation and mode (``make fuzz``
    runs 140 on SmolLM2). Positive cases must reach generation; afterwards the server still answers exactly."""
    from benchmarks.fuzz_api import FuzzConfig, fuzz

    report = fuzz(FuzzConfig(base_url=server.base, api_key=API_KEY, examples=15), log=lambda _: None)
    assert report.cases >= 100, report.to_json()
    assert report.server_errors == 0 and not report.failures, report.failures
    assert report.healthy_after
    for op in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert report.statuses[f"{op} positive"][200] > 0, report.statuses  # schema-valid requests generate
        assert any(400 <= s < 500 for s in report.statuses[f"{op} negative"]), report.statuses
    ids = prompt_ids(7)
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0.0)
    assert out.choices[0].text == words(expected(twin, ids, 12))


def test_locust_load_ramp_reports_every_stage_without_errors(server, tmp_path):
    """``benchmarks/load_locust.py`` (a subprocess: locust monkey-patches the standard library with gevent)
    over two short stages: requests finish in each, TTFT/ITL are measured, nothing is lost, the verdict
    is evaluated at 2 x saturation."""
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load_locust", "--base-url", server.base, "--api-key", API_KEY,
         "--model", MODEL_NAME, "--saturation", "1", "--stages", "1,2", "--stage-seconds", "3",
         "--max-tokens", "16", "--prompts", "4", "--json", str(out)],
        cwd=Path(__file__).resolve().parent.parent, env={**os.environ, **RAY_TEST_ENV}, capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert [s["users"] for s in res["stages"]] == [1, 2]
    for stage in res["stages"]:
        assert stage["requests_ok"] > 0 and stage["errors"] == {}, stage
        assert 0 < stage["ttft_p50_s"] <= stage["ttft_p99_s"] and stage["itl_p50_s"] > 0
        assert stage["goodput_tokens_per_s"] > 0
    assert res["lost"] == 0 and res["targets"]["evaluated"] and res["targets"]["server_errors"] == 0


# --------------------------------------------------------------------------- graceful shutdown (last)
def test_sigterm_drains_in_flight_request_and_finishes_mlflow_run(server, client, twin):
    ids = prompt_ids(6)
    ref = expected(twin, ids, 200)
    out: dict = {}
    first = threading.Event()

    def consume():
        text, last = "", None
        for c in client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=200, temperature=0,
                                           stream=True):
            text += c.choices[0].text
            first.set()
            last = c
        out["text"], out["finish"] = text, last.choices[0].finish_reason

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    t.join(90)
    assert out.get("text") == words(ref) and out["finish"] == "length"  # drained, not cut
    assert server.proc.wait(90) == 0

    import mlflow

    c = mlflow.MlflowClient(server.tracking_uri)
    exp = c.get_experiment_by_name("serve-test")
    runs = c.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["graftblock.kind"] == "serve"
    assert run.data.params["method"] == "retrieval" and run.data.params["api_key"] == "***"
    assert run.data.metrics["generated_tokens"] >= 200
    assert "retrieval.tau" in run.data.metrics


# --------------------------------------------------------------------------- in process: timeouts
class _SlowDrafter:
    """A real drafter (behind the protocol) whose ``propose`` waits ``delay_s`` or until ``release`` is set."""

    name, needs_aux, target_topk = "slow", False, 0

    def __init__(self, delay_s: float, release: threading.Event) -> None:
        self.delay_s, self.release = delay_s, release

    def begin(self, ctx, prompt_aux) -> None:
        pass

    def propose(self, ctx):
        from speculation.drafters.base import Proposal
        from speculation.spec.tree import DraftTree

        self.release.wait(self.delay_s)
        return Proposal(tree=DraftTree(ctx.root_token), drafter_forwards=0)

    def observe(self, ctx, outcome) -> None:
        pass


def _service(delay_s: float, release: threading.Event, batch: BatchConfig | None = None, **cfg):
    from cluster.openai_service import OpenAIService
    from cluster.serve_config import ServeConfig
    from speculation.engine.batch import BatchEngine
    from speculation.model.target import TargetModel

    target = TargetModel(tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048), word_tokenizer())
    config = ServeConfig(model="tiny", method="slow", max_prompt_tokens=64, max_tokens=256, mlflow=False, **cfg)
    batch = batch or BatchConfig(max_sequences=2, max_tokens_per_sequence=512)
    return OpenAIService(config, target.tokenizer, target.vocab_size, target.eos_token_ids,
                         lambda: BatchEngine(target, lambda: _SlowDrafter(delay_s, release), batch),
                         "slow", target.check_fits)


def _complete(service, max_tokens: int):
    body = json.dumps({"model": "tiny", "prompt": "t5 t6 t7", "max_tokens": max_tokens, "temperature": 0}).encode()

    async def go():
        t0 = time.monotonic()
        try:
            await service.completions(body)
        except Exception as exc:  # the APIError under test
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0

    return asyncio.run(go())


def test_slow_engine_times_out_with_a_clear_error_and_frees_the_slot():
    release = threading.Event()
    service = _service(0.1, release, request_timeout_s=0.8, stall_timeout_s=30.0)
    try:
        with single_thread():
            exc, took = _complete(service, 200)  # 200 steps x 0.1 s >> 0.8 s
        assert exc is not None and exc.status == 504 and exc.code == "timeout", exc
        assert "request_timeout_s = 0.8" in exc.message
        assert took < 3.0
        deadline = time.monotonic() + 5
        while service.engine.live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.engine.live == 0  # aborted: the slot is free
    finally:
        release.set()
        assert service.shutdown()


def test_full_admission_queue_gets_429_with_retry_after_and_the_running_request_is_untouched():
    """Past ``max_sequences`` live + ``max_waiting`` queued, a request is refused at once with 429
    and ``Retry-After`` (the HTTP layer sends the header), and the one already running completes."""
    from cluster.serve_app import _error_response

    release = threading.Event()
    service = _service(0.05, release, batch=BatchConfig(max_sequences=1, max_waiting=0, max_tokens_per_sequence=512),
                       max_sequences=1, max_waiting=0, retry_after_s=7, request_timeout_s=60.0)
    try:
        with single_thread():
            first: dict = {}
            runner = threading.Thread(target=lambda: first.update(r=_complete(service, 30)))
            runner.start()
            deadline = time.monotonic() + 10
            while service.engine.live == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert service.engine.live == 1, first
            exc, took = _complete(service, 5)
            assert exc is not None and exc.status == 429 and exc.code == "queue_full", exc
            assert "max_waiting=0" in exc.message and took < 1.0
            resp = _error_response(exc)
            assert resp.status_code == 429 and resp.headers["retry-after"] == "7"
            assert json.loads(resp.body)["error"]["type"] == "rate_limit_error"
            runner.join(30)
        assert first["r"][0] is None  # the running request was not disturbed
    finally:
        release.set()
        assert service.shutdown()


def test_admission_queue_config_is_validated():
    from cluster.serve_config import ConfigError, ServeConfig

    for kwargs, needle in (({"max_waiting": -1}, "serve.max_waiting must be"),
                           ({"retry_after_s": 0}, "serve.retry_after_s must be"),
                           ({"batch": {"max_waiting": 3}}, "serve.batch.max_waiting: set serve.max_waiting"),
                           ({"max_sequences": 8, "max_waiting": 60, "max_ongoing_requests": 64},
                            "serve.max_ongoing_requests (64) must be at least serve.max_sequences + serve.max_waiting (68)")):
        with pytest.raises(ConfigError) as e:
            ServeConfig(model="tiny", mlflow=False, **kwargs)
        assert needle in str(e.value), (kwargs, str(e.value))


def test_stalled_engine_fails_requests_and_reports_unhealthy():
    release = threading.Event()
    service = _service(3600.0, release, request_timeout_s=60.0, stall_timeout_s=0.5)
    try:
        with single_thread():
            exc, took = _complete(service, 20)
        assert exc is not None and exc.status == 503 and exc.code == "engine_stalled", exc
        assert took < 5.0
        status, body = service.health()
        assert status == 503 and body["status"] == "stalled"
        with pytest.raises(RuntimeError, match="engine unhealthy"):
            service.check_health()
    finally:
        release.set()
        assert service.shutdown()


class _FailingDrafter(_SlowDrafter):
    """A drafter whose ``propose`` raises ``exc``: the engine thread dies of it mid-request."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def propose(self, ctx):
        raise self.exc


@pytest.mark.parametrize("cause, status, code", [
    ("shard_lost", 503, "shard_unavailable"),  # a lost target shard: transient, retry later
    ("bug", 500, "engine_failed"),
])
def test_a_dead_engine_answers_503_for_a_lost_shard_and_500_otherwise(cause, status, code):
    from cluster.batch_backend import ShardLostError
    from cluster.openai_service import OpenAIService
    from cluster.serve_app import _error_response
    from cluster.serve_config import ServeConfig
    from speculation.engine.batch import BatchEngine
    from speculation.model.target import TargetModel

    exc = (ShardLostError("target shard 1 died and Ray did not restart it") if cause == "shard_lost"
           else RuntimeError("a bug in a drafter"))
    target = TargetModel(tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048), word_tokenizer())
    config = ServeConfig(model="tiny", method="failing", max_prompt_tokens=64, max_tokens=256, mlflow=False,
                         retry_after_s=3)
    batch = BatchConfig(max_sequences=2, max_tokens_per_sequence=512)
    service = OpenAIService(config, target.tokenizer, target.vocab_size, target.eos_token_ids,
                            lambda: BatchEngine(target, lambda: _FailingDrafter(exc), batch), "failing",
                            target.check_fits)
    try:
        with single_thread():
            err, took = _complete(service, 20)
        assert err is not None and (err.status, err.code) == (status, code), err
        assert str(exc) in err.message and took < 5.0
        resp = _error_response(err)
        assert resp.status_code == status
        assert (resp.headers.get("retry-after") == "3") == (status == 503)
        assert json.loads(resp.body)["error"]["type"] == ("overloaded_error" if status == 503 else "server_error")
    finally:
        service.shutdown()


def test_set_overrides_one_key_of_the_file_and_is_validated_like_it():
    """``graftblock serve --set KEY=VALUE``: YAML values, dotted keys into sections, the same
    validation as the file (errors name the key)."""
    from cluster.serve_config import ConfigError, load_serve_config

    path = Path(__file__).resolve().parent.parent / "ray_configs" / "serve_adaptive.yaml"
    base = load_serve_config(path)
    cfg = load_serve_config(path, ["learner.policy=static", "max_sequences=2", "batch={goodput: true}",
                                   "learner.budgets=[0, 16]"])
    assert (cfg.learner.policy, cfg.max_sequences, cfg.batch, cfg.learner.budgets) == ("static", 2, {"goodput": True},
                                                                                     (0, 16))
    assert cfg.learner.min_train_positions == base.learner.min_train_positions == 512  # the rest is the file's
    assert base.learner.policy == "cost_aware" and base.method == "eagle3"
    for sets, needle in ((["learner.policy"], "--set expects KEY=VALUE"), (["=3"], "--set expects KEY=VALUE"),
                         (["model.name=x"], "--set model.name: model is 'smollm2-135m', not a section"),
                         (["max_sequences=0"], "max_sequences"), (["bogus=1"], "unknown key(s) ['bogus']"),
                         (["learner.policy=sometimes"], "serve.learner.policy must be one of")):
        with pytest.raises(ConfigError) as e:
            load_serve_config(path, sets)
        assert needle in str(e.value), (sets, str(e.value))


@pytest.mark.parametrize("name", ["serve_local.yaml", "serve_cluster.yaml"])
def test_shipped_serve_configs_load_and_split_trees_by_goodput(name):
    """The configs the README points to validate, and batch with the goodput rule: without it, a
    retrieval tree per sequence ran at 0.36x batched vanilla at 8 sequences (serve_load, fp32)."""
    from cluster.openai_service import batch_config
    from cluster.serve_config import load_serve_config

    cfg = load_serve_config(str(Path(__file__).resolve().parent.parent / "ray_configs" / name))
    assert batch_config(cfg).goodput
    if name == "serve_local.yaml":  # chunked prefill: p99 ITL 1.89x unloaded at 2x saturation, 6.64x without
        assert (batch_config(cfg).prefill_chunk_tokens, batch_config(cfg).prefill_step_tokens) == (32, 32)
