"""Held-out evaluation of an EAGLE-3 head.

* :func:`heldout_metrics`: TTT loss and top-1 agreement per draft step on held-out cached
  features (teacher-forced: step j's top-1 vs the target's argmax at depth j+1).
* :func:`measure_tau`: real speculative decoding with the head on held-out prompts:
  tau = (tokens gained over all steps) / (verify steps), bonus included (DESIGN.md metrics),
  plus the mean accepted draft tokens per step.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from adaptation.batches import make_batch, plan_batches
from adaptation.features import ShardData
from adaptation.eagle3_loss import ttt_forward
from speculation.config import Eagle3Config, EngineConfig, SamplingConfig
from speculation.drafters.eagle3 import Eagle3Drafter
from speculation.drafters.eagle3_model import Eagle3Model
from speculation.engine import generate_speculative


@torch.no_grad()
def heldout_metrics(
    model: Eagle3Model, embed_weight: torch.Tensor, shard: ShardData, steps: int, batch_tokens: int, autocast: bool
) -> dict[str, float]:
    """``heldout.loss`` and ``heldout.acc_j`` (j = 0..steps-1), weighted by rows."""
    t2d = model.target_to_draft()
    was_training = model.training
    model.eval()
    loss_sum = [0.0] * steps
    acc_sum = [0.0] * steps
    rows = [0] * steps
    for idx in plan_batches(shard.lengths(), batch_tokens, seed=0):
        batch = make_batch(shard, idx)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            res = ttt_forward(model, embed_weight, batch, steps, t2d)
        for j in range(steps):
            if res.step_count[j]:
                loss_sum[j] += res.step_loss[j] * res.step_count[j]
                acc_sum[j] += res.step_acc[j] * res.step_count[j]
                rows[j] += res.step_count[j]
    model.train(was_training)
    out = {f"heldout.acc_{j}": (acc_sum[j] / rows[j] if rows[j] else math.nan) for j in range(steps)}
    out.update({f"heldout.loss_{j}": (loss_sum[j] / rows[j] if rows[j] else math.nan) for j in range(steps)})
    return out


@torch.inference_mode()
def measure_tau(
    target: Any,
    model: Eagle3Model,
    tree: Eagle3Config,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> dict[str, float]:
    """``tau`` and ``accepted_per_step`` of greedy speculative decoding on ``prompts``."""
    head = copy.deepcopy(model).to(target.dtype).eval()
    drafter = Eagle3Drafter(tree, head, target.model.get_input_embeddings().weight.detach())
    return tau_of(target, drafter, prompts, max_new_tokens)


@torch.inference_mode()
def tau_of(target: Any, drafter: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """``tau`` and ``accepted_per_step`` of greedy speculative decoding with any drafter."""
    cfg = EngineConfig(max_new_tokens=max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    gained = steps = accepted = 0
    for p in prompts:
        res = generate_speculative(target, drafter, p, cfg)
        gained += sum(s.tokens_gained for s in res.steps)
        accepted += sum(s.accepted for s in res.steps)
        steps += len(res.steps)
    return {
        "tau": gained / steps if steps else math.nan,
        "accepted_per_step": accepted / steps if steps else math.nan,
        "eval_steps": float(steps),
    }
