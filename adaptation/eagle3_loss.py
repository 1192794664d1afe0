"""Training-time test (TTT) for the EAGLE-3 head: unrolled draft steps and the soft loss.

Notation for one sequence of length S: ``x_t`` tokens, ``f_t`` the target's aux features at
token t, ``z_t`` the target's logits at t (they predict ``x_{t+1}``; only the top-K are cached),
``m_t`` = 1 where ``x_t`` is an assistant token.

Step j = 0..J-1 at index t feeds the pair ``(h^j_t, x_{t+1+j})`` at RoPE position ``t + j`` and
predicts ``x_{t+2+j}``, where ``h^0 = W_fc f`` and ``h^j = y^{j-1}`` (the previous step's output).
Attention at step j: the query at t sees the step-0 keys at positions <= t (causal) and the keys
of steps 1..j at the same index t only; that is what a depth-(j+1) draft node sees at inference
(the committed context plus its own ancestors).

Loss of step j (soft cross-entropy against the target, restricted to the draft vocabulary):

    P_t  = softmax(top-K z_{t+1+j} over the tokens in the draft vocabulary)
    L_j  = -(1 / |M_j|) sum_{t in M_j} sum_v P_t(v) log q_j(v | t)
    M_j  = {t : m_{t+2+j} = 1 and argmax z_{t+1+j} is in the draft vocabulary}
    L    = sum_j decay^j L_j                      (decay = 0.8)

The LM head runs only on rows in M_j; log-softmax and the loss are computed in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculation.drafters.eagle3_model import Eagle3Model


@dataclass
class TTTBatch:
    """A right-padded batch of cached target features.

    Attributes:
        aux: ``[B, S, 3H]`` aux features f_t.
        input_ids: ``[B, S]`` int64 tokens x_t (0 in padding).
        loss_mask: ``[B, S]`` bool m_t (False in padding).
        topk_values: ``[B, S, K]`` the target's top-K logits at t (descending).
        topk_indices: ``[B, S, K]`` int64 their token ids.
        num_tokens: real (unpadded) tokens in the batch.
    """

    aux: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    topk_values: torch.Tensor
    topk_indices: torch.Tensor
    num_tokens: int = 0


@dataclass
class TTTResult:
    """Loss and per-step statistics of one TTT forward."""

    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_count: list[int]


def _shift(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, padded with ``fill`` at the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, nkv, S, hd] -> [B, nkv * n_rep, S, hd]`` (head h uses kv head h // n_rep)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


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


def ttt_unroll(
    model: Eagle3Model, embed_weight: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(j, y^j)`` with ``y^j`` ``[B, S, H]`` for j = 0..steps-1 (module docstring)."""
    a = model.arch
    B, S, _ = aux.shape
    n_rep = a.num_heads // a.num_kv_heads
    scale = model.attn_scale
    pos0 = torch.arange(S)
    causal = torch.ones(S, S, dtype=torch.bool).tril()  # [S, S]
    hidden = model.fuse(aux)  # [B, S, H]
    kr = vr = None  # step-0 keys/values, repeated to nh heads: [B, nh, S, hd]
    extra_k: list[torch.Tensor] = []  # steps 1..j, repeated: [B, nh, S, hd] each
    extra_v: list[torch.Tensor] = []
    for j in range(steps):
        # 1. inputs of step j: token x_{t+1+j}, hidden h^j_t, position t + j
        emb = F.embedding(_shift(input_ids, 1 + j), embed_weight)  # [B, S, H]
        q, k, v = model.qkv(emb, hidden, pos0 + j)  # [B, nh, S, hd], [B, nkv, S, hd] x2
        # 2. attention: causal over step 0, plus the same-index keys of steps 1..j
        if j == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if steps > 1:
                kr, vr = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        else:
            extra_k.append(_repeat_kv(k, n_rep))
            extra_v.append(_repeat_kv(v, n_rep))
            ctx = (q @ kr.transpose(-1, -2)) * scale  # [B, nh, S, S]
            ctx = ctx.masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * ki).sum(-1) for ki in extra_k], dim=-1) * scale  # [B, nh, S, j]
            w = torch.softmax(torch.cat((ctx, diag), dim=-1).float(), dim=-1).to(q.dtype)
            attn = w[..., :S] @ vr
            for i, vi in enumerate(extra_v):
                attn = attn + w[..., S + i, None] * vi
        # 3. residual blocks; y^j is the next step's hidden input
        hidden = model.finish(hidden, attn.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]
        yield j, hidden


def ttt_forward(
    model: Eagle3Model,
    embed_weight: torch.Tensor,
    batch: TTTBatch,
    steps: int,
    target_to_draft: torch.Tensor,
    decay: float = 0.8,
) -> TTTResult:
    """Unroll ``steps`` draft steps over ``batch`` and return the weighted loss (module docstring)."""
    B, S, _ = batch.aux.shape
    in_vocab = target_to_draft >= 0
    total = torch.zeros((), dtype=torch.float32)
    step_loss, step_acc, step_count = [], [], []
    for j, y in ttt_unroll(model, embed_weight, batch.aux, batch.input_ids, steps):
        # loss on rows whose predicted token x_{t+2+j} is an assistant token in the draft vocab
        top_idx = _shift(batch.topk_indices, 1 + j)  # [B, S, K]
        top_val = _shift(batch.topk_values, 1 + j)
        mask = _shift(batch.loss_mask, 2 + j, False) & in_vocab[top_idx[..., 0]]
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        if rows.numel():
            logits = model.logits(y.reshape(B * S, -1)[rows])  # [M, N_d]
            draft_idx = target_to_draft[top_idx.reshape(B * S, -1)[rows]]
            loss_rows, correct = soft_cross_entropy(logits, top_val.reshape(B * S, -1)[rows], draft_idx)
            loss_j = loss_rows.mean()
            total = total + (decay**j) * loss_j
            step_loss.append(float(loss_j.detach()))
            step_acc.append(float(correct.float().mean()))
        else:
            step_loss.append(float("nan"))
            step_acc.append(float("nan"))
        step_count.append(int(rows.numel()))
    return TTTResult(loss=total, step_loss=step_loss, step_acc=step_acc, step_count=step_count)
