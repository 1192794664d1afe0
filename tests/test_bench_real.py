"""The bench harness on real SmolLM2 weights: fp32 greedy exactness and the JSON contract.

Runs the retrieval drafter against vanilla on one Spec-Bench question per category (13 prompts,
first turn, 64 new tokens, fp32): every prompt must be token-identical to vanilla greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from graftblock.cli import main as cli_main
from speculation import assets
from speculation.bench.runner import run_bench
from speculation.config import BenchConfig

pytestmark = pytest.mark.slow

REQUIRED_METHOD_KEYS = {
    "speedup", "tau", "tokens_per_s", "drafting_share", "mean_tree_size", "drafter_forwards_per_step",
    "drafting_s_per_step", "verify_s_per_step", "lossless", "per_category", "config",
}
CONCURRENCY_KEYS = {"tokens_per_s", "request_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                    "tau", "speedup", "lossless"}


def test_retrieval_is_lossless_on_spec_bench_fp32(smol_fp32):
    questions = assets.load_questions("spec_bench", limit_per_category=1)  # packaged with the code
    assert len(questions) >= 8
    questions = questions[:8]  # 8 categories x 32 tokens keep the fp32 bench path under a minute
    cfg = BenchConfig(methods=("vanilla", "retrieval"), dtype="float32", dataset="spec_bench",
                      limit_per_category=1, max_new_tokens=32, max_turns=1, warmup=0)
    # cost_aware off: measuring c(T) took 3-4 minutes here; the cost-aware cut is covered by
    # tests/test_retrieval.py, tests/test_graft.py and the Ray tests
    result = run_bench(cfg, smol_fp32, questions, {"retrieval": {"budget": 16, "cost_aware": False}})
    m = result["methods"]["retrieval"]
    assert m["lossless"] is True, f"match rate {m['match_rate']}"
    assert REQUIRED_METHOD_KEYS <= set(m)
    assert result["n_prompts"] == len(questions)
    assert set(m["per_category"]) == set(result["categories"])
    # tokens gained over all steps = all generated tokens minus one prefill token per turn
    assert m["tau"] == pytest.approx((m["new_tokens"] - m["n_turns"]) / m["steps"])
    assert result["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)


def test_cli_bench_writes_contract_json_and_logs_mlflow(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "b.json"
    rc = cli_main(["bench", "--methods", "retrieval", "--dataset", "mixed", "--limit-per-category", "1",
                   "--max-new-tokens", "8", "--dtype", "float32", "--peers", "hf_generate",
                   "--warmup", "0", "--concurrency", "1,3", "--json", str(out), "--experiment", "test-bench"])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("model", "dtype", "dataset", "n_prompts", "max_new_tokens", "temperature", "env",
                "baseline_tokens_per_s", "methods", "peers", "command", "concurrency"):
        assert key in res
    assert set(res["methods"]) == {"vanilla", "retrieval"}
    assert "hf_generate" in res["peers"]
    # --concurrency: the batched engine's contract per N, with the padded HF batch as a peer row.
    assert set(res["concurrency"]) == {"1", "3"}
    for level in res["concurrency"].values():
        assert set(level["methods"]) == {"vanilla", "retrieval"}
        for m in [*level["methods"].values(), level["peers"]["hf_generate"]]:
            assert CONCURRENCY_KEYS <= set(m)
            assert m["tokens_per_s"] > 0
        for m in level["methods"].values():
            assert m["lossless"] is True  # fp32 greedy: every request equals its solo vanilla output
            assert m["ttft_p50_s"] <= m["ttft_p99_s"]
        assert level["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
        # the saturated window (every client busy) ends when the dataset runs dry, before the drain
        for m in level["methods"].values():
            assert 0.0 < m["saturated_wall_s"] <= m["wall_s"]
            assert m["saturated_share"] == pytest.approx(m["saturated_wall_s"] / m["wall_s"])
            assert m["saturated_tokens_per_s"] * m["saturated_wall_s"] <= m["tokens_per_s"] * m["wall_s"] + 1e-6
        assert level["methods"]["vanilla"]["saturated_speedup"] == pytest.approx(1.0)
    # The concurrency phase shows its progress: every request of every N and method, counted once.
    n_requests = 2 * 2 * res["n_prompts"]
    err = capsys.readouterr().err
    assert f"{n_requests}/{n_requests}" in err and "N=3 retrieval" in err
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("test-bench")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    assert "retrieval.speedup" in runs[0].data.metrics
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id)] == ["b.json"]
    head = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent.parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert runs[0].data.tags["mlflow.source.git.commit"] == head  # the run records its commit
    assert runs[0].data.tags["mlflow.source.name"] == "graftblock bench"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--dataset", "/nonexistent/questions.jsonl"], "questions.jsonl"),
        (["--methods", "vanilla,bogus"], "bogus"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be in [1, 65536], got 0"),
        (["--temperature", "-1"], "temperature"),
        (["--peers", "vllm_medusa"], "vllm_medusa"),
        (["--concurrency", "1,4", "--prefill-step-tokens", "64"], "--prefill-step-tokens needs --prefill-chunk-tokens"),
        (["--concurrency", "1,4", "--prefill-chunk-tokens", "0"], "--prefill-chunk-tokens must be in [1, 1048576], got 0"),
        (["--concurrency", "1,4", "--prefill-chunk-tokens", "64", "--no-fold-prefills"], "--prefill-chunk-tokens needs --fold-prefills true"),
    ],
)
def test_cli_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    rc = cli_main(["bench", "--no-mlflow", "--json", str(tmp_path / "x.json"), "--dataset", "mixed", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err
    assert not (tmp_path / "x.json").exists()


def test_saturated_window_arithmetic():
    from speculation.bench.runner import _saturated

    assert _saturated(120, 2.0, 8.0) == {"saturated_tokens_per_s": 60.0, "saturated_wall_s": 2.0,
                                         "saturated_share": 0.25}
    # fewer prompts than clients: N is never reached, so there is no saturated figure
    assert _saturated(0, None, 8.0) == {"saturated_tokens_per_s": None, "saturated_wall_s": None,
                                        "saturated_share": None}


@pytest.mark.parametrize("argv", [["--method", "vanilla"], ["--method", "retrieval", "--veto", "--goodput"],
                                  ["--method", "retrieval", "--chunk", "64"]])
def test_fold_prefills_against_vanilla_refuses_what_it_cannot_pair(argv, capsys):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fold_prefills.py"
    spec = importlib.util.spec_from_file_location("fold_prefills_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main(["--against-vanilla", *argv])
    assert exc.value.code == 2
    assert "--against-vanilla compares --method with vanilla" in capsys.readouterr().err
