"""Runs: create one with its source tags, log params/metrics/artifacts in batches, settle it.

Params are the flattened resolved config; bench metrics follow the bench JSON names as
``<method>.<metric>`` and ``<method>.<category>.<metric>`` (:func:`bench_metrics`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tracking.source import RunSource
from tracking.store import TrackingError

METRIC_KEYS = (
    "speedup", "tau", "tokens_per_s", "drafting_share", "mean_tree_size",
    "drafter_forwards_per_step", "drafting_s_per_step", "verify_s_per_step", "match_rate",
)
KIND_TAG = "graftblock.kind"
#: MLflow truncates nothing itself; params longer than this are cut (MLflow's limit is 6000).
PARAM_CHARS = 500


class RunStatus(str, enum.Enum):
    """MLflow run states graftblock sets."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    """The run raised (or its process died, seen from the driver)."""
    KILLED = "KILLED"
    """The run was stopped from outside (the sweep was stopped, not a failure of the point)."""


def _client(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
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
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    plist = [Param(k, str(v)[:PARAM_CHARS]) for k, v in params.items()]
    mlist = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    for i in range(0, len(plist), 100):
        client.log_batch(run_id, params=plist[i : i + 100])
    for i in range(0, len(mlist), 500):
        client.log_batch(run_id, metrics=mlist[i : i + 500])


def create_run(uri: str, exp_id: str, run_name: str | None, tags: Mapping[str, str], source: RunSource) -> str:
    """A new RUNNING run carrying ``tags`` and the source tags (commit, entry point, user); its id."""
    run = _client(uri).create_run(exp_id, run_name=run_name, tags={**source.tags(), **tags})
    return run.info.run_id


def set_status(uri: str, run_id: str, status: RunStatus) -> None:
    """Mark a run RUNNING again (a resumed run) or terminated with ``status``."""
    client = _client(uri)
    if status == RunStatus.RUNNING:
        client.update_run(run_id, status=status.value)
    else:
        client.set_terminated(run_id, status.value)


def log_values(uri: str, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float],
               step: int = 0) -> None:
    """Params and metrics of a run that stays open (see :func:`log_batch`)."""
    log_batch(_client(uri), run_id, params, metrics, step)


def finish_run(uri: str, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float],
               artifacts: Iterable[Path] = (), status: RunStatus = RunStatus.FINISHED) -> None:
    """Log params, metrics and artifacts (see :func:`log_batch`), then mark the run ``status``;
    a logging failure marks it FAILED and re-raises."""
    client = _client(uri)
    try:
        log_batch(client, run_id, params, metrics)
        for a in artifacts:
            client.log_artifact(run_id, str(a))
        client.set_terminated(run_id, status.value)
    except Exception:
        client.set_terminated(run_id, RunStatus.FAILED.value)
        raise


def log_bench(
    uri: str,
    exp_id: str,
    kind: str,
    params: Mapping[str, Any],
    result: Mapping[str, Any] | None,
    source: RunSource,
    artifacts: Iterable[Path] = (),
    run_name: str | None = None,
) -> str:
    """Log one finished bench (or verify-curve) run into experiment ``exp_id``; returns its run id.

    ``uri`` and ``exp_id`` come from :func:`tracking.store.prepare`, called before the bench ran.
    """
    flat = {k: str(v)[:PARAM_CHARS] for k, v in flatten(params).items()}
    if result is not None:
        for name, m in result.get("methods", {}).items():
            flat.update({f"method.{name}.{k}": str(v)[:PARAM_CHARS] for k, v in flatten(m.get("config", {})).items()})
    metrics = bench_metrics(result) if result is not None else {}
    from mlflow.exceptions import MlflowException

    try:
        rid = create_run(uri, exp_id, run_name, {KIND_TAG: kind}, source)
        finish_run(uri, rid, flat, metrics, artifacts)
    except (MlflowException, OSError) as exc:  # the store went away during the run
        text = " ".join(str(exc).split())
        raise TrackingError(f"MLflow store {uri}: could not log the {kind} run ({text[:300]}); "
                            "the result JSON was written") from exc
    return rid
