"""Read-side queries for ``compare``: an experiment's runs by name."""

from __future__ import annotations

from speculation.config import ConfigError
from tracking.store import check_reachable, resolve_uri
from tracking.sweep import RunRecord, search


def experiment_runs(experiment: str, uri: str | None) -> tuple[str, list[RunRecord]]:
    """``(resolved uri, runs of experiment oldest first)``; an unknown experiment is a ConfigError
    listing the experiments the store holds."""
    import mlflow

    resolved = resolve_uri(uri)
    check_reachable(resolved)
    client = mlflow.MlflowClient(tracking_uri=resolved)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ConfigError(f"no MLflow experiment {experiment!r} in {resolved}; experiments there: {names}")
    return resolved, search(resolved, exp.experiment_id, oldest_first=True)
