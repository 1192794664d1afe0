"""End to end: a real Ray head, ``ray job submit`` of the smoke sweep, MLflow/Optuna checks,
``graftblock compare``, and a killed-then-resubmitted sweep (marked ``slow``; ~3 min on 2 CPUs).

The head is ``cluster.local_cluster`` with no worker node (``ray start --head --block`` in its own
process group, loopback, free ports, a dedicated ``--temp-dir``), stopped by signalling that
process group and any process still running from that temp dir; ``ray stop`` is never used (it
would stop every Ray cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster.local_cluster import LocalCluster
from tests.ray_fixtures import RAY_TEST_ENV, running_cluster

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        **RAY_TEST_ENV,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A one-node cluster (``cluster.local_cluster``, as ``make cluster-local`` starts it): a
    ``ray start --head --block`` process group on loopback with the job server, stopped by PID."""
    with running_cluster(tmp_path_factory.mktemp("head"), head_cpus=2, worker_cpus=()) as h:
        yield h


def _ray(head: LocalCluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "ray"), *args], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _submit(head: LocalCluster, config: Path, root: Path, sid: str) -> None:
    out = _ray(
        head,
        "job",
        "submit",
        "--address",
        head.dashboard_url,
        "--submission-id",
        sid,
        "--no-wait",
        "--working-dir",
        ".",
        "--",
        sys.executable,
        "-m",
        "sweeps.run",
        "--config",
        str(config),
        "--root",
        str(root),
        "--git-commit",
        _head_commit(),
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _head_commit() -> str:
    """What the submitter passes in: the job's copy of the checkout has no .git (.rayignore)."""
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _client(head: LocalCluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.dashboard_url)


def _wait(head: LocalCluster, sid: str, timeout: float = 600) -> str:
    from ray.job_submission import JobStatus

    client = _client(head)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get_job_status(sid)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(2)
    raise TimeoutError(f"job {sid} still {status} after {timeout}s:\n{client.get_job_logs(sid)[-4000:]}")


def _study(root: Path, name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{root / 'runs' / 'sweeps' / 'optuna.db'}")


def _trial_runs(root: Path, experiment: str, study: str):
    import mlflow

    import tracking

    uri = f"sqlite:///{root / 'mlflow.db'}"
    exp = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    return (
        uri,
        exp,
        tracking.find_runs(
            uri, exp.experiment_id, {tracking.STUDY_TAG: study, tracking.KIND_TAG: "sweep_trial"}
        ),
    )


def test_smoke_sweep_job(head, tmp_path):
    import mlflow
    from optuna.trial import TrialState

    import tracking

    sid = f"smoke-{int(time.time())}"
    config = REPO / "ray_configs" / "sweep_smoke.yaml"
    _submit(head, config, tmp_path, sid)
    status = _wait(head, sid)
    logs = _client(head).get_job_logs(sid)
    assert status == "SUCCEEDED", logs[-4000:]
    assert "[sweep smoke] trial 0 finished" in logs and "done 3/3 (failed 0)" in logs

    study = _study(tmp_path, "smoke")
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 3 == len(study.trials)

    uri, exp, runs = _trial_runs(tmp_path, "graftblock-sweep-smoke", "smoke")
    client = mlflow.MlflowClient(tracking_uri=uri)
    parents = tracking.find_runs(
        uri, exp.experiment_id, {tracking.KIND_TAG: "sweep", tracking.STUDY_TAG: "smoke"}
    )
    assert len(parents) == 1 and parents[0].status == "FINISHED"
    assert exp.artifact_location.startswith(str(tmp_path))  # absolute, not the job's temp dir
    assert sorted(int(r.tags[tracking.TRIAL_TAG]) for r in runs) == sorted(t.number for t in complete)
    assert parents[0].tags["mlflow.source.git.commit"] == _head_commit()
    for run in runs:
        assert run.status == "FINISHED"
        assert run.tags["mlflow.parentRunId"] == parents[0].run_id
        assert run.tags["mlflow.source.git.commit"] == _head_commit()  # passed in by the submitter
        m = run.metrics
        for key in (
            "speedup",
            "tau",
            "tokens_per_s",
            "drafting_share",
            "mean_tree_size",
            "retrieval.humaneval.speedup",
            "retrieval.translation.tau",
            "baseline_tokens_per_s",
        ):
            assert key in m, key
        number = int(run.tags[tracking.TRIAL_TAG])
        assert m["speedup"] == pytest.approx(study.trials[number].values[0])
        assert run.params["method.retrieval.budget"] == str(study.trials[number].params["budget"])
        arts = {a.path for a in client.list_artifacts(run.run_id)}
        assert {f"trial-{number:04d}.json", f"trial-{number:04d}-categories.png"} <= arts
        bench = json.loads(
            Path(
                client.download_artifacts(run.run_id, f"trial-{number:04d}.json", str(tmp_path))
            ).read_text()
        )
        assert bench["methods"]["retrieval"]["lossless"] is True  # greedy fp32: token-identical to vanilla

    out = tmp_path / "cmp"
    cmp = subprocess.run(
        [
            str(VENV_BIN / "graftblock"),
            "compare",
            "--experiment",
            "graftblock-sweep-smoke",
            "--tracking-uri",
            uri,
            "--out-dir",
            str(out),
        ],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cmp.returncode == 0, cmp.stderr
    assert "best: retrieval" in cmp.stdout and (out / "pareto.png").stat().st_size > 5000
    from speculation.drafters import resolve_methods

    best = yaml.safe_load((out / "best_config.yaml").read_text())
    assert resolve_methods(["retrieval"], best)[0].config.cost_aware is False

    # The held-out run: the best trial's config, benched on categories no trial saw, reported
    # beside its sweep score (and never a row of compare).
    held = json.loads((tmp_path / "runs" / "sweeps" / "smoke" / "compare" / "holdout.json").read_text())
    best_trial = max(complete, key=lambda t: t.values[0])
    assert held["trial_number"] == best_trial.number and held["config"] == best["retrieval"]
    assert held["holdout_categories"] == ["xsum", "asdiv"]
    assert held["sweep"]["speedup"] == pytest.approx(best_trial.values[0])
    holdouts = tracking.holdout_runs(uri, exp.experiment_id, "smoke", best_trial.number)
    assert len(holdouts) == 1 and holdouts[0].status == "FINISHED"
    h = holdouts[0].metrics
    assert h["speedup"] == pytest.approx(held["holdout"]["speedup"])
    assert "retrieval.xsum.speedup" in h and "retrieval.asdiv.tau" in h and "retrieval.humaneval.speedup" not in h
    assert json.loads(holdouts[0].tags[tracking.CONFIG_TAG]) == best["retrieval"]
    assert parents[0].metrics["holdout.speedup"] == pytest.approx(held["holdout"]["speedup"])
    assert "held-out (xsum, asdiv): speedup" in logs
    listed = {r["run_id"] for r in json.loads((out / "runs.json").read_text())}
    assert holdouts[0].run_id not in listed and {r.run_id for r in runs} <= listed


def test_killed_sweep_resumes_without_losing_or_repeating_trials(head, tmp_path):
    from optuna.trial import TrialState

    TRIALS = 5

    import tracking

    data = yaml.safe_load((REPO / "ray_configs" / "sweep_smoke.yaml").read_text())
    # Multi-objective here (speedup vs drafting share), so both modes run end to end.
    # 5 trials: the stop takes seconds to land, and on a loaded host the trials still running
    # could otherwise finish the whole study before it does (seen with 3).
    data.update(study="resume", trials=TRIALS, categories=["nq_open"], objective="speedup_vs_drafting")
    data.pop("holdout_categories")  # the held-out run is the smoke test's; keep this one short
    config = tmp_path / "sweep_resume.yaml"
    config.write_text(yaml.safe_dump(data))

    sid = f"resume-a-{int(time.time())}"
    _submit(head, config, tmp_path, sid)
    deadline = time.monotonic() + 300
    client = _client(head)
    while time.monotonic() < deadline:  # kill once one trial finished and the next one runs
        # Open the storage only after the job created it (two processes creating the schema race).
        if "trials to run" in client.get_job_logs(sid):
            trials = _study(tmp_path, "resume").trials
            if sum(t.state == TrialState.COMPLETE for t in trials) >= 1 and any(
                t.state == TrialState.RUNNING for t in trials
            ):
                break
        time.sleep(0.5)
    else:
        pytest.fail("the first sweep job never had a finished and a running trial")
    stop = _ray(head, "job", "stop", "--address", head.dashboard_url, sid, timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert _wait(head, sid, timeout=120) == "STOPPED"
    before = {t.number: t.values for t in _study(tmp_path, "resume").trials if t.state == TrialState.COMPLETE}
    assert 1 <= len(before) < TRIALS

    sid2 = f"resume-b-{int(time.time())}"
    _submit(head, config, tmp_path, sid2)
    status = _wait(head, sid2)
    logs = _client(head).get_job_logs(sid2)
    assert status == "SUCCEEDED", logs[-4000:]
    found = re.search(r"(\d+) complete, (\d+) failed, (\d+) recovered and (\d+) re-queued", logs)
    assert found, logs[-4000:]
    complete_now, _, recovered, _ = (int(g) for g in found.groups())
    assert complete_now - recovered == len(before)  # what finished before the kill is all still there

    trials = _study(tmp_path, "resume").trials
    complete = {t.number: t.values for t in trials if t.state == TrialState.COMPLETE}
    assert len(complete) == TRIALS  # exactly the target: nothing repeated beyond it
    assert all(len(v) == 2 for v in complete.values())  # (speedup, drafting share)
    assert all(complete[n] == v for n, v in before.items())  # nothing finished was lost or re-run
    killed = [t for t in trials if t.state == TrialState.FAIL]
    assert all(t.system_attrs.get("graftblock.killed") for t in killed)

    _, _, runs = _trial_runs(tmp_path, "graftblock-sweep-resume", "resume")
    finished = [int(r.tags[tracking.TRIAL_TAG]) for r in runs if r.status == "FINISHED"]
    assert sorted(finished) == sorted(complete)  # one finished MLflow run per complete trial, no duplicates
    assert all(r.status in ("FINISHED", "KILLED") for r in runs)
