"""Drafter training on a tiny random Llama (the EAGLE-3 family): the loss falls, acceptance rises,
runs resume.

Data: the tiny target's own greedy continuations of random prompts (the self-distillation
path, :func:`adaptation.data.regenerate`). A few hundred optimizer steps on one thread
must lower the TTT loss and raise tau (mean tokens per verify step) of real speculative decoding
on the training prompts; a run killed half-way resumes from its saved state and cached features.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from adaptation.data import Sample, TrainData, regenerate, regenerated_samples
from adaptation.eagle3_loss import Eagle3Family
from adaptation.evaluation import ACCEPT_DEPTHS
from adaptation.features import FeatureCache, extract_sequence
from adaptation.trainer import Trainer, TrainConfig
from adaptation.vocab import select_draft_vocab, token_counts
from speculation.config import ConfigError, Eagle3Config
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.checkpoint import load_checkpoint, read_manifest, TargetFingerprint
from tests.helpers import interrupt_training, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
TREE = Eagle3Config(checkpoint="random", total_tokens=16, depth=3, top_k=4)
FAMILY = Eagle3Family(eval_tree=TREE)


@functools.lru_cache(maxsize=1)
def _setup():
    model = tiny_llama(vocab_size=VOCAB, seed=11, lm_head_scale=8.0)
    target = tiny_target(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(6)] for _ in range(48)]
    conts = regenerate(model, prompts, max_new_tokens=40, batch_size=16)
    samples = regenerated_samples(prompts, conts)
    return target, prompts, samples


def _data(samples, prompts) -> TrainData:
    return TrainData(
        items=lambda: iter(samples[4:]),
        to_samples=lambda items: list(items),
        vocab_samples=lambda: iter(samples),
        heldout=samples[:4],
        eval_prompts=prompts[:6],
        description={"source": "tiny self-distillation"},
    )


def _cfg(**kw) -> TrainConfig:
    base = dict(
        max_len=64, draft_vocab_size=VOCAB, ttt_steps=3, curriculum_steps=1, curriculum_tokens=600,
        lr=1e-2, warmup_steps=5, batch_tokens=256, max_tokens=20_000, epochs=40, topk=8, shard_size=12,
        eval_every_tokens=0, eval_prompts=6, eval_max_new_tokens=24, save_every_steps=10,
        log_every_steps=5, autocast_bf16=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_regenerate_matches_greedy_decoding():
    target, prompts, samples = _setup()
    from speculation.config import EngineConfig, SamplingConfig
    from speculation.engine.solo import generate_vanilla

    ref = generate_vanilla(target, prompts[0], EngineConfig(max_new_tokens=40, stop_at_eos=False,
                                                            sampling=SamplingConfig())).tokens
    assert list(samples[0].input_ids[6:]) == ref
    assert samples[0].loss_mask == (0,) * 6 + (1,) * 40


def test_extracted_features_equal_the_targets_aux():
    target, prompts, samples = _setup()
    feats = extract_sequence(target.model, target.aux_layers, samples[0], topk=8)
    _, _, aux = target.prefill(list(samples[0].input_ids), need_aux=True)
    assert torch.allclose(feats["aux"].float(), aux.float(), atol=0.05, rtol=0.02)
    full = target.model(input_ids=torch.tensor([samples[0].input_ids])).logits[0]
    rows = [t for t in range(len(samples[0]) - 1) if samples[0].loss_mask[t + 1]]
    assert torch.equal(feats["topk_indices"][rows, 0].long(), full[rows].argmax(-1))
    assert int(feats["topk_indices"][0].abs().sum()) == 0  # position 0 predicts a prompt token


def test_vocab_selection_is_sorted_and_fills_gaps():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 3, 3, 9]] = torch.tensor([5, 2, 2, 1])
    v = select_draft_vocab(counts, 4)
    assert v.ids.tolist() == [0, 3, 7, 9]  # 7, 3, 9 by count, then the lowest unseen id
    assert v.coverage == pytest.approx(1.0)
    s = Sample((1, 2, 2, 3), (0, 1, 1, 0))
    assert token_counts([s], 5).tolist() == [0, 0, 2, 0, 0]


def test_config_is_validated():
    with pytest.raises(ConfigError, match="train.curriculum_steps"):
        TrainConfig(ttt_steps=3, curriculum_steps=4)
    with pytest.raises(ConfigError, match="train.batch_tokens"):
        TrainConfig(max_len=1024, batch_tokens=512)
    with pytest.raises(ConfigError, match=r"train.step_decay must be in \(0, 1\]"):
        Eagle3Family(step_decay=0.0)


def test_training_lowers_loss_raises_acceptance_and_resumes(tmp_path):
    target, prompts, samples = _setup()
    data = _data(samples, prompts)
    # untrained head with the same vocabulary and init
    before = Trainer(_cfg(), FAMILY, target, data, tmp_path / "probe", "tiny", progress=False)
    before.setup()
    tau0 = before.measure_tau(prompts[:6])["tau"]

    # phase 1: stop after a few hundred tokens (as a kill would), then resume to the end
    first = Trainer(_cfg(max_tokens=1500), FAMILY, target, data, tmp_path / "run", "tiny", progress=False)
    m1 = first.run()
    assert m1["training"]["tokens"] >= 1500
    losses1 = [e for e in first.state.evals]
    assert (tmp_path / "run" / "state.pt").is_file()
    second = Trainer(_cfg(), FAMILY, target, data, tmp_path / "run", "tiny", progress=False)
    m2 = second.run(export=tmp_path / "export", command="pytest")
    assert m2["training"]["steps"] > m1["training"]["steps"]
    assert m2["training"]["tokens"] >= 20_000
    evals = second.state.evals
    assert len(evals) == len(losses1) + 1
    assert evals[-1]["heldout.loss_0"] < evals[0]["heldout.loss_0"]
    tau1 = evals[-1]["heldout.tau"]
    print(f"tau untrained {tau0:.2f} -> trained {tau1:.2f}; acc0 {evals[0]['heldout.acc_0']:.2f} -> "
          f"{evals[-1]['heldout.acc_0']:.2f}")
    assert tau1 > tau0 + 0.5
    # the exported checkpoint loads into a drafter and reproduces the measured tau
    live = TargetFingerprint.from_target(target, name="tiny")
    head = load_checkpoint(tmp_path / "export", live)
    manifest = read_manifest(tmp_path / "export")
    assert manifest["command"] == "pytest" and manifest["training"]["stop_reason"] == "max_tokens"
    assert [p["tokens"] for p in manifest["tau_curve"]] == [e["tokens"] for e in evals]
    # Acceptance per position: P(accepted >= j) falls with j, and its sum is the mean accepted
    # per step (E[A] = sum_j P(A >= j); the eval tree is 3 deep, below ACCEPT_DEPTHS).
    ge = manifest["tau_curve"][-1]["accept_ge"]
    assert len(ge) == ACCEPT_DEPTHS and all(a >= b for a, b in zip(ge, ge[1:])) and ge[0] > 0
    assert sum(ge) == pytest.approx(evals[-1]["heldout.accepted_per_step"])
    assert manifest["tau_curve"][-1]["elapsed_s"] >= manifest["tau_curve"][0]["elapsed_s"]
    drafter = build_eagle3_drafter(Eagle3Config(checkpoint=str(tmp_path / "export"), total_tokens=16, depth=3,
                                                top_k=4), target)
    assert drafter.model.arch == head.arch
    # features were cached once and reused by the resumed run
    cache = FeatureCache(tmp_path / "run" / "features")
    assert cache.has(0) and cache.has("heldout")
    shards = m2["training"]["feature_shards"]
    assert shards["extracted"] == 4 and shards["reused"] > 0  # 44 training samples / shard_size 12; later epochs reuse
    assert m2["training"]["feature_extract_s"] > 0
    # a run of another workdir on the same cache extracts nothing: its wall is the drafter's alone
    third = Trainer(_cfg(max_tokens=800), FAMILY, target, data, tmp_path / "other", "tiny", progress=False,
                    features_dir=tmp_path / "run" / "features")
    m3 = third.run()
    assert m3["training"]["feature_shards"]["extracted"] == 0 and m3["training"]["feature_shards"]["reused"] >= 1
    assert m3["training"]["feature_extract_s"] == 0.0


def test_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """A run interrupted mid-shard and restarted ends with exactly the uninterrupted weights."""
    target, prompts, samples = _setup()
    data = _data(samples, prompts)
    cfg = _cfg(max_tokens=2500, eval_prompts=0, save_every_steps=3)
    ref = Trainer(cfg, FAMILY, target, data, tmp_path / "ref", "tiny", progress=False)
    ref.run()

    interrupt_training(monkeypatch, Trainer(cfg, FAMILY, target, data, tmp_path / "run", "tiny", progress=False), 8)
    resumed = Trainer(cfg, FAMILY, target, data, tmp_path / "run", "tiny", progress=False)
    resumed.run()
    assert resumed.state.step == ref.state.step and resumed.state.tokens == ref.state.tokens
    for k, v in ref.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
