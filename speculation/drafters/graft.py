"""Graft (arXiv 2605.20104): dynamic-depth pruning of a drafter tree, then grafting of retrieved
tokens into the freed slots, verified in one tree pass (docs/algorithms.md §0, §5, §6).

Per decode step, with K_max the dense tree size (root included), L the committed context length
and stages s_1 < ... < s_m:

1. **Retrieve at the root.** The retrieval source (suffix index over prompt + history, and the
   token-adjacency table M refreshed from every verification) proposes a best-first tree R whose
   node scores are calibrated log path probabilities, so ``E_R = sum_{i in R} p_i`` is its expected
   accepted length. R cut to K_max tokens is the *retrieval-only* tree.
2. **Gate** (when 0 is a stage). Calling the drafter pays when its expected marginal accepted
   tokens G (over the retrieval-only tree), priced by the per-token time of the retrieval-only
   step, exceed what it adds to the step time::

       G * (c(|R|, L) + d_R) / (1 + E_R)  >  d + c(|T_g|, L) - c(|R|, L)

   which is the paper's B.3 condition ``(A_R + G) / (c_g + d_R + d) > A_R / (c_R + d_R)`` solved for
   G. G is the measured mean of ``accepted(T_g) - accepted_along_truth(R)`` over past drafter calls
   in the same E_R bucket (:class:`DrafterGate`), d the measured drafter time per call
   (:class:`StageTiming`), |T_g| the measured mean hybrid size. Until a bucket has ``gate_warmup``
   observations the drafter is called. When the gate says no, the retrieval-only tree is verified
   (stage 0, no drafter forward). Every verdict and its terms go into ``Proposal.stats``.
3. **Prune.** The tree drafter (any :class:`~speculation.drafters.base.StagedDrafter`: EAGLE-3 adds
   one level per forward, SpecBlock a block of K levels) grows its tree. At each stage depth
   s < s_m it computes the path mass of its open leaves ``C_s = sum_{b in open} exp(S_b)`` and stops
   if ``C_s < threshold``. The pool is reranked to the node budget N_s of the stage it stopped at:
   the pruned tree T_pi.
4. **Graft.** ``F = K_max - |T_pi|`` slots are free (at most ``graft_budget`` are used). Candidate
   sources: R anchored at the root (offset log 1), and, for each of the ``graft_anchors`` kept
   drafter nodes v of highest path mass (leaves of T_pi, the pruned frontier, or inner nodes),
   retrieval on ``context + path(v)`` (suffix index matched through the path, transition table
   from v's token) anchored under v with offset ``log a_rank(v)``, the calibrated probability that
   v is accepted. Every candidate's score is then a calibrated log path probability from the root,
   and all sources are attached together best-first (:func:`graft_anchored`): a candidate equal to
   an existing child is merged into it, any other takes a free slot. |T_g| <= K_max always.
   **Cut by cost** (``cost_cut``, on by default): T_g, and the retrieval-only tree R of stage 0,
   are cut to the best-first prefix maximising ``(1 + sum_{i<=n} p_i) / (c(n + 1, L) + d)`` with
   p_i each node's calibrated acceptance (drafter nodes: a_rank of their score rank; retrieved
   nodes: their calibrated path probability; never above the parent's) and d the step's measured
   retrieval + drafting + assembly seconds. A graft is verified only when what it adds to the
   expected accepted length pays for what it adds to the verify time; the retrieval-only tree
   gets the rule of the cost-aware retrieval method, so Graft is priced like its best source.
5. **Verify** T_g in one target pass (greedy or lossless sampling, unchanged: every candidate is
   fixed before the uniforms are drawn), then both sources observe the result, and Graft updates
   the rank posterior, the gate's gain estimate, and the acceptance attribution by anchor.

Batched (:meth:`GraftDrafter.propose_batch`, used by the batching engine): steps 1-2 run per
sequence; the sequences whose gate calls the drafter run step 3 together (one drafter forward per
level or block for all of them, each stopping at its own stage); steps 4-5 run per sequence.

K_max (``dense_budget: 0``): ``K_max = argmax_K (1 + sum_{r < K-1} a_r) / (c(K, L) + d)`` with a_r the
Beta-posterior acceptance of the drafter node of score rank r (:class:`RankAcceptance`), c the
measured c(T, L) at the current context length and d the measured drafting time; recomputed every
step.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from speculation.config import ConfigError, GraftConfig
from speculation.policy.cost import OnlineCostModel, RankAcceptance, VerifyCost, measure_cost_model, online
from speculation.drafters.base import (
    DraftContext,
    DraftResult,
    Proposal,
    SkippableDrafter,
    StagedDrafter,
    StepOutcome,
    StopRule,
    draft_many,
)
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.drafters.specblock import build_specblock_drafter
from speculation.spec.tree import ROOT, DraftTree, NodeSource

TREE_BUILDERS: dict[str, Callable[[Any, Any, VerifyCost | None], StagedDrafter]] = {
    "eagle3": build_eagle3_drafter,
    "specblock": build_specblock_drafter,
}
"""Builder of each ``graft.tree_drafter.type`` (the same keys as ``config.TREE_DRAFTER_CONFIGS``)."""


@dataclass(frozen=True)
class StageTemplate:
    """The node budgets of one (stage, K_max), computed once and cached: the drafter node budget
    N_s and the graft capacity ``min(graft_budget, K_max - 1 - N_s)``.

    This is budget arithmetic only. The verify pass builds each tree's positions and ancestor mask
    from the tree itself (``DraftTree.to_tensors``); no per-stage verify template is precomputed.
    """

    stage: int
    k_max: int
    drafter_nodes: int
    graft_capacity: int


class StageTiming:
    """Measured drafting time d: an EMA of the wall seconds of one drafter call (drafting, anchored
    retrieval and grafting) per stage it stopped at, and the calls' stage frequencies (discounted
    counts), so ``expected() = sum_s w_s d_s / sum_s w_s`` is the d of the next call."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.seconds: dict[int, float] = {}
        self.weight: dict[int, float] = {}

    def update(self, stage: int, seconds: float) -> None:
        prev = self.seconds.get(stage)
        self.seconds[stage] = seconds if prev is None else self.decay * prev + (1.0 - self.decay) * seconds
        for s in self.weight:
            self.weight[s] *= self.decay
        self.weight[stage] = self.weight.get(stage, 0.0) + 1.0

    def expected(self) -> float:
        total = sum(self.weight.values())
        return sum(self.weight[s] * self.seconds[s] for s in self.weight) / total if total else 0.0


class GateVerdict(enum.IntEnum):
    """Why the drafter was (not) called this step."""

    NO_STAGE_0 = 0  # 0 is not a stage: the drafter runs every step
    WARMUP = 1  # fewer than gate_warmup observations in this bucket: called to measure
    PAYS = 2  # expected marginal value > drafting + extra verify cost
    DOES_NOT_PAY = 3  # retrieval-only this step


@dataclass(frozen=True)
class GateDecision:
    """One step's gate verdict and its terms (seconds and tokens)."""

    verdict: GateVerdict
    bucket: int
    expected_gain: float  # G: expected marginal accepted tokens of calling the drafter
    per_token_s: float  # (c(|R|, L) + d_R) / (1 + E_R)
    value_s: float  # G * per_token_s
    cost_s: float  # d + c(|T_g|, L) - c(|R|, L)

    @property
    def call(self) -> bool:
        return self.verdict != GateVerdict.DOES_NOT_PAY


class DrafterGate:
    """Per-bucket estimate of the drafter's marginal accepted tokens over the retrieval-only tree.

    Buckets are ranges of the retrieval tree's expected accepted length E_R (:data:`EDGES`): the
    drafter adds least when retrieval is already confident. Each bucket keeps a discounted mean of
    the observed gains ``accepted(T_g) - accepted_along_truth(R)`` (R's accepted length along the
    target's emitted tokens: exact under greedy, the emitted-token proxy under sampling) and the
    number of observations; fewer than ``warmup`` observations force a call.
    """

    EDGES = (0.5, 1.0, 2.0, 4.0)

    def __init__(self, warmup: int, decay: float = 0.98) -> None:
        self.warmup = warmup
        self.decay = decay
        n = len(self.EDGES) + 1
        self.gain_sum = [0.0] * n
        self.weight = [0.0] * n
        self.count = [0] * n

    def bucket(self, retrieval_expected: float) -> int:
        return sum(retrieval_expected >= e for e in self.EDGES)

    def gain(self, bucket: int) -> float:
        w = self.weight[bucket]
        return self.gain_sum[bucket] / w if w else 0.0

    def decide(self, retrieval_expected: float, per_token_s: float, cost_s: float) -> GateDecision:
        b = self.bucket(retrieval_expected)
        g = self.gain(b)
        value = g * per_token_s
        if self.count[b] < self.warmup:
            verdict = GateVerdict.WARMUP
        else:
            verdict = GateVerdict.PAYS if value > cost_s else GateVerdict.DOES_NOT_PAY
        return GateDecision(verdict, b, g, per_token_s, value, cost_s)

    def update(self, bucket: int, gain: float) -> None:
        self.gain_sum[bucket] = self.decay * self.gain_sum[bucket] + gain
        self.weight[bucket] = self.decay * self.weight[bucket] + 1.0
        self.count[bucket] += 1


@dataclass(frozen=True)
class GraftSource:
    """Retrieved candidates hung under one anchor of the draft tree.

    Attributes:
        anchor: the node of the draft tree the candidates continue (ROOT = root-anchored).
        candidates: a tree rooted at the anchor's token; node scores are calibrated log path
            probabilities given the anchor.
        offset: the anchor's own calibrated log probability (0 at the root), added to every score.
    """

    anchor: int
    candidates: DraftTree
    offset: float = 0.0


def graft_anchored(tree: DraftTree, sources: Sequence[GraftSource], room: int) -> dict[int, int]:
    """Graft every source's candidates into ``tree``, in place, best-first across sources.

    Candidates are visited by decreasing ``score + offset`` (a stable order: within a source a
    parent never scores below its child and comes first). A candidate whose parent was placed and
    whose token equals an existing child there is merged into it (the existing node keeps its
    source tag and score); otherwise it is added as a new ``RETRIEVAL`` node while fewer than
    ``room`` new nodes exist. Siblings stay unique, parents stay before children, and ``len(tree)``
    grows by at most ``room``. Returns ``{new node: anchor}`` of the grafted nodes.
    """
    if room <= 0:
        return {}
    for src in sources:
        if src.candidates.root_token != tree.tokens[src.anchor]:
            raise ValueError(f"retrieved tree is rooted at token {src.candidates.root_token}, "
                             f"its anchor {src.anchor} holds {tree.tokens[src.anchor]}")
    order = sorted(((-(src.candidates.scores[j] + src.offset), i, j)
                    for i, src in enumerate(sources) for j in range(1, len(src.candidates))))
    placed = [[-1] * len(src.candidates) for src in sources]
    for i, src in enumerate(sources):
        placed[i][ROOT] = src.anchor
    origin: dict[int, int] = {}
    for neg, i, j in order:
        cand = sources[i].candidates
        parent = placed[i][cand.parents[j]]
        if parent < 0:
            continue
        existing = tree.child(parent, cand.tokens[j])
        if existing is not None:
            placed[i][j] = existing
            continue
        if len(origin) >= room:
            continue
        node = tree.add(parent, cand.tokens[j], -neg, NodeSource.RETRIEVAL)
        placed[i][j] = node
        origin[node] = sources[i].anchor
    return origin


def graft(pruned: DraftTree, retrieved: DraftTree, room: int) -> int:
    """Root-anchored grafting: ``retrieved`` (rooted at the same root token) into ``pruned``, in
    place, by :func:`graft_anchored` with one source. Returns the number of nodes grafted."""
    if len(retrieved) <= 1:
        return 0
    if retrieved.root_token != pruned.root_token:
        raise ValueError(f"retrieved tree is rooted at token {retrieved.root_token}, the draft at {pruned.root_token}")
    return len(graft_anchored(pruned, [GraftSource(ROOT, retrieved)], room))


def accepted_along(tree: DraftTree, truth: Sequence[int]) -> int:
    """How many of ``truth`` (the emitted tokens after the root) ``tree`` holds as a root path."""
    cur, n = ROOT, 0
    for tok in truth:
        nxt = tree.child(cur, tok)
        if nxt is None:
            break
        cur, n = nxt, n + 1
    return n


@dataclass
class _Step:
    """What ``observe`` needs from the matching ``propose``."""

    tree: DraftTree  # the proposed tree (node indices below refer to it)
    retrieval_only: DraftTree
    decision: GateDecision | None
    ranked: list[tuple[int, int]]  # (tree node, score rank) of drafter nodes
    origin: dict[int, int]  # grafted node -> anchor


@dataclass
class _Plan:
    """A sequence whose gate called the drafter: what its drafter stage and grafting need."""

    k_max: int
    retrieved: DraftTree  # the root retrieval tree (best-first)
    alone: DraftTree  # ... cut to k_max: the retrieval-only tree
    decision: GateDecision
    stats: dict[str, float]
    confidence: list[float]  # beam masses the prune rule saw (filled while drafting)
    stop: StopRule  # the dynamic-depth prune rule
    budget: Callable[[int], int]  # drafter nodes kept after ``levels`` levels
    context: int  # committed tokens L
    retrieval_s: float  # seconds of the root retrieval


class GraftDrafter:
    """Prune-then-graft drafter composing a tree drafter with the retrieval drafter.

    Args:
        config: the Graft knobs.
        drafter: any :class:`~speculation.drafters.base.StagedDrafter` (EAGLE-3, SpecBlock); None
            when the only stage is 0 (retrieval only).
        retrieval: the retrieval source (its own cost cut disabled; the hybrid tree is sized here).
        cost_model: the target's measured verify curve c(T, L); required when
            ``config.verify_curve_size()`` is non-zero (``dense_budget`` 0, or the drafter gate).
    """

    name = "graft"
    needs_aux = True

    def __init__(self, config: GraftConfig, drafter: StagedDrafter | None, retrieval: RetrievalDrafter,
                 cost_model: VerifyCost | None = None) -> None:
        if drafter is None and config.max_stage > 0:
            raise ValueError(f"graft.stages {list(config.stages)} need a tree drafter (only [0] runs without one)")
        if drafter is not None and not isinstance(drafter, StagedDrafter):
            raise TypeError(f"graft needs a drafter that can stop early (StagedDrafter.draft); {drafter.name!r} cannot")
        if config.verify_curve_size() and cost_model is None:
            need = ("graft.dense_budget = 0 (auto)" if config.dense_budget == GraftConfig.AUTO
                    else f"graft.stages {list(config.stages)} (stage 0: the drafter gate)")
            raise ConfigError(f"{need} needs the measured verify curve c(T): build the drafter with "
                              "speculation.drafters.build_drafter (it measures c(T)), or pass cost_model")
        self.config = config
        self.drafter = drafter
        self.retrieval = retrieval
        self.target_topk = retrieval.target_topk
        self.cost_model: VerifyCost | None = online(cost_model) if config.verify_curve_size() else None
        """c(T, L) for K_max sizing, the gate and the cost cut (a measured one corrected by the solo
        loop's live verify times, :meth:`observe_verify`); else None."""
        self.ranks = RankAcceptance(GraftConfig.AUTO_MAX)
        self.timing = StageTiming()
        self.gate = DrafterGate(config.gate_warmup)
        self.hybrid_size: float | None = None
        """EMA of |T_g| over drafter calls (the gate's estimate of the size a call verifies)."""
        self.counters = {"steps": 0, "drafter_calls": 0, "grafted_root": 0, "grafted_anchored": 0,
                         "accepted_drafter": 0, "accepted_root_graft": 0, "accepted_anchored_graft": 0}
        """Cumulative counts: steps, calls, grafted nodes and accepted nodes by origin."""
        self._templates: dict[tuple[int, int], StageTemplate] = {}
        self._step: _Step | None = None
        self._checks = {s for s in config.stages if 0 < s < config.max_stage}

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        self.retrieval.begin(ctx, prompt_aux)
        if self.drafter is not None:
            self.drafter.begin(ctx, prompt_aux)
        self._step = None

    def observe_verify(self, size: int, context: int, seconds: float) -> None:
        """Correct c(T, L) by one live verify (:class:`~speculation.drafters.base.VerifyTimed`)."""
        if isinstance(self.cost_model, OnlineCostModel):
            self.cost_model.observe(size, context, seconds)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        step = self._step
        if step is not None and outcome.tree is step.tree:  # (an engine that cut the tree renumbered it)
            accepted = set(outcome.accepted)
            self.ranks.update([(r, node in accepted) for node, r in step.ranked])
            tree = outcome.tree
            for node in outcome.accepted[1:]:
                if tree.sources[node] == NodeSource.DRAFTER:
                    self.counters["accepted_drafter"] += 1
                elif node in step.origin:
                    key = "accepted_root_graft" if step.origin[node] == ROOT else "accepted_anchored_graft"
                    self.counters[key] += 1
        if step is not None and step.decision is not None and step.decision.verdict in (GateVerdict.WARMUP,
                                                                                        GateVerdict.PAYS):
            truth = [*outcome.accepted_tokens[1:], outcome.bonus_token]
            gain = (len(outcome.accepted) - 1) - accepted_along(step.retrieval_only, truth)
            self.gate.update(step.decision.bucket, float(gain))
        self._step = None
        self.retrieval.observe(ctx, outcome)
        if self.drafter is not None:
            self.drafter.observe(ctx, outcome)

    def skip(self, ctx: DraftContext) -> None:
        """Sit out a step (:class:`~speculation.drafters.base.SkippableDrafter`): no rank, gate or
        graft bookkeeping for it; both sources skip too. (A stage-0 step already leaves the tree
        drafter without a ``propose``; the feature drafters catch up lazily.)"""
        self._step = None
        self.retrieval.skip(ctx)
        if isinstance(self.drafter, SkippableDrafter):
            self.drafter.skip(ctx)

    def batch_key(self) -> Hashable:
        """Every Graft drafter joins one group; its tree drafters batch by their own keys."""
        return GraftDrafter

    def propose(self, ctx: DraftContext) -> Proposal:
        return self.propose_batch([self], [ctx])[0]

    @classmethod
    def propose_batch(cls, drafters: Sequence[GraftDrafter], ctxs: Sequence[DraftContext]) -> list[Proposal]:
        """Steps 1-4 for B sequences: retrieval and the gate per sequence; the sequences whose gate
        calls the drafter draft together (:func:`~speculation.drafters.base.draft_many`: one forward
        per level or block for all tree drafters sharing a network; each stops on its own prune
        rule); then pruning and grafting per sequence. The shared drafting wall time is split
        equally among the callers (their measured d)."""
        plans = [g._plan(ctx) for g, ctx in zip(drafters, ctxs)]
        calls = [i for i, p in enumerate(plans) if isinstance(p, _Plan)]
        if calls:
            t1 = time.perf_counter()
            staged = [cast(StagedDrafter, drafters[i].drafter) for i in calls]
            called = [cast(_Plan, plans[i]) for i in calls]
            results = draft_many(staged, [ctxs[i] for i in calls], [p.budget for p in called], [p.stop for p in called])
            share = (time.perf_counter() - t1) / len(calls)
            for i, plan, r in zip(calls, called, results):
                plans[i] = drafters[i]._finish(ctxs[i], plan, r, share)
        return [cast(Proposal, p) for p in plans]

    def _plan(self, ctx: DraftContext) -> Proposal | _Plan:
        """Steps 1-2: retrieve at the root and ask the gate; the retrieval-only proposal when the
        drafter is not called, else what the drafter stage needs (budget and prune rule)."""
        cfg = self.config
        context = len(ctx.tokens)
        k_max = self.dense_budget(context)
        t0 = time.perf_counter()
        retrieved = self.retrieval.propose(ctx).tree  # best-first, scores = log calibrated p
        alone = retrieved if len(retrieved) <= k_max else retrieved.subtree(range(k_max))
        retrieval_s = time.perf_counter() - t0
        uncut = len(alone)
        alone, _ = self._cost_cut(alone, [math.exp(s) for s in alone.scores], retrieval_s, context)
        expected = sum(math.exp(s) for s in alone.scores[1:])
        self.counters["steps"] += 1
        decision = self._decide(len(alone), expected, retrieval_s, k_max, context)
        stats: dict[str, float] = {"k_max": float(k_max), "retrieval_expected": expected,
                                   "retrieval_s": retrieval_s, "cost_cut": float(uncut - len(alone))}
        stats.update(self._gate_stats(decision))
        if self.drafter is None or not decision.call:
            self._step = _Step(alone, alone, decision, [], {})
            return self._proposal(alone, 0, 0, stats)

        self.counters["drafter_calls"] += 1
        confidence: list[float] = []

        def stop(levels: int, beam_scores: torch.Tensor) -> bool:
            if levels >= cfg.max_stage:
                return True
            if levels not in self._checks:
                return False
            mass = float(torch.exp(beam_scores.float()).sum())
            confidence.append(mass)
            return mass < cfg.threshold

        def budget(levels: int) -> int:
            return self.template(self.stage_of(levels), k_max).drafter_nodes

        return _Plan(k_max, retrieved, alone, decision, stats, confidence, stop, budget, context, retrieval_s)

    def _finish(self, ctx: DraftContext, plan: _Plan, drafted: DraftResult, draft_s: float) -> Proposal:
        """Steps 3-4 after the drafter stage (``draft_s``: this sequence's share of its wall time)."""
        tree, forwards, levels = drafted
        k_max = plan.k_max
        stage = self.stage_of(levels)
        tmpl = self.template(stage, k_max)
        order = sorted(range(1, len(tree)), key=lambda i: -tree.scores[i])
        ranked = [(node, r) for r, node in enumerate(order)]
        self.ranks.observe_capacity(len(order))
        room = min(tmpl.graft_capacity, k_max - len(tree))
        t2 = time.perf_counter()
        origin = graft_anchored(tree, self._sources(ctx, tree, plan.retrieved, ranked, room), room)
        rates = self.ranks.rates
        probs = [1.0] * len(tree)
        for node, r in ranked:
            probs[node] = rates[r] if r < len(rates) else 0.0
        for node in origin:
            probs[node] = math.exp(tree.scores[node])  # calibrated log path probability (graft_anchored)
        uncut = len(tree)
        tree, remap = self._cost_cut(tree, probs, plan.retrieval_s + draft_s + time.perf_counter() - t2, plan.context)
        if remap is not None:
            ranked = [(remap[node], r) for node, r in ranked if node in remap]
            origin = {remap[node]: remap[a] for node, a in origin.items() if node in remap}
        assembly_s = time.perf_counter() - t2
        drafting_s = draft_s + assembly_s
        self.timing.update(stage, drafting_s)
        n = float(len(tree))
        self.hybrid_size = n if self.hybrid_size is None else 0.9 * self.hybrid_size + 0.1 * n
        anchored = sum(1 for a in origin.values() if a != ROOT)
        self.counters["grafted_anchored"] += anchored
        self.counters["grafted_root"] += len(origin) - anchored
        self._step = _Step(tree, plan.alone, plan.decision, ranked, origin)
        stats = plan.stats
        stats.update({"drafting_s": drafting_s, "assembly_s": assembly_s, "grafted": float(len(origin)),
                      "grafted_anchored": float(anchored), "cost_cut": float(uncut - len(tree))})
        if plan.confidence:
            stats["beam_mass"] = plan.confidence[-1]
        return self._proposal(tree, stage, forwards, stats)

    # ------------------------------------------------------------------ the gate and the grafts
    def _decide(self, alone_size: int, expected: float, retrieval_s: float, k_max: int, context: int) -> GateDecision:
        """The drafter gate's verdict for this step (module docstring, step 2)."""
        if not self.config.gated or self.cost_model is None:
            return GateDecision(GateVerdict.NO_STAGE_0, 0, 0.0, 0.0, 0.0, 0.0)
        c = self.cost_model
        c_alone = c.cost(alone_size, context)
        per_token = (c_alone + retrieval_s) / (1.0 + expected)
        size = min(float(k_max), self.hybrid_size if self.hybrid_size is not None else float(k_max))
        extra_verify = max(0.0, c.cost(max(1, round(size)), context) - c_alone)
        return self.gate.decide(expected, per_token, self.timing.expected() + extra_verify)

    def _cost_cut(self, tree: DraftTree, probs: Sequence[float], drafting_s: float,
                  context: int) -> tuple[DraftTree, dict[int, int] | None]:
        """``tree`` cut to its cost-optimal best-first prefix (``GraftConfig.cost_cut``).

        ``probs[i]``: node i's calibrated probability of being accepted (``probs[0]`` unused). A
        node is never rated above its parent (``p_i <- min(p_i, p_parent)``, parents come first),
        so sorting by ``(-p_i, i)`` puts every parent before its children and each prefix is
        ancestor-closed; the kept prefix is the n of :func:`~speculation.policy.cost.best_prefix`. Returns
        the cut tree and ``{old node: new node}`` (None when nothing was cut)."""
        if self.cost_model is None or not self.config.cost_cut or len(tree) <= 1:
            return tree, None
        p = [1.0] * len(tree)
        for i in range(1, len(tree)):
            p[i] = min(max(float(probs[i]), 0.0), p[tree.parents[i]])
        order = sorted(range(1, len(tree)), key=lambda i: (-p[i], i))
        n = self.cost_model.best_prefix([p[i] for i in order], drafting_s, context)
        if n == len(order):
            return tree, None
        keep = sorted([ROOT, *order[:n]])
        return tree.subtree(keep), {old: new for new, old in enumerate(keep)}

    def _sources(self, ctx: DraftContext, tree: DraftTree, retrieved: DraftTree,
                 ranked: list[tuple[int, int]], room: int) -> list[GraftSource]:
        """The root-anchored retrieval tree plus one anchored retrieval per kept drafter node of
        highest path mass (at most ``graft_anchors``), each offset by its calibrated log a_rank."""
        sources = [GraftSource(ROOT, retrieved)]
        if room <= 0 or not self.config.graft_anchors:
            return sources
        rates = self.ranks.rates
        for node, r in ranked[: self.config.graft_anchors]:
            p = rates[r] if r < len(rates) else rates[-1]
            if p <= 0.0:
                continue
            path = tree.path_tokens(node)[1:]
            cands = self.retrieval.continuations(ctx.tokens, path, room)
            if len(cands) > 1:
                sources.append(GraftSource(node, cands, math.log(p)))
        return sources

    # ------------------------------------------------------------------ sizing
    def stage_of(self, levels: int) -> int:
        """The stage drafting stopped at after ``levels`` levels: the smallest stage >= ``levels``
        (a drafter whose open leaves ran out stops between stages)."""
        return next(s for s in self.config.stages if s >= levels)

    def dense_budget(self, context: int | None = None) -> int:
        """K_max for this step: the configured one, or (``dense_budget: 0``) the measured optimum
        ``argmax_K (1 + sum_{r<K-1} a_r) / (c(K, L) + d)`` at context length ``context``."""
        if self.config.dense_budget != GraftConfig.AUTO:
            return self.config.dense_budget
        assert self.cost_model is not None  # the constructor checked that auto has c(T)
        return self.ranks.best_size(self.cost_model, GraftConfig.AUTO_MAX, self.timing.expected(), context)

    def template(self, stage: int, k_max: int) -> StageTemplate:
        """The budgets of ``stage`` for trees of ``k_max`` tokens (cached)."""
        key = (stage, k_max)
        tmpl = self._templates.get(key)
        if tmpl is None:
            n = self.config.stage_budget(stage, k_max)
            cap = min(self.config.graft_budget, k_max - 1 - n)
            tmpl = StageTemplate(stage, k_max, n, cap)
            self._templates[key] = tmpl
        return tmpl

    def report(self) -> dict[str, Any]:
        """What the bench JSON records about this drafter's sizing and decisions."""
        rates = self.ranks.rates
        out: dict[str, Any] = {
            "tree_drafter": self.config.tree_type if self.drafter is not None else None,
            "dense_budget_rule": "configured" if self.config.dense_budget else
            "K_max = argmax_K (1 + sum_{r<K-1} a_r) / (c(K, L) + d); a_r = Beta-posterior acceptance of the "
            "r-th best drafter node, d = measured drafting time per call",
            "stage_budgets": {s: self.config.stage_budget(s, self.dense_budget()) for s in self.config.stages},
            "rank_acceptance": [round(a, 4) for a in rates[:64]],
            "rank_verified": [round(n, 2) for n in self.ranks.verified[:64]],
            "drafting_s_by_stage": dict(self.timing.seconds),
            "drafting_s_expected": self.timing.expected(),
            "gate": {"rule": "call iff G * (c(|R|,L) + d_R) / (1 + E_R) > d + c(|T_g|,L) - c(|R|,L)",
                     "bucket_edges": list(DrafterGate.EDGES), "gain": [self.gate.gain(b) for b in range(len(self.gate.count))],
                     "observations": list(self.gate.count)} if self.config.gated else None,
            "counters": dict(self.counters),
            "cost_cut_rule": ("keep the best-first prefix maximising (1 + sum p_i) / (c(n + 1, L) + d)"
                              if self.config.cost_cut and self.cost_model is not None else None),
        }
        if self.cost_model is not None:
            out["verify_curve_s"] = dict(zip(self.cost_model.sizes, self.cost_model.seconds))
            if self.cost_model.contexts:
                out["verify_grid_s"] = {c: dict(zip(self.cost_model.sizes, row))
                                        for c, row in zip(self.cost_model.contexts, self.cost_model.grid)}
            if isinstance(self.cost_model, OnlineCostModel):  # verify_curve_s above is the corrected curve
                base = self.cost_model.base
                out["verify_curve_measured_s"] = dict(zip(base.sizes, base.seconds))
                out["verify_steps_observed"] = self.cost_model.observed
            if self.config.dense_budget == GraftConfig.AUTO:
                k = self.dense_budget()
                d = self.timing.expected()
                out["k_max_now"] = k
                out["expected_tokens_per_s_at_k_max"] = (1 + sum(rates[: k - 1])) / (self.cost_model.cost(k) + d)
        return out

    def _gate_stats(self, d: GateDecision) -> dict[str, float]:
        return {"gate_verdict": float(d.verdict), "gate_call": float(d.call), "gate_expected_gain": d.expected_gain,
                "gate_per_token_s": d.per_token_s, "gate_value_s": d.value_s, "gate_cost_s": d.cost_s}

    def _proposal(self, tree: DraftTree, stage: int, forwards: int, stats: dict[str, float]) -> Proposal:
        stats.setdefault("grafted", 0.0)
        stats.setdefault("assembly_s", 0.0)
        stats.update({"stage": float(stage), "drafter_nodes": float(tree.count_source(NodeSource.DRAFTER)),
                      "retrieval_nodes": float(tree.count_source(NodeSource.RETRIEVAL))})
        stats.update({f"stage_{s}": float(s == stage) for s in self.config.stages})
        return Proposal(tree=tree, drafter_forwards=forwards, stats=stats)


def build_graft_drafter(
    config: GraftConfig, target: Any, cost_model: VerifyCost | None = None
) -> GraftDrafter:
    """A :class:`GraftDrafter` for an in-process target: the tree drafter of ``config.tree_type``
    (built from ``config.tree``; none when the only stage is 0) + the retrieval source.
    ``cost_model`` (c(T, L)) is used when ``config.verify_curve_size()`` is non-zero; if none is
    given then, it is measured on ``target`` (:func:`~speculation.policy.cost.measure_cost_model`)."""
    size = config.verify_curve_size()
    if size and cost_model is None:
        cost_model = measure_cost_model(target, max_size=size)
    drafter = None
    if config.max_stage > 0:
        drafter = TREE_BUILDERS[config.tree_type](config.tree, target, cost_model)
    retrieval = RetrievalDrafter(config.retrieval(), target.vocab_size, cost_model=cost_model)
    return GraftDrafter(config, drafter, retrieval, cost_model)
