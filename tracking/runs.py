"""MLflow logging for every run (bench, train, sweep trial, serve), outside ``speculation/``.

Default store: ``sqlite:///<cwd>/mlflow.db``; ``--tracking-uri`` / ``MLFLOW_TRACKING_URI`` point
elsewhere (e.g. an ``mlflow server``). Experiments are addressed by *id* (created on first use),
never through ``MLFLOW_EXPERIMENT_ID``. Params are the flattened resolved config; metrics follow
the bench JSON names as ``<method>.<metric>`` and ``<method>.<category>.<metric>``.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRIC_KEYS = (
    "speedup", "tau", "tokens_per_s", "drafting_share", "mean_tree_size",
    "drafter_forwards_per_step", "drafting_s_per_step", "verify_s_per_step", "match_rate",
)


class TrackingError(RuntimeError):
    """The tracking store cannot be used (unreachable server, bad URI)."""


def resolve_uri(uri: str | None) -> str:
    """Explicit URI, else ``MLFLOW_TRACKING_URI``, else an absolute sqlite file in the cwd."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with a clear message, if an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TrackingError(f"MLflow tracking URI {uri} is unreachable ({exc}); start `mlflow server` "
                            "or pass --no-mlflow") from exc


def experiment_id(name: str, uri: str, artifact_location: str | None = None) -> str:
    """Id of experiment ``name`` in the store at ``uri``, created if missing.

    ``artifact_location`` (absolute) applies only when the experiment is created; without it
    MLflow's default for a local store is ``./mlruns`` under the *current* directory, which for a
    Ray job is a temporary copy of the working directory.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # created concurrently by another process: read it back
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def bench_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """Flat numeric metrics from a bench result dict."""
    out: dict[str, float] = {}
    sections = list(result.get("methods", {}).items()) + [(f"peer.{k}", v) for k, v in result.get("peers", {}).items()]
    for name, m in sections:
        for key in METRIC_KEYS:
            v = m.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{name}.{key}"] = float(v)
        if isinstance(m.get("lossless"), bool):
            out[f"{name}.lossless"] = float(m["lossless"])
        for key, v in (m.get("drafter_stats") or {}).items():  # e.g. graft: stage shares, grafted nodes
            out[f"{name}.stats.{key}"] = float(v)
        for cat, pc in (m.get("per_category") or {}).items():
            for key in ("speedup", "tau", "tokens_per_s", "mean_tree_size"):
                v = pc.get(key)
                if isinstance(v, (int, float)) and v is not None:
                    out[f"{name}.{cat}.{key}"] = float(v)
    if "baseline_tokens_per_s" in result:
        out["baseline_tokens_per_s"] = float(result["baseline_tokens_per_s"])
    return out


def log_batch(client, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float], step: int = 0) -> None:
    """Params and metrics in batches (one sqlite transaction per 100 items, not per item)."""
    import time

    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    plist = [Param(k, str(v)[:500]) for k, v in params.items()]
    mlist = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    for i in range(0, len(plist), 100):
        client.log_batch(run_id, params=plist[i : i + 100])
    for i in range(0, len(mlist), 500):
        client.log_batch(run_id, metrics=mlist[i : i + 500])


def log_bench(
    experiment: str,
    tracking_uri: str | None,
    kind: str,
    params: Mapping[str, Any],
    result: Mapping[str, Any] | None,
    artifacts: Iterable[Path] = (),
    run_name: str | None = None,
) -> str:
    """Log one run; returns its run id."""
    import mlflow

    uri = resolve_uri(tracking_uri)
    check_reachable(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp_id = experiment_id(experiment, uri)
    run = client.create_run(exp_id, run_name=run_name, tags={"graftblock.kind": kind})
    rid = run.info.run_id
    try:
        flat = {k: str(v)[:500] for k, v in flatten(params).items()}
        if result is not None:
            for name, m in result.get("methods", {}).items():
                flat.update({f"method.{name}.{k}": str(v)[:500] for k, v in flatten(m.get("config", {})).items()})
        metrics = bench_metrics(result) if result is not None else {}
    except Exception:
        client.set_terminated(rid, "FAILED")
        raise
    finish_run(client, rid, flat, metrics, artifacts)
    return rid


def finish_run(client, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float],
               artifacts: Iterable[Path] = ()) -> None:
    """Log params, metrics and artifacts (see :func:`log_batch`), then mark the
    run FINISHED; a logging failure marks it FAILED and re-raises."""
    try:
        log_batch(client, run_id, params, metrics)
        for a in artifacts:
            client.log_artifact(run_id, str(a))
        client.set_terminated(run_id, "FINISHED")
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise


# --------------------------------------------------------------------------- sweeps
#: Tags that tie sweep runs together (MLflow's own nesting tag, plus ours).
PARENT_TAG = "mlflow.parentRunId"
KIND_TAG = "graftblock.kind"
STUDY_TAG = "graftblock.study"
TRIAL_TAG = "graftblock.trial_number"
METHOD_TAG = "graftblock.method"
CONFIG_TAG = "graftblock.method_config"


def find_runs(uri: str, exp_id: str, tags: Mapping[str, str], max_results: int = 5000) -> list:
    """Runs of ``exp_id`` carrying every tag in ``tags`` (any status), newest first."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return client.search_runs(
        [exp_id], filter_string=flt, max_results=max_results, order_by=["attributes.start_time DESC"]
    )


def open_sweep_parent(uri: str, exp_id: str, study: str, params: Mapping[str, Any]) -> str:
    """The sweep's parent run: the existing one for ``study`` (a resumed sweep), else a new one."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    existing = find_runs(uri, exp_id, {KIND_TAG: "sweep", STUDY_TAG: study})
    if existing:
        rid = existing[0].info.run_id
        client.update_run(rid, status="RUNNING")
        return rid
    run = client.create_run(exp_id, run_name=f"sweep-{study}", tags={KIND_TAG: "sweep", STUDY_TAG: study})
    log_batch(client, run.info.run_id, {k: str(v)[:500] for k, v in flatten(params).items()}, {})
    return run.info.run_id


def start_trial_run(uri: str, exp_id: str, parent_id: str, study: str, number: int, method: str,
                    method_config: Mapping[str, Any]) -> str:
    """A child run for Optuna trial ``number``, nested under ``parent_id`` (status RUNNING)."""
    import json

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    tags = {
        PARENT_TAG: parent_id, KIND_TAG: "sweep_trial", STUDY_TAG: study, TRIAL_TAG: str(number),
        METHOD_TAG: method, CONFIG_TAG: json.dumps(dict(method_config), sort_keys=True, default=str),
    }
    return client.create_run(exp_id, run_name=f"{study}-trial-{number}", tags=tags).info.run_id
