"""Verify-cost curve c(T): seconds of one target tree forward (+ KV commit) over T tokens.

Later issues size trees from it: the expected tokens per second of a tree of size T is
``A(T) / (c(T) + d)`` (A = expected accepted length, d = drafting time), so the best budget is
the T that maximises it. Measured over a committed prefix of ``context`` tokens with a random
tree shape (the cost depends on T, not on the shape), median of ``repeats`` after ``warmup``.
"""

from __future__ import annotations

from typing import Any

from speculation.policy.cost import measure_at_context, random_tree
from speculation.engine.sequence import TargetBackend

__all__ = ["DEFAULT_SIZES", "measure", "random_tree"]

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def measure(
    target: TargetBackend[Any],
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    context: int = 256,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
) -> dict[int, float]:
    """Median seconds of ``verify`` + ``commit`` (root kept) for each tree size in ``sizes``
    (:func:`speculation.policy.cost.measure_at_context`: synchronised on CUDA targets)."""
    return measure_at_context(target, sizes, context, repeats=repeats, warmup=warmup, seed=seed)
