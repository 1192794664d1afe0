"""CLI user errors are one line and exit 2, found before any weights load; compare's --metric
knows each metric's direction; the bench table reads whole in 80 columns."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from graftblock import cli
from speculation.bench import report
from speculation.config import ConfigError
from sweeps import compare
from tests.ray_fixtures import apply_test_env

apply_test_env()


def _no_load(*a, **k):
    raise AssertionError("the model was loaded before the tracking store was checked")


def test_bench_with_unreachable_tracking_uri_fails_fast_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_target", _no_load)
    t0 = time.monotonic()
    code = cli.main(["bench", "--methods", "vanilla", "--dataset", "humaneval", "--limit-per-category", "1",
                     "--json", str(tmp_path / "o.json"), "--tracking-uri", "http://127.0.0.1:9"])
    assert code == 2 and time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert err.startswith("graftblock bench: error: MLflow tracking URI http://127.0.0.1:9 is unreachable")
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "o.json").exists()


def test_malformed_yaml_config_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_target", _no_load)
    bad = tmp_path / "bad.yaml"
    bad.write_text("retrieval: {budget: 8\n  max_depth: [\n")
    code = cli.main(["bench", "--methods", "vanilla,retrieval", "--config", str(bad), "--no-mlflow",
                     "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"graftblock bench: error: --config {bad}: not valid YAML (")


def test_ray_actor_error_is_one_line_exit_2(monkeypatch, capsys):
    from ray.exceptions import RayActorError

    def dies(args):
        raise RayActorError(error_msg="The actor died unexpectedly before finishing this task.\n  class: TargetShard")

    monkeypatch.setattr(cli, "cmd_assets", dies)  # build_parser binds the module's cmd_assets
    assert cli.main(["assets"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("graftblock assets: error: RayActorError: The actor died unexpectedly")


def test_compare_metric_is_validated_and_knows_directions(capsys):
    with pytest.raises(ConfigError, match=r"--metric must be one of speedup \(max\), .*drafting_share \(min\)"):
        compare.check_metric("speed")
    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", "--experiment", "x", "--metric", "speed"])
    assert exc.value.code == 2 and "invalid choice: 'speed'" in capsys.readouterr().err

    def row(n, speedup, share, verify):
        return compare.Row(run_id=str(n), run_name=str(n), status="FINISHED", kind="sweep_trial",
                           method="retrieval", trial_number=n, config={},
                           metrics={"speedup": speedup, "drafting_share": share, "verify_s_per_step": verify})

    rows = [row(0, 1.4, 0.30, 0.2), row(1, 1.2, 0.05, 0.1), row(2, 1.1, 0.10, 0.3)]
    assert compare.best_row(rows, "speedup").trial_number == 0
    assert compare.best_row(rows, "drafting_share").trial_number == 1  # minimised
    assert compare.best_row(rows, "verify_s_per_step").trial_number == 1  # minimised
    pts = [(r.metrics["speedup"], r.metrics["drafting_share"]) for r in rows]
    # y = drafting share (min) against x = speedup (max): row 2 is dominated by row 1.
    assert compare.pareto_front(pts, (compare.Direction.MAX, compare.Direction.MIN)) == [0, 1]
    assert compare.pareto_axes("drafting_share") == ["mean_tree_size", "speedup"]


def _result():
    cats = ["coding", "math_reasoning", "summarization", "translation"]
    m = {"tokens_per_s": 123.4, "speedup": 1.234, "tau": 1.8, "mean_tree_size": 12.3, "drafting_share": 0.12,
         "drafting_s_per_step": 0.0123, "verify_s_per_step": 0.2, "drafter_forwards_per_step": 3.0,
         "lossless": True, "per_category": {c: {"speedup": 1.1, "tau": 1.5} for c in cats}}
    return {"model": "smollm2-135m", "dtype": "bfloat16", "dataset": "spec_bench", "n_prompts": 26,
            "n_turns": 26, "max_new_tokens": 128, "temperature": 0.0, "categories": cats,
            "methods": {"vanilla": m, "retrieval": m, "graft_specblock": m}, "peers": {"hf_prompt_lookup": m}}


def test_bench_table_headers_are_whole_at_80_columns():
    console = Console(width=80, record=True)
    report.render(_result(), console)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    header = "\n".join(text.splitlines()[:8])
    for word in ("method", "tok/s", "speedup", "tau", "tree", "draft", "share", "ms/step", "verify", "fwd/",
                 "step", "lossless"):
        assert word in header, word
    assert "graft_specblock" in text and "summarization" in text and "math_reasoning" in text


@pytest.mark.parametrize("command", [
    ["bench", "--methods", "vanilla", "--dataset", "humaneval", "--limit-per-category", "1", "--no-mlflow"],
    ["generate", "--method", "vanilla", "--prompt", "Hi"],
])
def test_batch_invariant_with_ray_is_one_line_exit_2_before_loading(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_target", _no_load)
    extra = ["--json", str(tmp_path / "o.json")] if command[0] == "bench" else []
    code = cli.main([*command, *extra, "--ray", "--batch-invariant"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--batch-invariant applies to the in-process target only" in err and "--ray" in err


def test_bench_config_batch_invariant_must_be_a_bool():
    from speculation.config import BenchConfig

    assert BenchConfig(batch_invariant=True).batch_invariant is True
    with pytest.raises(ConfigError, match="bench.batch_invariant must be true or false, got 'yes'"):
        BenchConfig(batch_invariant="yes")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-new-tokens", "0", "--max-new-tokens must be in [1, 65536], got 0"),
    ("--top-p", "2", "--top-p must be in (0.0, 1.0], got 2.0"),
    ("--temperature", "-1", "--temperature must be in [0.0, 100.0], got -1.0"),
    ("--limit-per-category", "0", "--limit-per-category must be in [1, 100000], got 0"),
    ("--threads", "-2", "--threads must be in [1, 256], got -2"),
])
def test_bench_bad_flag_value_names_the_flag_and_its_range(flag, value, message, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_target", _no_load)
    code = cli.main(["bench", "--methods", "vanilla", "--dataset", "humaneval", "--no-mlflow", flag, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"graftblock bench: error: {message}"


def test_generate_bad_threads_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_target", _no_load)
    assert cli.main(["generate", "--method", "vanilla", "--prompt", "Hi", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "graftblock generate: error: --threads must be in [1, 256], got 0"


class _StubTarget:
    batch_invariant_rows = None


def test_bench_without_json_writes_under_runs_and_prints_the_path(tmp_path, monkeypatch, capsys):
    """No --json: the result goes to runs/bench-<UTC time>.json (the folder is made) and the path is printed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: _StubTarget())
    monkeypatch.setattr(cli, "run_bench", lambda *a, **k: {"methods": {}, "bench_config": {}, "marker": 7})
    monkeypatch.setattr(cli.report, "render", lambda result, console: None)
    code = cli.main(["bench", "--methods", "vanilla", "--dataset", "humaneval", "--limit-per-category", "1",
                     "--no-mlflow"])
    assert code == 0
    written = list((tmp_path / "runs").glob("bench-*.json"))
    assert len(written) == 1 and written[0].name[len("bench-"):-len(".json")].endswith("Z")
    import json

    assert json.loads(written[0].read_text())["marker"] == 7
    out = "".join(capsys.readouterr().out.split())  # rich may wrap the long path
    assert f"JSONwrittento{written[0].resolve()}" in out


def test_help_description_has_no_rest_markup(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "The graftblock command line" in out
