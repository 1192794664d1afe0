"""``DrafterWorker``: any drafter behind the drafter protocol, hosted in a Ray actor.

The worker keeps its own mirror of the :class:`~speculation.drafters.base.DraftContext`; the
coordinator sends only the tokens appended since the previous call (the context is append-only),
so a step costs O(new tokens) on the wire, not O(context).

Weight swaps. ``swap_weights(slot, state)`` replaces the drafter's weights with a ``state_dict``
(pass an object ref: Ray resolves it before the call runs). An actor runs one method at a time
and the decode loop calls ``propose``/``observe`` between verify steps, so a swap always lands
*between* decode steps, never inside one: atomic from the loop's point of view. A drafter
supports it when it implements :class:`~speculation.drafters.base.WeightSwappable`; the retrieval
drafter has no weights (its state is the suffix index and transition table, rebuilt per request
and updated by ``observe``), so a swap on it raises :class:`WeightsNotSupportedError`.

Drafters that need a verify-cost curve get it from the coordinator (measured over the
distributed target, which is what they will really pay), passed to their builder.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray import cloudpickle

from speculation.drafters import MethodSpec, build_drafter
from speculation.drafters.base import DraftContext, Drafter, Proposal, StepOutcome, WeightSwappable
from speculation.policy.cost import VerifyCostModel


class WeightsNotSupportedError(TypeError):
    """The hosted drafter has no weights to swap."""


class UnknownSlotError(KeyError):
    """The worker holds no drafter in that slot (never loaded, unloaded, or the actor restarted
    since: a restarted actor starts empty)."""


@dataclass(frozen=True)
class DrafterTraits:
    """Protocol attributes of the hosted drafter (read once by the proxy)."""

    name: str
    needs_aux: bool
    target_topk: int
    has_weights: bool


class _VocabOnly:
    """The part of a target the retrieval drafter's builder reads (feature drafters need a real
    target: build them where it is and :meth:`DrafterWorker.host` them)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


def pack_drafter(drafter: Drafter) -> bytes:
    """A drafter as bytes for :meth:`DrafterWorker.host`."""
    return cloudpickle.dumps(drafter)


class _Slot:
    __slots__ = ("drafter", "ctx")

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.ctx = DraftContext(tokens=[], prompt_len=0)


class DrafterWorker:
    """Hosts drafters, one per named slot (a bench interleaves several methods on one worker).

    Each slot is one drafter serving one sequence at a time, with its own context mirror.

    Args:
        vocab_size: the target's vocabulary size.
        torch_threads: torch intra-op threads in this process (None = torch's default).
    """

    def __init__(self, vocab_size: int, torch_threads: int | None = 1) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.vocab_size = vocab_size
        self.slots: dict[str, _Slot] = {}
        self.weights_version: dict[str, int] = {}
        self._incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def incarnation(self) -> str:
        """An id of this actor process's life: it changes when Ray restarts the actor (its slots
        are then empty). A supervisor's liveness probe."""
        return self._incarnation

    def _build(self, spec: MethodSpec, cost_model: VerifyCostModel | None) -> Drafter:
        size = spec.config.verify_curve_size() if spec.config is not None else 0
        if size and cost_model is None:
            raise ValueError(
                f"method {spec.name!r} needs the verify curve c(T) up to T={size}: the worker cannot "
                "measure it (it holds no target); pass the cost model measured over the shards"
            )
        drafter = build_drafter(spec, _VocabOnly(self.vocab_size), cost_model)
        if drafter is None:
            raise ValueError(f"method {spec.name!r} is vanilla: there is no drafter to host")
        return drafter

    def load(self, slot: str, spec: MethodSpec, cost_model: VerifyCostModel | None = None) -> DrafterTraits:
        """Put a fresh drafter for ``spec`` in ``slot`` (replacing what was there); ``cost_model``
        is required when the method needs a verify curve (the coordinator measures it)."""
        self.slots[slot] = _Slot(self._build(spec, cost_model))
        self.weights_version[slot] = 0
        return self.traits(slot)

    def host(self, slot: str, payload: bytes) -> DrafterTraits:
        """Put an already-built drafter (any object behind the protocol) in ``slot``.

        ``payload`` is the drafter pickled with :func:`pack_drafter`: unpickling bytes gives the
        drafter its own writable arrays (an object Ray deserialises directly would hold
        read-only views of the object store, and drafters update their tables in place).
        """
        drafter = cloudpickle.loads(payload)
        if not isinstance(drafter, Drafter):
            raise TypeError(
                f"{type(drafter).__name__} does not implement the drafter protocol (begin/propose/observe)"
            )
        self.slots[slot] = _Slot(drafter)
        self.weights_version[slot] = 0
        return self.traits(slot)

    def unload(self, slot: str) -> None:
        self.slots.pop(slot, None)
        self.weights_version.pop(slot, None)

    def _slot(self, slot: str) -> _Slot:
        try:
            return self.slots[slot]
        except KeyError:
            raise UnknownSlotError(f"drafter worker has no slot {slot!r}; loaded: {sorted(self.slots)}") from None

    def traits(self, slot: str) -> DrafterTraits:
        d = self._slot(slot).drafter
        return DrafterTraits(
            name=d.name,
            needs_aux=bool(d.needs_aux),
            target_topk=int(d.target_topk),
            has_weights=isinstance(d, WeightSwappable),
        )

    # ------------------------------------------------------------------ protocol
    def begin(self, slot: str, tokens: list[int], prompt_len: int, prompt_aux: torch.Tensor | None) -> None:
        s = self._slot(slot)
        s.ctx = DraftContext(tokens=list(tokens), prompt_len=prompt_len)
        s.drafter.begin(s.ctx, prompt_aux)

    def propose(self, slot: str, new_tokens: list[int]) -> Proposal:
        s = self._slot(slot)
        s.ctx.tokens.extend(new_tokens)
        return s.drafter.propose(s.ctx)

    def observe(self, slot: str, new_tokens: list[int], outcome: StepOutcome) -> None:
        s = self._slot(slot)
        s.ctx.tokens.extend(new_tokens)
        s.drafter.observe(s.ctx, outcome)

    # ------------------------------------------------------------------ weights
    def swap_weights(self, slot: str, state: Mapping[str, Any]) -> int:
        """Load ``state`` into the slot's drafter between decode steps; returns the new weights version."""
        drafter = self._slot(slot).drafter
        if not isinstance(drafter, WeightSwappable):
            raise WeightsNotSupportedError(
                f"drafter {drafter.name!r} has no weights to swap (the retrieval drafter's state is its "
                "suffix index and transition table, updated by observe)"
            )
        drafter.load_state_dict(dict(state))
        self.weights_version[slot] += 1
        return self.weights_version[slot]


def make_actor_class(**options):
    """The ``DrafterWorker`` Ray actor class with ``options`` (Ray is imported lazily)."""
    return _remote_class().options(**options) if options else _remote_class()


@functools.cache
def _remote_class():
    return ray.remote(DrafterWorker)
