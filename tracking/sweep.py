"""Sweep runs: one parent run per study, one child run per Optuna trial, settled whatever happens.

A trial's run is keyed by (study, trial number): a trial Tune restarts after a transient failure
reopens its run (:func:`open_trial_run`) instead of adding a duplicate, and a trial whose actor
died is settled from the driver (:func:`settle_trial_runs`), so no run stays RUNNING.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracking.runs import KIND_TAG, PARAM_CHARS, RunStatus, create_run, finish_run, flatten, log_values, set_status
from tracking.source import RunSource

#: Tags that tie sweep runs together (MLflow's own nesting tag, plus ours).
PARENT_TAG = "mlflow.parentRunId"
STUDY_TAG = "graftblock.study"
TRIAL_TAG = "graftblock.trial_number"
METHOD_TAG = "graftblock.method"
CONFIG_TAG = "graftblock.method_config"
SWEEP_KIND = "sweep"
TRIAL_KIND = "sweep_trial"
HOLDOUT_KIND = "sweep_holdout"
"""The best trial's configuration run once more on the held-out categories (not a trial: compare
skips it, so it never competes for "best")."""


@dataclass(frozen=True)
class RunRecord:
    """What the sweep and compare code read of an MLflow run (no MLflow types above ``tracking``)."""

    run_id: str
    run_name: str
    status: str
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]


def _record(run) -> RunRecord:
    return RunRecord(
        run_id=run.info.run_id,
        run_name=run.info.run_name or "",
        status=run.info.status,
        tags=dict(run.data.tags),
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
    )


def search(uri: str, exp_id: str, filter_string: str = "", oldest_first: bool = False,
           max_results: int = 5000) -> list[RunRecord]:
    """Runs of ``exp_id`` matching an MLflow ``filter_string``, newest first (or oldest first)."""
    import mlflow

    order = "ASC" if oldest_first else "DESC"
    runs = mlflow.MlflowClient(tracking_uri=uri).search_runs(
        [exp_id], filter_string=filter_string, max_results=max_results,
        order_by=[f"attributes.start_time {order}"],
    )
    return [_record(r) for r in runs]


def find_runs(uri: str, exp_id: str, tags: Mapping[str, str], max_results: int = 5000) -> list[RunRecord]:
    """Runs of ``exp_id`` carrying every tag in ``tags`` (any status), newest first."""
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return search(uri, exp_id, flt, max_results=max_results)


def open_sweep_parent(uri: str, exp_id: str, study: str, params: Mapping[str, Any], source: RunSource) -> str:
    """The sweep's parent run: the existing one for ``study`` (a resumed sweep), else a new one."""
    existing = find_runs(uri, exp_id, {KIND_TAG: SWEEP_KIND, STUDY_TAG: study})
    if existing:
        rid = existing[0].run_id
        set_status(uri, rid, RunStatus.RUNNING)
        return rid
    rid = create_run(uri, exp_id, f"sweep-{study}", {KIND_TAG: SWEEP_KIND, STUDY_TAG: study}, source)
    log_values(uri, rid, {k: str(v)[:PARAM_CHARS] for k, v in flatten(params).items()}, {})
    return rid


def trial_runs(uri: str, exp_id: str, study: str, number: int) -> list[RunRecord]:
    """Every run of trial ``number`` of ``study``, newest first."""
    return find_runs(uri, exp_id, {STUDY_TAG: study, TRIAL_TAG: str(number)})


def open_trial_run(uri: str, exp_id: str, parent_id: str, study: str, number: int, method: str,
                   method_config: Mapping[str, Any], source: RunSource) -> str:
    """The RUNNING child run of Optuna trial ``number``, nested under ``parent_id``.

    A trial run again (Tune retrying it after a failure) reopens its newest run rather than adding
    a second one, so one trial is one run.
    """
    existing = trial_runs(uri, exp_id, study, number)
    if existing:
        rid = existing[0].run_id
        set_status(uri, rid, RunStatus.RUNNING)
        return rid
    tags = {
        PARENT_TAG: parent_id, KIND_TAG: TRIAL_KIND, STUDY_TAG: study, TRIAL_TAG: str(number),
        METHOD_TAG: method, CONFIG_TAG: json.dumps(dict(method_config), sort_keys=True, default=str),
    }
    return create_run(uri, exp_id, f"{study}-trial-{number}", tags, source)


def holdout_runs(uri: str, exp_id: str, study: str, number: int) -> list[RunRecord]:
    """Held-out runs of trial ``number``'s configuration, newest first."""
    return find_runs(uri, exp_id, {KIND_TAG: HOLDOUT_KIND, STUDY_TAG: study, TRIAL_TAG: str(number)})


def open_holdout_run(uri: str, exp_id: str, parent_id: str, study: str, number: int, method: str,
                     method_config: Mapping[str, Any], source: RunSource) -> str:
    """A new RUNNING run for the held-out evaluation of trial ``number``, nested under ``parent_id``."""
    tags = {
        PARENT_TAG: parent_id, KIND_TAG: HOLDOUT_KIND, STUDY_TAG: study, TRIAL_TAG: str(number),
        METHOD_TAG: method, CONFIG_TAG: json.dumps(dict(method_config), sort_keys=True, default=str),
    }
    return create_run(uri, exp_id, f"{study}-holdout-trial-{number}", tags, source)


def settle_trial_runs(uri: str, exp_id: str, study: str, number: int, status: RunStatus) -> list[str]:
    """Mark the RUNNING runs of trial ``number`` ``status`` (its process died); their ids."""
    settled = [r.run_id for r in trial_runs(uri, exp_id, study, number) if r.status == RunStatus.RUNNING.value]
    for rid in settled:
        set_status(uri, rid, status)
    return settled


def finish_sweep_parent(uri: str, parent_id: str, metrics: Mapping[str, float], files: Iterable[Path],
                        complete: bool) -> None:
    """Log the sweep's summary metrics and comparison files; FINISHED if ``complete`` else FAILED."""
    finish_run(uri, parent_id, {}, metrics, files, RunStatus.FINISHED if complete else RunStatus.FAILED)
