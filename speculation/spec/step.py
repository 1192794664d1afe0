"""What one batched step hands between its three parts: the scheduler
(:class:`~speculation.engine.batch.BatchEngine`), the draft budget policy
(:class:`~speculation.policy.draft_budget.DraftBudgetPolicy`) and the verifier (the target's
batched forward and each sequence's acceptance).

1. The policy's verdict before drafting, a :class:`DraftingCheck`: call the drafters or not.
2. After drafting, the policy's :class:`StepPlan`: draft nodes granted per sequence (tree tokens
   = 1 + drafts) and what the goodput rule predicted.
3. After the forward and acceptance, the scheduler's :class:`StepResult`: the trees verified and
   each sequence's accepted path, with the step's seconds; the policy books it.

Plain data only: this module depends on the tree and nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from speculation.spec.tree import DraftTree


class DraftingCheck(str, enum.Enum):
    """The goodput rule's verdict before drafting (:meth:`~speculation.policy.draft_budget.DraftBudgetPolicy.check`)."""

    DRAFT = "draft"
    """Some sequence's expected tree has a draft node that pays: call the drafters."""
    SKIP = "skip"
    """No draft node pays: every :class:`~speculation.drafters.base.SkippableDrafter` sits out."""
    PROBE = "probe"
    """Only the expected tree sizes said skip (full trees would pay): draft anyway, to re-measure
    the sizes; probes back off by doubling while they keep verifying nothing."""
    VETO = "veto"
    """The rule would draft, but drafted steps have realised less than plain ones
    (:class:`~speculation.policy.goodput.RealisedPayoff`): sit out as on SKIP."""
    RETEST = "retest"
    """A vetoed step that drafts anyway, as DRAFT would, to re-measure the realised payoff;
    re-tests back off by doubling while drafting keeps losing."""

    @property
    def skips(self) -> bool:
        """Whether skippable drafters sit this step out (SKIP, VETO)."""
        return self in (DraftingCheck.SKIP, DraftingCheck.VETO)


@dataclass(frozen=True)
class StepPlan:
    """The policy's plan of one step, after drafting (B live sequences).

    Attributes:
        check: the verdict before drafting.
        drafts: draft nodes granted per sequence (``[B]``; each tree is cut to its best ``drafts[b]``
            nodes, tree tokens ``1 + drafts[b]``), or None: no goodput rule, the trees as drafted.
        drafted: whether a drafter proposed this step (the policy booked the drafting).
        expected_accepted: draft nodes the raw acceptance estimates expect accepted under ``drafts``.
        predicted_forward_s: the rule's corrected forward seconds ``k c(B, t, L)`` (0 without a rule).
        vanilla_s: the grid's c(B, 1, L), what a plain step is judged against (0 without a rule).
        stats: the goodput figures every step record carries (``goodput_*``; empty without a rule).
    """

    check: DraftingCheck
    drafts: tuple[int, ...] | None = None
    drafted: bool = False
    expected_accepted: float = 0.0
    predicted_forward_s: float = 0.0
    vanilla_s: float = 0.0
    stats: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """What the verifier and acceptance did with a :class:`StepPlan` (one row per live sequence).

    Attributes:
        trees: the trees verified (``[B]``, root included).
        paths: each sequence's accepted path (node indices, root 0 first).
        accepted: each sequence's accepted draft nodes (its step record's ``accepted``).
        forward_s: seconds of the step's one target forward.
        drafting_s: seconds all drafters spent this step.
        started: ``time.perf_counter()`` at the step's start (the policy reads the step's seconds
            when it has booked it, so its own bookkeeping counts as host time).
        folded_prefills: whether prompts were prefilled inside the forward (its seconds then are
            not a verify step's, and the cost correction and realised payoff skip it).
    """

    trees: tuple[DraftTree, ...]
    paths: tuple[list[int], ...]
    accepted: tuple[int, ...]
    forward_s: float
    drafting_s: float
    started: float
    folded_prefills: bool = False

    @property
    def verified_drafts(self) -> bool:
        """Whether any tree had a draft node."""
        return any(len(t) > 1 for t in self.trees)
