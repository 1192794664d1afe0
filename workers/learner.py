"""``Learner``: the online-adaptation controller hosted in a restartable Ray actor.

The actor wraps :class:`~adaptation.controller.AdaptationController` (its single-process twin):

* **Feedback** arrives as fire-and-forget ``learner.feed.remote(records)`` calls from a
  :class:`~adaptation.feedback.FeedbackSink` whose consumer is a :class:`RemoteFeed`; the feed
  keeps at most ``max_inflight`` calls outstanding and drops batches beyond that, so a busy (or
  dead) learner never slows decode.
* **Rounds run off the call path.** ``feed`` only appends the batch to a bounded inbox (up to
  :data:`INBOX_RECORDS` records; a batch beyond it is dropped and counted) and returns; one
  background thread moves the inbox into the controller, which runs its decision rounds there.
  A round trains for tens of seconds: run inside ``feed`` (as it was), it held the actor, so
  later ``feed`` calls queued, the replicas' ``max_inflight`` filled and two thirds of the
  feedback of a served domain-shift stream was dropped (``graftblock_learner_feedback_dropped_total
  {reason="inflight"}``), and ``published`` calls timed out. ``feed(records, wait=True)`` processes
  the inbox and the batch in the caller (tests, single-process use).
* **Weights** are published with ``ray.put`` once per update and swapped by every registered
  ``DrafterWorker`` (``swap_weights(slot, ref)``: Ray resolves the ref before the call, the swap
  lands between decode steps); without workers the learner keeps them for callers that pull
  (:meth:`Learner.weights`).
* **Restarts.** Every published state is checkpointed (safetensors, written to a temporary file
  and renamed) with its version; an actor restarted by Ray (``max_restarts``) reloads the last
  one, so a killed learner resumes from the weights serving runs with. Decode does not depend on
  the learner: its crash costs feedback, never tokens.

Ask for ``num_cpus=0`` or a fraction (a long-lived actor must not pin the 2 CPUs).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import cloudpickle
from safetensors.torch import load_file, save_file

from adaptation.controller import AdaptationController, ControllerConfig, Decision
from adaptation.feedback import FeedbackRecord
from adaptation.online import StateDict, TrainableDrafter
from workers.drafter_worker import pack_drafter

INBOX_RECORDS = 16384
"""Feedback records the learner's inbox holds while a round runs (about 7 KB each at H = 576)."""
WEIGHTS_FILE = "learner_weights.safetensors"
VERSION_FILE = "learner_version.json"
DRAFTER_FILE = "drafter.pkl"


def weights_digest(state: StateDict) -> str:
    """sha256 over the state's names, shapes, dtypes and bytes (sorted by name): a weights identity
    that survives a round trip through the checkpoint."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class LearnerReport:
    """What a serving replica pulls from the learner (:meth:`Learner.published`).

    Attributes:
        version: published weights version (0 = the drafter's own weights, nothing published).
        weights: ``[ref]``, the ObjectRef of the published state (``ray.put`` once per publish;
            kept in a list so Ray hands over the reference, not the tensors), or ``[]`` at version 0.
        digest: :func:`weights_digest` of the published weights ("" at version 0).
        decisions: the learner's decisions from index ``since`` on.
        total_decisions: decisions this incarnation made in all.
        incarnation: a fresh id per actor start (a change means the learner restarted).
        restored: whether this incarnation reloaded published weights from the checkpoint.
        restored_version, restored_digest: what it reloaded (0 and "" when not restored).
    """

    version: int
    weights: list[Any]
    digest: str
    decisions: list[Decision]
    total_decisions: int
    incarnation: str
    restored: bool
    restored_version: int = 0
    restored_digest: str = ""


@dataclass(frozen=True)
class SwapTarget:
    """A drafter worker actor handle and the slot whose drafter the learner updates."""

    worker: Any
    slot: str


class WeightsCheckpoint:
    """The learner's last published weights on disk (module docstring, "Restarts")."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def save(self, state: StateDict, version: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / (WEIGHTS_FILE + ".tmp")
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp))
        tmp.replace(self.dir / WEIGHTS_FILE)
        vtmp = self.dir / (VERSION_FILE + ".tmp")
        vtmp.write_text(json.dumps({"version": version}))
        vtmp.replace(self.dir / VERSION_FILE)

    def load(self) -> tuple[StateDict, int] | None:
        w, v = self.dir / WEIGHTS_FILE, self.dir / VERSION_FILE
        if not (w.is_file() and v.is_file()):
            return None
        return load_file(str(w)), int(json.loads(v.read_text())["version"])


class Learner:
    """The Ray-hosted learner (module docstring).

    Args:
        config: the controller's knobs.
        checkpoint_dir: holds the drafter to adapt (``drafter.pkl``, written by
            :func:`spawn_learner`: a restart reads it from disk, not from the object store, whose
            copy of a large constructor argument may be gone by then) and the last published
            weights.
        targets: drafter workers to push weights to (may be empty: callers pull).
        torch_threads: torch intra-op threads in the actor.
    """

    def __init__(self, config: ControllerConfig, checkpoint_dir: str, targets: Sequence[SwapTarget] = (),
                 torch_threads: int | None = 1) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        drafter = cloudpickle.loads((Path(checkpoint_dir) / DRAFTER_FILE).read_bytes())
        if not isinstance(drafter, TrainableDrafter):
            raise TypeError(f"{type(drafter).__name__} is not a trainable feature drafter")
        self.targets = list(targets)
        self.checkpoint = WeightsCheckpoint(checkpoint_dir)
        saved = self.checkpoint.load()
        self.restored = saved is not None
        self.incarnation = uuid.uuid4().hex
        self.controller = AdaptationController(drafter, self._publish, config,
                                               weights=saved[0] if saved else None)
        self._ref: Any = None
        self._digest = ""
        if saved is not None:
            self.controller.version = saved[1]
            self._ref, self._digest = ray.put(saved[0]), weights_digest(saved[0])
        self._restored_from = (self.controller.version, self._digest)
        self._inbox: deque[list[FeedbackRecord]] = deque()
        self._inbox_records = 0
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self.inbox_dropped = 0
        self.round_errors = 0
        self._rounds_thread = threading.Thread(target=self._rounds_loop, name="learner-rounds", daemon=True)
        self._rounds_thread.start()

    def _publish(self, state: StateDict) -> None:
        ref = ray.put(state)  # once per publish: workers and pulling replicas share this copy
        if self.targets:
            ray.get([t.worker.swap_weights.remote(t.slot, ref) for t in self.targets])
        self.checkpoint.save(state, self.controller.version + 1)
        self._ref, self._digest = ref, weights_digest(state)

    # ------------------------------------------------------------------ calls
    def feed(self, records: list[FeedbackRecord], wait: bool = False) -> int:
        """Take a feedback batch: into the inbox, processed by the rounds thread (returns 0 at once),
        or with ``wait`` processed here after the inbox (returns the decisions made)."""
        if wait:
            return self._drain() + len(self.controller.add(records))
        with self._inbox_lock:
            if self._inbox_records + len(records) > INBOX_RECORDS:
                self.inbox_dropped += len(records)
                return 0
            self._inbox.append(records)
            self._inbox_records += len(records)
        self._wake.set()
        return 0

    def _drain(self) -> int:
        """Hand every inbox batch to the controller (its rounds run in this thread); decisions made."""
        made = 0
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return made
                batch = self._inbox.popleft()
                self._inbox_records -= len(batch)
            made += len(self.controller.add(batch))

    def _rounds_loop(self) -> None:
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - a failed round costs an update, never the learner
                self.round_errors += 1
                logging.getLogger("graftblock.learner").exception("learner round failed")

    def round(self) -> Decision:
        """Run one decision round now."""
        return self.controller.round()

    def weights(self) -> tuple[int, StateDict]:
        """(version, the live weights as last published)."""
        return self.controller.version, self.controller.weights

    def decisions(self) -> list[Decision]:
        return list(self.controller.decisions)

    def published(self, since: int = 0) -> LearnerReport:
        """The published weights (by reference) and the decisions from index ``since`` on."""
        decisions = list(self.controller.decisions)
        return LearnerReport(self.controller.version, [self._ref] if self._ref is not None else [], self._digest,
                             decisions[since:], len(decisions), self.incarnation, self.restored,
                             *self._restored_from)

    def summary(self) -> dict[str, float]:
        with self._inbox_lock:
            inbox = self._inbox_records
        return {**self.controller.summary(), "restored": float(self.restored),
                "buffered_records": float(len(self.controller.buffer)), "inbox_records": float(inbox),
                "inbox_dropped": float(self.inbox_dropped), "round_errors": float(self.round_errors)}

    def pid(self) -> int:
        return os.getpid()


class RemoteFeed:
    """A :class:`~adaptation.feedback.FeedbackSink` consumer that forwards batches to a learner actor.

    At most ``max_inflight`` ``feed`` calls are outstanding; a batch beyond that is dropped (counted
    in ``dropped``), as is one whose call cannot even be submitted. Finished calls' errors (a
    killed learner) are counted in ``failed`` and otherwise ignored.
    """

    def __init__(self, learner: Any, max_inflight: int = 4) -> None:
        self.learner = learner
        self.max_inflight = max_inflight
        self._pending: deque[Any] = deque()
        self.dropped = 0
        self.failed = 0
        self.sent = 0

    def _reap(self) -> None:
        if not self._pending:
            return
        done, rest = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        self._pending = deque(rest)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
                self.failed += 1

    def __call__(self, batch: list[FeedbackRecord]) -> None:
        self._reap()
        if len(self._pending) >= self.max_inflight:
            self.dropped += len(batch)
            return
        try:
            self._pending.append(self.learner.feed.remote(batch))
        except ray.exceptions.RayActorError:
            self.dropped += len(batch)
            return
        self.sent += len(batch)


def wait_until_ready(learner: Any, timeout_s: float = 120.0) -> None:
    """Block until ``learner`` answers (e.g. after Ray restarted it); raises ``TimeoutError``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(learner.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting, or not yet up
            if time.monotonic() > deadline:
                raise TimeoutError(f"the learner actor did not come back within {timeout_s} s") from None
            time.sleep(0.5)


def spawn_learner(drafter: TrainableDrafter, config: ControllerConfig, checkpoint_dir: str | Path,
                  targets: Sequence[SwapTarget] = (), torch_threads: int | None = 1, **options: Any) -> Any:
    """Start a ``Learner`` actor for ``drafter`` (written to ``checkpoint_dir`` first, see
    :class:`Learner`); ``options`` go to Ray (defaults of :func:`make_learner_class`; with
    ``name=`` and ``get_if_exists=True`` an existing named learner is returned instead)."""
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (DRAFTER_FILE + ".tmp")
    tmp.write_bytes(pack_drafter(drafter))
    tmp.replace(directory / DRAFTER_FILE)
    return make_learner_class(**options).remote(config, str(directory), list(targets), torch_threads)


def make_learner_class(**options):
    """The ``Learner`` Ray actor class with ``options`` (default ``num_cpus=0``, ``max_restarts=3``)."""
    opts = {"num_cpus": 0, "max_restarts": 3, **options}
    return _remote_class().options(**opts)


@functools.cache
def _remote_class():
    return ray.remote(Learner)
