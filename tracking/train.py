"""Run logging for drafter training: a small sink protocol and its MLflow implementation.

The trainer only sees :class:`MetricsSink`; the MLflow sink addresses the experiment by id on
the store resolved by :func:`tracking.resolve_uri` (default: sqlite in the cwd) and can
re-open a run by id, so a resumed training run keeps logging into the same MLflow run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


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
    """One MLflow run (created, or re-opened by ``run_id``) in experiment ``experiment``."""

    def __init__(self, experiment: str, tracking_uri: str | None, run_name: str | None, run_id: str | None = None) -> None:
        import mlflow

        import tracking

        self.uri = tracking.resolve_uri(tracking_uri)
        tracking.check_reachable(self.uri)
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        self._log_batch = tracking.log_batch
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            exp_id = tracking.experiment_id(experiment, self.uri)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"graftblock.kind": "train"})
            self.run_id = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from tracking import flatten

        existing = self.client.get_run(self.run_id).data.params
        flat = {k: v for k, v in flatten(dict(params)).items() if k not in existing}
        if flat:
            self._log_batch(self.client, self.run_id, flat, {})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v == v}  # drop NaN
        if clean:
            self._log_batch(self.client, self.run_id, {}, clean, step=step)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)
