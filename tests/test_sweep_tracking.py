"""Sweep bookkeeping on real stores (Optuna RDB on SQLite, MLflow on SQLite), no Ray (~15 s).

* resume: trials a killed sweep left RUNNING are recovered from MLflow or re-queued;
* compare: table rows, Pareto plot, best config usable by ``graftblock bench --config``;
* unreachable tracking server: a clear error, fast.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import optuna
import pytest
import yaml

from speculation.drafters import resolve_methods
import tracking
from sweeps import compare, resume
from tests.ray_fixtures import apply_test_env

apply_test_env()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    exp = tracking.experiment_id("sweep-test", uri, artifact_location=str(root / "artifacts"))
    return root, uri, exp


SOURCE = tracking.RunSource(name="test", type=tracking.SourceType.JOB, commit="0123456789abcdef0123456789abcdef01234567")


def _trial_run(uri, exp, parent, study, number, cfg, metrics, status="FINISHED"):
    import mlflow

    rid = tracking.open_trial_run(uri, exp, parent, study, number, "retrieval", cfg, SOURCE)
    client = mlflow.MlflowClient(tracking_uri=uri)
    tracking.log_batch(client, rid, {f"method.retrieval.{k}": v for k, v in cfg.items()}, metrics)
    if status != "RUNNING":
        client.set_terminated(rid, status)
    return rid


def test_settle_interrupted_recovers_and_requeues(store):
    import mlflow

    root, uri, exp = store
    storage = optuna.storages.RDBStorage(f"sqlite:///{root / 'optuna.db'}")
    study = resume.create_or_load(storage, "killed", ["maximize"])
    parent = tracking.open_sweep_parent(uri, exp, "killed", {"trials": 4}, SOURCE)
    t0 = study.ask({"budget": optuna.distributions.IntDistribution(4, 32)})
    _trial_run(uri, exp, parent, "killed", t0.number, {"budget": t0.params["budget"]}, {"speedup": 1.2})
    study.tell(t0, 1.2)
    # Killed after the trial logged its result but before Tune told Optuna:
    t1 = study.ask({"budget": optuna.distributions.IntDistribution(4, 32)})
    _trial_run(uri, exp, parent, "killed", t1.number, {"budget": t1.params["budget"]}, {"speedup": 1.5})
    # Killed mid-trial:
    t2 = study.ask({"budget": optuna.distributions.IntDistribution(4, 32)})
    rid2 = _trial_run(
        uri, exp, parent, "killed", t2.number, {"budget": t2.params["budget"]}, {}, status="RUNNING"
    )

    status = resume.settle_interrupted(study, storage, uri, exp, ["speedup"])
    assert (status.complete, status.failed, status.recovered, status.requeued, status.waiting) == (
        2,
        0,
        1,
        1,
        1,
    )
    assert status.remaining(4) == 2 and status.remaining(2) == 0
    states = {t.number: t.state for t in study.get_trials()}
    assert states[t0.number] == states[t1.number] == optuna.trial.TrialState.COMPLETE
    assert study.trials[t1.number].values == [1.5]
    assert study.trials[t2.number].state == optuna.trial.TrialState.FAIL
    assert mlflow.MlflowClient(tracking_uri=uri).get_run(rid2).info.status == "KILLED"
    # The killed point is retried first, under a new trial number.
    retry = study.ask({"budget": optuna.distributions.IntDistribution(4, 32)})
    assert retry.number == 3 and retry.params == t2.params
    # Settling again changes nothing (idempotent) except the now-running retry.
    again = resume.settle_interrupted(study, storage, uri, exp, ["speedup"])
    assert again.complete == 2 and again.requeued == 1
    # The parent run is reused by a resumed sweep.
    assert tracking.open_sweep_parent(uri, exp, "killed", {}, SOURCE) == parent


def test_study_direction_mismatch_is_an_error(store):
    root, _, _ = store
    storage = optuna.storages.RDBStorage(f"sqlite:///{root / 'optuna.db'}")
    resume.create_or_load(storage, "dirs", ["maximize"])
    with pytest.raises(ValueError, match=r"optimises \['maximize'\], but the config asks for"):
        resume.create_or_load(storage, "dirs", ["maximize", "minimize"])


def test_pareto_front():
    pts = [(10, 1.0), (20, 1.5), (15, 1.2), (25, 1.4), (5, 0.9), (10, 0.8)]
    assert compare.pareto_front(pts) == [0, 1, 2, 4]


def test_compare_table_plot_and_best_config(store, tmp_path):
    root, uri, exp_id = store
    import mlflow

    exp_name = "compare-test"
    exp = tracking.experiment_id(exp_name, uri, artifact_location=str(root / "artifacts"))
    parent = tracking.open_sweep_parent(uri, exp, "cmp", {}, SOURCE)
    base = {"budget": 8, "max_depth": 4, "cost_aware": False, "datastore": None}
    for n, (speedup, tree, share) in enumerate([(1.1, 5.0, 0.05), (1.4, 9.0, 0.08), (1.2, 12.0, 0.2)]):
        cfg = {**base, "budget": 8 * (n + 1)}
        _trial_run(
            uri,
            exp,
            parent,
            "cmp",
            n,
            cfg,
            {
                "speedup": speedup,
                "mean_tree_size": tree,
                "drafting_share": share,
                "retrieval.speedup": speedup,
            },
        )
    _trial_run(uri, exp, parent, "cmp", 3, {**base, "budget": 64}, {"speedup": 9.9}, status="RUNNING")
    # A plain `graftblock bench` run in the same experiment is a row too.
    result = {
        "methods": {"vanilla": {"speedup": 1.0}, "retrieval": {"speedup": 1.3, "tau": 1.8, "config": base}}
    }
    tracking.log_bench(uri, exp, "bench", {"model": "m"}, result, SOURCE)

    report = compare.compare(exp_name, uri, tmp_path / "cmp")
    assert len(report.rows) == 5
    assert report.best["trial_number"] == 1 and report.best["metrics"]["speedup"] == pytest.approx(1.4)
    best = yaml.safe_load((tmp_path / "cmp" / "best_config.yaml").read_text())
    assert best == {"retrieval": {**base, "budget": 16}}
    spec = resolve_methods(["retrieval"], best)[0]  # loads as `graftblock bench --config`
    assert spec.config.budget == 16 and spec.config.cost_aware is False
    png = (tmp_path / "cmp" / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    rows = json.loads((tmp_path / "cmp" / "runs.json").read_text())
    assert {r["status"] for r in rows} == {"FINISHED", "RUNNING"}
    only = compare.compare(exp_name, uri, tmp_path / "cmp2", study="cmp")
    assert len(only.rows) == 4
    assert mlflow.MlflowClient(tracking_uri=uri).get_experiment(exp).name == exp_name


def test_compare_unknown_experiment_lists_the_known_ones(store, tmp_path):
    from speculation.config import ConfigError

    _, uri, _ = store
    with pytest.raises(
        ConfigError, match=r"no MLflow experiment 'nope' .* experiments there: \[.*'sweep-test'"
    ):
        compare.compare("nope", uri, tmp_path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_tracking_uri_fails_fast(tmp_path, capsys):
    from graftblock import cli
    from sweeps import run

    data = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "ray_configs" / "sweep_smoke.yaml").read_text()
    )
    data["tracking_uri"] = f"http://127.0.0.1:{_closed_port()}"
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump(data))
    t0 = time.monotonic()
    assert run.main(["--config", str(cfg), "--root", str(tmp_path)]) == 2
    assert cli.main(["compare", "--experiment", "x", "--tracking-uri", data["tracking_uri"]]) == 2
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err
    assert "is unreachable" in err and "mlflow server" in err
    assert not (tmp_path / "runs").exists()  # nothing was started
