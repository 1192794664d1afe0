"""The source tags every run carries: git commit, entry point, source type, user.

``mlflow.start_run`` fills these from the calling process; runs made with
``MlflowClient.create_run`` (ours: bench, verify-curve, train, sweep parent and trials) get them
only from :func:`source_tags`. A Ray job runs in a copy of the checkout without ``.git``
(``.rayignore``), so the sweep job takes the commit from its submitter (``--git-commit``).
"""

from __future__ import annotations

import enum
import getpass
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMIT_TAG = "mlflow.source.git.commit"
SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"
USER_TAG = "mlflow.user"

_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
#: The checkout this code runs from (``tracking/`` sits at its top level).
CHECKOUT = Path(__file__).resolve().parent.parent


class SourceType(str, enum.Enum):
    """MLflow's ``mlflow.source.type`` values that graftblock uses."""

    LOCAL = "LOCAL"
    """A command run by hand (``graftblock bench``, ``train``)."""
    JOB = "JOB"
    """A submitted job (a sweep and its trials)."""


def git_commit(checkout: Path = CHECKOUT) -> str | None:
    """``git rev-parse HEAD`` of ``checkout``, or None when it is not a git checkout (a Ray job's copy)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and _COMMIT.match(sha) else None


def check_commit(sha: str) -> str:
    """``sha`` lower-cased if it looks like a git commit (7-40 hex digits), else ValueError."""
    s = sha.strip().lower()
    if not _COMMIT.match(s):
        raise ValueError(f"--git-commit must be 7-40 hex digits (git rev-parse HEAD), got {sha!r}")
    return s


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no USER/LOGNAME (some containers)
        return "unknown"


@dataclass(frozen=True)
class RunSource:
    """What produced a run: the entry point, its type and the code's commit (None: unknown)."""

    name: str
    type: SourceType = SourceType.LOCAL
    commit: str | None = None

    @classmethod
    def here(cls, name: str, type: SourceType = SourceType.LOCAL) -> "RunSource":
        """The source for a command run from this checkout (commit read from its ``.git``)."""
        return cls(name=name, type=type, commit=git_commit())

    def tags(self) -> dict[str, str]:
        """MLflow's own source tags (``mlflow.source.*``, ``mlflow.user``)."""
        out = {SOURCE_NAME_TAG: self.name, SOURCE_TYPE_TAG: self.type.value, USER_TAG: _user()}
        if self.commit is not None:
            out[COMMIT_TAG] = self.commit
        return out
