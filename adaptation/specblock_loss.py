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

:class:`SpecBlockFamily` is SpecBlock's training plug-in (:mod:`adaptation.family`): this loss,
the head, the held-out block-1 metrics (:func:`heldout_metrics`) and the drafter used for the tau
measurement. One unrolled step is one TTT block.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from adaptation.batches import FeatureBatch
from adaptation.family import StepLoss, check_knob
from adaptation.loss_terms import shift, soft_cross_entropy
from speculation.config import SpecBlockConfig, to_dict
from speculation.drafters.checkpoint import SPECBLOCK, CheckpointKind
from speculation.drafters.specblock import SpecBlockDrafter
from speculation.drafters.specblock_model import SpecBlockArch, SpecBlockModel, rank_bucket


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
    c = torch.arange(classes, device=t.device)[None, :]
    tt = t[:, None]
    w = (1.0 + (c - tt).abs() + (tt - c).clamp(min=0)).float().pow(-2.0)
    return w / w.sum(-1, keepdim=True)


def block_masks(S: int, K: int, ttt_valid: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Attention mask of one block over ``[block-1 keys, TTT block keys..., own keys]``.

    Args:
        ttt_valid: ``M_b'`` of every earlier block (empty for block 1).
    Returns:
        ``[S*K, (1 + len(ttt_valid)) * S*K]`` bool (module docstring, "Attention").
    """
    anchor = torch.arange(S, device=device).repeat_interleave(K)  # [S*K]
    slot = torch.arange(K, device=device).repeat(S)
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
    batch: FeatureBatch,
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
    dev = batch.aux.device
    pos = torch.arange(S, device=dev)[:, None] + 1 + torch.arange(K, device=dev)  # [S, K]
    keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per block, per layer (k, v)
    ttt_valid: list[int] = []
    off = 0
    cond = model.condition_from_aux(batch.aux)  # [B, S, H]
    total = torch.zeros((), dtype=torch.float32, device=dev)
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
        emb = F.embedding(shift(batch.input_ids, 1 + off), embed_weight)  # [B, S, H]
        mask = block_masks(S, K, ttt_valid, dev)
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
        chain = torch.ones(B * S, dtype=torch.bool, device=dev)
        rchain = torch.ones(B * S, dtype=torch.bool, device=dev)
        accs, counts = [], []
        terms: list[torch.Tensor | None] = []
        counted = torch.zeros(B * S, K, dtype=torch.bool, device=dev)
        correct_bk = torch.zeros(B * S, K, dtype=torch.bool, device=dev)
        rank_terms, rank_weights = [], []
        for k in range(K):
            top_idx = shift(batch.topk_indices, 1 + off + k).reshape(B * S, -1)  # [BS, topK]
            top_val = shift(batch.topk_values, 1 + off + k).reshape(B * S, -1)
            base = (shift(batch.loss_mask, 2 + off + k, False).reshape(-1) & in_vocab[top_idx[:, 0]])
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


def heldout_metrics(
    model: SpecBlockModel, embed_weight: torch.Tensor, target_to_draft: torch.Tensor,
    batches: Iterable[FeatureBatch], position_weight: float, rank_weight: float,
) -> dict[str, float]:
    """Block-1 metrics on held-out features, always under the valid-prefix mask:

    ``heldout.acc_k``: top-1 agreement at slot k given slots < k were right;
    ``heldout.prefix_len``: mean right prefix of a block, sum_k P(slots 0..k all right);
    ``heldout.rank_acc``: rank-class accuracy; ``heldout.loss``: the total loss.
    """
    K = model.arch.block_size
    right = [0] * K
    rows = [0] * K
    rank_right = rank_rows = 0
    loss_sum, n_batches = 0.0, 0
    for batch in batches:
        res = block_forward(model, embed_weight, batch, target_to_draft, 1, torch.Generator().manual_seed(0),
                            position_weight=position_weight, valid_prefix_mask=True, rank_weight=rank_weight)
        counted, correct = res.counted[0], res.correct[0]
        for k in range(K):
            rows[k] += int(counted[:, k].sum())
            right[k] += int((counted[:, k] & correct[:, k]).sum())
        if not math.isnan(res.rank_acc):
            n = sum(res.slot_count[0])
            rank_right += res.rank_acc * n
            rank_rows += n
        loss_sum += float(res.loss)
        n_batches += 1
    out = {f"heldout.acc_{k}": (right[k] / rows[k] if rows[k] else math.nan) for k in range(K)}
    out["heldout.prefix_len"] = sum(right) / rows[0] if rows[0] else math.nan
    out["heldout.rank_acc"] = rank_right / rank_rows if rank_rows else math.nan
    out["heldout.loss"] = loss_sum / n_batches if n_batches else math.nan
    return out


EVAL_TREE_KEYS = ("total_tokens", "block_size", "max_blocks", "beam", "slot_widths")
"""The tau tree's knobs recorded in the training config."""


@dataclass(frozen=True)
class SpecBlockFamily:
    """SpecBlock's training plug-in (``graftblock train specblock``); its fields are its knobs.

    One unrolled step is one TTT block (``ttt_steps`` blocks per batch, each K slots).
    """

    block_size: int = 4
    """K: slots per block. Range [1, 16]."""
    num_layers: int = 2
    """Decoder layers of the head (the shift needs >= 2). Range [1, 8]."""
    intermediate_size: int = 0
    """FFN width of the head (0 = the target's). >= 0."""
    shift: bool = True
    """Layer-wise shift (False = the no-shift ablation)."""
    valid_prefix_mask: bool = True
    """Count slot k's loss only after a right prefix (False = the no-mask ablation)."""
    position_weight: float = 0.8
    """Weight of slot k is position_weight^k. Range (0, 1]."""
    rank_weight: float = 1.0
    """Weight of the rank head's loss (0 = no rank head training). Range [0, 100]."""
    eval_tree: SpecBlockConfig = field(default_factory=lambda: SpecBlockConfig(checkpoint="random"))
    """Tree knobs used for the tau measurement."""

    name: ClassVar[str] = "specblock"
    kind: ClassVar[CheckpointKind] = SPECBLOCK
    unroll_defaults: ClassVar[Mapping[str, int]] = MappingProxyType({"ttt_steps": 3, "curriculum_steps": 1})

    def __post_init__(self) -> None:
        check_knob("block_size", 1 <= self.block_size <= 16, "in [1, 16]", self.block_size)
        check_knob("num_layers", 1 <= self.num_layers <= 8, "in [1, 8]", self.num_layers)
        check_knob("intermediate_size", self.intermediate_size >= 0, ">= 0", self.intermediate_size)
        check_knob("shift", isinstance(self.shift, bool), "true or false", self.shift)
        check_knob("shift", not (self.shift and self.num_layers < 2),
                   "false with num_layers=1 (it acts between layers)", self.shift)
        check_knob("valid_prefix_mask", isinstance(self.valid_prefix_mask, bool), "true or false",
                   self.valid_prefix_mask)
        check_knob("position_weight", 0 < self.position_weight <= 1, "in (0, 1]", self.position_weight)
        check_knob("rank_weight", 0 <= self.rank_weight <= 100, "in [0, 100]", self.rank_weight)
        check_knob("eval_tree.block_size", self.eval_tree.block_size <= self.block_size,
                   f"<= block_size={self.block_size}", self.eval_tree.block_size)

    def config_dict(self) -> dict[str, Any]:
        tree = to_dict(self.eval_tree)
        return {
            "block_size": self.block_size, "num_layers": self.num_layers,
            "intermediate_size": self.intermediate_size, "shift": self.shift,
            "valid_prefix_mask": self.valid_prefix_mask, "position_weight": self.position_weight,
            "rank_weight": self.rank_weight,
            "eval_tree": {k: tree[k] for k in EVAL_TREE_KEYS},
        }

    def new_model(self, target: Any, draft_vocab_size: int) -> SpecBlockModel:
        arch = SpecBlockArch.from_target_config(
            target.model.config, target.vocab_size, draft_vocab_size, block_size=self.block_size,
            num_layers=self.num_layers, shift=self.shift, intermediate_size=self.intermediate_size or None,
        )
        return SpecBlockModel(arch)

    def loss(
        self, model: SpecBlockModel, embed_weight: torch.Tensor, batch: FeatureBatch,
        target_to_draft: torch.Tensor, steps: int, generator: torch.Generator,
    ) -> StepLoss:
        """:func:`block_forward` over ``steps`` blocks; ``generator`` draws each later block's M."""
        res = block_forward(model, embed_weight, batch, target_to_draft, steps, generator,
                            position_weight=self.position_weight, valid_prefix_mask=self.valid_prefix_mask,
                            rank_weight=self.rank_weight)
        metrics = {f"train.acc_{k}": a for k, a in enumerate(res.slot_acc[0])}
        metrics.update({"train.draft_loss": res.draft_loss, "train.rank_loss": res.rank_loss,
                        "train.rank_acc": res.rank_acc})
        return StepLoss(res.loss, metrics, res.slot_count[0][0])

    def heldout_metrics(
        self, model: SpecBlockModel, embed_weight: torch.Tensor, target_to_draft: torch.Tensor,
        batches: Iterable[FeatureBatch], steps: int,
    ) -> dict[str, float]:
        """:func:`heldout_metrics` (block 1 only: ``steps`` is unused)."""
        return heldout_metrics(model, embed_weight, target_to_draft, batches, self.position_weight,
                               self.rank_weight)

    def eval_drafter(self, head: SpecBlockModel, embed_weight: torch.Tensor) -> SpecBlockDrafter:
        return SpecBlockDrafter(self.eval_tree, head, embed_weight)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--block-size", type=int, default=self.block_size, help="K: slots per block")
        parser.add_argument("--num-layers", type=int, default=self.num_layers)
        parser.add_argument("--intermediate-size", type=int, default=self.intermediate_size,
                            help="FFN width (0 = target's)")
        parser.add_argument("--no-shift", action="store_true", help="ablation: no layer-wise shift")
        parser.add_argument("--no-valid-prefix-mask", action="store_true",
                            help="ablation: count every slot's loss")
        parser.add_argument("--position-weight", type=float, default=self.position_weight)
        parser.add_argument("--rank-weight", type=float, default=self.rank_weight)
        parser.add_argument("--eval-total-tokens", type=int, default=48,
                            help="tree budget of the tau measurement")

    def configure(self, flags: Mapping[str, Any]) -> SpecBlockFamily:
        return SpecBlockFamily(
            block_size=flags["block_size"], num_layers=flags["num_layers"],
            intermediate_size=flags["intermediate_size"], shift=not flags["no_shift"],
            valid_prefix_mask=not flags["no_valid_prefix_mask"], position_weight=flags["position_weight"],
            rank_weight=flags["rank_weight"],
            eval_tree=SpecBlockConfig(checkpoint="random", total_tokens=flags["eval_total_tokens"],
                                      block_size=flags["block_size"], max_blocks=2),
        )
