"""Goodput rule: split one batched step's tree tokens across sequences to maximise tokens/s.

A step verifies B live sequences; sequence b verifies its root plus ``n_b`` draft nodes (its
best ``n_b`` by score, ancestor-closed: :meth:`~speculation.spec.tree.DraftTree.pruned_to`). With
``q_b[r]`` the estimated probability that the r-th best draft node of sequence b is accepted
(its acceptance-by-rank estimate, non-increasing in r), the expected tokens of the step are
``sum_b (1 + sum_{r < n_b} q_b[r])`` (every sequence gains its bonus token).

What the step costs is decided by the batched forward's layout
(:class:`~speculation.config.BatchLayout`, the target's ``batch_layout``).

**FLAT** (the lean forward): the trees' tokens are packed into one pass and every row attends
over its own keys, so the step costs what its real tokens cost: ``c(B, 1 + D/B, L)`` with
``D = sum_b n_b`` the step's draft nodes and L the mean committed length (the grid is measured
with every row the same size; a flat pass of B rows and N tokens costs about what B rows of
N/B tokens do). For a given D the best split takes the D largest ``q_b[r]`` over all
sequences (each ``q_b`` is non-increasing, so global descending order respects every
sequence's rank order), and the rule scans D = 0 .. the step's room::

    maximise   G(D) = (B + top_D(q)) / (k * c(B, 1 + D / B, mean_b len_b) + d)

**PADDED** (transformers' forward): :meth:`~speculation.model.target.TargetModel.verify_batch` pads
every row to the largest tree, ``t = 1 + max_b n_b`` query positions, over the longest row's
KV, ``L = max_b len_b`` committed tokens. So the step costs ``c(B, t, L)`` seconds (measured:
:class:`BatchCostModel`), and a split that gives one sequence 10 drafts and the others none
pays for ``B * 11`` query rows. The rule picks::

    maximise   G(n_1..n_B) = (B + sum_b sum_{r < n_b} q_b[r]) / (k * c(B, 1 + max_b n_b, L) + d)
    subject to n_b <= cap_b (the drafted tree, slot room, max_tree_tokens - 1),
               B + sum_b n_b <= step_token_budget

where ``k`` is the online correction (:class:`CostCorrection`: the EMA of measured over predicted
forward seconds), the ``q`` are scaled by the gain correction (:class:`GainCorrection`: realised
over expected extra tokens of drafted steps), and ``d`` the step's drafting seconds plus, for a split that verifies any draft,
the host seconds such a step spends beyond a vanilla one outside the forward (acceptance over
the trees, KV row moves, the drafters' observation: :class:`HostOverhead`, measured live; on
the fp32 host about 3 ms at B = 8, 5% of the step, enough to turn a marginal draft node). For a fixed row size t every sequence may
take up to ``t - 1`` drafts at no extra forward cost (the padding is paid either way), and within
a token budget the slots go to the largest ``q_b[r]`` with ``r < t - 1`` (each q_b is
non-increasing, so global descending order respects every sequence's rank order). The rule scans
t = 1 .. 1 + max cap and keeps the best G. ``n_b = 0`` (a tree of one token: plain decoding for
that sequence) happens whenever its q's do not pay, and t = 1 (batched vanilla) is always a
candidate, so speculation is never chosen at a predicted loss.

Three guards around the rule, all in :class:`~speculation.policy.draft_budget.DraftBudgetPolicy`
(which :class:`~speculation.engine.batch.BatchEngine` asks every step):

- **Draft at all?** Before drafting, the engine runs the rule on the trees it expects, with
  drafting *not yet spent*: a split that verifies drafts pays ``d`` (the EMA of past drafting
  seconds), the vanilla split ``t = 1`` does not,

      draft  iff  max_{n} (B + sum_b sum_{r < n_b} q_b[r]) / (k c(B, 1 + max n_b, L) + d)  >  B / (k c(B, 1, L))

  (after drafting, ``d`` is sunk and every candidate pays it, so it no longer favours t = 1).
  If the expected trees cannot pay, nor full trees, drafters that can sit out a step
  (:class:`~speculation.drafters.base.SkippableDrafter`) are not called: the step is batched
  vanilla at batched vanilla's price.
- **Did drafting pay?** (:class:`RealisedPayoff`, with ``batch.payoff_veto``, off by default) The
  engine compares the realised rate of its drafted steps with that of its plain ones. While
  drafted steps lose, a step the rule would draft sits out instead, except every
  ``retest_every``-th one, which drafts as the rule says and re-measures; a re-test that leaves
  drafting losing doubles ``retest_every``.
- **Ranks open by doubling** (:func:`exploration_cap`): a sequence verifies at most
  ``2 E + 1`` draft ranks, E the leading ranks verified so far, and new sequences start from
  the engine's pooled estimate, so a fresh engine does not verify whole trees on no evidence.

Acceptance by rank is the one estimator Graft uses too (:class:`~speculation.policy.cost.RankAcceptance`:
a discounted Beta posterior per best-first rank; ranks the tree did not contain are not updated).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from speculation.config import BatchLayout
from speculation.policy.cost import interp
from speculation.spec.tree import DraftTree, NodeSource

DEFAULT_BATCH_CONTEXTS = (64, 512)
"""Committed-context lengths c(B, t, L) is measured at (those that fit the slots)."""
DEFAULT_ROW_TOKENS = (1, 2, 4, 16)
"""Query positions per row (tree size of the largest tree) c(B, t, L) is measured at. The curve
is far from linear at the small end: on the fp32 CPU host c(16, 2, 64) measured 1.7x c(16, 1, 64)
while c(16, 4, 64) was 1.9x, so t = 2 is measured rather than interpolated between 1 and 4
(``benchmarks/results/goodput_calibration_n16_fp32.json``)."""


@dataclass(frozen=True)
class BatchCostModel:
    """c(B, t, L): seconds of one batched verify of B rows padded to t query positions each over a
    longest committed context of L tokens.

    ``grid[L][B][t]`` is measured at a few contexts, batch sizes and row sizes. The interpolation
    is linear in t per measured (L, B) (last slope beyond the largest t), linear in B between
    measured batch sizes (flat beyond the ends), and linear in L between measured contexts (last
    non-negative slope beyond the longest: attention grows with the context).

    ``layout``: how the measured target lays a batch out, which decides how :func:`split_budget`
    prices a split (module docstring): PADDED by the largest tree, FLAT by the mean tree.
    """

    grid: Mapping[int, Mapping[int, Mapping[int, float]]]
    layout: BatchLayout = BatchLayout.PADDED

    def __post_init__(self) -> None:
        if not self.grid or any(not by_b or any(not row for row in by_b.values()) for by_b in self.grid.values()):
            raise ValueError("BatchCostModel needs at least one context, batch size and row size")
        if any(s <= 0 for by_b in self.grid.values() for row in by_b.values() for s in row.values()):
            raise ValueError("BatchCostModel seconds must be positive")
        if any(k < 1 for k in itertools.chain(self.grid, *(by_b for by_b in self.grid.values()),
                                              *(row for by_b in self.grid.values() for row in by_b.values()))):
            raise ValueError("BatchCostModel contexts, batch sizes and row sizes must be >= 1")

    def cost(self, batch: int, row_tokens: float, context: float) -> float:
        """c(batch, row_tokens, context) in seconds (class docstring)."""
        return float(self.costs(batch, [row_tokens], context)[0])

    def costs(self, batch: int, row_tokens: Sequence[float] | np.ndarray, context: float) -> np.ndarray:
        """c(batch, t, context) for every t of ``row_tokens`` at once (``[n]`` seconds): the
        split scans hundreds of row sizes per step at one (batch, context), and interpolating
        each one by one cost milliseconds of host time per step at B = 8."""
        t = np.asarray(row_tokens, dtype=np.float64)
        contexts, tables = self._tables
        per_l = [interp(bs, [_row_curve(ts, secs, t) for ts, secs in curves], batch, extrapolate=False)
                 for bs, curves in tables]
        return interp(contexts, per_l, context, extrapolate=True)

    @functools.cached_property
    def _tables(self) -> tuple[list[int], list[tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]]]:
        """The contexts (ascending) and per context the batch sizes (ascending) with each one's
        (row sizes, seconds): the grid sorted once (it never changes)."""
        contexts = sorted(self.grid)
        tables = []
        for L in contexts:
            by_b = self.grid[L]
            bs = sorted(by_b)
            curves = [(np.array(sorted(by_b[b]), dtype=np.float64),
                       np.array([by_b[b][t] for t in sorted(by_b[b])], dtype=np.float64)) for b in bs]
            tables.append((bs, curves))
        return contexts, tables


def _row_curve(ts: np.ndarray, seconds: np.ndarray, t: np.ndarray) -> np.ndarray:
    """:func:`~speculation.policy.cost.interp` in t (flat below the first row size, the last non-negative
    slope beyond the largest) at every element of ``t``."""
    out = np.interp(t, ts, seconds)
    if len(ts) > 1:
        slope = max((seconds[-1] - seconds[-2]) / (ts[-1] - ts[-2]), 0.0)
        out = out + slope * np.maximum(t - ts[-1], 0.0)
    return out


class CostCorrection:
    """``k``: EMA of measured / predicted forward seconds, clipped to [1/4, 4].

    The grid is measured once, on an idle model, with random tokens; live steps add host work
    (masks, scatter, compaction) and share the machine (a learner, other processes). ``k``
    rescales every prediction by what the last ~1/(1-decay) steps actually cost, so the rule
    prices speculation at today's prices. Starts at 1 (trust the grid)."""

    LOW, HIGH = 0.25, 4.0

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"CostCorrection decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.factor = 1.0
        self.observed = 0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s <= 0 or measured_s <= 0:
            return
        ratio = min(self.HIGH, max(self.LOW, measured_s / predicted_s))
        self.factor = ratio if self.observed == 0 else self.decay * self.factor + (1 - self.decay) * ratio
        self.observed += 1


class GainCorrection:
    """``g``: realised over expected extra tokens of the steps that verified drafts, clipped to
    [:attr:`LOW`, :attr:`HIGH`]; the rule's acceptance estimates are scaled by it
    (``q_b[r] <- min(1, g q_b[r])``). Starts at 1 (trust the estimates).

    Why: the rule drafts exactly when the estimates look good, and estimates that look good are
    the noisy ones that are too high (regression to the mean), so the tokens a drafted step gains
    fall short of what the rule expected (fp32 calibration at B = 8: drafted steps gained about 3
    extra tokens in 16 steps where far more were expected). As :class:`CostCorrection` rescales
    the cost side by what steps really cost, this rescales the gain side by what drafted steps
    really gained. Both sides are EMAs (``decay``), so the ratio follows drift and one unlucky
    step does not swing it::

        E <- decay E + (1 - decay) sum_b sum_{r < n_b} q_b[r]    (raw estimates of the granted nodes)
        R <- decay R + (1 - decay) accepted draft nodes of the step
        g  = clip(R / E, LOW, HIGH)
    """

    LOW, HIGH = 0.05, 2.0

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"GainCorrection decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.expected = 0.0
        self.realised = 0.0
        self.observed = 0

    @property
    def factor(self) -> float:
        if self.observed == 0 or self.expected <= 0.0:
            return 1.0
        return min(self.HIGH, max(self.LOW, self.realised / self.expected))

    def observe(self, expected: float, realised: float) -> None:
        """One drafted step: the raw estimates' expected accepted draft nodes, and those accepted."""
        if expected <= 0.0 or realised < 0.0:
            return
        if self.observed == 0:
            self.expected, self.realised = expected, realised
        else:
            self.expected = self.decay * self.expected + (1 - self.decay) * expected
            self.realised = self.decay * self.realised + (1 - self.decay) * realised
        self.observed += 1

    def scale(self, estimates: Sequence[float]) -> list[float]:
        """``min(1, g q)`` for every q (the order, non-increasing, is kept)."""
        g = self.factor
        return [min(1.0, g * q) for q in estimates]


class HostOverhead:
    """Host seconds of a step outside the target forward and the drafting, as an EMA for steps
    that verified draft nodes and for steps that did not; :attr:`extra_s` is what verifying
    drafts adds (never negative). Until a step without drafts is seen (an engine whose every step
    drafts), a vanilla step's host time counts as 0: the whole host time of a drafted step is
    charged to its drafts, which errs on the side of not speculating (by about 1 ms at B = 8)."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"HostOverhead decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.seconds: dict[bool, float | None] = {True: None, False: None}

    def observe(self, drafted: bool, seconds: float) -> None:
        prev = self.seconds[drafted]
        self.seconds[drafted] = seconds if prev is None else self.decay * prev + (1 - self.decay) * seconds

    @property
    def extra_s(self) -> float:
        d, v = self.seconds[True], self.seconds[False]
        return 0.0 if d is None else max(0.0, d - (v or 0.0))


class RealisedPayoff:
    """Did drafting pay, as served? The realised rate of the steps that verified draft nodes
    against that of the steps that did not, each normalised by the grid's vanilla rate at its own
    batch size and context (so a step of 8 sequences over 900 keys and one of 4 over 100 compare)::

        rho = (tokens the step gained / its wall seconds) / (B / c(B, 1, L))
        rho_k <- decay rho_k + (1 - decay) rho        (k = drafted or plain, EMAs)
        LOSES  iff  both kinds seen >= min_steps times  and  rho_drafted < rho_plain

    Why: the rule decides on predictions (acceptance estimates, a cost grid, host and drafting
    EMAs), each corrected on its own; their errors can still add up to drafted steps that lose
    (bf16, B = 8: drafted 109 steps against 128 at a 65 ms ITL p50 against 54 ms, 0.93x batched
    vanilla). This compares outcomes, the whole step's seconds included, so nothing is left out.
    Only the engine's own steps enter: an engine that drafts every step (no plain step to compare
    with, as at B = 1 when drafting pays) never reads LOSES. Steps that prefill an arriving prompt
    are not observed (their forward is mostly the prompt's)."""

    def __init__(self, decay: float = 0.9, min_steps: int = 4) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"RealisedPayoff decay must be in [0, 1), got {decay}")
        if min_steps < 1:
            raise ValueError(f"RealisedPayoff min_steps must be >= 1, got {min_steps}")
        self.decay, self.min_steps = decay, min_steps
        self.rate: dict[bool, float] = {True: 0.0, False: 0.0}
        self.steps: dict[bool, int] = {True: 0, False: 0}

    def observe(self, drafted: bool, tokens: float, seconds: float, vanilla_s: float, batch: int) -> None:
        """One served step: ``tokens`` gained by all sequences in ``seconds`` of wall time;
        ``vanilla_s`` = c(B, 1, L) for its ``batch`` size B (the grid, uncorrected)."""
        if seconds <= 0 or vanilla_s <= 0 or batch < 1:
            return
        rho = (tokens / seconds) / (batch / vanilla_s)
        n = self.steps[drafted]
        self.rate[drafted] = rho if n == 0 else self.decay * self.rate[drafted] + (1 - self.decay) * rho
        self.steps[drafted] = n + 1

    @property
    def loses(self) -> bool:
        """Drafted steps realised less than plain ones (class docstring)."""
        seen = all(n >= self.min_steps for n in self.steps.values())
        return seen and self.rate[True] < self.rate[False]


def exploration_cap(explored: int) -> int:
    """Most draft ranks a sequence may verify when ``explored`` leading ranks have been verified:
    ``2 * explored + 1`` (ranks open by doubling: 1, 3, 7, 15, ...).

    An unverified rank's posterior mean is the uninformed 1/2 (:class:`~speculation.policy.cost.RankAcceptance`),
    so without the cap a fresh engine's first step would verify every rank of every tree at 1/2, the
    most expensive step it can take, on no evidence. New sequences start from the engine's pooled
    estimate (:class:`~speculation.policy.draft_budget.DraftBudgetPolicy`), so the doubling is paid once per engine."""
    return 2 * max(explored, 0) + 1


@dataclass(frozen=True)
class Split:
    """The rule's choice for one step: draft nodes per sequence and what it expected.

    ``forward_s`` is the corrected forward prediction ``k * c(B, t, L)``; ``predicted_s`` adds
    the drafting seconds. ``row_tokens`` is the largest tree (root included): the padded row size
    of a PADDED step; a FLAT step pays for ``tree_tokens`` instead."""

    drafts: list[int]
    expected_tokens: float
    predicted_s: float
    forward_s: float
    row_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.predicted_s

    @property
    def tree_tokens(self) -> int:
        """Tokens the step verifies: every root plus the granted draft nodes."""
        return len(self.drafts) + sum(self.drafts)


def step_context(layout: BatchLayout, contexts: Sequence[int] | None) -> float:
    """The committed context L a step is priced at: the mean of the sequences' lengths in a FLAT
    step (every row attends over its own keys), the longest in a PADDED one (module docstring);
    0 when the lengths are not given."""
    if not contexts:
        return 0.0
    return statistics.fmean(contexts) if layout is BatchLayout.FLAT else float(max(contexts))


def split_budget(
    estimates: Sequence[Sequence[float]],
    caps: Sequence[int],
    cost: BatchCostModel,
    budget: int | None = None,
    drafting_s: float = 0.0,
    contexts: Sequence[int] | None = None,
    correction: float = 1.0,
    drafting_spent: bool = True,
    verify_overhead_s: float = 0.0,
) -> Split:
    """Draft nodes per sequence maximising G (module docstring). ``estimates[b]``: q_b, non-increasing;
    ``caps[b]``: most draft nodes sequence b can verify; ``budget``: most tree tokens in total;
    ``contexts[b]``: sequence b's committed KV length (0 when None); ``correction``: ``k``;
    ``drafting_spent``: whether ``drafting_s`` is already spent (every candidate pays it) or still
    to be decided (the pre-drafting check: the vanilla split ``t = 1`` would not pay it);
    ``verify_overhead_s``: host seconds a step that verifies drafts spends beyond a vanilla step
    outside the forward (tree acceptance, KV row moves, drafter observation; measured by the
    engine), paid by every candidate with a draft node, spent drafting or not."""
    if verify_overhead_s < 0:
        raise ValueError(f"split_budget verify_overhead_s must be >= 0, got {verify_overhead_s}")
    B = len(estimates)
    if B == 0 or len(caps) != B or (contexts is not None and len(contexts) != B):
        raise ValueError("split_budget needs one estimate, one cap (and one context) per sequence, at least one")
    if correction <= 0:
        raise ValueError(f"split_budget correction must be positive, got {correction}")
    qs = [list(estimates[b])[: max(caps[b], 0)] for b in range(B)]
    ranked = sorted(((q, r, b) for b, qb in enumerate(qs) for r, q in enumerate(qb)), key=lambda x: -x[0])
    room = None if budget is None else max(0, budget - B)
    L = step_context(cost.layout, contexts)
    if cost.layout is BatchLayout.FLAT:
        return _split_flat(ranked, B, room, cost, L, drafting_s, correction, drafting_spent, verify_overhead_s)
    # prefix[b][n] = sum of sequence b's n best q's
    prefix = [list(itertools.accumulate(q, initial=0.0)) for q in qs]
    sizes = 2 + max(len(q) for q in qs)
    row_costs = correction * cost.costs(B, range(sizes), L)  # [sizes]: c(B, t, L) at t = 0 .. sizes - 1
    best: Split | None = None
    for t in range(1, sizes):
        if room is None or sum(min(len(q), t - 1) for q in qs) <= room:
            drafts = [min(len(q), t - 1) for q in qs]
            acc = B + sum(p[n] for p, n in zip(prefix, drafts))
        else:  # the budget binds: the largest q's among ranks < t - 1
            drafts, acc, taken = [0] * B, float(B), 0
            for q, r, b in ranked:
                if taken == room:
                    break
                if r < t - 1:
                    drafts[b] += 1
                    acc += q
                    taken += 1
        rows = 1 + max(drafts)
        fwd = float(row_costs[rows])
        d = (drafting_s if drafting_spent or rows > 1 else 0.0) + (verify_overhead_s if rows > 1 else 0.0)
        cand = Split(drafts, acc, fwd + d, fwd, rows)
        if best is None or cand.tokens_per_s > best.tokens_per_s:
            best = cand
    assert best is not None
    return best


def _split_flat(
    ranked: list[tuple[float, int, int]],
    B: int,
    room: int | None,
    cost: BatchCostModel,
    context: float,
    drafting_s: float,
    correction: float,
    drafting_spent: bool,
    verify_overhead_s: float,
) -> Split:
    """:func:`split_budget` for a FLAT step: the D largest q's (``ranked``: (q, rank, sequence),
    descending) for the D in 0 .. room that maximises G(D) (module docstring); every G(D) at once::

        acc[D] = B + sum_{i < D} ranked[i].q          [top + 1]
        G[D]   = acc[D] / (k c(B, 1 + D / B, L) + d[D])

    the first D of the largest G wins (a larger D only on a strict gain)."""
    top = len(ranked) if room is None else min(room, len(ranked))
    D = np.arange(top + 1)
    acc = float(B) + np.concatenate(([0.0], np.cumsum([q for q, _, _ in ranked[:top]], dtype=np.float64)))
    fwd = correction * cost.costs(B, 1 + D / B, context)
    d = np.where(D > 0, drafting_s + verify_overhead_s, drafting_s if drafting_spent else 0.0)
    best = int(np.argmax(acc / (fwd + d)))
    drafts = [0] * B
    for _, _, b in ranked[:best]:
        drafts[b] += 1
    return Split(drafts, float(acc[best]), float(fwd[best] + d[best]), float(fwd[best]), 1 + max(drafts))


@torch.inference_mode()
def measure_batch_cost(
    target,
    batch_sizes: Sequence[int],
    row_tokens: Sequence[int] = DEFAULT_ROW_TOKENS,
    contexts: Sequence[int] = DEFAULT_BATCH_CONTEXTS,
    repeats: int = 3,
) -> BatchCostModel:
    """Time :meth:`TargetModel.verify_batch` at each context L, batch size B and row size t (every
    row a t-token tree over L committed tokens); median of ``repeats`` (after one warm-up).
    On CUDA every timed call is bracketed by ``torch.cuda.synchronize``. The model records the
    target's ``batch_layout`` (PADDED for a target that does not say)."""
    if not contexts or not batch_sizes or not row_tokens:
        raise ValueError("measure_batch_cost needs at least one context, batch size and row size")
    bmax, lmax, tmax = max(batch_sizes), max(contexts), max(row_tokens)
    pool = target.new_slot_pool(bmax, lmax + tmax + 1)
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    grid: dict[int, dict[int, dict[int, float]]] = {}
    states = []
    try:
        for _ in range(bmax):
            ids = torch.randint(0, target.vocab_size, (lmax,), generator=gen).tolist()
            states.append(target.prefill_slot(pool, ids)[0])
        for L in sorted(contexts):
            grid[L] = {}
            for st in states:
                st.length = L  # the first L rows of the prefilled prompt
            for B in batch_sizes:
                grid[L][B] = {}
                for t in row_tokens:
                    tree = DraftTree(1)
                    tree.add_chain(0, [2 + i % 7 for i in range(t - 1)], [-1.0 - i for i in range(t - 1)],
                                   NodeSource.DRAFTER)
                    times = []
                    for rep in range(repeats + 1):
                        sync()
                        t0 = time.perf_counter()
                        target.verify_batch(states[:B], [tree] * B)
                        sync()
                        if rep:
                            times.append(time.perf_counter() - t0)
                        for st in states[:B]:
                            st.length = L  # drop the provisional tree rows
                    grid[L][B][t] = statistics.median(times)
        return BatchCostModel(grid, layout=getattr(target, "batch_layout", BatchLayout.PADDED))
    finally:
        for st in states:
            target.release_slot(st)
