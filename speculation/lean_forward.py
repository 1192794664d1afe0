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


class LeanDecoder:
    """The forward of a fused, packed Llama-family causal LM as one loop over its layers.

    Build it with :meth:`from_model` (None when the model does not qualify). The tensors are the
    model's own (shared, not copied); like the packed copies, it must be rebuilt if the weights
    change.
    """

    def __init__(self, model: nn.Module, layers: list[_Layer], head: torch.Tensor, head_bias: torch.Tensor | None) -> None:
        cfg = model.config
        self.model = model
        self.layers = layers
        self.embed: torch.Tensor = model.model.embed_tokens.weight  # [V_in, H]
        self.w_norm: torch.Tensor = model.model.norm.weight  # [H]
        self.rotary: nn.Module = model.model.rotary_emb
        self.head, self.head_bias = head, head_bias
        self.hidden_size: int = int(cfg.hidden_size)
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps: float = float(cfg.rms_norm_eps)
        self.scaling: float = float(model.model.layers[0].self_attn.scaling)

    @classmethod
    def from_model(cls, model: nn.Module) -> LeanDecoder | None:
        """The lean forward of ``model``, or None where ``model`` is not a fused, packed decoder
        of :data:`LEAN_MODEL_TYPES` with the structure in the module docstring."""
        cfg = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if cfg is None or inner is None or getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
            return None
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            return None
        if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "attn_logit_softcapping", None):
            return None
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            return None
        if type(getattr(inner, "norm", None)) is not FusedRMSNorm or not hasattr(inner, "rotary_emb"):
            return None
        head = _packed(model.get_output_embeddings())
        if head is None or not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding):
            return None
        layers = []
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
                return None
            if getattr(attn, "sliding_window", None) is not None:
                return None
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
            if not all(type(p) is GroupedProjection for p in projections):
                return None
            qkv, gu = attn.q_proj.group, mlp.gate_proj.group
            if not (attn.k_proj._group is qkv and attn.v_proj._group is qkv and mlp.up_proj._group is gu):
                return None
            wo, down = _packed(attn.o_proj), _packed(mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if wo is None or down is None or down[1] is not None or gu.bias is not None:
                return None
            if not all(type(n) is FusedRMSNorm for n in norms):
                return None
            layers.append(_Layer(
                w_in=norms[0].weight, qkv=qkv.packed, qkv_bias=qkv.bias, qkv_sizes=list(qkv.sizes),
                wo=wo[0], wo_bias=wo[1], w_post=norms[1].weight, gate_up=gu.packed,
                gate_up_sizes=list(gu.sizes), down=down[0],
            ))
        if not layers:
            return None
        return cls(model, layers, head[0], head[1])

    def applies(self) -> bool:
        """Whether the lean forward may run now: weights on the CPU, in the packed copies' dtype,
        no gradient wanted (oneDNN's packed op has no backward)."""
        return (not torch.is_grad_enabled() and self.embed.device.type == "cpu"
                and self.embed.dtype == self.head.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        keep_last: bool = False,
        hidden_at: tuple[int, ...] = (),
    ) -> LeanOutput:
        """One forward of ``input_ids`` ``[B, T]`` at RoPE ``positions`` ``[B, T]``, appending its
        keys and values to ``cache`` (any transformers ``Cache``: ``cache.update(k, v, layer)``).

        ``mask``: None for causal attention over the cache (a decode step, or a prefill of an empty
        cache), else a boolean ``[B, 1, T, n + T]`` (True = attend), as transformers takes it.
        ``keep_last``: logits of the last row only (``[B, 1, V]``), else every row (``[B, T, V]``).
        ``hidden_at``: transformers ``hidden_states`` indices to return (0..L).
        """
        B, T = input_ids.shape
        H, D, nq, nkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        lp = torch.ops.mkldnn._linear_pointwise
        wanted = set(hidden_at)
        hidden: dict[int, torch.Tensor] = {}
        x = F.embedding(input_ids, self.embed)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        gqa = nq // nkv
        causal = mask is None and T > 1
        for i, layer in enumerate(self.layers):
            if i in wanted:
                hidden[i] = x
            h = rms_norm(x, layer.w_in, self.eps).view(B * T, H)
            q, k, v = lp(h, layer.qkv, layer.qkv_bias, "none", [], "").split(layer.qkv_sizes, -1)
            q = q.view(B, T, nq, D).transpose(1, 2)  # [B, nq, T, D]
            k = k.view(B, T, nkv, D).transpose(1, 2)  # [B, nkv, T, D]
            v = v.view(B, T, nkv, D).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = cache.update(k, v, i)  # [B, nkv, n + T, D]
            if gqa > 1 and mask is not None:
                k, v = _repeat_kv(k, gqa), _repeat_kv(v, gqa)
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                   scale=self.scaling, enable_gqa=gqa > 1)
            a = a.transpose(1, 2).reshape(B * T, nq * D)  # [B T, nq D]
            x = x + lp(a, layer.wo, layer.wo_bias, "none", [], "").view(B, T, H)
            h = rms_norm(x, layer.w_post, self.eps).view(B * T, H)
            g, u = lp(h, layer.gate_up, None, "none", [], "").split(layer.gate_up_sizes, -1)
            x = x + lp(F.silu(g) * u, layer.down, None, "none", [], "").view(B, T, H)
        x = rms_norm(x, self.w_norm, self.eps)
        if len(self.layers) in wanted:
            hidden[len(self.layers)] = x
        rows = x[:, -1:] if keep_last else x  # [B, T_keep, H]
        logits = lp(rows.reshape(-1, H), self.head, self.head_bias, "none", [], "")
        return LeanOutput(logits=logits.view(B, rows.shape[1], -1), hidden=hidden)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves on the last dim (RoPE's rotation)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, nkv, S, D] -> [B, nkv * n_rep, S, D]``, each KV head repeated for its query group."""
    b, nkv, s, d = x.shape
    return x[:, :, None].expand(b, nkv, n_rep, s, d).reshape(b, nkv * n_rep, s, d)
