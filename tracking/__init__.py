"""The one MLflow module of graftblock: bench, verify-curve, train, sweep trials, serving metrics.

Everything that talks to an MLflow store goes through here, so the packages below it
(``speculation``) stay free of MLflow and the packages above it (``adaptation``, ``workers``,
``cluster``, ``sweeps``, the CLI) share one set of conventions:

* the store: ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``
  (:func:`resolve_uri`);
* experiments addressed by id (:func:`experiment_id`), never through ``MLFLOW_EXPERIMENT_ID``;
* params = the flattened resolved config; metrics follow the bench JSON names;
* every run carries its source commit (:mod:`tracking.runs`).

Modules: :mod:`tracking.runs` (stores, runs, bench/verify-curve logging, sweep runs) and
:mod:`tracking.train` (the metrics-sink protocol the trainers log through).
"""

from tracking.runs import (
    CONFIG_TAG,
    KIND_TAG,
    METHOD_TAG,
    METRIC_KEYS,
    PARENT_TAG,
    STUDY_TAG,
    TRIAL_TAG,
    TrackingError,
    bench_metrics,
    check_reachable,
    experiment_id,
    find_runs,
    finish_run,
    flatten,
    log_batch,
    log_bench,
    open_sweep_parent,
    resolve_uri,
    start_trial_run,
)
from tracking.train import MetricsSink, MlflowSink, NullSink

__all__ = [
    "CONFIG_TAG",
    "KIND_TAG",
    "METHOD_TAG",
    "METRIC_KEYS",
    "PARENT_TAG",
    "STUDY_TAG",
    "TRIAL_TAG",
    "MetricsSink",
    "MlflowSink",
    "NullSink",
    "TrackingError",
    "bench_metrics",
    "check_reachable",
    "experiment_id",
    "find_runs",
    "finish_run",
    "flatten",
    "log_batch",
    "log_bench",
    "open_sweep_parent",
    "resolve_uri",
    "start_trial_run",
]
