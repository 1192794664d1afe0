"""Graft (arXiv 2605.20104): dynamic-depth pruning of a drafter tree, then grafting of retrieved
tokens into the freed slots, verified in one tree pass (ALGORITHMS.md sections 0, 5, 6).

Per decode step, with K_max the dense tree size (root included) and stages s_1 < ... < s_m:

1. **Retrieve.** The retrieval source (suffix index over prompt + history, and the token-adjacency
   table M refreshed from every verification) proposes a best-first tree R whose node scores are
   calibrated log path probabilities, so ``E_R = sum_{i in R} p_i`` is its expected accepted length.
2. **Stage 0.** If 0 is a stage and ``E_R >= retrieval_confidence``, the drafter is not run this
   step (no forward at all): the verified tree is R cut to K_max - 1 nodes.
3. **Prune.** Otherwise the tree drafter (any :class:`~speculation.drafters.base.StagedDrafter`:
   EAGLE-3 adds one level per forward, SpecBlock a block of K levels) grows its tree. At each stage
   depth s < s_m it computes the path mass of its open leaves ``C_s = sum_{b in open} exp(S_b)``
   (EAGLE-3's beam, SpecBlock's pending leaves; S = cumulative draft log-prob) and stops if
   ``C_s < threshold``. The pool drafted so far is reranked to the node budget N_s of the stage
   it stopped at (the smallest stage >= the levels drafted, should the drafter run out of open
   leaves first): the pruned tree T_pi. Stopping early saves drafter forwards and tree slots.
4. **Graft.** ``F = K_max - |T_pi|`` slots are free; up to ``min(F, graft_budget)`` nodes of R
   are attached best-first by retrieval score, starting at the root: an R node whose token equals
   an existing child is merged into it (the walk descends through drafter nodes that agree with
   the retrieved continuation), any other is hung under the node whose path matches its retrieved
   context. Source tags are kept (drafter / retrieval), so |T_g| <= K_max always.
5. **Verify** T_g in one target pass (greedy or lossless sampling, unchanged), then both sources
   observe the result: the drafter appends the accepted aux features, the retrieval source
   updates its index and recycles the target's top-k at every verified node into M.

Dense-budget sizing (``dense_budget: 0``): the drafter's acceptance by score rank ``a_r`` (an
exponential moving average over verified steps) and the measured verify curve c(T) give the
expected tokens per second of a dense tree of size T, ``(1 + sum_{r < T-1} a_r) / c(T)``; K_max is
the T that maximises it (the paper's B.3 condition as a rule), recomputed every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from speculation.config import ConfigError, GraftConfig
from speculation.cost import VerifyCostModel
from speculation.drafters.base import DraftContext, Proposal, StagedDrafter, StepOutcome
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.drafters.specblock import build_specblock_drafter
from speculation.tree import ROOT, DraftTree, NodeSource

TREE_BUILDERS: dict[str, Callable[[Any, Any, VerifyCostModel | None], StagedDrafter]] = {
    "eagle3": build_eagle3_drafter,
    "specblock": build_specblock_drafter,
}
"""Builder of each ``graft.tree_drafter.type`` (the same keys as ``config.TREE_DRAFTER_CONFIGS``)."""


@dataclass(frozen=True)
class StageTemplate:
    """What is fixed per (stage, K_max) and precomputed once: the drafter node budget N_s and the
    graft capacity ``min(graft_budget, K_max - 1 - N_s)``."""

    stage: int
    k_max: int
    drafter_nodes: int
    graft_capacity: int


class RankAcceptance:
    """``a_r``: EMA of P(the drafter node of score rank r is on the accepted path).

    Only ranks that were verified are updated. Prior ``a_r = 0.6 / (1 + r)``.
    """

    def __init__(self, size: int, decay: float = 0.98) -> None:
        self.rates = [0.6 / (1.0 + r) for r in range(size)]
        self.decay = decay

    def update(self, ranked: list[tuple[int, bool]]) -> None:
        """``ranked``: (rank, accepted?) of every verified drafter node."""
        for r, ok in ranked:
            if r < len(self.rates):
                self.rates[r] = self.decay * self.rates[r] + (1.0 - self.decay) * float(ok)

    def best_size(self, cost_model: VerifyCostModel, cap: int) -> int:
        """argmax_T (1 + sum_{r < T-1} a_r) / c(T) over T in [2, cap]."""
        return max(2, 1 + cost_model.best_prefix(self.rates[: cap - 1]))


def graft(pruned: DraftTree, retrieved: DraftTree, room: int) -> int:
    """Graft ``retrieved`` (a tree rooted at the same root token) into ``pruned``, in place.

    Retrieved nodes are visited in their own order (best-first by retrieval score, parents
    first). A node whose parent was placed and whose token equals an existing child of that
    parent is merged into it (it keeps its source tag); otherwise it is added under that parent
    as a new ``RETRIEVAL`` node, while fewer than ``room`` new nodes exist. So every grafted node
    hangs under the node whose root path equals its retrieved context, siblings stay unique, and
    ``len(pruned)`` grows by at most ``room``. Returns the number of nodes grafted.
    """
    if room <= 0 or len(retrieved) <= 1:
        return 0
    if retrieved.root_token != pruned.root_token:
        raise ValueError(f"retrieved tree is rooted at token {retrieved.root_token}, the draft at {pruned.root_token}")
    before = len(pruned)
    pruned.attach(ROOT, retrieved, max_new_nodes=room)
    return len(pruned) - before


class GraftDrafter:
    """Prune-then-graft drafter composing a tree drafter with the retrieval drafter.

    Args:
        config: the Graft knobs.
        drafter: any :class:`~speculation.drafters.base.StagedDrafter` (EAGLE-3, SpecBlock); None
            when the only stage is 0 (retrieval only).
        retrieval: the retrieval source (its own cost cut disabled; the hybrid tree is sized here).
        cost_model: the target's measured verify curve c(T); required when ``dense_budget`` is 0
            (K_max is then chosen from it every step).
    """

    name = "graft"
    needs_aux = True

    def __init__(self, config: GraftConfig, drafter: StagedDrafter | None, retrieval: RetrievalDrafter,
                 cost_model: VerifyCostModel | None = None) -> None:
        if drafter is None and config.max_stage > 0:
            raise ValueError(f"graft.stages {list(config.stages)} need a tree drafter (only [0] runs without one)")
        if drafter is not None and not isinstance(drafter, StagedDrafter):
            raise TypeError(f"graft needs a drafter that can stop early (StagedDrafter.draft); {drafter.name!r} cannot")
        if config.verify_curve_size() and cost_model is None:
            raise ConfigError("graft.dense_budget = 0 (auto) needs the measured verify curve c(T): build the drafter "
                              "with speculation.drafters.build_drafter (it measures c(T)), or set graft.dense_budget")
        self.config = config
        self.drafter = drafter
        self.retrieval = retrieval
        self.target_topk = retrieval.target_topk
        self.cost_model = cost_model if config.verify_curve_size() else None
        """The measured c(T) K_max is chosen from (``dense_budget`` 0), else None."""
        self.ranks = RankAcceptance(GraftConfig.AUTO_MAX)
        self._templates: dict[tuple[int, int], StageTemplate] = {}
        self._ranked_nodes: list[tuple[int, int]] = []  # (tree node, score rank) of drafter nodes
        self._checks = {s for s in config.stages if 0 < s < config.max_stage}

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        self.retrieval.begin(ctx, prompt_aux)
        if self.drafter is not None:
            self.drafter.begin(ctx, prompt_aux)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        accepted = set(outcome.accepted)
        self.ranks.update([(r, node in accepted) for node, r in self._ranked_nodes])
        self.retrieval.observe(ctx, outcome)
        if self.drafter is not None:
            self.drafter.observe(ctx, outcome)

    def propose(self, ctx: DraftContext) -> Proposal:
        cfg = self.config
        k_max = self.dense_budget()
        retrieved = self.retrieval.propose(ctx).tree  # best-first, scores = log calibrated p
        expected = sum(math.exp(s) for s in retrieved.scores[1:])
        self._ranked_nodes = []
        if self.drafter is None or (cfg.stages[0] == 0 and expected >= cfg.retrieval_confidence):
            t0 = time.perf_counter()
            tree = retrieved if len(retrieved) <= k_max else retrieved.subtree(range(k_max))
            return self._proposal(tree, 0, 0, k_max, 0, time.perf_counter() - t0, expected, None)

        confidence: list[float] = []

        def stop(levels: int, beam_scores: torch.Tensor) -> bool:
            if levels >= cfg.max_stage:
                return True
            if levels not in self._checks:
                return False
            mass = float(torch.exp(beam_scores.float()).sum())
            confidence.append(mass)
            return mass < cfg.threshold

        tree, forwards, levels = self.drafter.draft(
            ctx, lambda lv: self.template(self.stage_of(lv), k_max).drafter_nodes, stop
        )
        t0 = time.perf_counter()
        stage = self.stage_of(levels)
        tmpl = self.template(stage, k_max)
        order = sorted(range(1, len(tree)), key=lambda i: -tree.scores[i])
        self._ranked_nodes = [(node, r) for r, node in enumerate(order)]
        grafted = graft(tree, retrieved, min(tmpl.graft_capacity, k_max - len(tree)))
        assembly = time.perf_counter() - t0
        return self._proposal(tree, stage, forwards, k_max, grafted, assembly, expected,
                              confidence[-1] if confidence else None)

    # ------------------------------------------------------------------ sizing
    def stage_of(self, levels: int) -> int:
        """The stage drafting stopped at after ``levels`` levels: the smallest stage >= ``levels``
        (a drafter whose open leaves ran out stops between stages)."""
        return next(s for s in self.config.stages if s >= levels)

    def dense_budget(self) -> int:
        """K_max for this step: the configured one, or the measured optimum (``dense_budget: 0``)."""
        if self.cost_model is None:  # a configured K_max (the constructor checked that auto has c(T))
            return self.config.dense_budget
        return self.ranks.best_size(self.cost_model, GraftConfig.AUTO_MAX)

    def template(self, stage: int, k_max: int) -> StageTemplate:
        """The precomputed template of ``stage`` for trees of ``k_max`` tokens (cached)."""
        key = (stage, k_max)
        tmpl = self._templates.get(key)
        if tmpl is None:
            n = self.config.stage_budget(stage, k_max)
            cap = min(self.config.graft_budget, k_max - 1 - n)
            tmpl = StageTemplate(stage, k_max, n, cap)
            self._templates[key] = tmpl
        return tmpl

    def report(self) -> dict[str, Any]:
        """What the bench JSON records about this drafter's sizing."""
        out: dict[str, Any] = {
            "tree_drafter": self.config.tree_type if self.drafter is not None else None,
            "dense_budget_rule": "configured" if self.config.dense_budget else
            "K_max = argmax_T (1 + sum_{r<T-1} a_r) / c(T); a_r = measured acceptance of the r-th best drafter node",
            "stage_budgets": {s: self.config.stage_budget(s, self.dense_budget()) for s in self.config.stages},
            "rank_acceptance": [round(a, 4) for a in self.ranks.rates[:64]],
        }
        if self.cost_model is not None:
            out["verify_curve_s"] = dict(zip(self.cost_model.sizes, self.cost_model.seconds))
            k = self.ranks.best_size(self.cost_model, GraftConfig.AUTO_MAX)
            out["k_max_now"] = k
            out["expected_tokens_per_s_at_k_max"] = (1 + sum(self.ranks.rates[: k - 1])) / self.cost_model.cost(k)
        return out

    def _proposal(self, tree: DraftTree, stage: int, forwards: int, k_max: int, grafted: int, assembly_s: float,
                  retrieval_expected: float, confidence: float | None) -> Proposal:
        stats = {"stage": float(stage), "k_max": float(k_max), "grafted": float(grafted),
                 "assembly_s": assembly_s, "retrieval_expected": retrieval_expected,
                 "drafter_nodes": float(tree.count_source(NodeSource.DRAFTER)),
                 "retrieval_nodes": float(tree.count_source(NodeSource.RETRIEVAL))}
        stats.update({f"stage_{s}": float(s == stage) for s in self.config.stages})
        if confidence is not None:
            stats["beam_mass"] = confidence
        return Proposal(tree=tree, drafter_forwards=forwards, stats=stats)


def build_graft_drafter(
    config: GraftConfig, target: Any, cost_model: VerifyCostModel | None = None
) -> GraftDrafter:
    """A :class:`GraftDrafter` for an in-process target: the tree drafter of ``config.tree_type``
    (built from ``config.tree``; none when the only stage is 0) + the retrieval source.
    ``cost_model`` (c(T)) is required when ``dense_budget`` is 0 and ignored otherwise."""
    drafter = None
    if config.max_stage > 0:
        drafter = TREE_BUILDERS[config.tree_type](config.tree, target, cost_model)
    retrieval = RetrievalDrafter(config.retrieval(), target.vocab_size, cost_model=cost_model)
    return GraftDrafter(config, drafter, retrieval, cost_model)
