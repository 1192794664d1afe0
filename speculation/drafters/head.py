"""Pieces shared by the draft heads (EAGLE-3, SpecBlock): RMSNorm, the RoPE rotation, the target
dimensions a head copies, the reduced draft vocabulary, initialisation and untrained heads.

A head drafts over N_d of the target's V tokens. Buffers: ``d2t`` ``[N_d]`` offsets with
``target_id = i + d2t[i]``, and ``t2d`` ``[V]`` marking the target ids in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w``, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split on the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def target_dims(config: Any) -> dict[str, Any]:
    """Width, heads, FFN size, norm epsilon and RoPE base of a Llama-style HF config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    return {
        "hidden_size": int(cfg.hidden_size),
        "num_heads": heads,
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        "intermediate_size": int(cfg.intermediate_size),
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
    }


@dataclass(frozen=True)
class HeadArch:
    """What every draft head copies from the target, plus its draft vocabulary size."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    draft_vocab_size: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, target_vocab_size={self.target_vocab_size}], got {self.draft_vocab_size}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class DraftVocabMixin:
    """d2t/t2d and RoPE buffers, default init and the maps between draft and target ids (for an
    ``nn.Module`` head with ``arch`` (vocab sizes, head_dim, rope_theta) and ``lm_head``)."""

    def _register_buffers(self: nn.Module) -> None:
        a = self.arch
        self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.long))  # [N_d] offsets
        self.register_buffer("t2d", torch.zeros(a.target_vocab_size, dtype=torch.bool))  # [V]
        self.t2d[: a.draft_vocab_size] = True
        hd = a.head_dim
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd/2]

    def _default_init(self: nn.Module, std: float) -> None:
        """Linear weights ~ N(0, std), norm weights 1."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., hd]`` for integer ``positions`` ``[...]`` (Llama's rotate-half convention)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Set d2t/t2d from the sorted target ids of the draft vocabulary (``[N_d]`` int64)."""
        ids = draft_to_target.to(torch.long).flatten()
        if ids.numel() != self.arch.draft_vocab_size:
            raise ValueError(f"need {self.arch.draft_vocab_size} draft ids, got {ids.numel()}")
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= self.arch.target_vocab_size:
            raise ValueError("draft ids must be strictly increasing target ids in [0, V)")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def init_head_from_target(self, target_head_weight: torch.Tensor) -> None:
        """``W_lm[i] = W_target[draft_ids[i]]`` (the target's output rows of the kept tokens)."""
        self.lm_head.weight.copy_(target_head_weight[self.draft_ids()].to(self.lm_head.weight.dtype))

    def draft_ids(self) -> torch.Tensor:
        """``[N_d]`` target id of every draft token: ``i + d2t[i]``."""
        return torch.arange(self.arch.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> torch.Tensor:
        """``[V]`` draft id of every target id, -1 where the token is not in the draft vocabulary."""
        out = torch.full((self.arch.target_vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        out[self.draft_ids()] = torch.arange(self.arch.draft_vocab_size, device=self.d2t.device)
        return out


def untrained_head(model_cls: type, arch: Any, target: Any, seed: int) -> Any:
    """A randomly initialised head (seeded, global RNG untouched) whose draft vocabulary is the
    first N_d token ids and whose LM head starts from the target's output rows of those ids."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(arch)
    model.set_vocab(torch.arange(arch.draft_vocab_size))
    model.init_head_from_target(target.model.get_output_embeddings().weight.detach().float())
    return model
