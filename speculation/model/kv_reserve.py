"""KV rows of one sequence with spare capacity: appends write in place instead of concatenating.

The solo decode loop (:class:`speculation.model.target.TargetModel`) and the Ray shards keep one
transformers ``DynamicCache`` per sequence; :func:`reserve_rows` swaps its plain layers for
:class:`ReservedLayer`. (Continuous batching keeps its rows in :mod:`speculation.model.kv_slots`.) Only
``DynamicLayer`` is needed, so this works with every transformers the project supports,
including the vLLM peer environment's.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

RESERVE_MIN_ROWS = 256
"""Rows a :class:`ReservedLayer` grows by at least (then it doubles)."""


class ReservedLayer(DynamicLayer):
    """A solo sequence's KV layer whose rows live in a buffer with spare capacity.

    ``DynamicLayer.update`` concatenates, copying the whole layer on every append (O(n) per step,
    ``aten::cat``: 1.6 ms of a 29 ms SmolLM2 decode step, ``benchmarks/decode_profile.py``). Here an
    append of T rows writes them in place at rows ``n .. n+T`` of a buffer ``[B, H_kv, cap, D]``;
    when ``n + T > cap`` the buffer is reallocated at ``cap' = max(2 (n + T), n + T + 256)`` and the
    valid rows copied once (amortised O(T) per append). ``keys``/``values`` stay views of the valid
    rows ``[B, H_kv, n, D]``, so ``crop``, :func:`speculation.model.target.compact_kv` (which slice or
    write those views) and ``get_seq_length`` work unchanged. If anything rebinds ``keys`` to a
    tensor that is not a prefix view of the buffer, the next append re-reserves from it.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _is_prefix_view(self) -> bool:
        kb, vb = self._kbuf, self._vbuf
        return (kb is not None and vb is not None and self.keys.data_ptr() == kb.data_ptr()
                and self.values.data_ptr() == vb.data_ptr() and self.keys.shape[:2] == kb.shape[:2]
                and self.keys.stride() == kb.stride() and self.values.stride() == vb.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states``: ``[B, H_kv, T, D]``; returns the valid rows ``[B, H_kv, n + T, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        T = key_states.shape[-2]
        if n + T > (self._kbuf.shape[-2] if self._kbuf is not None else 0) or (n and not self._is_prefix_view()):
            cap = max(2 * (n + T), n + T + RESERVE_MIN_ROWS)
            b, h, _, dk = key_states.shape
            kb = key_states.new_zeros((b, h, cap, dk))
            vb = value_states.new_zeros((b, h, cap, value_states.shape[-1]))
            if n:
                kb[:, :, :n] = self.keys
                vb[:, :, :n] = self.values
            self._kbuf, self._vbuf = kb, vb
        self._kbuf[:, :, n : n + T] = key_states
        self._vbuf[:, :, n : n + T] = value_states
        self.keys = self._kbuf[:, :, : n + T]
        self.values = self._vbuf[:, :, : n + T]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def reserve_rows(cache: Cache) -> Cache:
    """Swap every plain ``DynamicLayer`` of a fresh ``cache`` for a :class:`ReservedLayer`
    (sliding-window and other layer kinds are kept as they are). Returns ``cache``."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = ReservedLayer()
    return cache
