"""Tracking beyond one machine, on real stores (MLflow on SQLite, Optuna RDB on SQLite):

* runs carry the repo's git commit and source (bench run, sweep trial run);
* a retried trial reuses its run; a dead trial's RUNNING run is settled;
* sweeps honour MLFLOW_TRACKING_URI; a multi-node cluster refuses one-machine stores;
* a study lease: a second live sweep job refuses to start, without settling the first's trials.
"""

from __future__ import annotations

import getpass
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

import tracking
from speculation.config import ConfigError
from sweeps import lease as lease_mod
from sweeps.config import ResolvedPaths, check_cluster, load_sweep_config
from tests.ray_fixtures import apply_test_env, ray_local  # noqa: F401  (fixture)

apply_test_env()
REPO = Path(__file__).resolve().parent.parent


def _head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture()
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, tracking.experiment_id("t", uri, artifact_location=str(tmp_path / "art"))


def _run(uri, rid):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri).get_run(rid)


def test_bench_and_trial_runs_carry_the_repo_commit(store):
    uri, exp = store
    head = _head()
    bench = tracking.log_bench(uri, exp, "bench", {"model": "m"}, {"methods": {"vanilla": {"speedup": 1.0}}},
                               tracking.RunSource.here("graftblock bench"))
    tags = _run(uri, bench).data.tags
    assert tags["mlflow.source.git.commit"] == head
    assert tags["mlflow.source.name"] == "graftblock bench" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"] == getpass.getuser()
    # A sweep job has no .git: the commit is passed in (--git-commit) and every run records it.
    job = tracking.RunSource("graftblock sweep", tracking.SourceType.JOB, tracking.check_commit(head))
    parent = tracking.open_sweep_parent(uri, exp, "s", {}, job)
    trial = tracking.open_trial_run(uri, exp, parent, "s", 0, "retrieval", {"budget": 8}, job)
    for rid in (parent, trial):
        t = _run(uri, rid).data.tags
        assert t["mlflow.source.git.commit"] == head and t["mlflow.source.type"] == "JOB"
    with pytest.raises(ValueError, match="--git-commit must be 7-40 hex digits"):
        tracking.check_commit("not-a-sha")


def test_retried_trial_reuses_its_run_and_a_dead_trial_is_settled(store):
    uri, exp = store
    src = tracking.RunSource("t")
    parent = tracking.open_sweep_parent(uri, exp, "r", {}, src)
    first = tracking.open_trial_run(uri, exp, parent, "r", 3, "retrieval", {}, src)
    tracking.set_status(uri, first, tracking.RunStatus.FAILED)  # the attempt raised
    again = tracking.open_trial_run(uri, exp, parent, "r", 3, "retrieval", {}, src)  # Tune retries it
    assert again == first and _run(uri, first).info.status == "RUNNING"
    assert len(tracking.trial_runs(uri, exp, "r", 3)) == 1
    other = tracking.open_trial_run(uri, exp, parent, "r", 4, "retrieval", {}, src)
    # The actor of trial 3 died: the driver settles only that trial's RUNNING run.
    assert tracking.settle_trial_runs(uri, exp, "r", 3, tracking.RunStatus.FAILED) == [first]
    assert _run(uri, first).info.status == "FAILED" and _run(uri, other).info.status == "RUNNING"


def _smoke(tmp_path, **over) -> Path:
    data = yaml.safe_load((REPO / "ray_configs" / "sweep_smoke.yaml").read_text())
    data.update(over)
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def test_sweep_honours_mlflow_tracking_uri(tmp_path, monkeypatch):
    cfg = load_sweep_config(_smoke(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cfg.resolved(tmp_path).tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert cfg.resolved(tmp_path).tracking_uri == "http://mlflow.example:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel.db")  # relative: against --root
    assert cfg.resolved(tmp_path).tracking_uri == f"sqlite:///{tmp_path.resolve() / 'rel.db'}"
    assert cfg.resolved(tmp_path, tracking_uri="http://flag:5000").tracking_uri == "http://flag:5000"
    pinned = load_sweep_config(_smoke(tmp_path, tracking_uri="http://yaml:5000"))
    assert pinned.resolved(tmp_path).tracking_uri == "http://yaml:5000"  # the config beats the env


def _paths(tmp_path, uri: str, tune: str, shared: bool = False) -> ResolvedPaths:
    return ResolvedPaths(root=tmp_path, output_dir=tmp_path, storage="sqlite:///x.db", tracking_uri=uri,
                         experiment="e", artifact_location=str(tmp_path), tune_storage=tune,
                         shared_filesystem=shared)


def test_multi_node_cluster_refuses_one_machine_stores(tmp_path):
    local = _paths(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "tune"))
    check_cluster(1, local)  # one node: everything is local anyway
    with pytest.raises(ConfigError, match=r"3 nodes.*is a file on one machine; use an mlflow server URI "
                                          r"\(--tracking-uri http://HEAD:5000"):
        check_cluster(3, local)
    server_local_dir = _paths(tmp_path, "http://head:5000", str(tmp_path / "tune"))
    with pytest.raises(ConfigError, match=r"storage_path .* is a local directory; set tune_storage: to a URI"):
        check_cluster(2, server_local_dir)
    check_cluster(2, _paths(tmp_path, "http://head:5000", "s3://bucket/tune"))
    check_cluster(2, _paths(tmp_path, "postgresql://db/mlflow", str(tmp_path), shared=True))
    with pytest.raises(ConfigError, match="is a file on one machine"):
        check_cluster(2, _paths(tmp_path, "file:///tmp/mlruns", "s3://b/t"))


def _study(tmp_path, name="leased"):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    optuna.create_study(storage=storage, study_name=name, load_if_exists=True)
    return storage


def test_lease_refuses_a_second_live_job_and_expires(tmp_path):
    storage = _study(tmp_path)
    now = [1000.0]
    a = lease_mod.StudyLease(storage, "leased", ttl_s=60, confirm_s=0, clock=lambda: now[0])
    b = lease_mod.StudyLease(storage, "leased", ttl_s=60, confirm_s=0, clock=lambda: now[0])
    a.acquire()
    now[0] += 30
    assert a.renew()
    now[0] += 59  # 59 s after a's last heartbeat: still live
    with pytest.raises(lease_mod.StudyBusy, match=r"study 'leased' is being run by another sweep job .*--force"):
        b.acquire()
    now[0] += 2  # expired
    b.acquire()
    assert b.current().owner == b.owner
    assert not a.renew()  # a sees it lost the lease and stops renewing
    a.acquire(force=True)  # explicit take-over
    assert a.current().owner == a.owner
    b.release()  # not b's any more: untouched
    assert a.current().owner == a.owner
    a.release()
    assert a.current() is None
    b.acquire()  # a released lease is free at once


def test_second_submission_refuses_and_leaves_live_trials_alone(tmp_path, ray_local, capsys):  # noqa: F811
    from sweeps import resume, run

    cfg = _smoke(tmp_path, study="busy")
    root = tmp_path / "root"
    (root / "runs" / "sweeps").mkdir(parents=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{root / 'runs' / 'sweeps' / 'optuna.db'}")
    study = resume.create_or_load(storage, "busy", ["maximize"])
    live = study.ask({"budget": optuna.distributions.IntDistribution(4, 32)})  # the first job's trial
    holder = lease_mod.StudyLease(storage, "busy", confirm_s=0)
    holder.acquire()
    assert run.main(["--config", str(cfg), "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "sweep: error: study 'busy' is being run by another sweep job" in err and "--force" in err
    assert study.trials[live.number].state == optuna.trial.TrialState.RUNNING  # not settled as killed
    assert holder.current().owner == holder.owner


@pytest.mark.slow  # starts several Python processes that each import MLflow (~13 s)
def test_processes_opening_one_fresh_sqlite_store_together_all_get_the_experiment(tmp_path):
    """Two ``graftblock train`` started at once in one directory both create the schema of a new
    sqlite store; without the first-open lock one died with alembic's "expected to match one row"."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("import sys, time; import mlflow, tracking; t = float(sys.argv[2]); time.sleep(max(0.0, t - time.time())); "
            "print(tracking.experiment_id('together', sys.argv[1]))")
    start = time.time() + 8.0  # every process has imported mlflow before the common start
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, str(start)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-1500:] for _, e in outs]
    ids = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(ids) == 1  # one experiment, the same id for all
    assert (tmp_path / "mlflow.db.lock").exists()
