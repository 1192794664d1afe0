"""SpecBlock training forward: TTT blocks, the valid-prefix mask, position weights and the rank loss.

Notation for one right-padded sequence of length S (as in :mod:`adaptation.eagle3_loss`): ``x_t``
tokens, ``f_t`` aux features, ``z_t`` the target's (top-K) logits at t, ``m_t`` the assistant mask.

**Blocks.** Block 1 runs at every anchor i with condition ``W_c f_i`` and token ``x_{i+1}``; its
slot k predicts ``x_{i+2+k}`` (target ``z_{i+1+k}``). Before each later block, ``M ~ U{1..K}``
(shared by the batch) is drawn; the next block starts from slot M-1 of the previous one
(condition ``d[:, :, M-1]``, teacher-forced token ``x_{i+1+off+M}``), and ``off += M``. Slot k of a
block at offset ``off`` targets ``z_{i+1+off+k}``. RoPE positions are ``i+1+k`` in every block.

**Attention** (query (i, k) of block b):
* block-1 keys of anchors j < i (all slots);
* the TTT cache: keys of every earlier block b' at the same anchor, slots ``< M_b'``;
* its own block's keys at the same anchor, slots ``<= k``.
Block 1 has no TTT cache. This is what a leaf sees at inference (``drafters/specblock.py``).

**Draft loss.** With P = softmax of the target's top-K logits restricted to the draft vocabulary,

    base_k(i)  = m_{i+2+off+k} * [argmax z_{i+1+off+k} in the draft vocabulary]
    chain_0    = 1,  chain_{k+1} = chain_k * base_k * [argmax q_k = argmax P_k]   (valid prefix)
    L_{b,k}    = -sum_i chain_k base_k sum_v P log q_k / sum_i chain_k base_k
    L_draft    = sum_b sum_k w^k L_{b,k}                                          (w = 0.8)

The chain resets at every block. Without the valid-prefix mask (``valid_prefix=False``) chain = 1.
A position whose target is outside the draft vocabulary or the assistant text breaks the chain
(nothing after it can be accepted at inference either).

**Rank loss** (per block, pooled over slots): label ``t = bucket(rank of argmax P in q_k)``
(1 -> 0, 2-4 -> 1, 5-10 -> 2, > 10 -> 3); slot k counts only where the rank predictions at every
slot < k were right (reaches the first error inclusive); class frequency weight
``w_c = min(1, 10 / n_c)`` per slot and batch; soft label ``s(c|t) ∝ (1 + |c-t| + max(t-c, 0))^-2``;
distance weight ``1 + |t-p| + max(t-p, 0)`` for the predicted class p;

    L_rank = sum CE(s, softmax r) * dist * w_c / sum w_c

The rank head sees ``[RMSNorm(d).detach(); phi]``, so its loss trains only the rank head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptation.eagle3_loss import TTTBatch, _shift, soft_cross_entropy
from speculation.drafters.specblock_model import SpecBlockModel, rank_bucket


@dataclass
class BlockLossResult:
    """Loss and statistics of one training forward.

    ``slot_acc[b][k]``: top-1 agreement at block b, slot k on its counted rows (conditional on a
    valid prefix when the mask is on); ``slot_count[b][k]``: those rows; ``rank_acc``: rank-class
    accuracy over all counted rank rows. ``counted[b]`` ``[B*S, K]``: rows the draft loss counted;
    ``correct[b]``: top-1 agreement where it was computed (False elsewhere); ``hidden[b]``
    ``[B, S, K, H]``: the block's outputs d; ``slot_losses[b][k]``: the weighted term
    ``w^k L_{b,k}`` (None where no row counted), for diagnostics such as per-term gradient norms.
    """

    loss: torch.Tensor
    draft_loss: float
    rank_loss: float
    slot_acc: list[list[float]]
    slot_count: list[list[int]]
    rank_acc: float
    offsets: list[int]
    counted: list[torch.Tensor]
    correct: list[torch.Tensor]
    hidden: list[torch.Tensor]
    slot_losses: list[list[torch.Tensor | None]]


def valid_prefix(correct: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bool inputs -> ``[N, K]`` chain: chain_0 = 1, chain_{k+1} = chain_k & base_k & correct_k."""
    ok = (correct & base).to(torch.long)
    chain = torch.ones_like(ok)
    chain[:, 1:] = ok[:, :-1].cumprod(dim=1)
    return chain.bool()


def rank_soft_labels(t: torch.Tensor, classes: int = 4) -> torch.Tensor:
    """``[N]`` labels -> ``[N, C]`` soft labels ``s(c|t) ∝ (1 + |c-t| + max(t-c, 0))^-2``."""
    c = torch.arange(classes)[None, :]
    tt = t[:, None]
    w = (1.0 + (c - tt).abs() + (tt - c).clamp(min=0)).float().pow(-2.0)
    return w / w.sum(-1, keepdim=True)


def block_masks(S: int, K: int, ttt_valid: list[int]) -> torch.Tensor:
    """Attention mask of one block over ``[block-1 keys, TTT block keys..., own keys]``.

    Args:
        ttt_valid: ``M_b'`` of every earlier block (empty for block 1).
    Returns:
        ``[S*K, (1 + len(ttt_valid)) * S*K]`` bool (module docstring, "Attention").
    """
    anchor = torch.arange(S).repeat_interleave(K)  # [S*K]
    slot = torch.arange(K).repeat(S)
    same = anchor[:, None] == anchor[None, :]
    own = same & (slot[None, :] <= slot[:, None])
    if not ttt_valid:
        return (anchor[None, :] < anchor[:, None]) | own
    parts = [(anchor[None, :] < anchor[:, None]) | (same & (slot[None, :] < ttt_valid[0]))]
    for m in ttt_valid[1:]:
        parts.append(same & (slot[None, :] < m))
    parts.append(own)
    return torch.cat(parts, dim=1)


def block_forward(
    model: SpecBlockModel,
    embed_weight: torch.Tensor,
    batch: TTTBatch,
    target_to_draft: torch.Tensor,
    blocks: int,
    generator: torch.Generator,
    position_weight: float = 0.8,
    valid_prefix_mask: bool = True,
    rank_weight: float = 1.0,
) -> BlockLossResult:
    """Unroll ``blocks`` TTT blocks over ``batch``; return the total loss (module docstring)."""
    a = model.arch
    K = a.block_size
    B, S, _ = batch.aux.shape
    in_vocab = target_to_draft >= 0
    pos = torch.arange(S)[:, None] + 1 + torch.arange(K)  # [S, K]
    keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per block, per layer (k, v)
    ttt_valid: list[int] = []
    off = 0
    cond = model.condition_from_aux(batch.aux)  # [B, S, H]
    total = torch.zeros((), dtype=torch.float32)
    draft_sum = rank_sum = 0.0
    rank_right = rank_rows = 0
    slot_acc: list[list[float]] = []
    slot_count: list[list[int]] = []
    offsets: list[int] = []
    counted_all: list[torch.Tensor] = []
    correct_all: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []
    slot_losses: list[list[torch.Tensor | None]] = []
    d = None
    for b in range(blocks):
        if b > 0:
            M = int(torch.randint(1, K + 1, (1,), generator=generator))
            cond = model.condition_from_parent(d[:, :, M - 1])  # [B, S, H]
            ttt_valid.append(M)
            off += M
        offsets.append(off)
        emb = F.embedding(_shift(batch.input_ids, 1 + off), embed_weight)  # [B, S, H]
        mask = block_masks(S, K, ttt_valid)
        layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _kv=layer_kv, _mask=mask):
            _kv.append((k, v))
            ks = torch.cat([kv[li][0] for kv in keys] + [k], dim=2)  # [B, nkv, (b+1)*S*K, hd]
            vs = torch.cat([kv[li][1] for kv in keys] + [v], dim=2)
            return F.scaled_dot_product_attention(q, ks, vs, attn_mask=_mask, enable_gqa=True)

        d = model.block(cond, emb, pos, attend)  # [B, S, K, H]
        keys.append(layer_kv)
        hidden.append(d)

        # ---- per-slot targets and losses
        chain = torch.ones(B * S, dtype=torch.bool)
        rchain = torch.ones(B * S, dtype=torch.bool)
        accs, counts = [], []
        terms: list[torch.Tensor | None] = []
        counted = torch.zeros(B * S, K, dtype=torch.bool)
        correct_bk = torch.zeros(B * S, K, dtype=torch.bool)
        rank_terms, rank_weights = [], []
        for k in range(K):
            top_idx = _shift(batch.topk_indices, 1 + off + k).reshape(B * S, -1)  # [BS, topK]
            top_val = _shift(batch.topk_values, 1 + off + k).reshape(B * S, -1)
            base = (_shift(batch.loss_mask, 2 + off + k, False).reshape(-1) & in_vocab[top_idx[:, 0]])
            draft_rows = base & chain if valid_prefix_mask else base
            need = draft_rows | (base & rchain)
            rows = need.nonzero().squeeze(-1)
            if rows.numel() == 0:
                accs.append(float("nan"))
                terms.append(None)
                counts.append(0)
                chain = torch.zeros_like(chain)
                rchain = torch.zeros_like(rchain)
                continue
            d_rows = d[:, :, k].reshape(B * S, -1)[rows]
            logits = model.logits(d_rows)  # [R, N_d]
            didx = target_to_draft[top_idx[rows]]
            loss_rows, correct = soft_cross_entropy(logits, top_val[rows], didx)
            use = draft_rows[rows]
            counted[rows, k] = use
            correct_bk[rows, k] = correct
            if bool(use.any()):
                lk = loss_rows[use].mean()
                terms.append((position_weight**k) * lk)
                total = total + terms[-1]
                draft_sum += float(lk.detach()) * position_weight**k
                accs.append(float(correct[use].float().mean()))
            else:
                accs.append(float("nan"))
                terms.append(None)
            counts.append(int(use.sum()))
            new_chain = torch.zeros_like(chain)
            new_chain[rows] = correct & use
            chain = new_chain
            # rank head
            ruse = (base & rchain)[rows]
            if rank_weight > 0 and bool(ruse.any()):
                lf = logits.detach().float()[ruse]
                tgt = lf.gather(1, didx[ruse, :1])  # [r, 1]
                rank = 1 + (lf > tgt).sum(-1)
                t = rank_bucket(rank)
                r_logits = model.rank_logits(d_rows[ruse], logits[ruse]).float()
                pred = r_logits.argmax(-1)
                ce = -(rank_soft_labels(t) * torch.log_softmax(r_logits, -1)).sum(-1)
                dist = 1.0 + (t - pred).abs() + (t - pred).clamp(min=0)
                n_c = torch.bincount(t, minlength=4).float()
                w = (10.0 / n_c.clamp(min=1)).clamp(max=1.0)[t]
                rank_terms.append(ce * dist * w)
                rank_weights.append(w)
                rank_right += int((pred == t).sum())
                rank_rows += int(t.numel())
                new_r = torch.zeros_like(rchain)
                new_r[rows[ruse]] = pred == t
                rchain = new_r
            else:
                rchain = torch.zeros_like(rchain)
        if rank_terms:
            lr = torch.cat(rank_terms).sum() / torch.cat(rank_weights).sum()
            total = total + rank_weight * lr
            rank_sum += float(lr.detach())
        slot_acc.append(accs)
        slot_count.append(counts)
        counted_all.append(counted)
        correct_all.append(correct_bk)
        slot_losses.append(terms)
    return BlockLossResult(
        loss=total, draft_loss=draft_sum, rank_loss=rank_sum, slot_acc=slot_acc, slot_count=slot_count,
        rank_acc=rank_right / rank_rows if rank_rows else float("nan"), offsets=offsets,
        counted=counted_all, correct=correct_all, hidden=hidden, slot_losses=slot_losses,
    )
