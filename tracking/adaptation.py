"""MLflow logging of ``graftblock adapt-bench``: one run, every adaptation decision as metrics.

Each decision of policy ``p`` (round, arm, estimated gain with its CI, cost and its parts,
realised gain, reward, rollback) is logged as ``adapt.<p>.<metric>`` at step = the decision's
index in that policy's log; its outcome is ``adapt.<p>.outcome.<name>`` = 1 at that step. A
config-bandit round (``config_ucb``) logs its reward, scoring time and the other arms'
counterfactual tokens/s the same way, and ``adapt.<p>.arm.<arm>`` = 1 for the served arm. The
final summary (tokens/s, tau, updates, rollbacks, cost, regret, per phase) follows the JSON names
as ``<p>.<key>`` and ``<p>.<phase>.<key>``; the JSON is an artifact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracking.runs import KIND_TAG, RunStatus, create_run, flatten, log_batch, set_status
from tracking.source import RunSource
from tracking.store import prepare

KIND = "adapt-bench"


def _safe(name: str) -> str:
    """An MLflow metric name: characters other than letters, digits, ``_ - . /`` and space (e.g. the
    ``#`` of a trial label) become ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)


class AdaptationLog:
    """One MLflow run of an adapt-bench (created on construction; store checked first)."""

    def __init__(self, experiment: str, tracking_uri: str | None, run_name: str | None = None) -> None:
        import mlflow

        self.uri, exp_id = prepare(experiment, tracking_uri)
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        self.run_id = create_run(self.uri, exp_id, run_name, {KIND_TAG: KIND}, RunSource.here("graftblock adapt-bench"))
        self._steps: dict[str, int] = {}

    def log_params(self, params: Mapping[str, Any]) -> None:
        log_batch(self.client, self.run_id, flatten(dict(params)), {})

    def log_decision(self, policy: str, outcome: str, metrics: Mapping[str, float]) -> None:
        """One decision of ``policy`` (its :meth:`~adaptation.controller.Decision.metrics`)."""
        step = self._steps.get(policy, 0)
        self._steps[policy] = step + 1
        values = {f"adapt.{policy}.{k}": float(v) for k, v in metrics.items() if v == v}
        values[f"adapt.{policy}.outcome.{outcome}"] = 1.0
        log_batch(self.client, self.run_id, {}, values, step=step)

    def log_config_round(self, policy: str, arm: str, metrics: Mapping[str, float]) -> None:
        """One round of the config bandit of ``policy`` (its
        :meth:`~adaptation.config_bandit.ConfigDecision.metrics`): ``adapt.<p>.<metric>`` and
        ``adapt.<p>.arm.<arm>`` = 1 at step = the round's index (names made MLflow-safe)."""
        step = self._steps.get(policy, 0)
        self._steps[policy] = step + 1
        values = {_safe(f"adapt.{policy}.{k}"): float(v) for k, v in metrics.items() if v == v}
        values[_safe(f"adapt.{policy}.arm.{arm}")] = 1.0
        log_batch(self.client, self.run_id, {}, values, step=step)

    def finish(self, summary: Mapping[str, Any], artifacts: list[Path], status: RunStatus = RunStatus.FINISHED) -> None:
        """Log the flat numeric summary and the artifacts, then close the run."""
        flat = {k: float(v) for k, v in flatten(dict(summary)).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}
        try:
            log_batch(self.client, self.run_id, {}, flat)
            for a in artifacts:
                self.client.log_artifact(self.run_id, str(a))
        finally:
            set_status(self.uri, self.run_id, status)
