"""Free verifier feedback for online adaptation: compact step records, a non-blocking sink, a replay buffer.

Every verify step of the decode loop already has what a feature drafter trains on (docs/algorithms.md
§8, "Feedback"): the accepted tokens (root first), the target's aux features at those nodes, the
verified tree and, when the drafter asked for it, the target's top-k at every node. One
:class:`FeedbackRecord` per step keeps exactly that, detached and compact (aux in bf16).

Consecutive records of one request chain into a training sequence (:class:`FeedbackSequence`):
step s's root is step s-1's bonus token, so concatenating the accepted tokens of every step (and
appending the last bonus) gives the generated text ``x_0 .. x_L`` with aux features ``f_0 .. f_{L-1}``
at every token but the last: the layout of :class:`~adaptation.batches.FeatureBatch`. The first
token of every step after the first is where the previous step's draft went wrong (the bonus: the
target's token that the accepted path did not continue with): a *mistake position*.

:class:`FeedbackSink` is the engine's ``feedback`` hook. ``hook(request_id)`` returns the callable
the engine calls once per step (or pass the sink itself: it tells sequences apart by their
context, for the batched engine); it builds the record and ``put_nowait``s it on a bounded queue,
counting a drop when the queue is full: decode never waits on the learner. A daemon thread drains
the queue in batches into a consumer (a :class:`ReplayBuffer`, or a Ray actor's ``.remote``).

:class:`ReplayBuffer` keeps the most recent records, bounded, grouped by request; the most recent
``heldout_sequences`` finished requests form the held-out part (the freshest traffic, never trained
on), older ones the train part.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import torch

from adaptation.batches import FeatureBatch
from speculation.config import ConfigError
from speculation.drafters.base import DraftContext, StepOutcome

CONTEXT_TAIL = 16
"""Tokens of committed context kept per record before its root (for inspection and debugging)."""


@dataclass(frozen=True)
class FeedbackRecord:
    """One verify step, as the learner keeps it.

    Attributes:
        request_id: the request the step belongs to (records of a request chain by ``step``).
        step: 0-based verify-step index within the request.
        position: index of the root token in the request's generated text (0 for the first step).
        accepted_tokens: ``[m + 1]`` tokens on the accepted path, root first.
        bonus_token: the target's token after the accepted path (the next step's root).
        aux: ``[m + 1, 3H]`` bf16 target aux features at the accepted nodes.
        tree_tokens: ``[T]`` the verified tree's tokens (node 0 = root).
        tree_parents: ``[T]`` their parents (-1 for the root).
        target_topk: ``[T, k]`` the target's top-k token ids at every node, or None if not asked for.
        context_tail: up to :data:`CONTEXT_TAIL` committed tokens before the root.
        wall_time: ``time.time()`` when the step finished (consecutive records of a request give
            the serving step time the cost model prices contention with).
    """

    request_id: Hashable
    step: int
    position: int
    accepted_tokens: tuple[int, ...]
    bonus_token: int
    aux: torch.Tensor
    tree_tokens: torch.Tensor
    tree_parents: torch.Tensor
    target_topk: torch.Tensor | None
    context_tail: tuple[int, ...]
    wall_time: float = 0.0

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens accepted (root excluded)."""
        return len(self.accepted_tokens) - 1

    @property
    def tokens_gained(self) -> int:
        """Tokens the step appended: accepted drafts + the bonus (tau's numerator)."""
        return len(self.accepted_tokens)

    @classmethod
    def from_outcome(
        cls, request_id: Hashable, step: int, ctx: DraftContext, outcome: StepOutcome, wall_time: float | None = None
    ) -> FeedbackRecord:
        """The record of one engine step. ``ctx.tokens`` already ends with the accepted drafts and
        the bonus (the engine extends it before calling the hook). ``wall_time``: now by default."""
        if outcome.aux_hidden is None:
            raise ValueError("feedback needs the target's aux hidden states (a feature drafter sets needs_aux)")
        n_new = len(outcome.accepted_tokens)  # accepted drafts + bonus
        root_index = len(ctx.tokens) - n_new - 1
        position = root_index - ctx.prompt_len
        tree = outcome.tree
        return cls(
            request_id=request_id,
            step=step,
            position=position,
            accepted_tokens=tuple(int(t) for t in outcome.accepted_tokens),
            bonus_token=int(outcome.bonus_token),
            aux=outcome.aux_hidden.detach().to(torch.bfloat16).clone(),
            tree_tokens=torch.tensor(tree.tokens, dtype=torch.int32),
            tree_parents=torch.tensor(tree.parents, dtype=torch.int32),
            target_topk=None if outcome.target_topk is None else outcome.target_topk.detach().to(torch.int32).clone(),
            context_tail=tuple(ctx.tokens[max(0, root_index - CONTEXT_TAIL) : root_index]),
            wall_time=time.time() if wall_time is None else wall_time,
        )


@dataclass(frozen=True)
class FeedbackSequence:
    """A request's contiguous records joined into one training sequence.

    Attributes:
        tokens: ``[L + 1]`` generated tokens ``x_0 .. x_L`` (the last is the final bonus).
        aux: ``[L, 3H]`` aux features ``f_t`` at ``x_t``, t < L.
        mistakes: ``[L + 1]`` bool, True at every step's root after the first (where the
            previous step's accepted path ended and the target's bonus took over).
        step_tokens: tokens gained per recorded step (live tau of these steps = their mean).
    """

    tokens: torch.Tensor
    aux: torch.Tensor
    mistakes: torch.Tensor
    step_tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        """L: positions with features."""
        return int(self.aux.shape[0])

    @classmethod
    def join(cls, records: list[FeedbackRecord]) -> FeedbackSequence:
        """Join records of one request, in step order, stopping at the first gap."""
        records = sorted(records, key=lambda r: r.step)
        kept = [records[0]]
        for r in records[1:]:
            if r.step != kept[-1].step + 1:
                break
            kept.append(r)
        toks: list[int] = []
        mistakes: list[bool] = []
        for i, r in enumerate(kept):
            toks.extend(r.accepted_tokens)
            mistakes.extend([i > 0] + [False] * r.accepted_drafts)
        toks.append(kept[-1].bonus_token)
        mistakes.append(True)
        return cls(
            tokens=torch.tensor(toks, dtype=torch.long),
            aux=torch.cat([r.aux for r in kept]),
            mistakes=torch.tensor(mistakes, dtype=torch.bool),
            step_tokens=tuple(r.tokens_gained for r in kept),
        )

    def to_batch_row(self, loss_mask: torch.Tensor) -> FeatureBatch:
        """A one-row :class:`FeatureBatch` over positions ``0 .. L-1`` with hard targets.

        The target's prediction at t is the committed token ``x_{t+1}`` (greedy verification:
        its argmax), stored as a top-1 entry with logit 0, so the families' soft cross-entropy is
        the cross-entropy on the committed token. ``loss_mask`` ``[L]``: which tokens are trained
        as prediction targets (see :mod:`adaptation.online`).
        """
        L = self.length
        return FeatureBatch(
            aux=self.aux[None],
            input_ids=self.tokens[:L][None],
            loss_mask=loss_mask[None],
            topk_values=torch.zeros(1, L, 1),
            topk_indices=self.tokens[1 : L + 1][None, :, None],
            num_tokens=L,
        )


# ---------------------------------------------------------------------- replay buffer
@dataclass(frozen=True)
class BufferConfig:
    """Bounds of the replay buffer.

    Attributes:
        max_records: records kept in total (oldest requests evicted first). >= 2.
        heldout_sequences: most recent requests kept apart as the held-out part. >= 1.
        min_sequence_steps: requests with fewer recorded steps are not used. >= 1.
    """

    max_records: int = 4096
    heldout_sequences: int = 4
    min_sequence_steps: int = 2

    def __post_init__(self) -> None:
        if self.max_records < 2:
            raise ConfigError(f"adapt.buffer.max_records must be >= 2, got {self.max_records}")
        if self.heldout_sequences < 1:
            raise ConfigError(f"adapt.buffer.heldout_sequences must be >= 1, got {self.heldout_sequences}")
        if self.min_sequence_steps < 1:
            raise ConfigError(f"adapt.buffer.min_sequence_steps must be >= 1, got {self.min_sequence_steps}")


class ReplayBuffer:
    """Bounded store of recent feedback, split into a train part and a fresh held-out part.

    Requests are kept in arrival order of their first record; the ``heldout_sequences`` most
    recent requests are held out, the rest train. When more than ``max_records`` are stored the
    oldest requests are evicted whole. Thread-safe.
    """

    def __init__(self, config: BufferConfig | None = None) -> None:
        self.config = config or BufferConfig()
        self._requests: OrderedDict[Hashable, list[FeedbackRecord]] = OrderedDict()
        self._records = 0
        self._lock = threading.Lock()
        self.received = 0

    def __len__(self) -> int:
        return self._records

    def add(self, records: Iterable[FeedbackRecord]) -> None:
        with self._lock:
            for r in records:
                self._requests.setdefault(r.request_id, []).append(r)
                self._records += 1
                self.received += 1
            while self._records > self.config.max_records and len(self._requests) > 1:
                _, dropped = self._requests.popitem(last=False)
                self._records -= len(dropped)

    def _split(self) -> tuple[list[list[FeedbackRecord]], list[list[FeedbackRecord]]]:
        with self._lock:
            groups = [list(v) for v in self._requests.values() if len(v) >= self.config.min_sequence_steps]
        h = self.config.heldout_sequences
        return groups[:-h] if len(groups) > h else [], groups[-h:]

    def train_sequences(self) -> list[FeedbackSequence]:
        """Every request but the held-out ones, joined (oldest first)."""
        return [FeedbackSequence.join(g) for g in self._split()[0]]

    def heldout_sequences(self) -> list[FeedbackSequence]:
        """The most recent ``heldout_sequences`` requests, joined."""
        return [FeedbackSequence.join(g) for g in self._split()[1]]

    def live_tau(self, last_steps: int) -> float:
        """Mean tokens gained over the most recent ``last_steps`` recorded steps (nan if none)."""
        with self._lock:
            recent: deque[int] = deque(maxlen=last_steps)
            for recs in self._requests.values():
                recent.extend(r.tokens_gained for r in recs)
        return sum(recent) / len(recent) if recent else float("nan")


# ---------------------------------------------------------------------- the engine hook
@dataclass(frozen=True)
class SinkConfig:
    """The feedback queue between the decode loop and the learner.

    Attributes:
        max_queue: records the queue holds; a record arriving at a full queue is dropped. >= 1.
        batch_records: records handed to the consumer per call at most. >= 1.
    """

    max_queue: int = 256
    batch_records: int = 32

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ConfigError(f"adapt.sink.max_queue must be >= 1, got {self.max_queue}")
        if self.batch_records < 1:
            raise ConfigError(f"adapt.sink.batch_records must be >= 1, got {self.batch_records}")


Consumer = Callable[[list[FeedbackRecord]], None]
"""Receives a batch of records off the decode thread (must not raise into the sink)."""


@dataclass
class SinkStats:
    """Counters of a :class:`FeedbackSink` (read them any time)."""

    emitted: int = 0
    dropped: int = 0
    delivered: int = 0
    consumer_errors: int = 0
    last_error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class FeedbackSink:
    """Fire-and-forget feedback: the engine's hook puts records on a bounded queue, never blocks.

    ``start()`` runs a daemon thread that drains the queue into ``consumer`` in batches; a
    consumer error (e.g. the learner actor is gone) is counted, never raised into decode.
    Without ``start()`` the queue is drained by :meth:`drain` (tests, single-threaded twins).
    """

    def __init__(self, consumer: Consumer, config: SinkConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or SinkConfig()
        self.consumer = consumer
        self.clock = clock  # stamps the records' wall_time (the controller's time base)
        self.stats = SinkStats()
        self._queue: queue.Queue[FeedbackRecord] = queue.Queue(maxsize=self.config.max_queue)
        self._steps: dict[Hashable, int] = {}
        self._by_ctx: dict[int, Hashable] = {}
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def hook(self, request_id: Hashable) -> Callable[[DraftContext, StepOutcome], None]:
        """The engine's ``feedback=`` callable for one request."""

        def emit(ctx: DraftContext, outcome: StepOutcome) -> None:
            step = self._steps.get(request_id, 0)
            self._steps[request_id] = step + 1
            self.offer(FeedbackRecord.from_outcome(request_id, step, ctx, outcome, self.clock()))

        return emit

    def __call__(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """The hook for engines that pass one sink for every sequence (the batched engine).

        A sequence is told apart by its context object; a step whose root is the first
        generated token starts a new request id (a context object's id may be reused later).
        """
        key = id(ctx)
        first = len(ctx.tokens) - len(outcome.accepted_tokens) - 1 == ctx.prompt_len
        if first or key not in self._by_ctx:
            self._next_id += 1
            self._by_ctx[key] = ("seq", self._next_id)
        self.hook(self._by_ctx[key])(ctx, outcome)

    def end_request(self, request_id: Hashable) -> None:
        """Forget the request's step counter (call when its generation ends)."""
        self._steps.pop(request_id, None)

    def offer(self, record: FeedbackRecord) -> bool:
        """Enqueue without waiting; False (and a counted drop) when the queue is full."""
        with self.stats._lock:
            self.stats.emitted += 1
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self.stats._lock:
                self.stats.dropped += 1
            return False
        return True

    def drain(self, max_records: int | None = None) -> int:
        """Hand queued records to the consumer now (in batches); returns how many were delivered."""
        n = 0
        limit = max_records if max_records is not None else self._queue.qsize()
        while n < limit:
            batch: list[FeedbackRecord] = []
            while len(batch) < self.config.batch_records and n + len(batch) < limit:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                break
            self._deliver(batch)
            n += len(batch)
        return n

    def _deliver(self, batch: list[FeedbackRecord]) -> None:
        try:
            self.consumer(batch)
        except Exception as e:  # noqa: BLE001 - a failing learner must never stop decoding
            with self.stats._lock:
                self.stats.consumer_errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
            return
        with self.stats._lock:
            self.stats.delivered += len(batch)

    def start(self) -> FeedbackSink:
        """Drain in a daemon thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="feedback-sink", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self.config.batch_records:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._deliver(batch)

    def close(self, flush: bool = True) -> None:
        """Stop the drain thread (delivering what is queued when ``flush``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if flush:
            self.drain()
