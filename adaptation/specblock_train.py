"""Offline SpecBlock training: the EAGLE-3 pipeline (data, feature cache, resume, MLflow,
checkpoints, manifest) with the block loss of :mod:`adaptation.specblock_loss`.

``ttt_steps`` counts TTT *blocks* here (each unrolls K slots); ``curriculum_steps`` blocks are
unrolled while ``tokens < curriculum_tokens``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from adaptation.batches import make_batch, plan_batches
from adaptation.evaluation import tau_of
from adaptation.trainer import Eagle3Trainer, Eagle3TrainConfig, _check
from adaptation.specblock_loss import block_forward
from speculation.config import SpecBlockConfig, to_dict
from speculation.drafters.checkpoint import SPECBLOCK
from speculation.drafters.specblock import SpecBlockDrafter
from speculation.drafters.specblock_model import SpecBlockArch, SpecBlockModel


@dataclass(frozen=True)
class SpecBlockTrainConfig(Eagle3TrainConfig):
    """Knobs of ``graftblock train specblock`` (the EAGLE-3 knobs, plus these)."""

    ttt_steps: int = 3
    """TTT blocks unrolled per batch (block 1 + inherited blocks). Range [1, 16]."""
    curriculum_steps: int = 1
    """Blocks unrolled while ``tokens < curriculum_tokens``. Range [1, ttt_steps]."""
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

    def __post_init__(self) -> None:
        super().__post_init__()
        _check("block_size", 1 <= self.block_size <= 16, "in [1, 16]", self.block_size)
        _check("num_layers", 1 <= self.num_layers <= 8, "in [1, 8]", self.num_layers)
        _check("intermediate_size", self.intermediate_size >= 0, ">= 0", self.intermediate_size)
        _check("shift", isinstance(self.shift, bool), "true or false", self.shift)
        _check("shift", not (self.shift and self.num_layers < 2), "false with num_layers=1 (it acts between layers)",
               self.shift)
        _check("valid_prefix_mask", isinstance(self.valid_prefix_mask, bool), "true or false", self.valid_prefix_mask)
        _check("position_weight", 0 < self.position_weight <= 1, "in (0, 1]", self.position_weight)
        _check("rank_weight", 0 <= self.rank_weight <= 100, "in [0, 100]", self.rank_weight)
        _check("eval_tree.block_size", self.eval_tree.block_size <= self.block_size,
               f"<= block_size={self.block_size}", self.eval_tree.block_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        tree = to_dict(self.eval_tree)
        d["eval_tree"] = {k: tree[k] for k in ("total_tokens", "block_size", "max_blocks", "beam", "slot_widths")}
        return d


class SpecBlockTrainer(Eagle3Trainer):
    """Trains one SpecBlock head (see :class:`~adaptation.trainer.Eagle3Trainer`)."""

    kind = SPECBLOCK
    label = "specblock"
    cfg: SpecBlockTrainConfig

    def new_model(self, draft_ids: torch.Tensor) -> SpecBlockModel:
        c = self.cfg
        arch = SpecBlockArch.from_target_config(
            self.target.model.config, self.target.vocab_size, draft_ids.numel(), block_size=c.block_size,
            num_layers=c.num_layers, shift=c.shift, intermediate_size=c.intermediate_size or None,
        )
        return SpecBlockModel(arch)

    def _generator(self) -> torch.Generator:
        """Draws of M: deterministic per step, so a resumed run draws what the killed one would."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.state.step)

    def forward(self, batch, steps: int) -> tuple[torch.Tensor, dict[str, float], int]:
        c = self.cfg
        res = block_forward(self.model, self.embed, batch, self._t2d, steps, self._generator(),
                            position_weight=c.position_weight, valid_prefix_mask=c.valid_prefix_mask,
                            rank_weight=c.rank_weight)
        metrics = {f"train.acc_{k}": a for k, a in enumerate(res.slot_acc[0])}
        metrics.update({"train.draft_loss": res.draft_loss, "train.rank_loss": res.rank_loss,
                        "train.rank_acc": res.rank_acc})
        return res.loss, metrics, res.slot_count[0][0]

    @torch.no_grad()
    def heldout_metrics(self, heldout) -> dict[str, float]:
        """Block-1 metrics on held-out features, always under the valid-prefix mask:

        ``heldout.acc_k``: top-1 agreement at slot k given slots < k were right;
        ``heldout.prefix_len``: mean right prefix of a block, sum_k P(slots 0..k all right);
        ``heldout.rank_acc``: rank-class accuracy; ``heldout.loss``: the total loss.
        """
        model, c = self.model, self.cfg
        was = model.training
        model.eval()
        K = model.arch.block_size
        right = [0] * K
        rows = [0] * K
        rank_right = rank_rows = 0
        loss_sum, batches = 0.0, 0
        for idx in plan_batches(heldout.lengths(), c.batch_tokens, seed=0):
            batch = make_batch(heldout, idx)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.autocast_bf16):
                res = block_forward(model, self.embed, batch, self._t2d, 1, torch.Generator().manual_seed(0),
                                    position_weight=c.position_weight, valid_prefix_mask=True,
                                    rank_weight=c.rank_weight)
            counted, correct = res.counted[0], res.correct[0]
            for k in range(K):
                rows[k] += int(counted[:, k].sum())
                right[k] += int((counted[:, k] & correct[:, k]).sum())
            if not math.isnan(res.rank_acc):
                n = sum(res.slot_count[0])
                rank_right += res.rank_acc * n
                rank_rows += n
            loss_sum += float(res.loss)
            batches += 1
        model.train(was)
        out = {f"heldout.acc_{k}": (right[k] / rows[k] if rows[k] else math.nan) for k in range(K)}
        out["heldout.prefix_len"] = sum(right) / rows[0] if rows[0] else math.nan
        out["heldout.rank_acc"] = rank_right / rank_rows if rank_rows else math.nan
        out["heldout.loss"] = loss_sum / batches if batches else math.nan
        return out

    def measure_tau(self, prompts: list[list[int]]) -> dict[str, float]:
        head = copy.deepcopy(self.model).to(self.target.dtype).eval()
        drafter = SpecBlockDrafter(self.cfg.eval_tree, head, self.embed)
        return tau_of(self.target, drafter, prompts, self.cfg.eval_max_new_tokens)


def train_config(args: Any) -> SpecBlockTrainConfig:
    """:class:`SpecBlockTrainConfig` from parsed ``train specblock`` arguments."""
    from graftblock.train import train_config as eagle3_config

    base = asdict(eagle3_config(args))
    base.pop("eval_tree")
    return SpecBlockTrainConfig(
        **base, block_size=args.block_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
        shift=not args.no_shift, valid_prefix_mask=not args.no_valid_prefix_mask,
        position_weight=args.position_weight, rank_weight=args.rank_weight,
        eval_tree=SpecBlockConfig(checkpoint="random", total_tokens=args.eval_total_tokens,
                                  block_size=args.block_size, max_blocks=2),
    )
