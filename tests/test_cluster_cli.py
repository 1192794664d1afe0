"""``graftblock bench|generate --ray --shards N``: same JSON contract, same outputs (~40 s).

A tiny random Llama with SmolLM2's vocabulary and tokenizer (so real prompts can be encoded)
keeps this fast; the actor path must still be token-identical to vanilla (``lossless: true``)
and to the in-process ``generate``.
"""

from __future__ import annotations

import json

import pytest

from graftblock import cli
from tests.helpers import tiny_llama
from tests.ray_fixtures import ray_local  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A saved tiny random Llama with SmolLM2's tokenizer and vocabulary (real prompts encode)."""
    from transformers import AutoTokenizer

    from speculation import assets

    tok = AutoTokenizer.from_pretrained(str(assets.resolve_model_dir("smollm2-135m")))
    model = tiny_llama(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                       eos_token_id=tok.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-vocab")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


BENCH = ("--methods vanilla,retrieval --dtype float32 --dataset mixed --limit-per-category 1 "
         "--max-new-tokens 16 --warmup 1 --threads 1 --no-mlflow").split()


def test_bench_ray_keeps_the_json_contract(ray_local, tiny_vocab_model, tmp_path, capsys):  # noqa: F811
    out_ray, out_local = tmp_path / "ray.json", tmp_path / "local.json"
    config = tmp_path / "fixed_trees.yaml"  # trees independent of measured timings: comparable tau
    config.write_text("retrieval: {cost_aware: false}\n")
    common = ["--model", tiny_vocab_model, *BENCH, "--config", str(config)]
    assert cli.main(["bench", *common, "--json", str(out_local)]) == 0
    assert cli.main(["bench", "--ray", "--shards", "2", *common, "--json", str(out_ray)]) == 0
    ray_res, local_res = json.loads(out_ray.read_text()), json.loads(out_local.read_text())
    for key in ("model", "dtype", "dataset", "n_prompts", "max_new_tokens", "temperature", "env",
                "baseline_tokens_per_s", "methods", "peers"):
        assert key in ray_res
    assert set(ray_res) - set(local_res) == {"ray"} and ray_res["ray"]["topology"]["shards"] == 2
    m = ray_res["methods"]["retrieval"]
    for key in ("speedup", "tau", "tokens_per_s", "drafting_share", "mean_tree_size", "drafter_forwards_per_step",
                "drafting_s_per_step", "verify_s_per_step", "lossless", "per_category", "config"):
        assert key in m
    assert m["lossless"] is True  # every prompt token-identical to the in-process vanilla
    assert m["config"] == local_res["methods"]["retrieval"]["config"]
    assert m["tau"] == pytest.approx(local_res["methods"]["retrieval"]["tau"])  # same trees, same acceptance


def test_generate_ray_prints_the_same_answer(ray_local, tiny_vocab_model, capsys):  # noqa: F811
    args = ["generate", "--model", tiny_vocab_model, *"--dtype float32 --threads 1 --max-new-tokens 24".split(),
            "--prompt", "Repeat: one two three, one two three, one two three.", "--config", "/dev/null"]
    assert cli.main(args) == 0
    local = capsys.readouterr().out
    assert cli.main([*args, "--ray", "--shards", "2"]) == 0
    assert capsys.readouterr().out == local


def test_ray_flags_are_validated_before_loading_weights(capsys):
    assert cli.main(["generate", "--shards", "2", "--prompt", "x"]) == 2
    assert "--shards needs --ray" in capsys.readouterr().err
    assert cli.main(["bench", "--ray", "--shards", "0", "--json", "x.json", "--dataset", "mixed"]) == 2
    assert "--shards must be >= 1" in capsys.readouterr().err


def test_too_many_shards_is_a_clear_cli_error(ray_local, tiny_vocab_model, capsys):  # noqa: F811
    args = ["generate", "--model", tiny_vocab_model,
            *"--dtype float32 --max-new-tokens 2 --prompt hi --ray --shards 9".split()]
    assert cli.main(args) == 2
    assert "topology.shards = 9 exceeds the target's 4 layers; allowed: [1, 4]" in capsys.readouterr().err
