"""Run logging for drafter training: a small sink protocol and its MLflow implementation.

The trainer only sees :class:`MetricsSink`; the MLflow sink addresses the experiment by id on
the store resolved by :func:`tracking.store.resolve_uri` (default: sqlite in the cwd) and can
re-open a run by id, so a resumed training run keeps logging into the same MLflow run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tracking.runs import KIND_TAG, RunStatus, create_run, flatten, log_batch, set_status
from tracking.source import RunSource
from tracking.store import prepare


class MetricsSink(Protocol):
    run_id: str | None

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullSink:
    """Logs nothing (``--no-mlflow``)."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


class MlflowSink:
    """One MLflow run (created, or re-opened by ``run_id``) in experiment ``experiment``.

    A new run carries the source tags (commit, ``graftblock train``, user): :mod:`tracking.source`.
    """

    def __init__(self, experiment: str, tracking_uri: str | None, run_name: str | None, run_id: str | None = None) -> None:
        import mlflow

        self.uri, exp_id = prepare(experiment, tracking_uri)
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        if run_id is not None:
            set_status(self.uri, run_id, RunStatus.RUNNING)
            self.run_id = run_id
        else:
            source = RunSource.here("graftblock train")
            self.run_id = create_run(self.uri, exp_id, run_name, {KIND_TAG: "train"}, source)

    def log_params(self, params: Mapping[str, Any]) -> None:
        existing = self.client.get_run(self.run_id).data.params
        flat = {k: v for k, v in flatten(dict(params)).items() if k not in existing}
        if flat:
            log_batch(self.client, self.run_id, flat, {})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v == v}  # drop NaN
        if clean:
            log_batch(self.client, self.run_id, {}, clean, step=step)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = "FINISHED") -> None:
        set_status(self.uri, self.run_id, RunStatus(status))
