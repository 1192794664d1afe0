"""``graftblock train eagle3`` end to end on a tiny model with the real tokenizer and ShareGPT.

A 4-layer random Llama with SmolLM2's vocabulary and chat template is saved to a directory and
trained for a few thousand tokens through the CLI: ShareGPT streaming, chat templating, the
Spec-Bench filter, the feature cache, evaluation, the exported checkpoint + manifest and the
MLflow run (params, loss curve, held-out metrics) on a local sqlite store.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from graftblock.cli import main as cli_main
from speculation import assets
from tests.helpers import single_thread

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    try:
        src = assets.resolve_model_dir("smollm2-135m")
        assets.sharegpt_path()
    except Exception as exc:  # assets not fetched on this machine
        pytest.skip(f"packaged assets unavailable: {exc}")
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tinychat")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_cli_trains_exports_and_logs(tiny_chat_model, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    argv = ["train", "eagle3", "--model", str(tiny_chat_model), "--dtype", "float32", "--workdir", "w",
            "--export", "ck", "--max-tokens", "3000", "--heldout", "3", "--eval-prompts", "1",
            "--eval-max-new-tokens", "6", "--vocab-items", "20", "--draft-vocab-size", "512", "--shard-size", "4",
            "--max-len", "128", "--batch-tokens", "256", "--ttt-steps", "2", "--eval-tree", "8,2,3",
            "--eval-every-tokens", "1500", "--no-progress", "--experiment", "test-train", "--lr", "1e-3"]
    assert cli_main(argv) == 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["training"]["tokens"] >= 3000
    assert manifest["draft_vocab"]["size"] == 512
    assert manifest["command"].startswith("graftblock train eagle3")
    steps = manifest["training"]["steps"]
    assert len(manifest["tau_curve"]) >= 2
    assert manifest["data"]["spec_bench_excluded_texts"] > 0
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("test-train")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert "train.loss" in run.data.metrics and "heldout.acc_0" in run.data.metrics
    assert run.data.params["train.ttt_steps"] == "2"
    assert len(client.get_metric_history(run.info.run_id, "train.loss")) >= 2
    # a second invocation resumes (nothing left to train) and keeps the same MLflow run
    assert cli_main(argv) == 0
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["training"]["steps"] == steps


def test_cli_self_distillation_trains_on_target_answers(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "eagle3", "--model", str(tiny_chat_model), "--dtype", "float32", "--workdir", "w",
            "--export", "ck", "--max-tokens", "600", "--heldout", "2", "--eval-prompts", "0",
            "--vocab-items", "10", "--draft-vocab-size", "256", "--shard-size", "4", "--max-len", "128",
            "--batch-tokens", "256", "--ttt-steps", "2", "--regenerate", "12", "--regenerate-batch", "4",
            "--no-progress", "--no-mlflow"]
    assert cli_main(argv) == 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["data"]["regenerate_new_tokens"] == 12
    assert manifest["training"]["tokens"] >= 600
    from adaptation.features import FeatureCache

    shard = FeatureCache(tmp_path / "w" / "features").load(0)
    # every sequence is prompt + at most 12 regenerated tokens, and only those are trained on
    for i in range(shard.num_sequences):
        sl, _ = shard.sequence(i)
        assert 1 <= int(shard.loss_mask[sl].sum()) <= 12
