"""Where runs go: the tracking URI, its reachability, experiments by id.

URI resolution (every entry point): an explicit ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``,
else ``sqlite:///<default_dir>/mlflow.db`` (``default_dir`` = the cwd for ``bench``/``train``/
``compare``, the sweep's ``--root`` for a sweep).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import urllib.error
import urllib.request
from pathlib import Path


class TrackingError(RuntimeError):
    """The tracking store cannot be used (unreachable server, bad URI, store refused a write)."""


class StoreKind(str, enum.Enum):
    """What a tracking URI points at, as far as other machines are concerned."""

    SERVER = "server"
    """``http(s)://``: an ``mlflow server`` every node can reach."""
    FILE = "file"
    """A sqlite file or a local directory: visible to this machine only."""
    DATABASE = "database"
    """A SQL database URL other than sqlite (``postgresql://`` …): shared if its host is."""


def resolve_uri(uri: str | None, default_dir: Path | None = None) -> str:
    """Explicit URI, else ``MLFLOW_TRACKING_URI``, else an absolute sqlite file in ``default_dir``
    (the cwd when None)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    base = (default_dir or Path.cwd()).resolve()
    return f"sqlite:///{base / 'mlflow.db'}"


def store_kind(uri: str) -> StoreKind:
    """Classify ``uri``: a server, a machine-local file store, or another database."""
    if uri.startswith(("http://", "https://")):
        return StoreKind.SERVER
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        return StoreKind.FILE
    return StoreKind.DATABASE


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with a clear message, if an HTTP tracking server does not answer ``/health``."""
    if store_kind(uri) != StoreKind.SERVER:
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TrackingError(f"MLflow tracking URI {uri} is unreachable ({exc}); start `mlflow server` "
                            "or pass --no-mlflow") from exc


SQLITE_PREFIX = "sqlite:///"


@contextlib.contextmanager
def first_open_lock(uri: str):
    """Hold an exclusive ``flock`` on ``<db>.lock`` beside a sqlite store, else nothing.

    MLflow creates and migrates a sqlite store's schema the first time a process opens it; two
    processes doing that at once (two ``graftblock train`` started together in one directory) make
    one fail with alembic's "expected to match one row". Holding this lock while the store is first
    opened serialises that step; it is released as soon as the experiment id is known.
    """
    if not uri.startswith(SQLITE_PREFIX) or uri.endswith(":memory:"):
        yield
        return
    db = Path(uri[len(SQLITE_PREFIX):].split("?", 1)[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def experiment_id(name: str, uri: str, artifact_location: str | None = None) -> str:
    """Id of experiment ``name`` in the store at ``uri``, created if missing.

    ``artifact_location`` (absolute) applies only when the experiment is created; without it
    MLflow's default for a local store is ``./mlruns`` under the *current* directory, which for a
    Ray job is a temporary copy of the working directory.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        with first_open_lock(uri):
            return _open_experiment(mlflow.MlflowClient(tracking_uri=uri), name, artifact_location)
    except MlflowException as exc:
        raise TrackingError(f"MLflow store {uri}: cannot open experiment {name!r} ({_first_line(exc)})") from exc


def _open_experiment(client, name: str, artifact_location: str | None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # created concurrently by another process: read it back
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def prepare(experiment: str, uri: str | None, artifact_location: str | None = None,
            default_dir: Path | None = None) -> tuple[str, str]:
    """Resolve the URI, check it answers and open (or create) ``experiment``: ``(uri, experiment id)``.

    Called *before* a long run, so a bad store fails in seconds, not after the run.
    """
    resolved = resolve_uri(uri, default_dir)
    check_reachable(resolved)
    return resolved, experiment_id(experiment, resolved, artifact_location)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
