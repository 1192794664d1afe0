"""Verify-cost curve c(T): seconds of one target tree forward (+ KV commit) over T tokens.

Later issues size trees from it: the expected tokens per second of a tree of size T is
``A(T) / (c(T) + d)`` (A = expected accepted length, d = drafting time), so the best budget is
the T that maximises it. Measured over a committed prefix of ``context`` tokens with a random
tree shape (the cost depends on T, not on the shape), median of ``repeats`` after ``warmup``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from speculation.engine import TargetBackend
from speculation.tree import DraftTree, NodeSource

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def random_tree(size: int, vocab: int, gen: torch.Generator, max_children: int = 4) -> DraftTree:
    """A random tree of exactly ``size`` nodes (root included) with distinct sibling tokens."""
    tree = DraftTree(int(torch.randint(vocab, (1,), generator=gen)))
    while len(tree) < size:
        parent = int(torch.randint(len(tree), (1,), generator=gen))
        if len(tree.children(parent)) >= max_children:
            continue
        tree.add(parent, int(torch.randint(vocab, (1,), generator=gen)), -float(len(tree)), NodeSource.DRAFTER)
    return tree


def measure(
    target: TargetBackend[Any],
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    context: int = 256,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
) -> dict[int, float]:
    """Median seconds of ``verify`` + ``commit`` (root kept) for each tree size in ``sizes``."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(target.vocab_size, (context,), generator=gen).tolist()
    state, _, _ = target.prefill(prompt)
    out = {}
    try:
        for size in sizes:
            tree = random_tree(size, target.vocab_size, gen)
            times = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                target.verify(state, tree)
                target.commit(state, tree, [0])
                dt = time.perf_counter() - t0
                target.truncate(state, context)  # same context length for every repeat
                if i >= warmup:
                    times.append(dt)
            out[size] = statistics.median(times)
    finally:
        target.release(state)
    return out
