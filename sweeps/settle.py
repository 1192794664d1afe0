"""Settle the MLflow run of a trial whose actor died (seen from the sweep's driver).

A trial that raises settles its own run (:func:`sweeps.objective.run_trial`). A trial whose
actor process died (out of memory, node lost, ``ray.kill``) cannot: its run would stay RUNNING.
Tune reports such a trial to the driver's callbacks; once Tune gives up on it (no retry left)
:class:`SettleDeadTrials` marks its RUNNING runs FAILED. A trial Tune retries keeps its run
(the retry reopens it), so nothing is settled then.
"""

from __future__ import annotations

from ray import tune

import tracking


class SettleDeadTrials(tune.Callback):
    """On a trial's final error, mark its still-RUNNING MLflow run(s) FAILED.

    Args:
        tracking_uri: absolute MLflow URI.
        experiment_id: the sweep's experiment id.
        study: the study name (trial runs are keyed by study and trial number).
    """

    def __init__(self, tracking_uri: str, experiment_id: str, study: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.study = study
        self.settled: list[str] = []

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        number = trial.config.get("_trial_number")
        if number is None:  # the searcher gave no trial number: nothing was logged under one
            return
        self.settled += tracking.settle_trial_runs(
            self.tracking_uri, self.experiment_id, self.study, int(number), tracking.RunStatus.FAILED
        )
