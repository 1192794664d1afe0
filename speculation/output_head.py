"""The target's output projection with its weight stored transposed, for fast CPU decode steps.

``logits = h @ W^T`` with ``W`` of shape ``[V, H]`` (vocabulary x hidden). At a decode step the
product has one row (M = 1) and streams the whole ``[V, H]`` matrix: for SmolLM2-135M that is
49152 x 576 fp32 values, 113 MB, the largest single weight of the model. On the AVX2 CPU host of
BENCHMARKS.md torch's ``F.linear`` took 6.9 ms for it (16.5 GB/s) and ``h @ W_t`` with ``W_t``
a contiguous ``[H, V]`` copy 4.0 ms; a greedy decode loop ran 8% faster (23.4 -> 25.3 tok/s,
identical tokens on 6 Spec-Bench prompts). :class:`TransposedHead` keeps ``W`` as its ``weight``
(the same parameter, still tied to the input embeddings where the model ties them) and a
non-persistent ``W_t`` buffer, so everything that reads the output embeddings sees the original
tensor; the cost is one extra ``V x H`` copy in memory.
"""

from __future__ import annotations

import torch
from torch import nn


class TransposedHead(nn.Module):
    """``y = x @ W_t (+ b)``: an ``nn.Linear`` whose product reads a contiguous ``[in, out]`` copy.

    Attributes:
        weight: the original ``[out, in]`` parameter (shared, not copied).
        bias: the original bias or None.
        weight_t: ``[in, out]`` contiguous copy of ``weight`` (a buffer; moves with ``.to``).
    """

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias
        self.register_buffer("weight_t", head.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t  # [..., in] @ [in, out] -> [..., out]
        return y if self.bias is None else y + self.bias


def use_transposed_head(model: nn.Module) -> bool:
    """Replace ``model``'s output embeddings (an ``nn.Linear``) by a :class:`TransposedHead`.

    Returns whether it did (False when the model has no plain linear output head). The model's
    weights must not change afterwards (``weight_t`` is a copy): this is for inference targets."""
    get, put = getattr(model, "get_output_embeddings", None), getattr(model, "set_output_embeddings", None)
    head = get() if get is not None else None
    if put is None or type(head) is not nn.Linear:
        return False
    put(TransposedHead(head))
    return True
