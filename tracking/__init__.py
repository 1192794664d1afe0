"""The one MLflow module of graftblock: bench, verify-curve, train, sweep trials, serving metrics.

Everything that talks to an MLflow store goes through here (``lint-imports`` holds it), so the
packages below it (``speculation``) stay free of MLflow and the packages above it
(``adaptation``, ``workers``, ``cluster``, ``sweeps``, the CLI) share one set of conventions:

* the store: ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<dir>/mlflow.db``
  (:func:`resolve_uri`), checked before a long run (:func:`prepare`);
* experiments addressed by id (:func:`experiment_id`), never through ``MLFLOW_EXPERIMENT_ID``;
* params = the flattened resolved config; metrics follow the bench JSON names;
* every run carries its source: git commit, entry point, user (:class:`RunSource`).

Modules: :mod:`tracking.store` (URI, reachability, experiments), :mod:`tracking.source` (source
tags), :mod:`tracking.runs` (create, log, settle; bench runs), :mod:`tracking.sweep` (sweep parent
and trial runs), :mod:`tracking.query` (compare's reads), :mod:`tracking.train` (the metrics-sink
protocol the trainers log through).
"""

from tracking.query import experiment_runs
from tracking.runs import (
    KIND_TAG,
    METRIC_KEYS,
    RunStatus,
    bench_metrics,
    create_run,
    finish_run,
    flatten,
    log_batch,
    log_bench,
    log_values,
    set_status,
)
from tracking.source import COMMIT_TAG, RunSource, SourceType, check_commit, git_commit
from tracking.store import StoreKind, TrackingError, check_reachable, experiment_id, prepare, resolve_uri, store_kind
from tracking.sweep import (
    CONFIG_TAG,
    HOLDOUT_KIND,
    METHOD_TAG,
    PARENT_TAG,
    STUDY_TAG,
    SWEEP_KIND,
    TRIAL_KIND,
    TRIAL_TAG,
    RunRecord,
    find_runs,
    finish_sweep_parent,
    holdout_runs,
    open_holdout_run,
    open_sweep_parent,
    open_trial_run,
    settle_trial_runs,
    trial_runs,
)
from tracking.train import MetricsSink, MlflowSink, NullSink

__all__ = [
    "COMMIT_TAG",
    "CONFIG_TAG",
    "HOLDOUT_KIND",
    "KIND_TAG",
    "METHOD_TAG",
    "METRIC_KEYS",
    "PARENT_TAG",
    "STUDY_TAG",
    "SWEEP_KIND",
    "TRIAL_KIND",
    "TRIAL_TAG",
    "MetricsSink",
    "MlflowSink",
    "NullSink",
    "RunRecord",
    "RunSource",
    "RunStatus",
    "SourceType",
    "StoreKind",
    "TrackingError",
    "bench_metrics",
    "check_commit",
    "check_reachable",
    "create_run",
    "experiment_id",
    "experiment_runs",
    "find_runs",
    "finish_run",
    "finish_sweep_parent",
    "holdout_runs",
    "open_holdout_run",
    "flatten",
    "git_commit",
    "log_batch",
    "log_bench",
    "log_values",
    "open_sweep_parent",
    "open_trial_run",
    "prepare",
    "resolve_uri",
    "set_status",
    "settle_trial_runs",
    "store_kind",
    "trial_runs",
]
