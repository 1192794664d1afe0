"""The swap guard: watch the drafter after a weight swap and roll back a harmful update.

Users report acceptance collapsing silently after weight syncs (sglang #27718, radixark/miles
#1926). After every applied update the guard keeps the previous weights and the pre-update live
tau ``tau_pre``; it then collects the feedback records of the next ``window_steps`` verify steps
(served with the new weights) and judges the swap in one of two modes (:class:`GuardMode`):

* ``live``: compare the window's live tau with the live tau of the window before the swap,

      tau_post = mean tokens gained over the window
      ROLLBACK  if tau_post < tau_pre * (1 - margin)

  The two windows cover different text, so the comparison carries the text's own variance
  (under fixed weights, per-request tau ranged from 1.29 to 1.97 within the code phase of the
  domain-shift stream, ``benchmarks/results/adapt_domain_shift_eagle3_fp32_explore_budget.json``).
* ``paired`` (default): replay both the previous and the new weights on the window's own
  feedback (:func:`adaptation.gain.replay_units`; the same replay the gate's gain estimate uses,
  here on the traffic served after the swap), and compare them on the same text:

      tau_prev, tau_new = replayed tau of the previous and the new weights over the window
      ROLLBACK  if tau_new < tau_prev * (1 - margin)

  Only the weights differ between the two, so text difficulty cancels. When the window holds
  too little feedback to replay (no request with two recorded steps), the live rule decides.

Ray-free; the controller (or the learner actor) replays, and republishes ``previous`` on ROLLBACK.

:func:`shuffled_head` builds the deliberately harmful update the guard is tested and benchmarked
against (``graftblock adapt-bench --policies static,harmful``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from adaptation.feedback import FeedbackRecord, FeedbackSequence
from speculation.config import ConfigError

StateDict = dict[str, torch.Tensor]

HEAD_KEY = "lm_head.weight"
"""The draft LM head in every learned drafter family's state dict (``[draft_vocab, hidden]``)."""


class GuardMode(str, enum.Enum):
    """How a watched swap is judged (module docstring)."""

    LIVE = "live"
    PAIRED = "paired"


class GuardVerdict(enum.Enum):
    IDLE = "idle"  # no swap being watched
    WATCHING = "watching"  # window not complete
    REPLAY = "replay"  # paired mode: window complete, replay both weights on it, then ``judge``
    KEEP = "keep"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class GuardConfig:
    """Attributes:
        window_steps: verify steps watched after a swap. >= 1.
        margin: relative tau drop that triggers a rollback. Range [0, 1).
        mode: ``paired`` (replay both weights on the window) or ``live`` (compare live windows).
    """

    window_steps: int = 32
    margin: float = 0.1
    mode: GuardMode = GuardMode.PAIRED

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", GuardMode(self.mode))
        except ValueError:
            allowed = ", ".join(m.value for m in GuardMode)
            raise ConfigError(f"adapt.guard.mode must be one of {allowed}, got {self.mode!r}") from None
        if self.window_steps < 1:
            raise ConfigError(f"adapt.guard.window_steps must be >= 1, got {self.window_steps}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"adapt.guard.margin must be in [0, 1), got {self.margin}")


@dataclass
class SwapGuard:
    """Watches one swap at a time (module docstring)."""

    config: GuardConfig = field(default_factory=GuardConfig)
    previous: StateDict | None = None
    tau_pre: float = float("nan")
    tau_post: float = float("nan")
    _records: list[FeedbackRecord] = field(default_factory=list)

    @property
    def watching(self) -> bool:
        return self.previous is not None

    def arm(self, previous: StateDict, tau_pre: float) -> None:
        """Start watching: ``previous`` are the weights before the swap (kept, not copied again)."""
        self.previous, self.tau_pre, self._records = previous, tau_pre, []
        self.tau_post = float("nan")

    def observe(self, record: FeedbackRecord) -> GuardVerdict:
        """One live verify step after the swap. Once the window is complete: the verdict (live
        mode, or paired mode without replayable feedback), or REPLAY (paired: the caller replays
        both weights on :meth:`window_sequences` and calls :meth:`judge`)."""
        if self.previous is None:
            return GuardVerdict.IDLE
        self._records.append(record)
        if len(self._records) < self.config.window_steps:
            return GuardVerdict.WATCHING
        self.tau_post = sum(r.tokens_gained for r in self._records) / len(self._records)
        if self.config.mode is GuardMode.PAIRED and self.window_sequences():
            return GuardVerdict.REPLAY
        return self.judge(self.tau_pre, self.tau_post)

    def window_sequences(self) -> list[FeedbackSequence]:
        """The window's records joined per request (:func:`window_sequences`)."""
        return window_sequences(self._records)

    def judge(self, tau_before: float, tau_after: float) -> GuardVerdict:
        """ROLLBACK if ``tau_after < tau_before * (1 - margin)``, else KEEP."""
        bad = tau_after < tau_before * (1 - self.config.margin)
        return GuardVerdict.ROLLBACK if bad else GuardVerdict.KEEP

    def release(self) -> StateDict | None:
        """Stop watching; returns the kept previous weights (what a rollback republishes)."""
        prev, self.previous = self.previous, None
        return prev


def window_sequences(records: list[FeedbackRecord]) -> list[FeedbackSequence]:
    """Live records joined per request, for a replay (requests with >= 2 recorded steps)."""
    groups: dict[object, list[FeedbackRecord]] = {}
    for r in records:
        groups.setdefault(r.request_id, []).append(r)
    seqs = [FeedbackSequence.join(g) for g in groups.values() if len(g) >= 2]
    return [s for s in seqs if s.length >= 2]


def shuffled_head(state: StateDict, seed: int = 0) -> StateDict:
    """A deliberately harmful update: the draft LM head's rows permuted,

        W'[i] = W[perm[i]]        W: [draft_vocab, hidden], perm a seeded permutation

    so draft token i is scored with another token's row: what training on shuffled labels drives
    a head to. Everything else is the same tensor objects as ``state`` (nothing copied). The
    drafter keeps running at full cost while its proposals are almost never accepted, the worst
    case a weight sync can bring (sglang #27718)."""
    if HEAD_KEY not in state:
        raise ConfigError(f"shuffled_head: the drafter's state dict has no {HEAD_KEY!r} "
                          f"(keys: {', '.join(sorted(state)[:8])}{', ...' if len(state) > 8 else ''})")
    head = state[HEAD_KEY]  # [V_draft, H]
    if head.dim() != 2 or head.shape[0] < 2:
        raise ConfigError(f"shuffled_head: {HEAD_KEY} must be [draft_vocab >= 2, hidden], got {tuple(head.shape)}")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(head.shape[0], generator=gen)
    while torch.equal(perm, torch.arange(head.shape[0])):  # a permutation that changes nothing harms nothing
        perm = torch.randperm(head.shape[0], generator=gen)
    return {**state, HEAD_KEY: head[perm]}
