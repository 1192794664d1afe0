"""Cost-model tree sizing from the measured verify curve c(T, L).

With per-node acceptance estimates p_i (the probability that node i ends on the accepted path),
a tree of nodes 1..n has expected tokens per step ``A(n) = 1 + sum_{i<=n} p_i`` (bonus
included) and costs ``c(n + 1, L) + d`` seconds (verify over n drafts plus the root at a
committed context of L tokens, plus drafting time d). The best tree is the prefix, in best-first
order, that maximises::

    rate(n) = A(n) / (c(n + 1, L) + d)

Best-first order visits parents before children, so every prefix is a valid tree. This is the
Graft paper's B.3 condition turned into a rule: a node is worth verifying when what it adds to
the expected accepted length outweighs what it adds to the verify cost. ``n = 0`` (verify the
root alone: plain decoding) is always a candidate, so speculation never runs at a predicted loss.

c(T, L) is measured on the target at a few context lengths L (:data:`DEFAULT_CONTEXTS`) and
interpolated bilinearly: linear in T between measured sizes (linear in the last slope beyond the
largest), linear in L between measured contexts (flat below the shortest, linear in the last
non-negative slope beyond the longest: attention's cost per verified token grows linearly in L, so
a curve measured to 1K still prices an 8K context; benchmarks/long_context.py checks this against
c(T, L) measured to 8K). On a CUDA target every
timed call is bracketed by ``torch.cuda.synchronize``, so c(T, L) is device time, not launch time.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from speculation.spec.tree import DraftTree, NodeSource

DEFAULT_CONTEXT = 256
"""The context length of the one-dimensional curve (``sizes``/``seconds``)."""
DEFAULT_CONTEXTS = (64, DEFAULT_CONTEXT, 1024)
"""Context lengths c(T, L) is measured at by :func:`measure_cost_model` (those that fit the target)."""


def interp(xs: Sequence[int], ys: Sequence[Any], x: float, extrapolate: bool) -> Any:
    """Piecewise-linear y(x); below the first point flat, beyond the last linear in the last
    (non-negative) slope when ``extrapolate``, else flat. The ``ys`` may be floats or equal-shaped
    numpy arrays (then every element is interpolated at the same ``x``, the slope clipped per
    element)."""
    if x <= xs[0]:
        return ys[0]
    j = bisect.bisect_left(xs, x)
    if j == len(xs):
        if len(xs) == 1 or not extrapolate:
            return ys[-1]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + np.maximum(slope, 0.0) * (x - xs[-1])
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class VerifyCostModel:
    """Piecewise-linear c(T) through measured points (seconds), optionally per context length.

    Attributes:
        sizes: increasing tree sizes T (tokens verified, root included).
        seconds: measured median seconds of one verify + commit at each size, at the reference
            context (:data:`DEFAULT_CONTEXT` when measured here).
        contexts: increasing committed-context lengths L of the rows of ``grid`` (empty = c does
            not depend on L: ``seconds`` is used at every length).
        grid: ``[len(contexts)][len(sizes)]`` seconds of c(T, L).
        measured: timed on the target by :func:`measure_cost_model`. Only a measured curve is
            corrected online by the drafters that read it (:func:`online`); a curve given by
            hand is a statement of prices and is used as given.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    contexts: tuple[int, ...] = ()
    grid: tuple[tuple[float, ...], ...] = ()
    measured: bool = False

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("VerifyCostModel needs matching, non-empty sizes and seconds")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be strictly increasing and >= 1, got {self.sizes}")
        if any(s <= 0 for s in self.seconds):
            raise ValueError("seconds must be positive")
        if list(self.contexts) != sorted(set(self.contexts)) or any(c < 1 for c in self.contexts):
            raise ValueError(f"contexts must be strictly increasing and >= 1, got {self.contexts}")
        if len(self.grid) != len(self.contexts) or any(len(row) != len(self.sizes) for row in self.grid):
            raise ValueError(f"grid must be [len(contexts)={len(self.contexts)}][len(sizes)={len(self.sizes)}]")
        if any(s <= 0 for row in self.grid for s in row):
            raise ValueError("grid seconds must be positive")

    @classmethod
    def from_curve(cls, curve: Mapping[int | str, float]) -> "VerifyCostModel":
        items = sorted((int(k), float(v)) for k, v in curve.items())
        return cls(tuple(k for k, _ in items), tuple(v for _, v in items))

    @classmethod
    def from_grid(cls, grid: Mapping[int, Mapping[int, float]], reference: int = DEFAULT_CONTEXT) -> "VerifyCostModel":
        """From ``{context: {size: seconds}}`` (every context measured at the same sizes); the 1-D
        curve is the row nearest ``reference``."""
        contexts = tuple(sorted(grid))
        if not contexts:
            raise ValueError("from_grid needs at least one context row")
        sizes = tuple(sorted(grid[contexts[0]]))
        rows = tuple(tuple(float(grid[c][s]) for s in sizes) for c in contexts)
        ref = min(range(len(contexts)), key=lambda i: abs(contexts[i] - reference))
        return cls(sizes, rows[ref], contexts, rows)

    def cost(self, size: int, context: int | None = None) -> float:
        """c(size, context): linear in size (in the last slope beyond the largest), linear in the
        context (in the last slope beyond the longest measured); ``context`` None (or no grid) uses
        the 1-D curve."""
        if context is None or not self.contexts:
            return interp(self.sizes, self.seconds, size, extrapolate=True)
        per_ctx = [interp(self.sizes, row, size, extrapolate=True) for row in self.grid]
        return interp(self.contexts, per_ctx, context, extrapolate=True)

    def best_prefix(self, path_probs: Sequence[float], drafting_s: float = 0.0, context: int | None = None) -> int:
        """The n maximising ``(1 + sum(path_probs[:n])) / (c(n + 1, context) + drafting_s)``."""
        return best_prefix(self, path_probs, drafting_s, context)


@runtime_checkable
class VerifyCost(Protocol):
    """c(T, L) as the drafters read it: a measured curve, or one corrected online."""

    def cost(self, size: int, context: int | None = None) -> float: ...

    def best_prefix(self, path_probs: Sequence[float], drafting_s: float = 0.0,
                    context: int | None = None) -> int: ...


def best_prefix(cost: VerifyCost, path_probs: Sequence[float], drafting_s: float = 0.0,
                context: int | None = None) -> int:
    """The n maximising ``rate(n) = (1 + sum(path_probs[:n])) / (c(n + 1, context) + drafting_s)``
    (module docstring); ``path_probs`` best-first, so every prefix is a valid tree."""
    best_n, best_rate = 0, 1.0 / (cost.cost(1, context) + drafting_s)
    acc = 1.0
    for n, p in enumerate(path_probs, start=1):
        acc += p
        rate = acc / (cost.cost(n + 1, context) + drafting_s)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class OnlineCostModel:
    """c(T, L) = base(T, L) * f(T): the start-up measurement, corrected by the verify steps it prices.

    ``base`` is measured once (:func:`measure_cost_model`), on random tokens, in a few seconds. If
    the host was busy or drifted then, the curve is wrong for the whole run, in scale and in shape:
    a curve read flat makes large trees look cheap (a solo retrieval run measured while another
    process shared the two cores averaged 13 tree tokens against 2.9 and ran below vanilla).
    f corrects it: one factor ``f_j`` per measured size ``s_j``, f piecewise linear between them
    (the last factor beyond the largest). A live step that verified T tokens at context L in
    ``seconds`` gives the ratio ``r = seconds / base(T, L)`` (clipped to [1/4, 4]), and every factor
    moves toward it, by a weight that halves per octave of distance from T::

        w_j = 2 ** -|log2 s_j - log2 T|
        f_j <- f_j + (1 - decay) * w_j * (r - f_j)

    The rule verifies only the few sizes it currently favours; the weights carry what those steps
    show to the sizes around them, so a size it never picks is still repriced by its neighbours
    (and picked once they make it pay). Factors start at 1 (trust the measurement).
    """

    LOW, HIGH = 0.25, 4.0

    def __init__(self, base: VerifyCostModel, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"OnlineCostModel decay must be in [0, 1), got {decay}")
        self.base = base
        self.decay = decay
        self.factors = [1.0] * len(base.sizes)
        self._log_sizes = [math.log2(s) for s in base.sizes]
        self.observed = 0
        """Verify steps observed so far."""

    def factor(self, size: int) -> float:
        """f(size): piecewise linear through the per-size factors (flat beyond the ends)."""
        return interp(self.base.sizes, self.factors, size, extrapolate=False)

    def cost(self, size: int, context: int | None = None) -> float:
        """Corrected c(size, context) = base(size, context) * f(size)."""
        return self.base.cost(size, context) * self.factor(size)

    def best_prefix(self, path_probs: Sequence[float], drafting_s: float = 0.0, context: int | None = None) -> int:
        """:func:`best_prefix` on the corrected curve."""
        return best_prefix(self, path_probs, drafting_s, context)

    def observe(self, size: int, context: int | None, seconds: float) -> None:
        """One live verify of ``size`` tokens (root included) at ``context`` that took ``seconds``."""
        predicted = self.base.cost(size, context)
        if size < 1 or seconds <= 0 or predicted <= 0:
            return
        r = min(self.HIGH, max(self.LOW, seconds / predicted))
        step, at = 1.0 - self.decay, math.log2(size)
        for j, log_s in enumerate(self._log_sizes):
            w = 2.0 ** -abs(log_s - at)
            self.factors[j] += step * w * (r - self.factors[j])
        self.observed += 1

    # The measured model's fields, corrected, so reports read the curve the rule uses.
    @property
    def sizes(self) -> tuple[int, ...]:
        return self.base.sizes

    @property
    def seconds(self) -> tuple[float, ...]:
        return tuple(s * f for s, f in zip(self.base.seconds, self.factors))

    @property
    def contexts(self) -> tuple[int, ...]:
        return self.base.contexts

    @property
    def grid(self) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(s * f for s, f in zip(row, self.factors)) for row in self.base.grid)


def online(cost: VerifyCost | None) -> VerifyCost | None:
    """The curve a drafter should hold: a measured :class:`VerifyCostModel` wrapped in an
    :class:`OnlineCostModel`; anything else (None, a curve given by hand, or one already
    corrected online, so that drafters sharing a curve share its corrections) as it is."""
    if isinstance(cost, VerifyCostModel) and cost.measured:
        return OnlineCostModel(cost)
    return cost


class RankAcceptance:
    """``a_r``: P(the drafter node of score rank r is on the accepted path), a Beta posterior.

    Rank r keeps discounted counts (s_r accepted, n_r verified; both multiplied by ``decay`` before
    each new observation of that rank, so the estimate tracks drift over ~1/(1-decay) steps) and the
    posterior mean under a uniform Beta(1, 1) prior is ``(s_r + 1) / (n_r + 2)``. Only ranks that
    were in the verified tree are observed: a rank the tree did not contain is no evidence either
    way. Scores rank nodes best-first, so acceptance cannot rise with rank; the reported rates are
    the running minimum of the posterior means (an unverified rank is never rated above the ranks
    before it). Ranks at or beyond the most drafter nodes one call ever produced
    (:meth:`observe_capacity`) are 0: such a node does not exist, so it cannot be accepted.
    """

    def __init__(self, size: int, decay: float = 0.995) -> None:
        self.accepted = [0.0] * size
        self.verified = [0.0] * size
        self.decay = decay
        self.capacity = 0
        """Most drafter nodes one call produced so far (0 = none observed yet: every rank may exist)."""
        self._rates: list[float] | None = None
        """:attr:`rates` since the last change of the counts (the batch engine's goodput rule reads
        every live sequence's estimate several times per step; recomputing them was about 1.3 ms of
        host time per step at B = 8)."""

    @property
    def rates(self) -> list[float]:
        return list(self._cached_rates())

    def _cached_rates(self) -> list[float]:
        """The rates list itself (computed once per change of the counts; callers must not mutate it)."""
        if self._rates is None:
            out, cap = [], 1.0
            for r, (s, n) in enumerate(zip(self.accepted, self.verified)):
                cap = 0.0 if self.capacity and r >= self.capacity else min(cap, (s + 1.0) / (n + 2.0))
                out.append(cap)
            self._rates = out
        return self._rates

    def observe_capacity(self, drafter_nodes: int) -> None:
        """Record that one drafter call produced ``drafter_nodes`` nodes."""
        if drafter_nodes > self.capacity:
            self.capacity = drafter_nodes
            self._rates = None

    def update(self, ranked: list[tuple[int, bool]]) -> None:
        """``ranked``: (rank, accepted?) of every drafter node of the verified tree."""
        if ranked:
            self._rates = None
        for r, ok in ranked:
            if r < len(self.verified):
                self.accepted[r] = self.decay * self.accepted[r] + float(ok)
                self.verified[r] = self.decay * self.verified[r] + 1.0

    def best_size(self, cost_model: VerifyCost, cap: int, drafting_s: float = 0.0,
                  context: int | None = None) -> int:
        """``argmax_T (1 + sum_{r < T-1} a_r) / (c(T, context) + drafting_s)`` over T in [2, cap]."""
        return max(2, 1 + cost_model.best_prefix(self.rates[: cap - 1], drafting_s, context))

    def observe(self, tree: DraftTree, accepted: Sequence[int]) -> None:
        """Update from a verified ``tree`` whose draft nodes are ranked best-first by score (all
        non-root nodes; the batch engine's per-sequence estimate) and its ``accepted`` node ids."""
        acc = set(accepted)
        order = sorted(range(1, len(tree)), key=lambda i: -tree.scores[i])
        self.update([(r, node in acc) for r, node in enumerate(order)])

    def estimate(self, n: int) -> list[float]:
        """``a_0 .. a_{n-1}`` (non-increasing), at most :attr:`size` of them."""
        return self._cached_rates()[:n]

    @property
    def explored(self) -> int:
        """How many leading ranks (0, 1, ...) have been verified at least once."""
        n = 0
        while n < len(self.verified) and self.verified[n] > 0.0:
            n += 1
        return n

    def copy(self) -> "RankAcceptance":
        """An independent estimator with the same counts (a new sequence's prior from a pool)."""
        out = RankAcceptance(len(self.verified), self.decay)
        out.accepted, out.verified, out.capacity = list(self.accepted), list(self.verified), self.capacity
        return out


@runtime_checkable
class OnDevice(Protocol):
    """A target whose forwards run on a torch device (the in-process ``TargetModel``)."""

    @property
    def device(self) -> torch.device: ...


def _synchronize(target: Any) -> None:
    """Wait for queued device work, so wall time is device time (CUDA targets only)."""
    if isinstance(target, OnDevice) and target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def random_tree(size: int, vocab: int, gen: torch.Generator, max_children: int = 4) -> DraftTree:
    """A random tree of exactly ``size`` nodes (root included) with distinct sibling tokens."""
    tree = DraftTree(int(torch.randint(vocab, (1,), generator=gen)))
    while len(tree) < size:
        parent = int(torch.randint(len(tree), (1,), generator=gen))
        if len(tree.children(parent)) >= max_children:
            continue
        tree.add(parent, int(torch.randint(vocab, (1,), generator=gen)), -float(len(tree)), NodeSource.DRAFTER)
    return tree


def measure_at_context(
    target: Any, sizes: Sequence[int], context: int, repeats: int = 5, warmup: int = 2, seed: int = 0
) -> dict[int, float]:
    """Median seconds of ``verify`` + ``commit`` (root kept) per tree size, over a committed
    random prefix of ``context`` tokens (restored after each repeat), synchronised on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(target.vocab_size, (context,), generator=gen).tolist()
    state, _, _ = target.prefill(prompt)
    out: dict[int, float] = {}
    try:
        for size in sizes:
            tree = random_tree(size, target.vocab_size, gen)
            times = []
            for i in range(warmup + repeats):
                _synchronize(target)
                t0 = time.perf_counter()
                target.verify(state, tree)
                target.commit(state, tree, [0])
                _synchronize(target)
                dt = time.perf_counter() - t0
                target.truncate(state, context)
                if i >= warmup:
                    times.append(dt)
            out[size] = statistics.median(times)
    finally:
        target.release(state)
    return out


_MEASURED: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], float]] = weakref.WeakKeyDictionary()
"""Per target: c(T, L) seconds measured so far, by (context, tree size) (dropped with the target)."""


def _fits(target: Any, context: int, size: int) -> bool:
    # Imported here: the vLLM proposer imports this module in .venv-vllm, whose transformers
    # cannot import the target (speculation.model.kv_slots).
    from speculation.model.target import ContextLengthError

    try:
        target.check_fits(context, size)
    except ContextLengthError:
        return False
    return True


def measure_cost_model(
    target: Any, max_size: int, repeats: int = 5, contexts: Sequence[int] = DEFAULT_CONTEXTS, fresh: bool = False
) -> VerifyCostModel:
    """Measure c(T, L) on ``target`` (any target backend) at powers of two up to ``max_size`` and
    at each context length of ``contexts`` that fits the target's window (at least the shortest).

    Points already measured on this target are reused, so several drafters built against one
    target pay for the measurement once; ``fresh`` measures every point again (and caches the new
    values).
    """
    sizes = [1]
    while sizes[-1] < max_size:
        sizes.append(min(sizes[-1] * 2, max_size))
    wanted = sorted(set(contexts))
    fitting = [c for c in wanted if _fits(target, c, sizes[-1])] or wanted[:1]
    cached = _MEASURED.setdefault(target, {})
    for ctx in fitting:
        todo = [s for s in sizes if fresh or (ctx, s) not in cached]
        if todo:
            for s, sec in measure_at_context(target, todo, ctx, repeats=repeats).items():
                cached[(ctx, s)] = sec
    model = VerifyCostModel.from_grid({c: {s: cached[(c, s)] for s in sizes} for c in fitting})
    return dataclasses.replace(model, measured=True)
