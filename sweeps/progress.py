"""Sweep progress in the job log: trials done / running / best so far, one line per event."""

from __future__ import annotations

import sys
import time

from ray import tune

from sweeps.config import Objective


class SweepProgress(tune.Callback):
    """Prints ``[sweep <study>] done d/N (failed f) | running r | best speedup s (trial k)``.

    Args:
        study: the study name.
        total: the finished trials the study should hold.
        finished_before: trials already finished when this run started (a resumed study).
        objective: what is optimised (the best-so-far line follows its first metric).
        best_before: (speedup, trial number) best among earlier trials, or None.
    """

    def __init__(
        self,
        study: str,
        total: int,
        finished_before: int,
        objective: Objective,
        best_before: tuple[float, int] | None = None,
    ) -> None:
        self.study = study
        self.total = total
        self.done = finished_before
        self.failed = 0
        self.objective = objective
        self.best = best_before
        self.running: set[str] = set()
        self.t0 = time.monotonic()

    def _line(self, trials, event: str) -> None:
        running = len(self.running)
        best = "-" if self.best is None else f"{self.best[0]:.3f} (trial {self.best[1]})"
        print(
            f"[sweep {self.study}] {event} | done {self.done}/{self.total} (failed {self.failed}) "
            f"| running {running} "
            f"| best {self.objective.metrics[0]} {best} | {time.monotonic() - self.t0:.0f}s",
            file=sys.stdout,
            flush=True,
        )

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.running.add(trial.trial_id)
        self._line(trials, f"trial {trial.config.get('_trial_number', '?')} started")

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.done += 1
        res = trial.last_result or {}
        value = res.get(self.objective.metrics[0])
        number = res.get("trial_number", trial.config.get("_trial_number"))
        if value is not None and (self.best is None or value > self.best[0]):
            self.best = (float(value), int(number))
        shown = ", ".join(f"{m} {res[m]:.3f}" for m in self.objective.metrics if m in res)
        self._line(trials, f"trial {number} finished: {shown}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.done += 1
        self.failed += 1
        self._line(trials, f"trial {trial.config.get('_trial_number', '?')} FAILED")
