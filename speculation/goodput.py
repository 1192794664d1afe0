"""Goodput rule: split one batched step's tree tokens across sequences to maximise tokens/s.

A step verifies B live sequences; sequence b verifies its root plus ``n_b`` draft nodes (its
best ``n_b`` by score, ancestor-closed: :meth:`~speculation.tree.DraftTree.pruned_to`). With
``q_b[r]`` the estimated probability that the r-th best draft node of sequence b is accepted
(its acceptance-by-rank estimate, non-increasing in r), the expected tokens of the step are
``sum_b (1 + sum_{r < n_b} q_b[r])`` (every sequence gains its bonus token), and the step costs
``c(B, N)`` seconds with ``N = B + sum_b n_b`` tree tokens (measured: :class:`BatchCostModel`).
The rule picks::

    maximise   G(n_1..n_B) = (B + sum_b sum_{r < n_b} q_b[r]) / (c(B, B + sum_b n_b) + d)
    subject to n_b <= cap_b (the drafted tree, slot room, max_tree_tokens - 1),
               B + sum_b n_b <= step_token_budget

For a fixed total ``n = sum n_b`` the numerator is largest when the n draft slots go to the n
largest ``q_b[r]`` over all sequences (each q_b is non-increasing, so taking them in global
descending order respects every sequence's rank order). So the rule sorts all candidate ranks by
q, and scans the totals n = 0..budget, keeping the n with the highest G. ``n_b = 0`` (a tree of
one token: plain decoding for that sequence) happens whenever its q's do not pay for their cost,
and n = 0 overall (batched vanilla) is always a candidate, so speculation is never chosen at a
predicted loss. ``d`` is the step's drafting seconds (spent before the split; it shifts nothing
but the comparison with n = 0 is made on the whole step time).

Acceptance by rank is the one estimator Graft uses too (:class:`~speculation.cost.RankAcceptance`:
a discounted Beta posterior per best-first rank; ranks the tree did not contain are not updated).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from speculation.cost import interp
from speculation.tree import DraftTree

@dataclass(frozen=True)
class BatchCostModel:
    """c(B, N): seconds of one batched verify of B sequences with N tree tokens in total.

    ``grid[B][N]`` measured at a few batch sizes and totals; linear in N per measured B (last
    slope beyond the largest N), linear in B between measured batch sizes (flat beyond the ends).
    """

    grid: Mapping[int, Mapping[int, float]]

    def __post_init__(self) -> None:
        if not self.grid or any(not row for row in self.grid.values()):
            raise ValueError("BatchCostModel needs at least one batch size with at least one total")
        if any(s <= 0 for row in self.grid.values() for s in row.values()):
            raise ValueError("BatchCostModel seconds must be positive")

    def cost(self, batch: int, total_tokens: int) -> float:
        bs = sorted(self.grid)
        per_b = []
        for b in bs:
            ns = sorted(self.grid[b])
            per_b.append(interp(ns, [self.grid[b][n] for n in ns], total_tokens, extrapolate=True))
        return interp(bs, per_b, batch, extrapolate=False)


@dataclass(frozen=True)
class Split:
    """The rule's choice for one step: draft nodes per sequence and what it expected."""

    drafts: list[int]
    expected_tokens: float
    predicted_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.predicted_s


def split_budget(
    estimates: Sequence[Sequence[float]],
    caps: Sequence[int],
    cost: BatchCostModel,
    budget: int | None = None,
    drafting_s: float = 0.0,
) -> Split:
    """Draft nodes per sequence maximising G (module docstring). ``estimates[b]``: q_b, non-increasing;
    ``caps[b]``: most draft nodes sequence b can verify; ``budget``: most tree tokens in total."""
    B = len(estimates)
    if B == 0 or len(caps) != B:
        raise ValueError("split_budget needs one estimate and one cap per sequence, at least one")
    cands = sorted(((q, b) for b in range(B) for q in list(estimates[b])[: max(caps[b], 0)]), key=lambda x: -x[0])
    limit = len(cands) if budget is None else max(0, min(len(cands), budget - B))
    best_n, best_g, best_a, best_c = 0, 0.0, float(B), 0.0
    acc = float(B)
    for n in range(limit + 1):
        if n > 0:
            acc += cands[n - 1][0]
        c = cost.cost(B, B + n) + drafting_s
        g = acc / c
        if n == 0 or g > best_g:
            best_n, best_g, best_a, best_c = n, g, acc, c
    drafts = [0] * B
    for _, b in cands[:best_n]:
        drafts[b] += 1
    return Split(drafts=drafts, expected_tokens=best_a, predicted_s=best_c)


@torch.inference_mode()
def measure_batch_cost(
    target,
    batch_sizes: Sequence[int],
    totals_per_seq: Sequence[int] = (1, 4, 16),
    context: int = 64,
    repeats: int = 3,
) -> BatchCostModel:
    """Time :meth:`TargetModel.verify_batch` at each batch size B and per-sequence tree size t
    (N = B * t) over ``context`` committed tokens; median of ``repeats`` (after one warm-up).
    On CUDA every timed call is bracketed by ``torch.cuda.synchronize``."""
    from speculation.tree import NodeSource

    bmax = max(batch_sizes)
    pool = target.new_slot_pool(bmax, context + max(totals_per_seq) + 1)
    gen = torch.Generator().manual_seed(0)
    states = []
    try:
        for _ in range(bmax):
            ids = torch.randint(0, target.vocab_size, (context,), generator=gen).tolist()
            states.append(target.prefill_slot(pool, ids)[0])
        sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
        grid: dict[int, dict[int, float]] = {}
        for B in batch_sizes:
            grid[B] = {}
            for t in totals_per_seq:
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
                        st.length = context  # drop the provisional tree rows
                grid[B][B * t] = statistics.median(times)
        return BatchCostModel(grid)
    finally:
        for st in states:
            target.release_slot(st)
