"""A sweep across a real two-node Ray cluster on this machine, submitted with ``ray job submit``, and
the worker node lost in the middle of it.

* ``cluster.local_cluster`` starts a head and a worker node (``ray start``, one CPU each); an ``mlflow
  server`` (sqlite behind it, 127.0.0.1) is the tracking store every node reaches (``check_cluster``
  refuses a file store on a multi-node cluster). Both are started and stopped by PID.
* The smoke sweep with 1-CPU trials and concurrency 2 must run trials on both nodes: each trial's MLflow
  run records its ``ray_node_id``.
* While two trials run, one per node, the worker's raylet is killed by PID. The sweep completes with
  exactly ``trials`` complete Optuna trials (those finished before the loss kept) and one FINISHED MLflow
  run per trial number: the trial lost with the node runs again (``retries: 1``), nothing is counted twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from ray.util.state import list_nodes

from cluster.local_cluster import HEAD, LABEL_KEY, LocalCluster
from tests.ray_fixtures import RAY_TEST_ENV, local_cluster  # noqa: F401 (a fixture)
from tests.test_serve import free_port
from tests.test_sweep_e2e import _client, _head_commit, _study, _wait

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TRIALS = 5
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1 (sqlite backend, artifacts proxied), in its own session, stopped by PID."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        env={**os.environ, **RAY_TEST_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _submit(cluster: LocalCluster, config: Path, root: Path, sid: str) -> None:
    env = {**os.environ, **RAY_TEST_ENV, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        # No --working-dir: the checkout is installed in the venv every node runs (one machine). With one,
        # the driver failed in os.getcwd() (FileNotFoundError) soon after the worker node was lost: its
        # working-dir copy seemed to be gone (seen once with Ray 2.60; not investigated further).
        [str(VENV_BIN / "ray"), "job", "submit", "--address", cluster.dashboard_url, "--submission-id", sid,
         "--no-wait", "--", sys.executable, "-m", "sweeps.run", "--config", str(config),
         "--root", str(root), "--git-commit", _head_commit()],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def _node_names(cluster: LocalCluster) -> dict[str, str]:
    return {n.node_id: (n.labels or {}).get(LABEL_KEY) for n in list_nodes(address=cluster.dashboard_url, detail=True)}


def test_a_sweep_runs_trials_on_both_nodes_and_completes_after_losing_one(local_cluster, mlflow_server, tmp_path):
    from optuna.trial import TrialState

    import tracking

    data = yaml.safe_load((REPO / "ray_configs" / "sweep_smoke.yaml").read_text())
    data.pop("holdout_categories")
    data.update(study="twonode", trials=TRIALS, concurrency=2, categories=["nq_open"], retries=1,
                trial_resources={"CPU": 1}, tracking_uri=mlflow_server, tune_storage=str(tmp_path / "tune"),
                shared_filesystem=True)  # one machine: every node mounts tmp_path
    config = tmp_path / "sweep_twonode.yaml"
    config.write_text(yaml.safe_dump(data))
    sid = f"twonode-{int(time.time())}"
    _submit(local_cluster, config, tmp_path, sid)
    client = _client(local_cluster)
    names = _node_names(local_cluster)

    def finished_nodes() -> set[str]:
        _, _, runs = _trial_runs_server(mlflow_server, "graftblock-sweep-twonode", "twonode")
        return {names.get(r.params.get("ray_node_id")) for r in runs if r.status == "FINISHED"}

    # Wait for a trial finished on each node and two running (one per node), then lose the worker.
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if "trials to run" in client.get_job_logs(sid):
            trials = _study(tmp_path, "twonode").trials
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if running == 2 and {HEAD, "worker"} <= finished_nodes():
                break
        time.sleep(1.0)
    else:
        pytest.fail(f"never had a trial finished on both nodes and two running:\n{client.get_job_logs(sid)[-3000:]}")
    complete_before = {t.number for t in _study(tmp_path, "twonode").trials if t.state == TrialState.COMPLETE}
    local_cluster.kill_raylet("worker")

    status = _wait(local_cluster, sid, timeout=600)
    logs = client.get_job_logs(sid)
    assert status == "SUCCEEDED", logs[-4000:]
    trials = _study(tmp_path, "twonode").trials
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == TRIALS == len({t.number for t in complete}), [(t.number, t.state) for t in trials]
    assert complete_before <= {t.number for t in complete}  # nothing finished before the loss was lost
    _, _, runs = _trial_runs_server(mlflow_server, "graftblock-sweep-twonode", "twonode")
    finished = sorted(int(r.tags[tracking.TRIAL_TAG]) for r in runs if r.status == "FINISHED")
    assert finished == sorted(t.number for t in complete)  # one FINISHED run per trial, none twice
    nodes = {names.get(r.params["ray_node_id"]) for r in runs if r.status == "FINISHED"}
    assert nodes == {HEAD, "worker"}


def _trial_runs_server(uri: str, experiment: str, study: str):
    import mlflow

    import tracking

    exp = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    if exp is None:
        return uri, None, []
    return uri, exp, tracking.find_runs(uri, exp.experiment_id,
                                        {tracking.STUDY_TAG: study, tracking.KIND_TAG: "sweep_trial"})
