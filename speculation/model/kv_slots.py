"""Preallocated per-slot KV caches for continuous batching, and the transformers ``Cache`` that
scatters a batched forward's new rows into them.

Layout, per model layer ``l``::

    K[l], V[l] : [S, H_kv, L, D]      S = max sequences (slots), L = max tokens per slot

A slot holds one live sequence; its first ``n`` rows are valid (the committed tokens), rows past
``n`` are stale and always masked. Memory is fixed at construction: nothing grows, nothing is
evicted; a sequence frees its slot when it ends.

A batched tree forward over slots ``s_1..s_B`` with trees of ``T_b`` nodes after ``n_b`` valid rows:

* writes node ``t < T_b`` of row ``b`` at ``K[l][s_b, :, n_b + t]`` (padding rows are not written),
* returns the slab ``K[l][s_1..s_B, :, :L_max]`` with ``L_max = max_b (n_b + T_b)``, the keys the
  4D mask ``[B, 1, T_max, L_max]`` (see :func:`speculation.model.tree_attention.batch_tree_attention_inputs`)
  selects from. When the slots are one contiguous range the slab is a view (no copy).

The **flat** (ragged) layout used by the lean forward (:mod:`speculation.model.lean_forward`) packs the
rows' tokens one after another instead (``[1, sum_b T_b]``, row b at offsets ``o_b .. o_b + T_b``,
no padding): :meth:`SlotBatchCache.write` scatters its new rows, and :meth:`SlotBatchCache.row_kv`
hands attention each row's own keys ``K[l][s_b : s_b + 1, :, : n_b + T_b]`` (a view, no slab, no
copy), so row b's attention is the very call a solo forward of that sequence makes.

After acceptance, :meth:`KVSlotPool.compact` moves the accepted rows ``n + accepted`` to
``n .. n + m`` inside the slot (m + 1 rows per layer) and the valid length becomes ``n + m + 1``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer


class SlotsExhaustedError(RuntimeError):
    """No free KV slot (callers check :attr:`KVSlotPool.free` before acquiring)."""


class KVSlotPool:
    """``max_sequences`` KV slots of ``max_tokens`` rows for every layer of one model.

    Tensors are allocated once, at full size: on the first :meth:`load_prefix` (head count, head
    size, dtype and device taken from the first prefill's cache) or an explicit :meth:`allocate`.

    ``first_layer``: the model layer index of the pool's layer 0. A pipeline shard holding model
    layers ``[first_layer, first_layer + num_layers)`` keeps only those; its batch cache answers
    to the model's own layer indices (the layers before ``first_layer`` are empty placeholders).
    """

    def __init__(self, num_layers: int, max_sequences: int, max_tokens: int, first_layer: int = 0) -> None:
        if num_layers < 1 or max_sequences < 1 or max_tokens < 1:
            raise ValueError("num_layers, max_sequences and max_tokens must be >= 1")
        if first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {first_layer}")
        self.num_layers = num_layers
        self.first_layer = first_layer
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self.keys: list[torch.Tensor] = []  # per layer [S, H_kv, L, D]
        self.values: list[torch.Tensor] = []
        self._free: list[int] = list(range(max_sequences - 1, -1, -1))  # pop() gives the lowest slot

    # ------------------------------------------------------------------ slots
    @property
    def free(self) -> int:
        """Slots not held by a live sequence."""
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise SlotsExhaustedError(f"all {self.max_sequences} KV slots are held by live sequences")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_sequences:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)
        self._free.sort(reverse=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # ------------------------------------------------------------------ KV rows
    @torch.inference_mode()
    def load_prefix(self, slot: int, layers: list) -> int:
        """Copy a prefill cache's rows (per layer ``keys``/``values`` ``[1, H_kv, n, D]``) into rows
        ``0..n`` of ``slot``; returns n."""
        if len(layers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} cache layers, got {len(layers)}")
        n = int(layers[0].keys.shape[-2])
        if n > self.max_tokens:
            raise ValueError(f"prefix of {n} tokens exceeds the slot size {self.max_tokens}")
        _, h, _, d = layers[0].keys.shape
        self.allocate(h, d, layers[0].keys.dtype, layers[0].keys.device)
        for k, v, layer in zip(self.keys, self.values, layers):
            k[slot, :, :n] = layer.keys[0]
            v[slot, :, :n] = layer.values[0]
        return n

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every layer's ``[S, H_kv, L, D]`` keys and values once (later calls: no-op)."""
        if self.keys:
            return
        shape = (self.max_sequences, kv_heads, self.max_tokens, head_dim)
        for _ in range(self.num_layers):
            # zeros, not empty: masked stale rows must be finite (0 * NaN would poison P @ V)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))

    @torch.inference_mode()
    def compact(self, slot: int, base: int, accepted: list[int]) -> None:
        """Move rows ``base + accepted`` of ``slot`` to ``base .. base + m`` (accepted[0] = 0)."""
        if not accepted or accepted[0] != 0:
            raise ValueError("accepted path must start at the root (node 0)")
        if accepted == list(range(len(accepted))):
            return  # already in place
        src = torch.tensor([base + a for a in accepted], device=self.keys[0].device)
        m1 = len(accepted)
        for k, v in zip(self.keys, self.values):
            k[slot, :, base : base + m1] = k[slot].index_select(1, src)
            v[slot, :, base : base + m1] = v[slot].index_select(1, src)

    def batch_cache(self, slots: list[int], bases: list[int], sizes: list[int], flat: bool = False) -> SlotBatchCache:
        """The ``Cache`` for one batched forward: row b writes ``sizes[b]`` tokens at ``bases[b]``
        (``flat``: the rows' tokens packed one after another, module docstring)."""
        return SlotBatchCache(self, slots, bases, sizes, flat=flat)


class _SlotLayer(CacheLayerMixin):
    """One layer's view of the pool during a batched forward (scatter new rows, return the slab)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, pool: KVSlotPool, layer_idx: int, plan: _WritePlan) -> None:
        super().__init__()
        self.pool, self.layer_idx, self.plan = pool, layer_idx, plan
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Scatter the new rows (``[B, H_kv, T_max, D]`` padded, or ``[1, H_kv, sum T_b, D]`` flat)
        into their slots."""
        p = self.plan
        k_all, v_all = self.pool.keys[self.layer_idx], self.pool.values[self.layer_idx]
        k_all[p.dst_slot, :, p.dst_pos] = key_states[p.src_row, :, p.src_col].to(k_all.dtype)
        v_all[p.dst_slot, :, p.dst_pos] = value_states[p.src_row, :, p.src_col].to(v_all.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``: ``[B, H_kv, T_max, D]``; returns the slab ``[B, H_kv, L_max, D]`` twice."""
        p = self.plan
        if p.flat:
            raise RuntimeError("a flat batch cache has no slab: attend per row through SlotBatchCache.row_kv")
        self.write(key_states, value_states)
        k_all, v_all = self.pool.keys[self.layer_idx], self.pool.values[self.layer_idx]
        if p.contiguous is not None:
            lo, hi = p.contiguous
            return k_all[lo:hi, :, : p.kv_len], v_all[lo:hi, :, : p.kv_len]
        return k_all[p.slots, :, : p.kv_len], v_all[p.slots, :, : p.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.kv_len, 0

    def get_seq_length(self) -> int:
        return self.plan.kv_len

    def get_max_length(self) -> int:
        return self.pool.max_tokens


class _WritePlan:
    """Flat scatter indices of one batched forward (built once, shared by every layer)."""

    def __init__(
        self, slots: list[int], bases: list[int], sizes: list[int], device: torch.device, flat: bool = False
    ) -> None:
        if not (len(slots) == len(bases) == len(sizes)) or not slots:
            raise ValueError("slots, bases and sizes must be non-empty and of equal length")
        row = [b for b, t in enumerate(sizes) for _ in range(t)]  # batch row of each new token
        col = [i for t in sizes for i in range(t)]  # its node index in that row's tree
        self.flat = flat
        self.slot_list, self.bases, self.sizes = list(slots), list(bases), list(sizes)
        # where each new token sits in the forward's key tensor: [B, H, T_max, D] padded -> (row, col);
        # [1, H, sum T_b, D] flat -> (0, running offset)
        self.src_row = torch.tensor([0] * len(row) if flat else row, dtype=torch.long, device=device)  # [N]
        self.src_col = torch.tensor(list(range(len(row))) if flat else col, dtype=torch.long, device=device)  # [N]
        self.dst_slot = torch.tensor([slots[b] for b in row], dtype=torch.long, device=device)  # [N]
        self.dst_pos = torch.tensor([bases[b] + i for b, i in zip(row, col)], dtype=torch.long,
                                    device=device)  # [N]
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # [B]
        self.kv_len = max(n + t for n, t in zip(bases, sizes))
        lo = slots[0]
        self.contiguous = (lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None


class SlotBatchCache(Cache):
    """A transformers ``Cache`` over :class:`KVSlotPool` rows for one batched forward."""

    def __init__(
        self, pool: KVSlotPool, slots: list[int], bases: list[int], sizes: list[int], flat: bool = False
    ) -> None:
        if not pool.keys:
            raise ValueError("the KV pool is empty: load a prefix first")
        if max(n + t for n, t in zip(bases, sizes)) > pool.max_tokens:
            raise ValueError(f"a row would write past the slot size {pool.max_tokens}")
        plan = _WritePlan(slots, bases, sizes, pool.keys[0].device, flat=flat)
        absent = [DummyLayer() for _ in range(pool.first_layer)]  # another shard's layers
        super().__init__(layers=[*absent, *(_SlotLayer(pool, i, plan) for i in range(pool.num_layers))])
        self.plan = plan
        self.pool = pool

    # ------------------------------------------------------------------ flat (ragged) rows
    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Scatter layer ``layer_idx``'s new rows (flat ``[1, H_kv, sum T_b, D]``) into the slots."""
        self.layers[layer_idx].write(key_states, value_states)

    def row_kv(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s keys and values of layer ``layer_idx`` after :meth:`write`: its committed
        rows and its tree, ``[1, H_kv, n_b + T_b, D]`` each (views into the pool)."""
        p = self.plan
        s, end = p.slot_list[row], p.bases[row] + p.sizes[row]
        i = layer_idx - self.pool.first_layer
        return self.pool.keys[i][s : s + 1, :, :end], self.pool.values[i][s : s + 1, :, :end]
