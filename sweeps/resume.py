"""Resuming a killed sweep: Optuna-side bookkeeping, reconciled with MLflow.

The Optuna RDB storage is the record of the study. A sweep killed mid-way leaves trials in state
RUNNING. Before a rerun of the same study asks for new points (and after it took the study's
lease, so no live job owns those trials), each such trial is settled:

1. its MLflow run FINISHED with the objective metric(s) -> the trial did finish (it was killed
   between logging and Tune reporting): it is marked COMPLETE with those values, not re-run;
2. otherwise -> it is marked FAIL with the system attr ``graftblock.killed`` and its parameters
   are enqueued, so the next trial retries the same point; its MLflow run is marked KILLED.

Trials already COMPLETE are never touched, and only ``trials - finished`` new trials run, where
finished = COMPLETE + FAIL by error (a killed trial is not finished). So no finished trial is lost
or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

import tracking

KILLED_ATTR = "graftblock.killed"


@dataclass(frozen=True)
class StudyStatus:
    """Where a study stands before a (re)run.

    Attributes:
        complete: trials COMPLETE.
        failed: trials that failed by error (not killed).
        recovered: RUNNING trials found finished in MLflow and marked COMPLETE now.
        requeued: RUNNING trials killed mid-way, marked FAIL and their points enqueued now.
        waiting: trials enqueued and not started yet.
    """

    complete: int
    failed: int
    recovered: int
    requeued: int
    waiting: int

    @property
    def finished(self) -> int:
        return self.complete + self.failed

    def remaining(self, target: int) -> int:
        return max(0, target - self.finished)


def create_or_load(storage: optuna.storages.BaseStorage, study: str, directions: list[str]) -> optuna.Study:
    """The study (created if missing); a study of other directions is an error."""
    s = optuna.create_study(storage=storage, study_name=study, directions=directions, load_if_exists=True)
    have = [d.name.lower() for d in s.directions]
    if have != list(directions):
        raise ValueError(
            f"study {study!r} in the storage optimises {have}, but the config asks for {list(directions)}; "
            "use another study name"
        )
    return s


def _mlflow_values(
    uri: str, exp_id: str, study: str, number: int, metrics: list[str]
) -> tuple[list[float] | None, list[str]]:
    """(objective values if trial ``number`` finished in MLflow, ids of its interrupted runs).

    The trial is RUNNING in Optuna, so a run of it that is not FINISHED was cut short by the kill:
    still RUNNING (the process died), or FAILED (the interruption reached its exception handler).
    """
    runs = tracking.trial_runs(uri, exp_id, study, number)
    cut = (tracking.RunStatus.RUNNING.value, tracking.RunStatus.FAILED.value)
    unfinished = [r.run_id for r in runs if r.status in cut]
    for r in runs:
        if r.status == tracking.RunStatus.FINISHED.value and all(m in r.metrics for m in metrics):
            return [float(r.metrics[m]) for m in metrics], unfinished
    return None, unfinished


def settle_interrupted(
    study: optuna.Study, storage: optuna.storages.BaseStorage, uri: str, exp_id: str, metrics: list[str]
) -> StudyStatus:
    """Settle trials left RUNNING by a killed sweep (see module doc) and count the study.

    Call it only while holding the study's lease (:mod:`sweeps.lease`): a RUNNING trial is then
    known to belong to a dead job, not to a live one.
    """
    study_id = storage.get_study_id_from_name(study.study_name)
    recovered = requeued = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        tid = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        values, unfinished = _mlflow_values(uri, exp_id, study.study_name, t.number, metrics)
        for rid in unfinished:
            tracking.set_status(uri, rid, tracking.RunStatus.KILLED)
        if values is not None:
            storage.set_trial_state_values(tid, TrialState.COMPLETE, values)
            recovered += 1
            continue
        storage.set_trial_system_attr(tid, KILLED_ATTR, True)
        storage.set_trial_state_values(tid, TrialState.FAIL)
        if t.params:
            study.enqueue_trial(t.params, skip_if_exists=False)
        requeued += 1
    trials = study.get_trials(deepcopy=False)
    return StudyStatus(
        complete=sum(t.state == TrialState.COMPLETE for t in trials),
        failed=sum(t.state == TrialState.FAIL and not t.system_attrs.get(KILLED_ATTR) for t in trials),
        recovered=recovered,
        requeued=requeued,
        waiting=sum(t.state == TrialState.WAITING for t in trials),
    )
