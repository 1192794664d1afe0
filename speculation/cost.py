"""Cost-model tree sizing from the measured verify curve c(T).

With per-node acceptance estimates p_i (the probability that node i ends on the accepted path),
a tree of nodes 1..n has expected tokens per step ``A(n) = 1 + sum_{i<=n} p_i`` (bonus
included) and costs ``c(n + 1) + d`` seconds (verify over n drafts plus the root, plus drafting
time d). The best tree is the prefix, in best-first order, that maximises::

    rate(n) = A(n) / (c(n + 1) + d)

Best-first order visits parents before children, so every prefix is a valid tree. This is the
Graft paper's B.3 condition turned into a rule: a node is worth verifying when what it adds to
the expected accepted length outweighs what it adds to the verify cost. ``n = 0`` (verify the
root alone: plain decoding) is always a candidate, so speculation never runs at a predicted loss.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VerifyCostModel:
    """Piecewise-linear c(T) through measured points (seconds), flat-extrapolated at the ends.

    Attributes:
        sizes: increasing tree sizes T (tokens verified, root included).
        seconds: measured median seconds of one verify + commit at each size.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("VerifyCostModel needs matching, non-empty sizes and seconds")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be strictly increasing and >= 1, got {self.sizes}")
        if any(s <= 0 for s in self.seconds):
            raise ValueError("seconds must be positive")

    @classmethod
    def from_curve(cls, curve: Mapping[int | str, float]) -> "VerifyCostModel":
        items = sorted((int(k), float(v)) for k, v in curve.items())
        return cls(tuple(k for k, _ in items), tuple(v for _, v in items))

    def cost(self, size: int) -> float:
        """c(size) by linear interpolation; beyond the last point, linear in the last slope."""
        xs, ys = self.sizes, self.seconds
        if size <= xs[0]:
            return ys[0]
        j = bisect.bisect_left(xs, size)
        if j == len(xs):
            if len(xs) == 1:
                return ys[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (size - xs[-1])
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def best_prefix(self, path_probs: Sequence[float], drafting_s: float = 0.0) -> int:
        """The n maximising ``(1 + sum(path_probs[:n])) / (c(n + 1) + drafting_s)``."""
        best_n, best_rate = 0, 1.0 / (self.cost(1) + drafting_s)
        acc = 1.0
        for n, p in enumerate(path_probs, start=1):
            acc += p
            rate = acc / (self.cost(n + 1) + drafting_s)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n


_MEASURED: weakref.WeakKeyDictionary[Any, dict[int, float]] = weakref.WeakKeyDictionary()
"""Per target: c(T) seconds measured so far, by tree size (dropped with the target)."""


def measure_cost_model(target: Any, max_size: int, repeats: int = 5) -> VerifyCostModel:
    """Measure c(T) on ``target`` (any target backend) at powers of two up to ``max_size``.

    Sizes already measured on this target are reused, so several drafters built against one
    target pay for the measurement once.
    """
    from speculation.bench.verify_curve import measure

    sizes = [1]
    while sizes[-1] < max_size:
        sizes.append(min(sizes[-1] * 2, max_size))
    cached = _MEASURED.setdefault(target, {})
    todo = tuple(s for s in sizes if s not in cached)
    if todo:
        cached.update(measure(target, sizes=todo, repeats=repeats))
    return VerifyCostModel.from_curve({s: cached[s] for s in sizes})
