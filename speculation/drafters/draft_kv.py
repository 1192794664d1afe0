"""The draft KV cache shared by the feature drafters (EAGLE-3, SpecBlock).

One sequence's keys and values of the draft network: rows ``[0, length)`` hold the committed
pairs (encoded once, kept across steps), rows after them are scratch rows for the tree drafted in
the current step (overwritten next step).

Batched drafting (many sequences, one forward) reads the caches through :func:`batch_view`: a
``[B, nkv, N + extra, hd]`` buffer with row b's committed rows at ``[0, length_b)``, zero padding up
to ``N = max_b length_b`` (masked out by the caller) and ``extra`` scratch rows at ``[N, N + extra)``
shared by every row's tree. A batch of one is the cache's own storage (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DraftKVCache:
    """Growable K/V rows of one sequence: ``[0, length)`` committed pairs, then scratch tree rows.

    Buffers: ``k``, ``v`` ``[1, nkv, capacity, hd]``.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256) -> None:
        self.k = torch.empty(1, num_kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def ensure(self, rows: int) -> None:
        """Grow (doubling) so ``rows`` rows fit; committed rows are kept."""
        cap = self.k.shape[2]
        if rows <= cap:
            return
        while cap < rows:
            cap *= 2
        k = self.k.new_empty(self.k.shape[0], self.k.shape[1], cap, self.k.shape[3])
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``start .. start + T`` := ``k``, ``v`` ``[1, nkv, T, hd]``."""
        t = k.shape[2]
        self.k[:, :, start : start + t] = k
        self.v[:, :, start : start + t] = v

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :end], self.v[:, :, :end]


def batch_view(caches: Sequence[DraftKVCache], lengths: Sequence[int], extra: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Keys and values of ``B`` caches as one padded batch (module docstring).

    Args:
        caches: one cache per sequence (same heads, head dim and dtype).
        lengths: how many committed rows to take from each cache.
        extra: scratch rows after the padded committed block.
    Returns:
        k, v ``[B, nkv, N + extra, hd]`` and ``N = max(lengths)``. For ``B == 1`` these are views of
        the cache (grown to fit), so scratch writes land in its own scratch rows; otherwise a
        zero-initialised copy (zeros, not garbage: a masked key must not turn into NaN).
    """
    n = max(lengths)
    if len(caches) == 1:
        c = caches[0]
        c.ensure(n + extra)
        return c.k[:, :, : n + extra], c.v[:, :, : n + extra], n
    ref = caches[0].k
    k = ref.new_zeros(len(caches), ref.shape[1], n + extra, ref.shape[3])
    v = torch.zeros_like(k)
    for b, (c, m) in enumerate(zip(caches, lengths)):
        k[b, :, :m] = c.k[0, :, :m]
        v[b, :, :m] = c.v[0, :, :m]
    return k, v, n


def length_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[B, width]`` bool: column j < lengths[b] (the committed rows of a :func:`batch_view`)."""
    return torch.arange(width)[None, :] < torch.tensor(list(lengths))[:, None]
