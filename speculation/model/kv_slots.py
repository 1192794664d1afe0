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

:class:`SizedKVSlotPool` sizes each slot to its request instead: slot ``s`` is its own
``K[l][s] : [1, H_kv, C_s, D]`` with ``C_s`` the rows the request asked for at :meth:`~SizedKVSlotPool.acquire`
(prompt + new tokens + one tree, at most ``L``), allocated then and freed at release, and the pool
admits a request only while ``sum_s C_s <= token_budget``. So memory follows the live requests'
contexts (``2 * sum_s C_s * H_kv * D`` values per layer) instead of ``S * L``: one 8K-token document
and seven short chats fit where eight 8K slots would not. Row views, writes and compactions act on
the slot's own tensor, so a sequence's attention calls are the same as in the fixed pool.

After acceptance, :meth:`KVSlotPool.compact` moves the accepted rows ``n + accepted`` to
``n .. n + m`` inside the slot (m + 1 rows per layer) and the valid length becomes ``n + m + 1``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer


class SlotsExhaustedError(RuntimeError):
    """No free KV slot (callers check :attr:`KVSlotPool.free` before acquiring)."""


class SlotLedger:
    """The slot bookkeeping every pool shares: ``max_sequences`` slots of ``max_tokens`` rows, the
    free list (the lowest free slot is handed out first), and admission by rows. The in-process
    pools below and the Ray coordinator's :class:`~cluster.batch_backend.RaySlotPool` build on it."""

    def __init__(self, max_sequences: int, max_tokens: int) -> None:
        if max_sequences < 1 or max_tokens < 1:
            raise ValueError("max_sequences and max_tokens must be >= 1")
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self._free: list[int] = list(range(max_sequences - 1, -1, -1))  # pop() gives the lowest slot

    @property
    def free(self) -> int:
        """Slots not held by a live sequence."""
        return len(self._free)

    def can_hold(self, rows: int) -> bool:
        """Whether :meth:`acquire` of a slot for ``rows`` KV rows would succeed now."""
        return bool(self._free) and rows <= self.max_tokens

    def acquire(self, rows: int | None = None) -> int:
        """The lowest free slot; ``rows`` (at most ``max_tokens``): the KV rows its request needs
        (every slot of a fixed pool holds ``max_tokens``)."""
        if rows is not None and not 1 <= rows <= self.max_tokens:
            raise ValueError(f"rows must be in [1, {self.max_tokens}] (the slot size), got {rows}")
        if not self._free:
            raise SlotsExhaustedError(f"all {self.max_sequences} KV slots are held by live sequences")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_sequences:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)
        self._free.sort(reverse=True)

    def capacity(self, slot: int) -> int:
        """KV rows ``slot`` holds (committed tokens plus the tree being verified)."""
        return self.max_tokens


class KVSlotPool(SlotLedger):
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
        super().__init__(max_sequences, max_tokens)
        self.num_layers = num_layers
        self.first_layer = first_layer
        self.keys: list[torch.Tensor] = []  # per layer [S, H_kv, L, D]
        self.values: list[torch.Tensor] = []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # ------------------------------------------------------------------ storage
    @property
    def allocated(self) -> bool:
        """Whether the KV shape (heads, head size, dtype, device) is known and storage exists."""
        return bool(self.keys)

    def slot_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool layer ``layer``'s keys and values of ``slot``: ``[1, H_kv, C, D]`` views, C = :meth:`capacity`."""
        return self.keys[layer][slot : slot + 1], self.values[layer][slot : slot + 1]

    def slot_layers(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's :meth:`slot_kv` of ``slot``."""
        return [self.slot_kv(i, slot) for i in range(self.num_layers)]

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every layer's ``[S, H_kv, L, D]`` keys and values once (later calls: no-op)."""
        if self.keys:
            return
        shape = (self.max_sequences, kv_heads, self.max_tokens, head_dim)
        for _ in range(self.num_layers):
            # zeros, not empty: masked stale rows must be finite (0 * NaN would poison P @ V)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))

    def scatter(self, layer: int, plan: _WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one forward's new rows of pool layer ``layer`` (``[B, H_kv, T_max, D]`` padded, or
        ``[1, H_kv, sum T_b, D]`` flat) at their slots' positions: one indexed write for all rows."""
        k_all, v_all = self.keys[layer], self.values[layer]
        k_all[plan.dst_slot, :, plan.dst_pos] = key_states[plan.src_row, :, plan.src_col].to(k_all.dtype)
        v_all[plan.dst_slot, :, plan.dst_pos] = value_states[plan.src_row, :, plan.src_col].to(v_all.dtype)

    def slab(self, layer: int, plan: _WritePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded batch's keys and values ``[B, H_kv, L_max, D]`` (a view when the slots are one
        contiguous range, else a gather)."""
        k_all, v_all = self.keys[layer], self.values[layer]
        if plan.contiguous is not None:
            lo, hi = plan.contiguous
            return k_all[lo:hi, :, : plan.kv_len], v_all[lo:hi, :, : plan.kv_len]
        return k_all[plan.slots, :, : plan.kv_len], v_all[plan.slots, :, : plan.kv_len]

    # ------------------------------------------------------------------ KV rows
    @torch.inference_mode()
    def load_prefix(self, slot: int, layers: list) -> int:
        """Copy a prefill cache's rows (per layer ``keys``/``values`` ``[1, H_kv, n, D]``) into rows
        ``0..n`` of ``slot``; returns n."""
        if len(layers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} cache layers, got {len(layers)}")
        n = int(layers[0].keys.shape[-2])
        if n > self.capacity(slot):
            raise ValueError(f"prefix of {n} tokens exceeds the slot size {self.capacity(slot)}")
        _, h, _, d = layers[0].keys.shape
        self.allocate(h, d, layers[0].keys.dtype, layers[0].keys.device)
        for i, layer in enumerate(layers):
            k, v = self.slot_kv(i, slot)
            k[0, :, :n] = layer.keys[0]
            v[0, :, :n] = layer.values[0]
        return n

    @torch.inference_mode()
    def compact(self, slot: int, base: int, accepted: list[int]) -> None:
        """Move rows ``base + accepted`` of ``slot`` to ``base .. base + m`` (accepted[0] = 0)."""
        if not accepted or accepted[0] != 0:
            raise ValueError("accepted path must start at the root (node 0)")
        if accepted == list(range(len(accepted))):
            return  # already in place
        src = torch.tensor([base + a for a in accepted], device=self.slot_kv(0, slot)[0].device)
        m1 = len(accepted)
        for i in range(self.num_layers):
            for t in self.slot_kv(i, slot):
                rows = t[0]  # [H_kv, C, D]
                rows[:, base : base + m1] = rows.index_select(1, src)

    def batch_cache(self, slots: list[int], bases: list[int], sizes: list[int], flat: bool = False) -> SlotBatchCache:
        """The ``Cache`` for one batched forward: row b writes ``sizes[b]`` tokens at ``bases[b]``
        (``flat``: the rows' tokens packed one after another, module docstring)."""
        return SlotBatchCache(self, slots, bases, sizes, flat=flat)


class SizedKVSlotPool(KVSlotPool):
    """Slots sized to their requests (module docstring): :meth:`acquire` takes the rows a request
    needs, and the pool admits requests while their rows sum to at most ``token_budget``.

    Slot ``s``'s tensors ``[1, H_kv, C_s, D]`` (zeros) are allocated when the KV shape is known (at
    :meth:`allocate`, or the first :meth:`load_prefix`) and dropped at :meth:`release`.
    """

    def __init__(self, num_layers: int, max_sequences: int, max_tokens: int, token_budget: int,
                 first_layer: int = 0) -> None:
        super().__init__(num_layers, max_sequences, max_tokens, first_layer)
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget
        self._rows: dict[int, int] = {}  # held slot -> C_s
        self._shape: tuple[int, int, torch.dtype, torch.device] | None = None
        self._slot_keys: dict[int, list[torch.Tensor]] = {}  # slot -> per layer [1, H_kv, C_s, D]
        self._slot_values: dict[int, list[torch.Tensor]] = {}

    @property
    def reserved_tokens(self) -> int:
        """KV rows held by live slots (``sum_s C_s``)."""
        return sum(self._rows.values())

    def can_hold(self, rows: int) -> bool:
        return bool(self._free) and rows <= self.max_tokens and self.reserved_tokens + rows <= self.token_budget

    def acquire(self, rows: int | None = None) -> int:
        """The lowest free slot, sized to ``rows`` KV rows (None: ``max_tokens``)."""
        rows = self.max_tokens if rows is None else rows
        if not 1 <= rows <= self.max_tokens:
            raise ValueError(f"rows must be in [1, {self.max_tokens}] (the slot size), got {rows}")
        if self.reserved_tokens + rows > self.token_budget:
            raise SlotsExhaustedError(f"a slot of {rows} KV rows does not fit: {self.reserved_tokens} of the "
                                      f"token_budget of {self.token_budget} rows are held by live sequences")
        slot = super().acquire()
        self._rows[slot] = rows
        if self._shape is not None:
            self._materialize(slot)
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self._rows.pop(slot, None)
        self._slot_keys.pop(slot, None)
        self._slot_values.pop(slot, None)

    def capacity(self, slot: int) -> int:
        if slot not in self._rows:
            raise ValueError(f"slot {slot} is not held")
        return self._rows[slot]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for ts in (*self._slot_keys.values(), *self._slot_values.values()) for t in ts)

    @property
    def allocated(self) -> bool:
        return self._shape is not None

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Record the KV shape (first call) and give every held slot its tensors."""
        if self._shape is None:
            self._shape = (kv_heads, head_dim, dtype, device)
        for slot in self._rows:
            self._materialize(slot)

    def _materialize(self, slot: int) -> None:
        if slot in self._slot_keys or self._shape is None:
            return
        h, d, dtype, device = self._shape
        shape = (1, h, self._rows[slot], d)
        # zeros, not empty: masked stale rows must be finite (0 * NaN would poison P @ V)
        self._slot_keys[slot] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self._slot_values[slot] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

    def slot_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if slot not in self._slot_keys:
            raise ValueError(f"slot {slot} has no KV rows (not held, or the pool's KV shape is not known yet)")
        return self._slot_keys[slot][layer], self._slot_values[slot][layer]

    def scatter(self, layer: int, plan: _WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One write per row: row b's ``T_b`` new rows go to rows ``n_b .. n_b + T_b`` of its slot."""
        off = 0
        for b, (slot, n, t) in enumerate(zip(plan.slot_list, plan.bases, plan.sizes)):
            k, v = self.slot_kv(layer, slot)
            r, c0 = (0, off) if plan.flat else (b, 0)  # flat: row b's tokens follow row b - 1's
            k[0, :, n : n + t] = key_states[r, :, c0 : c0 + t].to(k.dtype)
            v[0, :, n : n + t] = value_states[r, :, c0 : c0 + t].to(v.dtype)
            off += t

    def slab(self, layer: int, plan: _WritePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's first ``min(C_b, L_max)`` rows, zero padded to ``[B, H_kv, L_max, D]`` (a copy;
        rows past ``n_b + T_b`` are masked)."""
        k0, v0 = self.slot_kv(layer, plan.slot_list[0])
        b, h, d = len(plan.slot_list), k0.shape[1], k0.shape[-1]
        ks = k0.new_zeros((b, h, plan.kv_len, d))
        vs = v0.new_zeros((b, h, plan.kv_len, v0.shape[-1]))
        for row, slot in enumerate(plan.slot_list):
            k, v = self.slot_kv(layer, slot)
            e = min(k.shape[-2], plan.kv_len)
            ks[row, :, :e] = k[0, :, :e]
            vs[row, :, :e] = v[0, :, :e]
        return ks, vs


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
        self.pool.scatter(self.layer_idx, self.plan, key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``: ``[B, H_kv, T_max, D]``; returns the slab ``[B, H_kv, L_max, D]`` twice."""
        if self.plan.flat:
            raise RuntimeError("a flat batch cache has no slab: attend per row through SlotBatchCache.row_kv")
        self.write(key_states, value_states)
        return self.pool.slab(self.layer_idx, self.plan)

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
        if not pool.allocated:
            raise ValueError("the KV pool is empty: load a prefix first")
        for s, n, t in zip(slots, bases, sizes):
            if n + t > pool.capacity(s):
                raise ValueError(f"a row would write past the slot size {pool.capacity(s)}")
        plan = _WritePlan(slots, bases, sizes, pool.slot_kv(0, slots[0])[0].device, flat=flat)
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
        end = p.bases[row] + p.sizes[row]
        k, v = self.pool.slot_kv(layer_idx - self.pool.first_layer, p.slot_list[row])
        return k[:, :, :end], v[:, :, :end]
