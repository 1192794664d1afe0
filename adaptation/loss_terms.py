"""Pieces every family's training loss uses: sequence shifts and the soft cross-entropy.

Notation (one right-padded sequence of length S): ``x_t`` tokens, ``z_t`` the target's logits at
t (they predict ``x_{t+1}``; only the top-K are cached), ``m_t`` = 1 where ``x_t`` is an assistant
token. A draft position that predicts ``x_{t+n+1}`` reads its targets at ``shift(z, n)[t]`` and its
mask at ``shift(m, n + 1)[t]``.

Soft cross-entropy against the target, restricted to the draft vocabulary:

    P(v)  = softmax(top-K z over the tokens in the draft vocabulary)(v)
    L     = -sum_v P(v) log q(v)          (q: the draft distribution; fp32)
"""

from __future__ import annotations

import torch


def shift(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, padded with ``fill`` at the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def soft_cross_entropy(
    logits: torch.Tensor, values: torch.Tensor, draft_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``-sum_v P(v) log softmax(logits)(v)`` with P = softmax of the kept top-K values.

    Args:
        logits: ``[M, N_d]`` draft logits; values: ``[M, K]`` target top-K logits;
        draft_idx: ``[M, K]`` draft ids of the top-K tokens, -1 for tokens outside the draft vocab.
    Returns:
        (loss ``[M]``, correct ``[M]`` bool: draft argmax == target argmax).
    """
    logits = logits.float()
    present = draft_idx >= 0
    p = torch.softmax(values.float().masked_fill(~present, float("-inf")), dim=-1)  # [M, K]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [M, 1]
    logq = logits.gather(1, draft_idx.clamp(min=0)) - lse  # [M, K]
    loss = -(p * logq).masked_fill(~present, 0.0).sum(-1)
    correct = logits.argmax(-1) == draft_idx[:, 0]
    return loss, correct
