"""The swap guard: watch live tau after a weight swap and roll back a harmful update.

Users report acceptance collapsing silently after weight syncs (sglang #27718, radixark/miles
#1926). After every applied update the guard keeps the previous weights and the pre-update live
tau ``tau_pre``; it then collects the tokens gained by the next ``window_steps`` verify steps and
decides

    tau_post = mean tokens gained over the window
    ROLLBACK  if tau_post < tau_pre * (1 - margin)
    KEEP      otherwise

Ray-free; the controller (or the learner actor) republishes ``previous`` on ROLLBACK.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from speculation.config import ConfigError

StateDict = dict[str, torch.Tensor]


class GuardVerdict(enum.Enum):
    IDLE = "idle"  # no swap being watched
    WATCHING = "watching"  # window not complete
    KEEP = "keep"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class GuardConfig:
    """Attributes:
        window_steps: verify steps watched after a swap. >= 1.
        margin: relative tau drop that triggers a rollback. Range [0, 1).
    """

    window_steps: int = 32
    margin: float = 0.1

    def __post_init__(self) -> None:
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
    _gained: list[int] = field(default_factory=list)

    @property
    def watching(self) -> bool:
        return self.previous is not None

    def arm(self, previous: StateDict, tau_pre: float) -> None:
        """Start watching: ``previous`` are the weights before the swap (kept, not copied again)."""
        self.previous, self.tau_pre, self._gained = previous, tau_pre, []
        self.tau_post = float("nan")

    def observe(self, tokens_gained: int) -> GuardVerdict:
        """One live verify step after the swap; the verdict once the window is complete."""
        if self.previous is None:
            return GuardVerdict.IDLE
        self._gained.append(tokens_gained)
        if len(self._gained) < self.config.window_steps:
            return GuardVerdict.WATCHING
        self.tau_post = sum(self._gained) / len(self._gained)
        bad = self.tau_post < self.tau_pre * (1 - self.config.margin)
        return GuardVerdict.ROLLBACK if bad else GuardVerdict.KEEP

    def release(self) -> StateDict | None:
        """Stop watching; returns the kept previous weights (what a rollback republishes)."""
        prev, self.previous = self.previous, None
        return prev
