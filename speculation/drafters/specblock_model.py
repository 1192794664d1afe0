"""The SpecBlock draft network (docs/algorithms.md §4): K slots per forward, layer-wise shift,
rank head.

Shapes: H = the target's hidden size, K = block size, N_d = draft vocabulary, L_d = layers.
One block at anchor i (the pair ``(f_i, x_{i+1})``, or an inherited leaf) emits K slots; slot k
predicts ``x_{i+2+k}``:

* condition   ``c = RMSNorm_c(W_c f_i)`` in block 1 (``condition_proj``, 3H -> H);
              ``c = RMSNorm_c(d_prev)`` in later blocks (inherits the slot it starts from);
* token       ``e = RMSNorm_e(Emb(x_{i+1}))`` (the target's frozen embedding, not stored here);
* query       ``u_k = RMSNorm_u(Q[k])``, ``Q in R^{K x H}``;
* fusion      ``z^0_k = W_fuse [c; e; u_k]`` (3H -> H, no bias);
* layer l     a pre-norm Llama layer; before every layer l >= 2 the **layer-wise shift**
              ``z~_k = W_shift^(l-1) [z_k; z_{k-1}]`` (``z_{-1} := z_0``) *replaces* the hidden
              state (no residual), carrying the previous slot into the next;
* outputs     ``d_k`` = the last layer's output (the condition a child block inherits);
              ``logits_k = W_lm RMSNorm_f(d_k)`` over the draft vocabulary;
* rank head   ``r_k = W_2 silu(W_1 [RMSNorm_f(d_k).detach(); phi(logits_k)])`` (H+15 -> 256 -> 4),
              where phi are 15 gradient-free features of the top-20 draft logits
              (:func:`rank_features`); the class buckets the rank of the target's argmax in the
              draft distribution (:class:`RankClass`).

RoPE position of slot k at anchor i is ``i + 1 + k`` in every block (later blocks reuse block 1's
positions; training and inference agree). Attention is supplied by the caller through an
``attend(layer, q, k, v)`` callback, so one :meth:`SpecBlockModel.block` serves the training
masks, the inference caches and the unrolled reference used in the tests.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speculation.drafters.head import DraftVocabMixin, HeadArch, RMSNorm, rotate_half, target_dims

RANK_TOPK = 20
"""Draft logits the rank features look at (both in training and at inference)."""
RANK_FEATURES = 15
RANK_HIDDEN = 256


class RankClass(enum.IntEnum):
    """Where the target's argmax ranks in the draft distribution (1-based rank)."""

    CONTINUE = 0  # rank 1: the greedy slot is right
    BRANCH_FEW = 1  # ranks 2-4
    BRANCH_MANY = 2  # ranks 5-10
    GIVE_UP = 3  # rank > 10


def rank_bucket(rank: torch.Tensor) -> torch.Tensor:
    """1-based ranks ``[...]`` -> :class:`RankClass` values ``[...]`` (int64)."""
    r = rank.to(torch.long)
    return torch.where(r <= 1, 0, torch.where(r <= 4, 1, torch.where(r <= 10, 2, 3)))


@dataclass(frozen=True)
class SpecBlockArch(HeadArch):
    """Shape of a SpecBlock head; width, heads and FFN come from the target's config."""

    block_size: int = 4
    num_layers: int = 2
    shift: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.block_size <= 16:
            raise ValueError(f"block_size must be in [1, 16], got {self.block_size}")
        if not 1 <= self.num_layers <= 8:
            raise ValueError(f"num_layers must be in [1, 8], got {self.num_layers}")

    @classmethod
    def from_target_config(
        cls, config, target_vocab_size: int, draft_vocab_size: int, block_size: int = 4, num_layers: int = 2,
        shift: bool = True, intermediate_size: int | None = None,
    ) -> "SpecBlockArch":
        """Width and heads of the target; FFN width the target's unless ``intermediate_size`` is given."""
        dims = target_dims(config)
        if intermediate_size:
            dims["intermediate_size"] = int(intermediate_size)
        return cls(
            **dims, target_vocab_size=int(target_vocab_size),
            draft_vocab_size=int(min(draft_vocab_size, target_vocab_size)), block_size=int(block_size),
            num_layers=int(num_layers), shift=bool(shift),
        )


def rank_features(logits: torch.Tensor) -> torch.Tensor:
    """``[..., N_d]`` draft logits -> ``[..., 15]`` rank features (no gradient).

    With l_1 >= ... >= l_20 the top-20 logits and Z = logsumexp(l_1..l_20):
    ``[l_j - Z (j = 1..10), l_1 - l_2, l_1 - l_3, l_1 - l_5, exp(l_1 - Z), H(softmax(l_1..l_20))]``.
    A draft vocabulary under 20 tokens is padded with logits 30 below its smallest.
    """
    with torch.no_grad():
        x = logits.detach().float()
        top = x.topk(min(RANK_TOPK, x.shape[-1]), dim=-1).values  # [..., <=20]
        if top.shape[-1] < RANK_TOPK:
            pad = (top[..., -1:] - 30.0).expand(*top.shape[:-1], RANK_TOPK - top.shape[-1])
            top = torch.cat((top, pad), dim=-1)
        z = torch.logsumexp(top, dim=-1, keepdim=True)
        logp = top - z  # [..., 20]
        ent = -(logp.exp() * logp).sum(-1, keepdim=True)
        gaps = top[..., :1] - top[..., [1, 2, 4]]
        return torch.cat((logp[..., :10], gaps, logp[..., :1].exp(), ent), dim=-1)


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer split around attention (the caller attends)."""

    def __init__(self, arch: SpecBlockArch) -> None:
        super().__init__()
        H, nh, nkv, hd = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.input_norm = RMSNorm(H, arch.rms_norm_eps)
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_norm = RMSNorm(H, arch.rms_norm_eps)
        self.gate_proj = nn.Linear(H, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, H, bias=False)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        n = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q [B, nh, R*K, hd], k [B, nkv, R*K, hd], v) -> [B, nh, R*K, hd]``: the caller's
attention over its own keys (cache, training mask or reference) plus these rows' keys."""


class SpecBlockModel(DraftVocabMixin, nn.Module):
    """Condition/token/query fusion + L_d shifted decoder layers + draft LM head + rank head."""

    def __init__(self, arch: SpecBlockArch) -> None:
        super().__init__()
        self.arch = arch
        H, K = arch.hidden_size, arch.block_size
        eps = arch.rms_norm_eps
        self.condition_proj = nn.Linear(3 * H, H, bias=False)
        self.cond_norm = RMSNorm(H, eps)
        self.embed_norm = RMSNorm(H, eps)
        self.query_norm = RMSNorm(H, eps)
        self.queries = nn.Parameter(torch.zeros(K, H))
        self.fuse = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        n_shift = arch.num_layers - 1 if arch.shift else 0
        self.shift_proj = nn.ModuleList(nn.Linear(2 * H, H, bias=False) for _ in range(n_shift))
        self.final_norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, arch.draft_vocab_size, bias=False)
        self.rank_head = nn.Sequential(
            nn.Linear(H + RANK_FEATURES, RANK_HIDDEN, bias=False), nn.SiLU(), nn.Linear(RANK_HIDDEN, 4, bias=False)
        )
        self._register_buffers()
        self.reset_parameters()
        self.forward_calls = 0
        """Inference forwards run by drafters on this network (a batched forward counts once)."""

    # ------------------------------------------------------------------ init and vocab
    def reset_parameters(self, std: float = 0.02) -> None:
        self._default_init(std)
        nn.init.normal_(self.queries, std=std)
        H = self.arch.hidden_size
        with torch.no_grad():  # [I, 0]: the shift starts as the identity on the current slot
            for lin in self.shift_proj:
                lin.weight.zero_()
                lin.weight[:, :H].copy_(torch.eye(H))

    # ------------------------------------------------------------------ pieces
    def condition_from_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """Block-1 condition ``[..., 3H] -> [..., H]``: RMSNorm_c(W_c f)."""
        return self.cond_norm(self.condition_proj(aux.to(self.condition_proj.weight.dtype)))

    def condition_from_parent(self, d: torch.Tensor) -> torch.Tensor:
        """Inherited condition of a later block: RMSNorm_c(d_prev) (no projection)."""
        return self.cond_norm(d)

    def _shift(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """``[B, R, K, H]``: z~_k = W_shift [z_k; z_{k-1}] with z_{-1} := z_0 (before layer >= 2)."""
        prev = torch.cat((z[:, :, :1], z[:, :, :-1]), dim=2)
        return self.shift_proj[layer - 1](torch.cat((z, prev), dim=-1))

    def block(self, cond: torch.Tensor, token_emb: torch.Tensor, positions: torch.Tensor, attend: Attend,
              slots: int | None = None) -> torch.Tensor:
        """One block forward over R anchors/leaves at once.

        Args:
            cond: ``[B, R, H]`` conditions c (already normalised).
            token_emb: ``[B, R, H]`` raw token embeddings Emb(x).
            positions: ``[R, K']`` RoPE positions of the slots (shared by the batch), or ``[B, R, K']``.
            attend: the caller's attention (see :data:`Attend`); rows are ordered (r, k).
            slots: K' <= K slots to run (a prefix of the block; default all).
        Returns:
            d ``[B, R, K', H]``.
        """
        a = self.arch
        Kp = a.block_size if slots is None else slots
        B, R, H = cond.shape
        u = self.query_norm(self.queries[:Kp].to(cond.dtype))  # [K', H]
        c = cond[:, :, None].expand(B, R, Kp, H)
        e = self.embed_norm(token_emb.to(cond.dtype))[:, :, None].expand(B, R, Kp, H)
        z = self.fuse(torch.cat((c, e, u.expand(B, R, Kp, H)), dim=-1))  # [B, R, K', H]
        cos, sin = self.rope(positions.reshape(*positions.shape[:-2], R * Kp), z.dtype)  # [(B,) R*K', hd]
        if positions.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, R*K', hd]
        for li, layer in enumerate(self.layers):
            if li > 0 and a.shift:
                z = self._shift(li, z)
            n = layer.input_norm(z).reshape(B, R * Kp, H)
            q = layer.q_proj(n).view(B, R * Kp, a.num_heads, a.head_dim).transpose(1, 2)
            k = layer.k_proj(n).view(B, R * Kp, a.num_kv_heads, a.head_dim).transpose(1, 2)
            v = layer.v_proj(n).view(B, R * Kp, a.num_kv_heads, a.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            att = attend(li, q, k, v)  # [B, nh, R*K', hd]
            h = z + layer.o_proj(att.transpose(1, 2).reshape(B, R, Kp, -1).to(z.dtype))
            z = layer.mlp_residual(h)
        return z

    def logits(self, d: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., N_d]``."""
        return self.lm_head(self.final_norm(d))

    def rank_logits(self, d: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``[..., H], [..., N_d] -> [..., 4]`` class logits; no gradient reaches d or the drafter."""
        x = torch.cat((self.final_norm(d).detach(), rank_features(logits).to(d.dtype)), dim=-1)
        return self.rank_head(x)

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.arch.head_dim)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
