"""The EAGLE-3 draft network (docs/algorithms.md §3): fusion, one decoder layer, draft LM head.

Shapes (H = the target's hidden size, N_d = draft vocabulary, V = target vocabulary):

* fusion        ``g = W_fc f``,   f = [h_low; h_mid; h_high] in R^{3H}, g in R^H (no bias);
* token input   ``e = Emb(x)``   with the target's frozen embedding (not stored here);
* decoder layer ``u = [RMSNorm_e(e); RMSNorm_g(g)]`` in R^{2H},
                ``y = g + W_o Attn(W_q u, W_k u, W_v u)``,
                ``y = y + W_down(silu(W_gate n) * W_up n)``, ``n = RMSNorm_post(y)``;
* head          ``logits = W_lm RMSNorm_final(y)`` over the draft vocabulary; ``y`` is also the
                hidden input of the next draft depth (it replaces g).

The draft vocabulary maps to target ids with ``target_id = i + d2t[i]``; ``t2d[v]`` marks the
target ids that are in it. Attention itself lives with its callers (the inference KV cache in
:mod:`speculation.drafters.eagle3`, the training-time-test pattern in ``adaptation``); this
module provides the projections before and the residual blocks after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speculation.drafters.head import DraftVocabMixin, HeadArch, RMSNorm, rotate_half, target_dims


@dataclass(frozen=True)
class Eagle3Arch(HeadArch):
    """Shape of an EAGLE-3 head; derived from the target's config plus the draft vocabulary size."""

    @classmethod
    def from_target_config(cls, config, target_vocab_size: int, draft_vocab_size: int) -> "Eagle3Arch":
        """Width, heads and FFN size of the target (a Llama-style HF config)."""
        return cls(**target_dims(config), target_vocab_size=int(target_vocab_size),
                   draft_vocab_size=int(min(draft_vocab_size, target_vocab_size)))


class Eagle3Model(DraftVocabMixin, nn.Module):
    """Fusion + one decoder layer with a 2H attention input + draft LM head (see module docstring)."""

    def __init__(self, arch: Eagle3Arch) -> None:
        super().__init__()
        self.arch = arch
        H, nh, nkv, hd = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.embed_norm = RMSNorm(H, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_norm = RMSNorm(H, arch.rms_norm_eps)
        self.gate_proj = nn.Linear(H, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, H, bias=False)
        self.final_norm = RMSNorm(H, arch.rms_norm_eps)
        self.lm_head = nn.Linear(H, arch.draft_vocab_size, bias=False)
        self._register_buffers()
        self.reset_parameters()
        self.forward_calls = 0
        """Inference forwards run by drafters on this network (a batched forward counts once)."""

    # ------------------------------------------------------------------ init
    def reset_parameters(self, std: float = 0.02) -> None:
        self._default_init(std)

    # ------------------------------------------------------------------ pieces of the forward
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[..., 3H] -> [..., H]``: g = W_fc f."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def qkv(
        self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and rotated keys/values of the 2H attention input.

        Args:
            emb: ``[B, S, H]`` token embeddings e; hidden: ``[B, S, H]`` hidden input g (or y).
            positions: ``[S]`` RoPE positions shared by the batch, or ``[B, S]`` per row.
        Returns:
            q ``[B, nh, S, hd]``, k ``[B, nkv, S, hd]``, v ``[B, nkv, S, hd]``.
        """
        a = self.arch
        B, S, _ = hidden.shape
        u = torch.cat((self.embed_norm(emb.to(hidden.dtype)), self.hidden_norm(hidden)), dim=-1)  # [B, S, 2H]
        q = self.q_proj(u).view(B, S, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, q.dtype)  # [S, hd] or [B, S, hd]
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, S, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual blocks after attention: ``[B, S, H], [B, S, nh*hd] -> y [B, S, H]``."""
        y = hidden + self.o_proj(attn.to(hidden.dtype))
        n = self.post_norm(y)
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., N_d]`` draft logits."""
        return self.lm_head(self.final_norm(y))

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.arch.head_dim)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
