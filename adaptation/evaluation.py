"""Family-neutral evaluation of a draft head: tau of real speculative decoding.

``tau`` = (tokens gained over all verify steps) / (verify steps), bonus included (docs/algorithms.md
§7); ``accepted_per_step`` = mean accepted draft tokens per step; ``accept_ge_j`` = the share of
steps that accept at least j draft tokens (acceptance per position: the chance that depth j of
the verified path came from the drafter), j = 1..``ACCEPT_DEPTHS``; greedy decoding, so the
output equals the target's own greedy text and only the speed figures depend on the head.
A family's teacher-forced held-out metrics live with its loss (``adaptation/<family>_loss.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from speculation.config import EngineConfig, SamplingConfig
from speculation.drafters.base import Drafter
from speculation.engine.solo import generate_speculative

ACCEPT_DEPTHS = 6
"""Positions reported by :func:`measure_tau` as ``accept_ge_1`` .. ``accept_ge_6``."""


@torch.inference_mode()
def measure_tau(
    target: Any, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int
) -> dict[str, float]:
    """``tau``, ``accepted_per_step``, ``accept_ge_1..6`` and ``eval_steps`` of greedy speculative
    decoding on ``prompts``."""
    cfg = EngineConfig(max_new_tokens=max_new_tokens, stop_at_eos=True,
                       sampling=SamplingConfig(temperature=0.0))
    gained = steps = accepted = 0
    at_least = [0] * ACCEPT_DEPTHS  # at_least[j-1] = steps accepting >= j draft tokens
    for p in prompts:
        res = generate_speculative(target, drafter, p, cfg)
        gained += sum(s.tokens_gained for s in res.steps)
        accepted += sum(s.accepted for s in res.steps)
        steps += len(res.steps)
        for s in res.steps:
            for j in range(min(s.accepted, ACCEPT_DEPTHS)):
                at_least[j] += 1
    out = {
        "tau": gained / steps if steps else math.nan,
        "accepted_per_step": accepted / steps if steps else math.nan,
        "eval_steps": float(steps),
    }
    out.update({f"accept_ge_{j + 1}": (n / steps if steps else math.nan) for j, n in enumerate(at_least)})
    return out
