"""``RayDrafterProxy``: the :class:`~speculation.drafters.base.Drafter` protocol over a DrafterWorker.

The decode loop calls it like any local drafter. ``propose`` waits for the tree; ``begin`` and
``observe`` are submitted without waiting (one caller, one actor: calls run in order), and their
results are checked together with the next ``propose``, so errors still surface at once.
Only the tokens appended to the context since the previous call travel (the context is
append-only). Every ``ray.get`` waits at most ``timeout_s`` (a hung worker raises
``ray.exceptions.GetTimeoutError`` instead of hanging the decode loop); the serving path wraps
this in :class:`cluster.resilient_drafter.ResilientDrafterProxy`, which turns such failures into
steps without speculation and restarts the worker.
"""

from __future__ import annotations

import ray
import torch

from speculation.drafters.base import DraftContext, Proposal, StepOutcome
from workers.drafter_worker import DrafterTraits

DEFAULT_CALL_TIMEOUT_S = 120.0
"""Longest wait on one drafter-worker call (a propose, a weight swap) before it is an error."""


class RayDrafterProxy:
    """A drafter whose work runs in a :class:`~workers.drafter_worker.DrafterWorker` actor.

    Args:
        worker: the actor handle.
        slot: the worker slot holding this proxy's drafter.
        traits: the hosted drafter's protocol attributes (``worker.traits(slot)``; fetched if None).
        timeout_s: longest wait on one call (seconds, > 0).
    """

    def __init__(self, worker, slot: str, traits: DrafterTraits | None = None,
                 timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.worker = worker
        self.slot = slot
        self.timeout_s = timeout_s
        self.traits = traits if traits is not None else ray.get(worker.traits.remote(slot), timeout=timeout_s)
        self.name: str = self.traits.name
        self.needs_aux: bool = self.traits.needs_aux
        self.target_topk: int = self.traits.target_topk
        self._sent = 0
        self._pending: list = []

    def _delta(self, ctx: DraftContext) -> list[int]:
        new = ctx.tokens[self._sent :]
        self._sent = len(ctx.tokens)
        return list(new)

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        self._sent = len(ctx.tokens)
        self._pending.append(
            self.worker.begin.remote(self.slot, list(ctx.tokens), ctx.prompt_len, prompt_aux)
        )

    def propose(self, ctx: DraftContext) -> Proposal:
        ref = self.worker.propose.remote(self.slot, self._delta(ctx))
        got = ray.get([*self._pending, ref], timeout=self.timeout_s)
        self._pending.clear()
        return got[-1]

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        self._pending.append(self.worker.observe.remote(self.slot, self._delta(ctx), outcome))

    def swap_weights(self, state_ref) -> int:
        """Swap the hosted drafter's weights (an object ref to a state dict) before the next step."""
        return ray.get(self.worker.swap_weights.remote(self.slot, state_ref), timeout=self.timeout_s)

    def sync(self) -> None:
        """Wait for (and check) every call submitted without waiting."""
        if self._pending:
            ray.get(self._pending, timeout=self.timeout_s)
            self._pending.clear()
