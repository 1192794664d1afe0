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

:class:`Eagle3Family` is EAGLE-3's training plug-in (:mod:`adaptation.family`): this loss, the
head, the held-out metric (teacher-forced per-step accuracy, :func:`heldout_metrics`) and the
tree drafter used for the tau measurement.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from adaptation.batches import FeatureBatch
from adaptation.family import StepLoss, check_knob
from adaptation.loss_terms import shift, soft_cross_entropy
from speculation.config import ConfigError, Eagle3Config
from speculation.drafters.checkpoint import EAGLE3, CheckpointKind
from speculation.drafters.eagle3 import Eagle3Drafter
from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model


@dataclass
class TTTResult:
    """Loss and per-step statistics of one TTT forward."""

    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_count: list[int]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, nkv, S, hd] -> [B, nkv * n_rep, S, hd]`` (head h uses kv head h // n_rep)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def ttt_unroll(
    model: Eagle3Model, embed_weight: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(j, y^j)`` with ``y^j`` ``[B, S, H]`` for j = 0..steps-1 (module docstring)."""
    a = model.arch
    B, S, _ = aux.shape
    n_rep = a.num_heads // a.num_kv_heads
    scale = model.attn_scale
    pos0 = torch.arange(S, device=aux.device)
    causal = torch.ones(S, S, dtype=torch.bool, device=aux.device).tril()  # [S, S]
    hidden = model.fuse(aux)  # [B, S, H]
    kr = vr = None  # step-0 keys/values, repeated to nh heads: [B, nh, S, hd]
    extra_k: list[torch.Tensor] = []  # steps 1..j, repeated: [B, nh, S, hd] each
    extra_v: list[torch.Tensor] = []
    for j in range(steps):
        # 1. inputs of step j: token x_{t+1+j}, hidden h^j_t, position t + j
        emb = F.embedding(shift(input_ids, 1 + j), embed_weight)  # [B, S, H]
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
    batch: FeatureBatch,
    steps: int,
    target_to_draft: torch.Tensor,
    decay: float = 0.8,
) -> TTTResult:
    """Unroll ``steps`` draft steps over ``batch`` and return the weighted loss (module docstring)."""
    B, S, _ = batch.aux.shape
    in_vocab = target_to_draft >= 0
    total = torch.zeros((), dtype=torch.float32, device=batch.aux.device)
    step_loss, step_acc, step_count = [], [], []
    for j, y in ttt_unroll(model, embed_weight, batch.aux, batch.input_ids, steps):
        # loss on rows whose predicted token x_{t+2+j} is an assistant token in the draft vocab
        top_idx = shift(batch.topk_indices, 1 + j)  # [B, S, K]
        top_val = shift(batch.topk_values, 1 + j)
        mask = shift(batch.loss_mask, 2 + j, False) & in_vocab[top_idx[..., 0]]
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


def heldout_metrics(
    model: Eagle3Model, embed_weight: torch.Tensor, target_to_draft: torch.Tensor,
    batches: Iterable[FeatureBatch], steps: int,
) -> dict[str, float]:
    """Teacher-forced held-out figures per draft step j = 0..steps-1, weighted by rows:
    ``heldout.acc_j`` (step j's top-1 == the target's argmax at depth j+1) and ``heldout.loss_j``."""
    loss_sum = [0.0] * steps
    acc_sum = [0.0] * steps
    rows = [0] * steps
    for batch in batches:
        res = ttt_forward(model, embed_weight, batch, steps, target_to_draft)
        for j in range(steps):
            if res.step_count[j]:
                loss_sum[j] += res.step_loss[j] * res.step_count[j]
                acc_sum[j] += res.step_acc[j] * res.step_count[j]
                rows[j] += res.step_count[j]
    out = {f"heldout.acc_{j}": (acc_sum[j] / rows[j] if rows[j] else math.nan) for j in range(steps)}
    out.update({f"heldout.loss_{j}": (loss_sum[j] / rows[j] if rows[j] else math.nan) for j in range(steps)})
    return out


def parse_eval_tree(text: str) -> Eagle3Config:
    """``"TOTAL,DEPTH,TOP_K"`` -> the tree knobs of the tau measurement (an untrained-head config)."""
    try:
        total, depth, top_k = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--eval-tree must be TOTAL,DEPTH,TOP_K (e.g. 48,5,8), got {text!r}") from None
    return Eagle3Config(total_tokens=total, depth=depth, top_k=top_k, checkpoint=Eagle3Config.RANDOM)


@dataclass(frozen=True)
class Eagle3Family:
    """EAGLE-3's training plug-in (``graftblock train eagle3``); its fields are its knobs.

    One unrolled step is one TTT draft step (``ttt_steps`` of them per batch).
    """

    step_decay: float = 0.8
    """Weight of draft step j is decay^j. Range (0, 1]."""
    eval_tree: Eagle3Config = field(default_factory=lambda: Eagle3Config(checkpoint=Eagle3Config.RANDOM))
    """Tree knobs (total_tokens, depth, top_k) used for the tau measurement."""

    name: ClassVar[str] = "eagle3"
    kind: ClassVar[CheckpointKind] = EAGLE3
    unroll_defaults: ClassVar[Mapping[str, int]] = MappingProxyType({"ttt_steps": 7, "curriculum_steps": 2})

    def __post_init__(self) -> None:
        check_knob("step_decay", 0 < self.step_decay <= 1, "in (0, 1]", self.step_decay)

    def config_dict(self) -> dict[str, Any]:
        tree = self.eval_tree
        return {"step_decay": self.step_decay,
                "eval_tree": {"total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k}}

    def new_model(self, target: Any, draft_vocab_size: int) -> Eagle3Model:
        arch = Eagle3Arch.from_target_config(target.model.config, target.vocab_size, draft_vocab_size)
        return Eagle3Model(arch)

    def loss(
        self, model: Eagle3Model, embed_weight: torch.Tensor, batch: FeatureBatch,
        target_to_draft: torch.Tensor, steps: int, generator: torch.Generator,
    ) -> StepLoss:
        """:func:`ttt_forward` (no random draws: ``generator`` is unused)."""
        res = ttt_forward(model, embed_weight, batch, steps, target_to_draft, self.step_decay)
        metrics = {f"train.acc_{j}": a for j, a in enumerate(res.step_acc)}
        return StepLoss(res.loss, metrics, res.step_count[0])

    def heldout_metrics(
        self, model: Eagle3Model, embed_weight: torch.Tensor, target_to_draft: torch.Tensor,
        batches: Iterable[FeatureBatch], steps: int,
    ) -> dict[str, float]:
        return heldout_metrics(model, embed_weight, target_to_draft, batches, steps)

    def eval_drafter(self, head: Eagle3Model, embed_weight: torch.Tensor) -> Eagle3Drafter:
        return Eagle3Drafter(self.eval_tree, head, embed_weight)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--eval-tree", default="48,5,8",
                            help="total_tokens,depth,top_k of the tau measurement")

    def configure(self, flags: Mapping[str, Any]) -> Eagle3Family:
        return Eagle3Family(step_decay=self.step_decay, eval_tree=parse_eval_tree(flags["eval_tree"]))
