"""The contract between :class:`~speculation.engine.batch.BatchEngine` and the target it batches on.

:class:`BatchTarget` lists exactly what the engine (and
:func:`~speculation.policy.goodput.measure_batch_cost`) calls on its target. Two implementations:

* :class:`~speculation.model.target.TargetModel`: in process, over a
  :class:`~speculation.model.kv_slots.KVSlotPool`;
* :class:`~cluster.batch_backend.RayBatchTarget`: pipeline shard actors, over a
  :class:`~cluster.batch_backend.RaySlotPool` (the coordinator's ledger). The shards themselves
  (:class:`~workers.shard.TargetShard`) are pipeline stages behind it with a wire interface
  (pool ids, :class:`~workers.shard.BatchStepInput`, hidden-state refs), not batch targets.

Both hand out one sequence type, :class:`SlotState` (its ``pool`` is whichever pool made it), and
both raise :class:`ReleasedSequenceError` on any use of a sequence after ``release_slot``.

Shapes: V the vocabulary, H the hidden size, T_b the nodes of row b's tree, n a prompt's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from speculation.config import BatchLayout
    from speculation.model.target import PrefillForward, TreeForward
    from speculation.spec.tree import DraftTree


class ReleasedSequenceError(ValueError):
    """A target call on a sequence whose KV cache (or slot) was already released."""


@runtime_checkable
class SlotPool(Protocol):
    """What a sequence's pool offers the engine: its slot size and free slots.

    A pool either gives every slot ``max_tokens`` rows, or sizes each slot to the rows its request
    asks for at :meth:`acquire` within a token budget
    (:class:`~speculation.model.kv_slots.SizedKVSlotPool`)."""

    max_sequences: int
    max_tokens: int

    @property
    def free(self) -> int:
        """Slots not held by a live sequence."""
        ...

    def can_hold(self, rows: int) -> bool:
        """Whether a slot for a request of ``rows`` KV rows can be acquired now."""
        ...

    def acquire(self, rows: int | None = None) -> int:
        """A free slot's index (the lowest) for a request of ``rows`` KV rows (None: ``max_tokens``);
        raises when none is free or the rows do not fit."""
        ...

    def capacity(self, slot: int) -> int:
        """KV rows the held ``slot`` holds (``max_tokens`` unless the pool sizes slots per request)."""
        ...

    def release(self, slot: int) -> None:
        """Give ``slot`` back; raises ValueError when it is not held."""
        ...


PoolT = TypeVar("PoolT", bound=SlotPool)


@dataclass
class SlotState(Generic[PoolT]):
    """A sequence in a slot of a :class:`SlotPool` (continuous batching), in process or on shards.

    Attributes:
        pool: the pool that holds its KV rows (a :class:`~speculation.model.kv_slots.KVSlotPool`,
            or the Ray coordinator's :class:`~cluster.batch_backend.RaySlotPool`).
        slot: its slot index, or None once released.
        length: valid KV rows (committed tokens minus the pending root; + tree rows until commit).
        tokens: token ids held in those rows (what a re-prefill after a shard fault replays).
    """

    pool: PoolT
    slot: int | None
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    def held_slot(self) -> int:
        """The slot index; raises :class:`ReleasedSequenceError` once released."""
        if self.slot is None:
            raise ReleasedSequenceError("this sequence was released: its KV slot is gone (prefill a new one)")
        return self.slot


@runtime_checkable
class BatchTarget(Protocol):
    """The slot API :class:`~speculation.engine.batch.BatchEngine` drives (module docstring).

    A step's rows are provisional until :meth:`commit_slot`: :meth:`verify_batch` and
    :meth:`step_batch` add each tree's ``T_b`` rows to its state's ``length``, and the commit cuts
    them back to the accepted path.
    """

    vocab_size: int
    """V: token ids are in ``[0, V)``."""
    eos_token_ids: frozenset[int]
    """The ids that end a sequence (with ``Request.stop_at_eos``)."""
    device: torch.device
    """Where the returned logits live."""

    @property
    def batch_layout(self) -> BatchLayout:
        """FLAT (packed rows: a step costs its real tokens) or PADDED (rows padded to the largest
        tree): how the goodput rule prices a step."""
        ...

    @property
    def folds_prefills(self) -> bool:
        """Whether :meth:`step_batch` can prefill arriving prompts inside the step's forward."""
        ...

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`~speculation.model.target.ContextLengthError` when a prompt of
        ``prompt_len`` tokens plus ``max_new_tokens`` exceeds the model's context."""
        ...

    def new_slot_pool(self, max_sequences: int, max_tokens: int, token_budget: int | None = None) -> SlotPool:
        """A pool of ``max_sequences`` slots of ``max_tokens`` KV rows each (allocated once), or, with
        ``token_budget``, slots sized per request whose rows sum to at most ``token_budget``
        (a target that cannot size slots raises ValueError naming ``batch.kv_token_budget``)."""
        ...

    def prefill_slot(
        self, pool: SlotPool, ids: list[int], need_aux: bool = False, rows: int | None = None
    ) -> tuple[SlotState, torch.Tensor, torch.Tensor | None]:
        """Prefill ``ids`` (n tokens) into a free slot of ``pool`` (of ``rows`` KV rows, None: the
        pool's slot size) in its own forward.

        Returns (state holding n rows, next-token logits ``[V]``, aux features ``[n, 3H]`` or None).
        """
        ...

    def empty_slot(self, pool: SlotPool, rows: int | None = None) -> SlotState:
        """A free slot of ``pool`` (of ``rows`` KV rows) holding nothing yet, for a prompt :meth:`step_batch` prefills
        (only where :attr:`folds_prefills`; raises RuntimeError otherwise)."""
        ...

    def verify_batch(
        self, states: list[SlotState], trees: list[DraftTree], need_aux: bool = False
    ) -> list[TreeForward]:
        """ONE forward over ``trees[b]`` after the committed rows of ``states[b]`` (same pool).

        Returns per row a :class:`~speculation.model.target.TreeForward`: logits ``[T_b, V]``,
        aux ``[T_b, 3H]`` or None. Node i's logits equal a solo verify of that tree.
        """
        ...

    def step_batch(
        self,
        states: list[SlotState],
        trees: list[DraftTree],
        prefills: list[tuple[SlotState, list[int]]],
        need_aux: bool = False,
    ) -> tuple[list[TreeForward], list[PrefillForward]]:
        """:meth:`verify_batch` of ``trees`` plus, in the same forward, each ``(state, prompt)``
        of ``prefills`` (an :meth:`empty_slot`, or one holding the prompt's earlier chunks).

        Returns (per tree a TreeForward ``[T_b, V]``, per prompt a
        :class:`~speculation.model.target.PrefillForward`: logits ``[V]``, aux ``[n, 3H]`` or None).
        """
        ...

    def commit_slot(self, state: SlotState, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's rows (``accepted``: node indices, root 0 first) of the
        last verified ``tree``; ``state.length`` becomes base + len(accepted)."""
        ...

    def release_slot(self, state: SlotState) -> None:
        """Give the sequence's slot back (idempotent); later uses raise ReleasedSequenceError."""
        ...
