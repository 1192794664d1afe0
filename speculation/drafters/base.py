"""The drafter protocol: one contract for retrieval, EAGLE-3, SpecBlock and Graft.

Per request the decode loop calls ``begin`` once after prefill, then per step ``propose`` (a
:class:`~speculation.spec.tree.DraftTree` rooted at the pending root token) and, after verification,
``observe`` with what the target accepted. ``observe`` is also the feedback record that online
adaptation consumes, so it carries the aux hidden states at accepted positions and, when the
drafter asks for it, the target's top-k at every verified node.

Batching (optional capability): a :class:`BatchDrafter` proposes for many sequences at once, one
network forward per drafting stage for all of those whose drafters share the network;
:func:`propose_many` (the batching engine) and :func:`draft_many` (Graft's drafter stage) group
drafters by class and :meth:`BatchDrafter.batch_key`, and call everything else per sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from speculation.spec.tree import DraftTree


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
class SkippableDrafter(Drafter, Protocol):
    """A drafter that can sit out a step.

    The batch engine calls :meth:`skip` instead of ``propose`` when it knows before drafting that
    no draft node can pay this step (:class:`~speculation.engine.batch.BatchEngine` with ``goodput``);
    the step verifies the root alone and ``observe`` sees that root-only tree as usual. The next
    ``propose`` must need nothing from the skipped one (it catches up from ``ctx.tokens`` and the
    observations)."""

    def skip(self, ctx: DraftContext) -> None:
        """This step drafts nothing: forget any state the last ``propose`` left for ``observe``."""
        ...


@runtime_checkable
class FinishingDrafter(Drafter, Protocol):
    """A drafter that learns from a whole finished sequence (e.g. the cross-request suffix store).

    Called once, after the step that ended the sequence (a stop token or the length limit), in
    place of that step's ``observe``; an aborted sequence gets no call."""

    def finish(self, ctx: DraftContext, output: list[int]) -> None:
        """``output``: the sequence's generated tokens as returned to the caller."""
        ...


@runtime_checkable
class VerifyTimed(Protocol):
    """A drafter that sizes its trees by a verify-cost curve and corrects that curve from live steps.

    The solo loop, which runs one verify per step, reports each step's measured verify seconds
    (:class:`~speculation.policy.cost.OnlineCostModel`). The batch engine does not: a batched forward's
    seconds are not c(T) of one tree, and its goodput rule keeps its own correction."""

    def observe_verify(self, size: int, context: int, seconds: float) -> None:
        """One verify of ``size`` tokens (root included) over ``context`` committed tokens took
        ``seconds`` (forward, acceptance and KV commit: what c(T) measures)."""
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


DraftResult = tuple[DraftTree, int, int]
"""``(tree, drafter forwards, levels drafted)``: what :meth:`StagedDrafter.draft` returns."""


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that can propose for many sequences in one network forward per drafting stage.

    Drafters of the same class whose :meth:`batch_key` values are equal (the same network object
    and tree knobs) are proposed for together by ``type(d).propose_batch``; each keeps its own
    per-sequence state (context pairs, draft KV cache), batched with per-row lengths and masks.
    ``propose(ctx)`` must equal ``propose_batch([self], [ctx])[0]`` (the solo path is the batch of one).
    """

    def batch_key(self) -> Hashable:
        """Equal keys (same class) may share one batched forward."""
        ...

    @classmethod
    def propose_batch(cls, drafters: Sequence[Any], ctxs: Sequence[DraftContext]) -> list[Proposal]:
        """One proposal per drafter (``drafters[i]`` drafts for ``ctxs[i]``)."""
        ...


@runtime_checkable
class BatchStagedDrafter(StagedDrafter, BatchDrafter, Protocol):
    """A :class:`StagedDrafter` whose ``draft`` batches across sequences (Graft's drafter stage)."""

    @classmethod
    def draft_batch(
        cls,
        drafters: Sequence[Any],
        ctxs: Sequence[DraftContext],
        budgets: Sequence[int | Callable[[int], int]],
        stops: Sequence[StopRule | None],
    ) -> list[DraftResult]:
        """:meth:`StagedDrafter.draft` for every row; each row stops (``stops[i]``) on its own."""
        ...


def batch_groups(drafters: Sequence[Any]) -> list[list[int]]:
    """Indices of ``drafters`` grouped for batched drafting: one group per (class, batch key) of the
    :class:`BatchDrafter` ones (first-seen order), a group of one for any other drafter."""
    groups: dict[Hashable, list[int]] = {}
    for i, d in enumerate(drafters):
        key = (type(d), d.batch_key()) if isinstance(d, BatchDrafter) else ("solo", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def propose_many(drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[tuple[Proposal, float]]:
    """Proposals for many sequences, one batched call per :func:`batch_groups` group.

    Returns ``(proposal, seconds)`` per drafter; a group's wall time is split equally among its
    members (so the seconds sum to the drafting wall time of the whole batch).
    """
    out: list[tuple[Proposal, float] | None] = [None] * len(drafters)
    for group in batch_groups(drafters):
        t0 = time.perf_counter()
        first = drafters[group[0]]
        if isinstance(first, BatchDrafter) and len(group) > 1:
            proposals = type(first).propose_batch([drafters[i] for i in group], [ctxs[i] for i in group])
        else:
            proposals = [first.propose(ctxs[group[0]])]
        share = (time.perf_counter() - t0) / len(group)
        for i, p in zip(group, proposals):
            out[i] = (p, share)
    return [o for o in out if o is not None]


def draft_many(
    drafters: Sequence[StagedDrafter],
    ctxs: Sequence[DraftContext],
    budgets: Sequence[int | Callable[[int], int]],
    stops: Sequence[StopRule | None],
) -> list[DraftResult]:
    """:meth:`StagedDrafter.draft` for many sequences, one ``draft_batch`` call per group."""
    out: list[DraftResult | None] = [None] * len(drafters)
    for group in batch_groups(drafters):
        first = drafters[group[0]]
        if isinstance(first, BatchStagedDrafter) and len(group) > 1:
            results = type(first).draft_batch([drafters[i] for i in group], [ctxs[i] for i in group],
                                              [budgets[i] for i in group], [stops[i] for i in group])
        else:
            i = group[0]
            results = [first.draft(ctxs[i], budgets[i], stops[i])]
        for i, r in zip(group, results):
            out[i] = r
    return [o for o in out if o is not None]
