"""The target's decoder forward without the Hugging Face module glue, for Llama-family targets.

A decode step of SmolLM2-135M (30 layers) through ``LlamaForCausalLM.forward`` makes about 400
``nn.Module`` calls, builds keyword dictionaries, output dataclasses and mask objects, and goes
through transformers' attention dispatch. On the 2-core CPU host of BENCHMARKS.md that glue is a
large share of a bandwidth-bound step whose operators take about 37 ms
(``benchmarks/decode_profile.py``). :class:`LeanDecoder` runs the *same operators on the same
tensors* as the fused Hugging Face model (:mod:`speculation.fused_layers`, packed oneDNN weights
of :mod:`speculation.output_head`) from one Python loop:

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

The attention call follows transformers' SDPA integration exactly (GQA inside SDPA without a
mask, ``repeat_kv`` with one, ``is_causal`` for a maskless multi-token pass), and RoPE comes from
the model's own rotary module and ``apply_rotary_pos_emb``, so the result is the Hugging Face
forward's, not an approximation of it (the tests compare logits, auxiliary features and greedy
tokens). ``hidden[i]`` has transformers' ``hidden_states`` meaning: the input of layer ``i``
(``hidden[0]`` the embeddings, ``hidden[L]`` the final-normed output).

Which targets: :func:`LeanDecoder.from_model` accepts a model only when every piece has the
expected shape (Llama/Mistral/Qwen2 decoder layers whose projections were grouped and packed,
Llama-style RMS norms, a SiLU-gated MLP, a packed output head, no attention soft-capping, no
per-head q/k norms, no sliding window) and returns None otherwise; the target then keeps the
Hugging Face forward (Gemma-3, for instance). Off the CPU and under autograd it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from speculation.fused_layers import FusedRMSNorm, GroupedProjection, rms_norm
from speculation.output_head import PackedLinear

LEAN_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2"})
"""``config.model_type`` values whose decoder layer is the pre-norm block in the module docstring."""


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors: norms' weights and the packed (grouped) projections."""

    w_in: torch.Tensor  # [H]
    qkv: torch.Tensor  # oneDNN-packed [nq + 2 nkv, H] (D-wide heads)
    qkv_bias: torch.Tensor | None  # [nq + 2 nkv] or None
    qkv_sizes: list[int]
    wo: torch.Tensor  # packed [H, nq]
    wo_bias: torch.Tensor | None
    w_post: torch.Tensor  # [H]
    gate_up: torch.Tensor  # packed [2 I, H]
    gate_up_sizes: list[int]
    down: torch.Tensor  # packed [H, I]


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
    return _Layer(w_in=norms[0].weight, qkv=qkv.packed, qkv_bias=qkv.bias, qkv_sizes=list(qkv.sizes),
                  wo=wo[0], wo_bias=wo[1], w_post=norms[1].weight, gate_up=gu.packed,
                  gate_up_sizes=list(gu.sizes), down=down[0])


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
        return (not torch.is_grad_enabled() and x.device.type == "cpu" and self.device.type == "cpu"
                and x.dtype == self.dtype)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        hidden_at: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over ``x`` ``[B, T, H]`` at RoPE ``positions`` ``[B, T]``, appending keys and
        values to ``cache`` (any transformers ``Cache``: ``cache.update(k, v, layer)``).

        ``mask``: None for causal attention over the cache (a decode step, or a prefill of an
        empty cache), else boolean ``[B, 1, T, n + T]`` (True = attend), as transformers takes it.
        Returns (output ``[B, T, H]``, {index in ``hidden_at``: the input of that layer}).
        """
        B, T, H = x.shape
        D, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        lp = torch.ops.mkldnn._linear_pointwise
        wanted = set(hidden_at)
        hidden: dict[int, torch.Tensor] = {}
        cos, sin = self.rotary(x, positions)  # [B, T, D] each
        gqa = nq // nkv
        causal = mask is None and T > 1
        for i, layer in self.layers.items():
            if i in wanted:
                hidden[i] = x
            h = rms_norm(x, layer.w_in, self.eps).view(B * T, H)
            q, k, v = lp(h, layer.qkv, layer.qkv_bias, "none", [], "").split(layer.qkv_sizes, -1)
            q = q.view(B, T, nq, D).transpose(1, 2)  # [B, nq, T, D]
            k = k.view(B, T, nkv, D).transpose(1, 2)  # [B, nkv, T, D]
            v = v.view(B, T, nkv, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # cos/sin broadcast over heads
            k, v = cache.update(k, v, i)  # [B, nkv, n + T, D]
            if gqa > 1 and mask is not None:  # transformers' SDPA integration: repeat_kv with a mask
                k, v = repeat_kv(k, gqa), repeat_kv(v, gqa)
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                   scale=self.scaling, enable_gqa=gqa > 1)
            a = a.transpose(1, 2).reshape(B * T, nq * D)  # [B T, nq D]
            x = x + lp(a, layer.wo, layer.wo_bias, "none", [], "").view(B, T, H)
            h = rms_norm(x, layer.w_post, self.eps).view(B * T, H)
            g, u = lp(h, layer.gate_up, None, "none", [], "").split(layer.gate_up_sizes, -1)
            x = x + lp(F.silu(g) * u, layer.down, None, "none", [], "").view(B, T, H)
        return x, hidden


class LeanDecoder:
    """The forward of a fused, packed Llama-family causal LM: embedding, :class:`LeanLayers` over
    every layer, final norm, output head.

    Build it with :meth:`from_model` (None when the model does not qualify). The tensors are the
    model's own (shared, not copied); like the packed copies, it must be rebuilt if the weights
    change.
    """

    def __init__(self, model: nn.Module, layers: LeanLayers, head: torch.Tensor, head_bias: torch.Tensor | None) -> None:
        self.layers = layers
        self.num_layers = len(layers.layers)
        self.embed: torch.Tensor = model.model.embed_tokens.weight  # [V_in, H]
        self.w_norm: torch.Tensor = model.model.norm.weight  # [H]
        self.eps = layers.eps
        self.head, self.head_bias = head, head_bias

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
        return cls(model, layers, head[0], head[1])

    def applies(self) -> bool:
        """Whether the lean forward may run now (see :meth:`LeanLayers.applies`)."""
        return (not torch.is_grad_enabled() and self.embed.device.type == "cpu"
                and self.embed.dtype == self.head.dtype == self.layers.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        keep_last: bool = False,
        hidden_at: tuple[int, ...] = (),
    ) -> LeanOutput:
        """One forward of ``input_ids`` ``[B, T]`` at RoPE ``positions`` ``[B, T]`` over ``cache``
        (``mask`` as in :meth:`LeanLayers.run`).

        ``keep_last``: logits of the last row only (``[B, 1, V]``), else every row (``[B, T, V]``).
        ``hidden_at``: transformers ``hidden_states`` indices to return (0..L).
        """
        x = F.embedding(input_ids, self.embed)  # [B, T, H]
        x, hidden = self.layers.run(x, positions, cache, mask, hidden_at)
        x = rms_norm(x, self.w_norm, self.eps)
        if self.num_layers in hidden_at:
            hidden[self.num_layers] = x
        rows = x[:, -1:] if keep_last else x  # [B, T_keep, H]
        H = x.shape[-1]
        logits = torch.ops.mkldnn._linear_pointwise(rows.reshape(-1, H), self.head, self.head_bias, "none", [], "")
        return LeanOutput(logits=logits.view(x.shape[0], rows.shape[1], -1), hidden=hidden)
