"""``graftblock train <family>`` end to end on a tiny model with the real tokenizer and ShareGPT.

A 4-layer random Llama with SmolLM2's vocabulary and chat template is saved to a directory and
trained for a few thousand tokens through the CLI: ShareGPT streaming, chat templating, the
Spec-Bench filter, the feature cache, evaluation, the exported checkpoint + manifest and the
MLflow run (params, loss curve, held-out metrics) on a local sqlite store. The README's retrain
commands must still parse into the configs recorded in the committed checkpoints' manifests.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from graftblock.cli import build_parser
from graftblock.cli import main as cli_main
from graftblock.train import configure
from adaptation.data import normalize
from speculation import assets
from speculation.drafters.checkpoint import SPECBLOCK

REPO = Path(__file__).resolve().parent.parent
DRAFTER_DEFAULTS = ("beam", "slot_widths")
"""Tau-tree knobs of ``train specblock`` that no flag sets (``SpecBlockConfig``'s defaults)."""

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
    # The training data excludes every Spec-Bench text (decontamination): every distinct turn of
    # the packaged question file is in the exclusion set.
    turns = {normalize(t) for q in assets.load_questions("spec_bench") for t in q.turns}
    assert manifest["data"]["spec_bench_excluded_texts"] == len(turns) == 560  # MT-Bench's have 2 turns
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


def test_cli_specblock_flags_reach_the_family_and_the_manifest(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "specblock", "--model", str(tiny_chat_model), "--dtype", "float32", "--workdir", "w",
            "--export", "ck", "--max-tokens", "500", "--heldout", "2", "--eval-prompts", "1",
            "--eval-max-new-tokens", "4", "--vocab-items", "10", "--draft-vocab-size", "256",
            "--shard-size", "4", "--max-len", "128", "--batch-tokens", "256", "--ttt-steps", "2",
            "--block-size", "3", "--no-shift", "--no-valid-prefix-mask", "--rank-weight", "0.5",
            "--eval-total-tokens", "12", "--no-progress", "--no-mlflow"]
    assert cli_main(argv) == 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["format"] == SPECBLOCK.format
    assert manifest["command"].startswith("graftblock train specblock")
    config = manifest["training"]["config"]
    assert (config["block_size"], config["shift"], config["valid_prefix_mask"], config["rank_weight"]) == (
        3, False, False, 0.5)
    assert config["ttt_steps"] == 2 and config["curriculum_steps"] == 1  # SpecBlock's unroll default
    assert config["eval_tree"]["total_tokens"] == 12 and config["eval_tree"]["block_size"] == 3
    assert manifest["heldout"]["heldout.tau"] >= 1.0


def _readme_train_commands() -> list[list[str]]:
    lines = (REPO / "README.md").read_text().splitlines()
    return [shlex.split(line)[1:] for line in lines if line.startswith(".venv/bin/graftblock train ")]


def test_readme_retrain_commands_reproduce_the_committed_configs():
    """Each documented retrain command parses into the training config its committed checkpoint
    recorded (SpecBlock's manifest also holds the EAGLE-3-only ``step_decay`` it never used)."""
    commands = _readme_train_commands()
    assert sorted(argv[1] for argv in commands) == ["eagle3", "specblock"]
    for argv in commands:
        family, cfg = configure(build_parser().parse_args(argv))
        assert family.name == argv[1]
        export = REPO / argv[argv.index("--export") + 1]
        recorded = json.loads((export / "manifest.json").read_text())["training"]["config"]
        built = json.loads(json.dumps({**cfg.to_dict(), **family.config_dict()}))  # as a manifest holds it
        if family.name != "eagle3":
            recorded.pop("step_decay")
        for key in DRAFTER_DEFAULTS:  # not set by a flag: the drafter config's defaults of the day
            built["eval_tree"].pop(key, None)
            recorded["eval_tree"].pop(key, None)
        assert built == recorded
