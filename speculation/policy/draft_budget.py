"""The draft budget of a batched step: :class:`DraftBudgetPolicy` decides whether the drafters run
and how many draft nodes each sequence's tree verifies (the goodput rule,
:mod:`speculation.policy.goodput`), and learns from every step what it realised.

It owns every estimator the rule reads (cost, gain and host-overhead corrections, the realised
payoff, the drafting seconds, the pooled acceptance by rank) and the probe and re-test backoffs;
the scheduler (:class:`~speculation.engine.batch.BatchEngine`) only asks and reports:

1. :meth:`DraftBudgetPolicy.check` before drafting: a :class:`~speculation.spec.step.DraftingCheck`;
2. :meth:`DraftBudgetPolicy.plan` after drafting: a :class:`~speculation.spec.step.StepPlan`
   (draft nodes per sequence);
3. :meth:`DraftBudgetPolicy.observe` after acceptance: the step's
   :class:`~speculation.spec.step.StepResult`.

Per sequence, what the rule needs is a :class:`SequenceBudget` (its acceptance by rank and its
drafter's recent tree size), which the scheduler keeps with the sequence.

**split_budget per step.** A step runs :func:`~speculation.policy.goodput.split_budget` up to three
times, on three different questions, so the calls cannot be merged without changing decisions:
the check prices the *expected* tree sizes with drafting still to be paid (would drafting pay?),
then, only if that says no, *full* trees drafted for free on the uncorrected estimates (could any
tree pay: SKIP or PROBE?); the plan prices the trees actually drafted with their drafting spent.
The inputs differ (sizes, drafting seconds, spent or not, corrected or not), and so do the answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from speculation.policy.cost import RankAcceptance
from speculation.policy.goodput import (
    BatchCostModel,
    CostCorrection,
    GainCorrection,
    HostOverhead,
    RealisedPayoff,
    Split,
    exploration_cap,
    split_budget,
    step_context,
)
from speculation.spec.step import DraftingCheck, StepPlan, StepResult


class SequenceBudget:
    """What the goodput rule knows of one sequence.

    Attributes:
        ranks: acceptance by rank of its verified trees (starts from the policy's pooled estimate).
        draft_size: EMA of the draft nodes (root excluded) its drafter proposed when called; None
            until it has drafted once (the pre-drafting check then assumes a full tree).
    """

    SIZE_DECAY = 0.8

    def __init__(self, ranks: RankAcceptance) -> None:
        self.ranks = ranks
        self.draft_size: float | None = None

    def observe_draft_size(self, n: int) -> None:
        """``draft_size <- SIZE_DECAY * draft_size + (1 - SIZE_DECAY) * n`` (the first one replaces None)."""
        self.draft_size = float(n) if self.draft_size is None else (
            self.SIZE_DECAY * self.draft_size + (1.0 - self.SIZE_DECAY) * n)


@dataclass(frozen=True)
class DraftBudgetConfig:
    """The policy's settings (validated on construction).

    Attributes:
        max_tree_tokens: the most tree tokens (root included) a sequence verifies. Range >= 1.
        step_token_budget: the most tree tokens of a step in total, or None.
        payoff_veto: veto drafting while drafted steps realise less than plain ones.
    """

    max_tree_tokens: int
    step_token_budget: int | None = None
    payoff_veto: bool = False

    def __post_init__(self) -> None:
        m = self.max_tree_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"draft budget max_tree_tokens must be an integer >= 1, got {m!r}")
        b = self.step_token_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"draft budget step_token_budget must be None or an integer >= 1, got {b!r}")
        if not isinstance(self.payoff_veto, bool):
            raise ValueError(f"draft budget payoff_veto must be true or false, got {self.payoff_veto!r}")


class DraftBudgetPolicy:
    """The goodput rule's state and decisions for one engine (module docstring).

    Args:
        config: tree sizes, step budget, payoff veto.
        cost_model: c(B, t, L); None: no rule (every step drafts, trees verified as drafted, nothing
            learnt), what ``batch.goodput`` off means.
    """

    MAX_PROBE_EVERY = 64
    PROBE_DRAFTS = 1
    """Draft nodes a probe may verify per sequence (its best one)."""

    def __init__(self, config: DraftBudgetConfig, cost_model: BatchCostModel | None) -> None:
        self.config = config
        self.cost_model = cost_model
        self.cost_correction = CostCorrection()
        """Measured / predicted forward seconds (EMA) that rescales the goodput rule's c(B, t, L)."""
        self.drafting_s = 0.0
        """EMA of a drafted step's drafting seconds (all sequences): what the pre-drafting check prices."""
        self.gain_correction = GainCorrection()
        """Realised / expected extra tokens of drafted steps (EMAs): scales the acceptance estimates."""
        self.host_overhead = HostOverhead()
        """Host seconds of a step outside forward and drafting, with and without drafts verified:
        what verifying drafts adds is priced by the goodput rule (``verify_overhead_s``)."""
        self.payoff = RealisedPayoff()
        """Realised rate of drafted against plain steps: vetoes drafting while drafted steps lose."""
        self.pooled_ranks = RankAcceptance(config.max_tree_tokens)
        """Acceptance by rank over every sequence's verified trees: a new sequence's starting estimate."""
        self._skips_since_draft = 0
        self._probe_every = 1
        """Steps skipped on expected sizes before a probe (1, 2, 4, ... up to :attr:`MAX_PROBE_EVERY`)."""
        self._vetoes_since_draft = 0
        self._retest_every = 1
        """Vetoed steps before a re-test (1, 2, 4, ... up to :attr:`MAX_PROBE_EVERY`)."""

    @property
    def active(self) -> bool:
        """Whether the goodput rule decides (a cost model is there)."""
        return self.cost_model is not None

    def new_sequence(self) -> SequenceBudget:
        """A joining sequence's budget state, starting from the pooled acceptance estimate."""
        return SequenceBudget(self.pooled_ranks.copy())

    # ------------------------------------------------------------------ the rule
    def _split(self, seqs: Sequence[SequenceBudget], contexts: Sequence[int], drafts: Sequence[int],
               drafting_s: float, spent: bool = True, corrected: bool = True) -> Split:
        """The goodput split of this step when sequence b can verify ``drafts[b]`` draft nodes
        (cut to :func:`~speculation.policy.goodput.exploration_cap`) and drafting costs ``drafting_s``
        (``spent``: already paid, or, before drafting, paid only by a split that verifies drafts).
        ``corrected``: acceptance estimates scaled by :attr:`gain_correction` (False: as estimated,
        what a probe tests)."""
        assert self.cost_model is not None
        room = [min(n, exploration_cap(s.ranks.explored)) for s, n in zip(seqs, drafts)]
        scale = self.gain_correction.scale if corrected else list
        return split_budget([scale(s.ranks.estimate(n)) for s, n in zip(seqs, room)], room, self.cost_model,
                            budget=self.config.step_token_budget, drafting_s=drafting_s,
                            contexts=list(contexts), correction=self.cost_correction.factor,
                            drafting_spent=spent, verify_overhead_s=self.host_overhead.extra_s)

    def check(self, seqs: Sequence[SequenceBudget], contexts: Sequence[int], caps: Sequence[int]) -> DraftingCheck:
        """Before drafting: could any draft node pay this step, drafting included? (DRAFT when there
        is no rule or no live sequence.) ``contexts[b]``: committed KV rows; ``caps[b]``: the most
        tree nodes (root included) sequence b may verify.

        * expected: ``min(cap - 1, round(draft_size))`` draft nodes per sequence (what its drafter
          proposed lately; a retrieval drafter often proposes a few nodes or none), priced with
          the EMA of past drafted steps' drafting seconds (:attr:`drafting_s`), which the vanilla
          split would not spend. A split that verifies some of them: DRAFT.
        * full: ``cap - 1`` draft nodes drafted for free, on the uncorrected estimates. A split that
          verifies nothing even then: SKIP (no tree the drafter may propose can pay, whatever
          drafting costs).
        * Otherwise the corrected estimates say skip: a tree smaller than the cap, drafting dearer
          than what the drafts are expected to gain (a neural drafter's forwards on a CPU), or
          estimates that the realised gains scaled down (:attr:`gain_correction`). They are not
          re-measured while drafting is skipped, so every ``probe_every``-th such step drafts
          anyway (PROBE) and verifies what the uncorrected estimates grant of each sequence's best
          :attr:`PROBE_DRAFTS` draft node(s); a probe that did not
          pay in realised tokens (:meth:`observe`) doubles ``probe_every`` (up to
          :attr:`MAX_PROBE_EVERY`), a drafted step that paid resets it to 1.

        With ``payoff_veto``, a DRAFT verdict is then checked against what drafting realised
        (:attr:`payoff`, measured either way): while
        drafted steps have served fewer tokens per second than plain ones, it becomes VETO (sit
        out), except every ``retest_every``-th such step, RETEST (draft as DRAFT would, and
        re-measure); a re-test after which drafting still loses doubles ``retest_every`` (up to
        :attr:`MAX_PROBE_EVERY`), one after which it no longer does resets it to 1.
        """
        if not self.active or not seqs:
            return DraftingCheck.DRAFT
        full = [c - 1 for c in caps]
        expected = [f if s.draft_size is None else min(f, round(s.draft_size)) for s, f in zip(seqs, full)]
        if any(self._split(seqs, contexts, expected, self.drafting_s, spent=False).drafts):
            if not (self.config.payoff_veto and self.payoff.loses):
                return DraftingCheck.DRAFT
            self._vetoes_since_draft += 1
            return DraftingCheck.RETEST if self._vetoes_since_draft > self._retest_every else DraftingCheck.VETO
        if not any(self._split(seqs, contexts, full, 0.0, corrected=False).drafts):
            return DraftingCheck.SKIP
        self._skips_since_draft += 1
        return DraftingCheck.PROBE if self._skips_since_draft > self._probe_every else DraftingCheck.SKIP

    def plan(self, check: DraftingCheck, seqs: Sequence[SequenceBudget], contexts: Sequence[int],
             tree_drafts: Sequence[int], proposed: Sequence[bool], drafting_s: float) -> StepPlan:
        """After drafting: the draft nodes each sequence verifies, from ``tree_drafts[b]`` drafted
        (root excluded; ``proposed[b]``: its drafter was called) at ``drafting_s`` spent in all.
        Books a drafted step's drafting seconds and proposed sizes."""
        if not self.active or not seqs:
            return StepPlan(check)
        assert self.cost_model is not None
        probe = check is DraftingCheck.PROBE
        # a probe tests the uncorrected estimates on each sequence's best draft node only: the
        # cheapest step that re-measures them (a probe granted whole trees on raw estimates
        # verified 43 tokens for 2 extra at B = 8)
        room = [min(n, self.PROBE_DRAFTS) if probe else n for n in tree_drafts]
        if check is DraftingCheck.VETO:  # a drafter that cannot sit out drafted anyway: verify none of it
            room = [0] * len(room)
        split = self._split(seqs, contexts, room, drafting_s, corrected=not probe)
        # the grid's c(B, 1, L): the vanilla price a drafted step and the realised payoff are judged by
        vanilla_s = self.cost_model.cost(len(seqs), 1, step_context(self.cost_model.layout, list(contexts)))
        drafted = not check.skips and any(proposed)
        if drafted:
            self.drafting_s = drafting_s if self.drafting_s == 0.0 else 0.9 * self.drafting_s + 0.1 * drafting_s
            for s, n, p in zip(seqs, tree_drafts, proposed):
                if p:
                    s.observe_draft_size(n)
            self._skips_since_draft = 0
            self._vetoes_since_draft = 0
        expected = sum(sum(s.ranks.estimate(n)[:n]) for s, n in zip(seqs, split.drafts))
        stats = {"goodput_expected_tokens": split.expected_tokens,
                 "goodput_predicted_s": split.predicted_s,
                 "goodput_predicted_forward_s": split.forward_s,
                 "goodput_row_tokens": float(split.row_tokens),
                 "goodput_cost_correction": self.cost_correction.factor,
                 "goodput_verify_overhead_s": self.host_overhead.extra_s,
                 "goodput_gain_correction": self.gain_correction.factor,
                 "goodput_drafting_skipped": float(check.skips),
                 "goodput_drafting_probe": float(check is DraftingCheck.PROBE),
                 "goodput_drafting_vetoed": float(check is DraftingCheck.VETO),
                 "goodput_drafting_retest": float(check is DraftingCheck.RETEST)}
        return StepPlan(check, tuple(split.drafts), drafted, expected, split.forward_s, vanilla_s, stats)

    # ------------------------------------------------------------------ learning
    def observe(self, plan: StepPlan, result: StepResult, seqs: Sequence[SequenceBudget]) -> None:
        """Book a step: acceptance by rank (each sequence's and the pooled one), the cost correction
        (the grid's uncorrected prediction against the forward), the gain correction and probe
        backoff of a drafted step, the host overhead, and the realised payoff with its re-test
        backoff. Steps that folded prefills into the forward skip the cost correction and payoff."""
        ruled = self.active and plan.drafts is not None
        if self.active:  # the estimates feed only the goodput split
            for s, tree, path in zip(seqs, result.trees, result.paths):
                s.ranks.observe(tree, path)
                self.pooled_ranks.observe(tree, path)
        if ruled and not result.folded_prefills:
            self.cost_correction.observe(plan.predicted_forward_s / self.cost_correction.factor, result.forward_s)
        accepted = sum(result.accepted) if ruled else 0
        if plan.drafted and ruled:
            self._after_verify(plan, len(seqs), accepted, result.forward_s, result.drafting_s)
        step_s = time.perf_counter() - result.started
        host_s = step_s - result.forward_s - result.drafting_s
        if seqs:
            self.host_overhead.observe(result.verified_drafts, max(0.0, host_s))
        if ruled and not result.folded_prefills:
            self.payoff.observe(result.verified_drafts, len(seqs) + accepted, step_s, plan.vanilla_s, len(seqs))
            if plan.check is DraftingCheck.RETEST:
                losing = self.payoff.loses
                self._retest_every = min(2 * self._retest_every, self.MAX_PROBE_EVERY) if losing else 1

    def _after_verify(self, plan: StepPlan, batch: int, accepted: int, forward_s: float, drafting_s: float) -> None:
        """Book a drafted step's realised outcome: the gain correction (``plan.expected_accepted``
        draft nodes on the raw estimates against ``accepted``), and the probe backoff. The step paid
        when it accepted a draft node and its realised tokens per second beat the vanilla split's
        predicted ones (``plan.vanilla_s`` = c(B, 1, L), the grid at the step's batch and context)::

            accepted > 0  and  (B + accepted) / (forward_s + drafting_s)  >  B / (k c(B, 1, L))

        A drafted step that accepted nothing served the B tokens a plain step serves, at a plain
        step's forward or more plus the drafting: it never paid, whatever the prediction says (a
        correction clipped at its floor overprices the vanilla step, and timing noise alone then
        read such probes as paid and reset the backoff).
        """
        assert plan.drafts is not None
        if sum(plan.drafts):
            self.gain_correction.observe(plan.expected_accepted, float(accepted))
        B = batch
        vanilla = self.cost_correction.factor * plan.vanilla_s
        paid = accepted > 0 and (B + accepted) / max(forward_s + drafting_s, 1e-9) > B / vanilla
        if paid:
            self._probe_every = 1
        elif plan.check is DraftingCheck.PROBE:
            self._probe_every = min(2 * self._probe_every, self.MAX_PROBE_EVERY)
