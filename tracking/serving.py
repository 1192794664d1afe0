"""Serving runs: one MLflow run per serving replica, open for the replica's lifetime.

Params are the resolved serving config (flattened); metrics are logged periodically with a step
counter (tokens/s, tau per method, queue length, requests); the run ends FINISHED on a graceful
shutdown and FAILED when the engine died. Tagged ``graftblock.kind = serve`` so ``graftblock
compare`` lists serving runs beside bench and sweep runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracking.runs import KIND_TAG, RunStatus, create_run, flatten, log_values, set_status
from tracking.source import RunSource
from tracking.store import prepare

SERVE_KIND = "serve"
REPLICA_TAG = "graftblock.replica"


class ServingRun:
    """An open MLflow serving run: :meth:`open` it, :meth:`log` every interval, :meth:`finish` once."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri, self.run_id = uri, run_id
        self._finished = False

    @classmethod
    def open(cls, experiment: str, tracking_uri: str | None, params: Mapping[str, Any], replica: str,
             run_name: str | None = None) -> ServingRun:
        """Create the RUNNING run in ``experiment`` with the flattened ``params`` and the source tags."""
        uri, exp_id = prepare(experiment, tracking_uri)
        source = RunSource.here("graftblock serve")
        run_id = create_run(uri, exp_id, run_name, {KIND_TAG: SERVE_KIND, REPLICA_TAG: replica}, source)
        log_values(uri, run_id, flatten(dict(params)), {})
        return cls(uri, run_id)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One periodic sample (NaN values dropped)."""
        clean = {k: float(v) for k, v in metrics.items() if v == v}
        if clean and not self._finished:
            log_values(self.uri, self.run_id, {}, clean, step=step)

    def finish(self, status: RunStatus = RunStatus.FINISHED) -> None:
        """End the run (idempotent)."""
        if not self._finished:
            self._finished = True
            set_status(self.uri, self.run_id, status)
