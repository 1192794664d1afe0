"""One sweep job per study at a time: a lease held in the Optuna storage.

A sweep job holds the study's lease while it runs: the study user attribute ``graftblock.lease``
= ``{owner, host, pid, heartbeat}``, renewed every ``ttl_s / 3`` seconds by a daemon thread. A
second job for the same study finds a lease whose last heartbeat is younger than ``ttl_s`` and
refuses to start (it would otherwise settle the first job's live trials as killed, see
:mod:`sweeps.resume`). The lease is released when the job ends, also on SIGTERM (``ray job
stop``); a job killed outright leaves it to expire after ``ttl_s``, or ``--force`` takes it over.

Acquiring is write-then-confirm: after writing its lease a job waits ``confirm_s`` and reads it
back; of two jobs that wrote at nearly the same moment only the last writer finds its own lease
and proceeds.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

LEASE_ATTR = "graftblock.lease"
#: A lease is live while its last heartbeat is younger than this (seconds).
LEASE_TTL_S = 60.0


class StudyBusy(RuntimeError):
    """Another live sweep job holds the study's lease."""


@dataclass(frozen=True)
class Lease:
    """Who holds a study: a random owner id, its host and pid, and the last heartbeat (epoch s)."""

    owner: str
    host: str
    pid: int
    heartbeat: float

    @classmethod
    def from_attr(cls, value: Any) -> "Lease | None":
        if not isinstance(value, dict) or set(value) != {"owner", "host", "pid", "heartbeat"}:
            return None
        return cls(str(value["owner"]), str(value["host"]), int(value["pid"]), float(value["heartbeat"]))


class StudyLease:
    """The lease on ``study`` in ``storage`` for this process (see module doc).

    Args:
        storage: the study's Optuna storage.
        study: the study name (the study must exist).
        ttl_s: a lease without a heartbeat for this long is expired. Range > 0.
        confirm_s: wait between writing the lease and reading it back. Range >= 0.
        clock: seconds since the epoch (a parameter so tests can age a lease).
    """

    def __init__(self, storage: optuna.storages.BaseStorage, study: str, ttl_s: float = LEASE_TTL_S,
                 confirm_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        if confirm_s < 0:
            raise ValueError(f"lease confirm_s must be >= 0, got {confirm_s}")
        self.storage = storage
        self.study = study
        self.study_id = storage.get_study_id_from_name(study)
        self.ttl_s = ttl_s
        self.confirm_s = confirm_s
        self.clock = clock
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ state
    def current(self) -> Lease | None:
        """The lease recorded in the storage (live or expired), or None."""
        return Lease.from_attr(self.storage.get_study_user_attrs(self.study_id).get(LEASE_ATTR))

    def is_live(self, lease: Lease) -> bool:
        return self.clock() - lease.heartbeat < self.ttl_s

    def _write(self) -> None:
        lease = Lease(self.owner, socket.gethostname(), os.getpid(), self.clock())
        self.storage.set_study_user_attr(self.study_id, LEASE_ATTR, asdict(lease))

    # ------------------------------------------------------------------ acquire / renew / release
    def acquire(self, force: bool = False) -> None:
        """Take the lease; StudyBusy if another owner's lease is live (unless ``force``)."""
        held = self.current()
        if held is not None and held.owner != self.owner and self.is_live(held) and not force:
            raise StudyBusy(self._busy_message(held))
        self._write()
        if self.confirm_s:
            time.sleep(self.confirm_s)
        now = self.current()
        if now is None or now.owner != self.owner:
            raise StudyBusy(self._busy_message(now) if now else f"study {self.study!r}: lost the lease race")

    def renew(self) -> bool:
        """Refresh the heartbeat; False (and nothing written) if another owner took the lease over."""
        held = self.current()
        if held is None or held.owner != self.owner:
            return False
        self._write()
        return True

    def release(self) -> None:
        """Drop the lease if it is still ours."""
        self.stop_heartbeat()
        held = self.current()
        if held is not None and held.owner == self.owner:
            self.storage.set_study_user_attr(self.study_id, LEASE_ATTR, None)

    def start_heartbeat(self) -> None:
        """Renew every ``ttl_s / 3`` seconds in a daemon thread until released or taken over."""

        def beat() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                if not self.renew():
                    print(f"[sweep {self.study}] warning: the study's lease was taken over by another job",
                          flush=True)
                    return

        self._stop.clear()
        self._thread = threading.Thread(target=beat, name=f"lease-{self.study}", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _busy_message(self, held: Lease) -> str:
        age = self.clock() - held.heartbeat
        return (
            f"study {self.study!r} is being run by another sweep job (host {held.host}, pid {held.pid}, "
            f"last heartbeat {age:.0f}s ago); wait for it to end or stop it (`ray job stop <id>`). "
            f"If that job is dead, rerun after its lease expires ({self.ttl_s:.0f}s after the last "
            "heartbeat) or pass --force to take the study over"
        )
