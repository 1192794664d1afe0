"""The drafter protocol: one contract for retrieval, EAGLE-3, SpecBlock and Graft.

Per request the decode loop calls ``begin`` once after prefill, then per step ``propose`` (a
:class:`~speculation.tree.DraftTree` rooted at the pending root token) and, after verification,
``observe`` with what the target accepted. ``observe`` is also the feedback record that online
adaptation consumes, so it carries the aux hidden states at accepted positions and, when the
drafter asks for it, the target's top-k at every verified node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from speculation.tree import DraftTree


@dataclass
class DraftContext:
    """What a drafter may read when proposing.

    Attributes:
        tokens: the committed text, prompt included; the last entry is the pending root (the
            previous step's bonus token, not yet in the target's KV cache). Shared, append-only:
            a drafter must not mutate it.
        prompt_len: how many of ``tokens`` are the prompt.
    """

    tokens: list[int]
    prompt_len: int

    @property
    def root_token(self) -> int:
        return self.tokens[-1]


@dataclass(frozen=True)
class Proposal:
    """A drafted tree and what it cost.

    Attributes:
        tree: the candidate tree (node 0 = the pending root).
        drafter_forwards: neural drafter forward passes spent on it (0 for retrieval).
        stats: optional per-step numbers the drafter reports (e.g. Graft's stage and grafted
            nodes); the engine copies them into the step record and the bench averages them.
    """

    tree: DraftTree
    drafter_forwards: int = 0
    stats: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """One verification result, as the drafter (and the adaptation feedback stream) sees it.

    Attributes:
        tree: the verified tree.
        accepted: accepted node indices, root first.
        accepted_tokens: tokens at ``accepted`` (now in the target's KV cache), root first.
        bonus_token: the next root.
        aux_hidden: ``[len(accepted), 3H]`` target aux features at the accepted nodes, if asked for.
        target_topk: ``[T, k]`` the target's top-k token ids at every tree node, if asked for.
    """

    tree: DraftTree
    accepted: list[int]
    accepted_tokens: list[int]
    bonus_token: int
    aux_hidden: torch.Tensor | None = None
    target_topk: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft trees.

    Attributes:
        name: short method name used in reports (e.g. ``"retrieval"``).
        needs_aux: whether ``begin``/``observe`` need the target's aux hidden states.
        target_topk: how many of the target's top tokens per verified node ``observe`` wants
            (0 = none).
    """

    name: str
    needs_aux: bool
    target_topk: int

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        """Start a new sequence. ``prompt_aux``: ``[prompt_len, 3H]`` or None."""
        ...

    def propose(self, ctx: DraftContext) -> Proposal:
        """Draft a tree rooted at ``ctx.root_token``."""
        ...

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        """Learn from a verification result; ``ctx.tokens`` already includes the accepted tokens."""
        ...


@runtime_checkable
class Reportable(Protocol):
    """A drafter that explains its own decisions (e.g. Graft's chosen dense budget and why)."""

    def report(self) -> dict[str, Any]:
        """What the drafter decided, JSON-ready: the bench stores it as ``drafter_report``."""
        ...


@runtime_checkable
class WeightSwappable(Protocol):
    """A drafter whose network weights can be replaced between decode steps (online adaptation)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current network weights, by parameter name."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the weights atomically: a ``propose`` sees either the old or the new network."""
        ...


StopRule = Callable[[int, torch.Tensor], bool]
"""``stop(levels drafted so far, beam cumulative log-probs [k]) -> stop drafting here?``"""


@runtime_checkable
class StagedDrafter(Drafter, Protocol):
    """A tree drafter that can stop growing its tree early: what Graft prunes and grafts onto.

    ``draft`` grows the tree level by level, asking ``stop`` before each further level, keeps the
    ``budget`` best nodes (``budget`` may depend on the levels drafted) and returns
    ``(tree, drafter forwards, levels drafted)``.
    """

    def draft(
        self, ctx: DraftContext, budget: int | Callable[[int], int], stop: StopRule | None = None
    ) -> tuple[DraftTree, int, int]:
        ...
