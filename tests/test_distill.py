"""``graftblock distill-data``: the plan is disjoint from held-out and benchmark prompts, greedy
answers are the target's own greedy decode, and a run killed by PID resumes to the same shards."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaptation.data import conversations, iter_sharegpt, normalize, spec_bench_texts
from adaptation.distill import (
    Category,
    DistillConfig,
    benchmark_texts,
    categorize,
    distilled_data,
    plan_from_sharegpt,
    read_distilled,
    shard_path,
)
from speculation import assets
from speculation.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("max_new_tokens", 0, "in [1, 8192]"),
    ("greedy_fraction", 1.5, "in [0, 1]"),
    ("temperature", 0.0, "in (0, 100]"),
    ("top_p", 0.0, "in (0, 1]"),
    ("shard_size", 0, "in [1, 100000]"),
    ("max_turns", 17, "in [1, 16]"),
    ("seed", -1, ">= 0"),
])
def test_a_bad_config_names_the_field_and_its_range(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"distill\.{field} must be {re.escape(allowed)}, got"):
        DistillConfig(**{field: value})


def test_the_greedy_share_and_the_per_item_seeds_follow_the_config():
    half = DistillConfig(greedy_fraction=0.5, seed=3)
    picks = [half.sampling(i) for i in range(400)]
    greedy = sum(s.greedy for s in picks)
    assert 160 <= greedy <= 240  # Binomial(400, 0.5): 5 sigma
    sampled = [s for s in picks if not s.greedy]
    assert len({s.seed for s in sampled}) == len(sampled)  # every sampled item has its own seed
    assert all(s.temperature == 0.8 for s in sampled)
    assert [s.greedy for s in picks] == [half.sampling(i).greedy for i in range(400)]  # deterministic
    assert all(DistillConfig(greedy_fraction=1.0).sampling(i).greedy for i in range(50))
    assert not any(DistillConfig(greedy_fraction=0.0).sampling(i).greedy for i in range(50))


def test_categories_follow_the_prompt():
    assert categorize("Write a Python function that reverses a list") is Category.CODE
    assert categorize("Solve the equation 3x + 5 = 20") is Category.MATH
    assert categorize("Tell me about the history of Rome") is Category.CHAT


def test_the_plan_holds_no_heldout_and_no_benchmark_prompt():
    heldout = 24
    source = str(assets.sharegpt_path())
    plan = plan_from_sharegpt(source, heldout, 300)
    assert len(plan) == 300
    held_ids = {cid for cid, _ in itertools.islice(conversations(iter_sharegpt(source), spec_bench_texts()), heldout)}
    assert len(held_ids) == heldout
    assert not held_ids & {p.item_id for p in plan}
    bench = benchmark_texts()
    assert len(bench) > 1000  # Spec-Bench and the packaged datasets were all read
    assert not any(normalize(t) in bench for p in plan for t in p.user_turns)
    assert {p.category for p in plan} == set(Category)  # the packaged file has all three kinds
    # The plan is deterministic and a longer plan starts with the shorter one.
    assert [p.item_id for p in plan_from_sharegpt(source, heldout, 50)] == [p.item_id for p in plan[:50]]


def _cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "graftblock", "distill-data", "--out", str(out), "--items", "5",
            "--shard-size", "1", "--max-new-tokens", "12", "--max-turns", "1", "--batch-size", "2",
            "--threads", "1", "--no-mlflow", "--no-progress", *extra]


def _shards(out: Path) -> list[bytes]:
    return [gzip.decompress(p.read_bytes()) for p in sorted(out.glob("shard_*.jsonl.gz"))]


@pytest.mark.slow
def test_greedy_answers_are_the_targets_greedy_decode(tmp_path, smol_fp32):
    """With greedy_fraction 1 every answer is the target's vanilla greedy continuation, decoded."""
    from adaptation.distill import EngineGenerator, distill
    from speculation.config import EngineConfig, SamplingConfig
    from speculation.engine.solo import generate_vanilla

    cfg = DistillConfig(max_new_tokens=10, max_turns=2, greedy_fraction=1.0, shard_size=2)
    plan = plan_from_sharegpt(str(assets.sharegpt_path()), 24, 3)
    tok = smol_fp32.tokenizer
    stats = distill(plan, tmp_path, cfg, tok, EngineGenerator(smol_fp32, 3, 1100), smol_fp32.eos_token_ids,
                    {"target": "smollm2-135m", "heldout": 24, "sharegpt": "packaged"}, progress=False)
    records = list(read_distilled(tmp_path))
    assert [r["id"] for r in records] == [p.item_id for p in plan]
    assert stats.items == 3 and stats.shards_done == 2
    greedy = EngineConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=0.0))
    for r in records:
        history: list[tuple[str, str]] = []
        msgs = r["messages"]
        for user, answer in zip(msgs[::2], msgs[1::2]):
            ids = assets.encode_turn(tok, history, user["content"])
            want = generate_vanilla(smol_fp32, ids, greedy).tokens
            body = [t for t in want if t not in smol_fp32.eos_token_ids]
            assert answer["content"] == tok.decode(body, skip_special_tokens=True).strip()
            history.append((user["content"], answer["content"]))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and manifest["stats"]["new_tokens"] == stats.new_tokens
    # A resumed run with other settings is refused, naming what differs; nothing is overwritten.
    before = _shards(tmp_path)
    with pytest.raises(ConfigError, match=r"other settings \(\['config'\]\)"):
        distill(plan, tmp_path, DistillConfig(max_new_tokens=11, max_turns=2, greedy_fraction=1.0, shard_size=2),
                tok, EngineGenerator(smol_fp32, 3, 1100), smol_fp32.eos_token_ids, {"target": "smollm2-135m", "heldout": 24, "sharegpt": "packaged"},
                progress=False)
    assert _shards(tmp_path) == before
    # The trainer reads it back as training items, with ShareGPT's held-out set unchanged.
    data = distilled_data(tok, None, tmp_path, max_len=256, heldout=24)
    assert [cid for cid, _ in data.items()] == [p.item_id for p in plan]
    assert data.description["source"] == f"distilled:{tmp_path.name}"
    assert len(data.heldout) > 0
    with pytest.raises(ConfigError, match="planned after 24 held-out conversations but --heldout is 10"):
        distilled_data(tok, None, tmp_path, max_len=256, heldout=10)


@pytest.mark.slow
def test_a_run_killed_by_pid_resumes_to_the_same_shards(tmp_path):
    """Kill the CLI (SIGKILL, by the PID we started) after its first shard; re-running the same
    command finishes the rest, and the shards equal those of an uninterrupted run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_cli(whole), check=True, env=env, cwd=tmp_path, capture_output=True, timeout=600)
    proc = subprocess.Popen(_cli(killed), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not shard_path(killed, 0).is_file():
            assert proc.poll() is None, "the run ended before writing its first shard"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    left = len(list(killed.glob("shard_*.jsonl.gz")))
    assert 1 <= left < 5, f"the kill landed after {left} of 5 shards"
    subprocess.run(_cli(killed), check=True, env=env, cwd=tmp_path, capture_output=True, timeout=600)
    # Shard bodies equal (line 0 holds each shard's wall time, which differs run to run).
    assert [b.split(b"\n", 1)[1] for b in _shards(killed)] == [b.split(b"\n", 1)[1] for b in _shards(whole)]
    assert len(_shards(whole)) == 5
    manifest = json.loads((killed / "manifest.json").read_text())
    assert manifest["complete"] and manifest["stats"]["items"] == 5


COMMITTED = REPO / "data" / "distill" / "smollm2-135m"


def test_the_committed_distilled_data_is_complete_small_and_disjoint_from_heldout_and_benchmarks():
    manifest = json.loads((COMMITTED / "manifest.json").read_text())
    assert manifest["complete"] and manifest["contract"]["heldout"] == 24
    assert manifest["contract"]["sharegpt"] == "packaged" and manifest["contract"]["target"] == "smollm2-135m"
    assert sum(p.stat().st_size for p in COMMITTED.iterdir()) < 20 * 2**20  # the bound for the text
    records = list(read_distilled(COMMITTED))
    assert len(records) == manifest["stats"]["items"]
    source = str(assets.sharegpt_path())
    held_ids = {cid for cid, _ in itertools.islice(conversations(iter_sharegpt(source), spec_bench_texts()), 24)}
    assert not held_ids & {r["id"] for r in records}
    bench = benchmark_texts()
    users = [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]
    assert users and not any(normalize(u) in bench for u in users)
    # Every answer is the target's: the records hold one assistant turn after each user turn asked.
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2), r["id"]
