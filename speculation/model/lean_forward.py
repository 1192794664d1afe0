"""The target's decoder forward without the Hugging Face module glue, for Llama-family targets.

A decode step of SmolLM2-135M (30 layers) through ``LlamaForCausalLM.forward`` makes about 400
``nn.Module`` calls, builds keyword dictionaries, output dataclasses and mask objects, and goes
through transformers' attention dispatch. On the 2-core CPU host of BENCHMARKS.md that glue is a
large share of a bandwidth-bound step whose operators take about 37 ms
(``benchmarks/decode_profile.py``). :class:`LeanDecoder` runs the *same operators on the same
tensors* as the fused Hugging Face model (:mod:`speculation.model.fused_layers`, packed oneDNN weights
of :mod:`speculation.model.output_head`) from one Python loop:

    x_0     = E[ids]                                                   # [B, T, H]
    per layer l (pre-norm residual block):
    h       = rms_norm(x_l) * w_in
    [q|k|v] = h [Wq; Wk; Wv]^T,  q, k <- RoPE(q, k; positions)         # heads of width D
    K, V    = cache_l.update(k, v)                                     # [B, H_kv, n + T, D]
    a       = softmax(q K^T / sqrt(D) + mask) V                        # SDPA, GQA
    x'      = x_l + a Wo^T
    [g|u]   = rms_norm(x') * w_post [Wg; Wu]^T
    x_{l+1} = x' + (silu(g) * u) Wd^T
    logits  = rms_norm(x_L) * w_norm  W_head^T                         # the kept rows only

The attention call is transformers' SDPA call (``is_causal`` for a maskless multi-token pass, the
boolean mask otherwise), with SDPA's own GQA where transformers repeats the KV heads under a mask
(the same bits, without the copies: :meth:`LeanLayers._attend`), and RoPE comes from
the model's own rotary module and ``apply_rotary_pos_emb``, so the result is the Hugging Face
forward's, not an approximation of it (the tests compare logits, auxiliary features and greedy
tokens). ``hidden[i]`` has transformers' ``hidden_states`` meaning: the input of layer ``i``
(``hidden[0]`` the embeddings, ``hidden[L]`` the final-normed output).

In bf16 and fp16, a pass of one query token attends in fp32 (:data:`HALF_DTYPES`; torch's CPU
flash kernel is several times slower for one half-precision query: :meth:`LeanLayers._attend`),
so it equals transformers' forward to rounding. Two more departures, both for **batch
invariance** (a sequence's logits do not depend on what else shares the forward, so a batched
verify equals the solo one bit for bit where the CPU's GEMM kernels allow it;
``tests/test_lean_forward.py`` checks it on the real weights):

* :class:`PackedGemm` runs a single row as two where oneDNN's one-row kernel sums in another
  order than its multi-row ones (on the AVX2 host: SmolLM2's fp32 down projection). A
  single-token pass (a decode step) therefore equals transformers' forward to rounding, not bit
  for bit; every multi-token pass still does.
* A **flat batch** (:class:`RaggedRows`, continuous batching): the rows' tokens are packed into
  one ``[1, sum_b T_b]`` pass, so every projection runs once over the real tokens (no padding
  rows), and attention runs per row over that row's own keys with the exact call a solo forward
  makes (no ``[B, H, L_max, D]`` slab, no repeated KV heads for the whole batch, no padded keys).

Which targets: :func:`LeanDecoder.from_model` accepts a model only when every piece has the
expected shape (Llama/Mistral/Qwen2 decoder layers whose projections were grouped and packed,
Llama-style RMS norms, a SiLU-gated MLP, a packed output head, no attention soft-capping, no
per-head q/k norms, no sliding window) and returns None otherwise; the target then keeps the
Hugging Face forward (Gemma-3, for instance). Off the CPU and under autograd it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from speculation.model.fused_layers import FusedRMSNorm, GroupedProjection, rms_norm
from speculation.model.output_head import PackedLinear

LEAN_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2"})
"""``config.model_type`` values whose decoder layer is the pre-norm block in the module docstring."""


_ONE_ROW_DIFFERS: dict[tuple, bool] = {}
"""(weight shape, dtype, has bias) -> whether a probed one-row product of that kernel differed."""

_ROW_LIMIT: dict[tuple, int | None] = {}
"""(weight shape, dtype, has bias) -> the batch-invariant row limit probed for that kernel
(:meth:`PackedGemm.probe_row_limit`; None: every probed row count agrees)."""

ROW_PROBE_COUNTS: tuple[int, ...] = (*range(2, 65), 80, 96, 128, 160, 192, 256)
"""Row counts M the batch-invariant probe runs (every M up to 64: kernels switch at small M)."""


class PackedGemm:
    """``x W^T + b`` on oneDNN's packed weight ``W`` ``[N, K]``: ``x`` ``[M, K]`` -> ``[M, N]``.

    oneDNN picks its kernel by the row count M. On the AVX2 host of BENCHMARKS.md the one-row
    kernel of SmolLM2's down projection (``[576, 1536]``, fp32 and bf16) sums in another order
    than every multi-row one (M = 2 .. 199 all agree), while its other shapes agree at M = 1 too
    (in bf16 the output's rounding hides the order in most rows, so the probe checks eight). So a
    token's product could depend on whether it was decoded alone or inside a batch. The object
    probes that once, at construction (a row alone against the same row among others; a kernel
    that sums in another order shows it on random data; in bf16 only sometimes, so the finding
    is shared by every weight of the same shape), and runs a single row as two (the row
    repeated, the copy dropped) only where a probe found a difference: a batched verify then
    equals the solo one bit for bit, and the shapes that need no help pay nothing (the two-row
    call costs about 40 us more per product).

    **Batch-invariant mode** (:meth:`set_row_limit`, off by default). The same holds at larger M:
    on the Xeon host with AMX-BF16 every bf16 product of SmolLM2 switches kernel above 32 rows,
    so a decode row inside a step of more than 32 flat rows (a folded prefill, many trees) sums
    in another order than its solo one-row decode. With a row limit R, a product of M > R rows
    runs as ceil(M / R) products of at most R rows, every one in the kernels that agree with the
    two-row product row for row, so a row's bits do not depend on the rest of the batch; the
    price is the large kernel's speed on prefills and big verifies.
    """

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed, self.bias = packed, bias
        self._kernel = (tuple(packed.shape), packed.dtype, bias is not None)
        _ONE_ROW_DIFFERS[self._kernel] = self._probe() or _ONE_ROW_DIFFERS.get(self._kernel, False)
        self.row_limit: int | None = None
        """Batch-invariant mode's largest product (rows); None = off (one product of any M)."""

    @property
    def one_row_differs(self) -> bool:
        """Whether a one-row product of this kernel (shape, dtype, bias) was seen to differ from
        the same row among others, by this or any other weight of the same kernel probed in this
        process (bf16 hides the difference in some weights' probes, not in all of a model's)."""
        return _ONE_ROW_DIFFERS[self._kernel]

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @torch.inference_mode()
    def _probe(self) -> bool:
        k = int(self.packed.size(1)) if self.packed.dim() == 2 else None
        if k is None:
            return True  # an unexpected layout: always take the safe path
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(0)).to(self.packed.dtype)
        many = self._raw(x)
        # 8 rows: in bf16 the output's rounding hides most order differences (SmolLM2's bf16 down
        # projection shows one in about half of its layers' probes), hence also the shared record
        return any(not torch.equal(self._raw(x[i : i + 1])[0], many[i]) for i in range(8))

    @torch.inference_mode()
    def probe_row_limit(self) -> int | None:
        """The largest row count R such that, for every probed M <= R (:data:`ROW_PROBE_COUNTS`),
        a product of M random rows equals the same rows taken two at a time, bit for bit; None
        when every probed M agrees (the kernel is batch-invariant as it is). Shared by every weight
        of the same kernel (shape, dtype, bias): the smallest limit any of them showed."""
        k = int(self.packed.size(1))
        top = ROW_PROBE_COUNTS[-1]
        x = torch.randn(top, k, generator=torch.Generator().manual_seed(1)).to(self.packed.dtype)  # [top, K]
        pairs = torch.cat([self._raw(x[i : i + 2]) for i in range(0, top, 2)])  # [top, N], the 2-row kernel
        limit: int | None = None
        for prev, m in zip(ROW_PROBE_COUNTS, ROW_PROBE_COUNTS[1:]):  # M = 2 is the reference itself
            if not torch.equal(self._raw(x[:m]), pairs[:m]):
                limit = prev
                break
        limits = [v for v in (limit, _ROW_LIMIT.get(self._kernel)) if v is not None]
        _ROW_LIMIT[self._kernel] = min(limits) if limits else None
        return _ROW_LIMIT[self._kernel]

    def set_row_limit(self, on: bool) -> int | None:
        """Turn batch-invariant mode on (probing this kernel's limit) or off; returns the limit."""
        self.row_limit = self.probe_row_limit() if on else None
        return self.row_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        R = self.row_limit
        if R is not None and x.shape[0] > R:  # batch-invariant mode: products of at most R rows
            return torch.cat([self(x[i : i + R]) for i in range(0, x.shape[0], R)])
        if x.shape[0] == 1 and self.one_row_differs:
            return self._raw(torch.cat([x, x]))[:1]
        return self._raw(x)

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors: norms' weights and the packed (grouped) projections."""

    w_in: torch.Tensor  # [H]
    qkv: PackedGemm  # [nq + 2 nkv, H] (D-wide heads), bias [nq + 2 nkv] or None
    qkv_sizes: list[int]
    wo: PackedGemm  # [H, nq]
    w_post: torch.Tensor  # [H]
    gate_up: PackedGemm  # [2 I, H]
    gate_up_sizes: list[int]
    down: PackedGemm  # [H, I]


class RaggedKV(Protocol):
    """A KV store for a flat batch (:class:`~speculation.model.kv_slots.SlotBatchCache` with ``flat=True``)."""

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Store layer ``layer_idx``'s new keys and values ``[1, H_kv, sum T_b, D]``."""

    def row_kv(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s keys and values ``[1, H_kv, n_b + T_b, D]`` (its past, then its new tokens)."""


@dataclass(frozen=True)
class RaggedRows:
    """The rows of a flat (ragged) batch: row b is tokens ``offsets[b] .. offsets[b] + sizes[b]`` of
    the one packed sequence dimension (``[1, sum T_b]``), with no padding.

    ``masks[b]``: row b's own attention mask ``[1, 1, T_b, n_b + T_b]`` bool, exactly what a solo
    forward of that row takes (:func:`~speculation.model.tree_attention.tree_attention_inputs`), or None where the
    solo forward has none: a one-token row attends to all its keys, and a row of T_b > 1 tokens
    without a mask is a **prefill** of an empty slot (``n_b = 0``), causal over its own tokens
    (SDPA's ``is_causal``, the solo prefill's call)."""

    sizes: tuple[int, ...]
    masks: tuple[torch.Tensor | None, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.masks) != len(self.sizes) or min(self.sizes) < 1:
            raise ValueError("RaggedRows needs one mask (or None) per row and every row >= 1 token")
        for t, m in zip(self.sizes, self.masks):
            if m is not None and (t == 1 or m.dim() != 4 or m.shape[2] != t):
                raise ValueError("RaggedRows: a tree row of T > 1 tokens takes its [1, 1, T, n + T] mask; a "
                                 "one-token row or a prefill row takes None")

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for t in self.sizes:
            out.append(o)
            o += t
        return out


@dataclass(frozen=True)
class LeanOutput:
    """Logits of the kept rows ``[B, T_keep, V]`` and the requested hidden states (each ``[B, T, H]``)."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]


def _packed(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if type(module) is PackedLinear:
        return module.packed, module.bias
    return None


def _config_qualifies(cfg) -> bool:
    """A :data:`LEAN_MODEL_TYPES` config with full attention, SiLU MLPs, no soft-capping."""
    if cfg is None or getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return False
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "attn_logit_softcapping", None):
        return False
    return getattr(cfg, "pretraining_tp", 1) in (None, 1)


def _lean_layer(layer: nn.Module) -> _Layer | None:
    """The tensors of one fused, packed pre-norm decoder layer, or None if it has another shape."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return None
    if getattr(attn, "sliding_window", None) is not None:
        return None
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    if not all(type(p) is GroupedProjection for p in projections):
        return None
    qkv, gu = projections[0].group, projections[3].group
    if not (projections[1]._group is qkv and projections[2]._group is qkv and projections[4]._group is gu):
        return None
    wo, down = _packed(attn.o_proj), _packed(mlp.down_proj)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if wo is None or down is None or down[1] is not None or gu.bias is not None:
        return None
    if not all(type(n) is FusedRMSNorm for n in norms):
        return None
    return _Layer(w_in=norms[0].weight, qkv=PackedGemm(qkv.packed, qkv.bias), qkv_sizes=list(qkv.sizes),
                  wo=PackedGemm(*wo), w_post=norms[1].weight, gate_up=PackedGemm(gu.packed, None),
                  gate_up_sizes=list(gu.sizes), down=PackedGemm(*down))


HALF_DTYPES = (torch.bfloat16, torch.float16)
"""Model dtypes whose single-query attention :meth:`LeanLayers._attend` runs in fp32."""


class LeanLayers:
    """Decoder layers ``start .. end - 1`` of a fused, packed Llama-family model as one loop
    (the per-layer block of the module docstring): the whole stack for :class:`LeanDecoder`, or a
    pipeline shard's range (``workers/shard.py``). Layer indices are the model's, so the cache
    is updated at the right layers.
    """

    def __init__(self, cfg, layers: dict[int, _Layer], rotary: nn.Module, scaling: float) -> None:
        self.layers = layers
        self.rotary = rotary
        self.hidden_size: int = int(cfg.hidden_size)
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps: float = float(cfg.rms_norm_eps)
        self.scaling = scaling
        first = next(iter(layers.values()))
        self.dtype, self.device = first.qkv.dtype, first.w_in.device
        self.widen_single_query = True
        """Attend a one-query row in fp32 when the model is bf16/fp16 (:meth:`_attend`; False runs
        the half-precision call, the A/B of ``benchmarks/single_query_attention.py``)."""

    @classmethod
    def from_modules(cls, cfg, layers: dict[int, nn.Module], rotary: nn.Module) -> LeanLayers | None:
        """The loop over ``layers`` (model index -> decoder layer), or None where the config or any
        layer does not have the structure in the module docstring."""
        if not layers or not _config_qualifies(cfg):
            return None
        lean = {i: _lean_layer(layer) for i, layer in sorted(layers.items())}
        if any(v is None for v in lean.values()):
            return None
        scaling = float(next(iter(layers.values())).self_attn.scaling)
        return cls(cfg, lean, rotary, scaling)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the loop may run on ``x`` now: on the CPU, in the packed weights' dtype, with no
        gradient wanted (oneDNN's packed op has no backward)."""
        return (not torch.is_grad_enabled() and x.device.type == "cpu" and self.placed()
                and x.dtype == self.dtype)

    def placed(self) -> bool:
        """Whether the weights sit where the loop runs (the CPU)."""
        return self.device.type == "cpu"

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        hidden_at: tuple[int, ...] = (),
        rows: RaggedRows | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over ``x`` ``[B, T, H]`` at RoPE ``positions`` ``[B, T]``, appending keys and
        values to ``cache`` (any transformers ``Cache``: ``cache.update(k, v, layer)``).

        ``mask``: None for causal attention over the cache (a decode step, or a prefill of an
        empty cache), else boolean ``[B, 1, T, n + T]`` (True = attend), as transformers takes it.

        ``rows``: a flat batch instead. ``x`` is ``[1, sum T_b, H]``, ``cache`` a :class:`RaggedKV`,
        ``mask`` unused; every projection runs once over all tokens, and attention runs per row
        over that row's own keys with its own mask (:meth:`_attend`, the solo forward's call).
        Returns (output ``[B, T, H]``, {index in ``hidden_at``: the input of that layer}).
        """
        B, T, H = x.shape
        D, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        wanted = set(hidden_at)
        hidden: dict[int, torch.Tensor] = {}
        cos, sin = self.rotary(x, positions)  # [B, T, D] each
        causal = mask is None and T > 1
        offsets = rows.offsets if rows is not None else []
        if rows is not None and (B != 1 or sum(rows.sizes) != T):
            raise ValueError(f"a flat batch is [1, sum T_b = {sum(rows.sizes)}, H], got x of shape {tuple(x.shape)}")
        for i, layer in self.layers.items():
            if i in wanted:
                hidden[i] = x
            h = rms_norm(x, layer.w_in, self.eps).view(B * T, H)
            q, k, v = layer.qkv(h).split(layer.qkv_sizes, -1)
            q = q.view(B, T, nq, D).transpose(1, 2)  # [B, nq, T, D]
            k = k.view(B, T, nkv, D).transpose(1, 2)  # [B, nkv, T, D]
            v = v.view(B, T, nkv, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # cos/sin broadcast over heads
            if rows is None:
                k, v = cache.update(k, v, i)  # [B, nkv, n + T, D]
                a = self._attend(q, k, v, mask, causal)  # [B, nq, T, D]
            else:
                cache.write(k, v, i)
                parts = []
                for b, (o, t) in enumerate(zip(offsets, rows.sizes)):
                    kb, vb = cache.row_kv(i, b)  # [1, nkv, n_b + T_b, D]
                    m = rows.masks[b]  # None and t > 1: a prefill row (causal over its empty slot)
                    parts.append(self._attend(q[:, :, o : o + t], kb, vb, m, m is None and t > 1))
                a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [1, nq, sum T_b, D]
            a = a.transpose(1, 2).reshape(B * T, nq * D)  # [B T, nq D]
            x = x + layer.wo(a).view(B, T, H)
            h = rms_norm(x, layer.w_post, self.eps).view(B * T, H)
            g, u = layer.gate_up(h).split(layer.gate_up_sizes, -1)
            x = x + layer.down(F.silu(g) * u).view(B, T, H)
        return x, hidden

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """``softmax(q k^T * scaling + mask) v`` with grouped-query attention inside SDPA. ``q``
        ``[B, nq, T, D]``, ``k``/``v`` ``[B, nkv, S, D]``, ``mask`` ``[B, 1, T, S]`` bool or None;
        returns ``[B, nq, T, D]``.

        Transformers' SDPA integration repeats the KV heads (``repeat_kv``) whenever there is a
        mask; SDPA's own GQA gives the same bits on torch's CPU kernels (the bit-for-bit tests
        against transformers' tree verify check it) without copying the keys and values
        ``nq / nkv`` times: a 4-node tree over 500 committed tokens attends in 140 instead of
        240 us per layer, over 900 tokens in 0.23 instead of 1.9 ms (2 threads, fp32).

        A row of **one query** (a decode step, a sequence sitting out a batched step) in bf16 or
        fp16 attends in fp32: ``q``, ``k``, ``v`` are widened exactly, SDPA runs in fp32 and the
        output is rounded back to the model's dtype. torch's CPU flash kernel takes a slow path
        for a single bf16 query: over 200 / 500 / 1,000 keys (SmolLM2's 9 query and 3 KV heads of
        64) it took 118 / 322 / 738 us per layer on the AVX-512 host of BENCHMARKS.md, against 55
        / 96 / 172 us widened (copies included) and 45 / 117 / 230 us for two bf16 queries. At
        B = 8 that is 240 single-query calls per step. The choice depends on the row alone, so a
        batched row still equals its solo pass bit for bit; against transformers' bf16 SDPA it
        equals to rounding (a single-token pass already did, :class:`PackedGemm`)."""
        if self.widen_single_query and q.shape[2] == 1 and q.dtype in HALF_DTYPES:  # half SDPA's slow path
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  is_causal=causal, scale=self.scaling,
                                                  enable_gqa=self.num_heads > self.num_kv_heads).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling,
                                              enable_gqa=self.num_heads > self.num_kv_heads)


class LeanDecoder:
    """The forward of a fused, packed Llama-family causal LM: embedding, :class:`LeanLayers` over
    every layer, final norm, output head.

    Build it with :meth:`from_model` (None when the model does not qualify). The tensors are the
    model's own (shared, not copied); like the packed copies, it must be rebuilt if the weights
    change.
    """

    def __init__(self, model: nn.Module, layers: LeanLayers, head: PackedGemm) -> None:
        self.layers = layers
        self.num_layers = len(layers.layers)
        self.embed: torch.Tensor = model.model.embed_tokens.weight  # [V_in, H]
        self.w_norm: torch.Tensor = model.model.norm.weight  # [H]
        self.eps = layers.eps
        self.head = head

    @classmethod
    def from_model(cls, model: nn.Module) -> LeanDecoder | None:
        """The lean forward of ``model``, or None where ``model`` is not a fused, packed decoder
        of :data:`LEAN_MODEL_TYPES` with the structure in the module docstring."""
        cfg, inner = getattr(model, "config", None), getattr(model, "model", None)
        if inner is None or not _config_qualifies(cfg) or not hasattr(inner, "rotary_emb"):
            return None
        if type(getattr(inner, "norm", None)) is not FusedRMSNorm:
            return None
        head = _packed(model.get_output_embeddings())
        if head is None or not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding):
            return None
        layers = LeanLayers.from_modules(cfg, dict(enumerate(inner.layers)), inner.rotary_emb)
        if layers is None:
            return None
        return cls(model, layers, PackedGemm(*head))

    def gemms(self) -> list[PackedGemm]:
        """Every packed product of the forward: each layer's four, then the output head."""
        per_layer = [g for layer in self.layers.layers.values() for g in (layer.qkv, layer.wo, layer.gate_up, layer.down)]
        return [*per_layer, self.head]

    def set_batch_invariant(self, on: bool) -> dict[str, int | None]:
        """Batch-invariant mode on or off for every product (:meth:`PackedGemm.set_row_limit`).
        Returns each kernel's row limit by name (``[N, K] dtype``; None: needs no limit)."""
        return {f"{list(g.packed.shape)} {str(g.dtype).removeprefix('torch.')}": g.set_row_limit(on)
                for g in self.gemms()}

    def applies(self) -> bool:
        """Whether the lean forward may run now (see :meth:`LeanLayers.applies`)."""
        return not torch.is_grad_enabled() and self.placed()

    def placed(self) -> bool:
        """Whether the weights sit where the loop runs (CPU, one dtype): it applies under
        ``torch.inference_mode`` / ``no_grad``."""
        return self.embed.device.type == "cpu" and self.embed.dtype == self.head.dtype == self.layers.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        keep_last: bool = False,
        hidden_at: tuple[int, ...] = (),
        rows: RaggedRows | None = None,
        keep: torch.Tensor | None = None,
    ) -> LeanOutput:
        """One forward of ``input_ids`` ``[B, T]`` at RoPE ``positions`` ``[B, T]`` over ``cache``
        (``mask`` and ``rows``, a flat batch, as in :meth:`LeanLayers.run`).

        ``keep_last``: logits of the last row only (``[B, 1, V]``), else every row (``[B, T, V]``).
        ``keep``: instead, the logits of these token indices only (``[K]`` int64 into T:
        ``[B, K, V]``; a flat batch's tree rows and its prefill rows' last tokens).
        ``hidden_at``: transformers ``hidden_states`` indices to return (0..L).
        """
        x = F.embedding(input_ids, self.embed)  # [B, T, H]
        x, hidden = self.layers.run(x, positions, cache, mask, hidden_at, rows)
        x = rms_norm(x, self.w_norm, self.eps)
        if self.num_layers in hidden_at:
            hidden[self.num_layers] = x
        if keep is not None:
            kept = x.index_select(1, keep)  # [B, K, H]
        else:
            kept = x[:, -1:] if keep_last else x  # [B, T_keep, H]
        H = x.shape[-1]
        logits = self.head(kept.reshape(-1, H))
        return LeanOutput(logits=logits.view(x.shape[0], kept.shape[1], -1), hidden=hidden)
