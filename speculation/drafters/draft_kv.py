"""The draft KV cache shared by the feature drafters (EAGLE-3, SpecBlock).

One sequence's keys and values of the draft network: rows ``[0, length)`` hold the committed
pairs (encoded once, kept across steps), rows after them are scratch rows for the tree drafted in
the current step (overwritten next step).
"""

from __future__ import annotations

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
