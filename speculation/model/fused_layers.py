"""Fewer, larger operators in the target's decoder: sibling projections share one GEMM, and the
RMS norm is one kernel.

A Hugging Face decoder layer computes ``q = x Wq^T``, ``k = x Wk^T``, ``v = x Wv^T`` and, in its
gated MLP, ``g = x Wg^T``, ``u = x Wu^T``: five products of the same input. At a decode step
(one row) each is a small, bandwidth-bound call whose fixed cost (dispatch, oneDNN primitive
setup, thread fork/join) is a large share of its time. Here each group becomes one product with
the stacked weight ``[Wq; Wk; Wv]`` (``[Wg; Wu]``), split afterwards:

    [q | k | v] = x [Wq; Wk; Wv]^T          x: [M, H] -> [M, nq + nk + nv]

The layer's own ``forward`` is untouched: it still calls ``q_proj(x)``, ``k_proj(x)``,
``v_proj(x)``. Each of those is now a :class:`GroupedProjection` that runs the group's product on
its first call for an input tensor and hands out the other slices to its siblings when they are
called with the *same tensor object* (an identity check, so a sibling called with any other
input computes its own product: the result is always the right one). SmolLM2-135M's RMS norm,
five elementwise operators in transformers' ``LlamaRMSNorm``, becomes ``F.rms_norm``.

Measured on the AVX2 host of BENCHMARKS.md (fp32, 2 threads, ``TargetModel.decode`` of
SmolLM2-135M): 121 instead of 211 linear calls per step, and 1.06x as fast at the median of 31
runs timed side by side against the same target without them (faster in 23 of 31 pairs;
identical greedy tokens). The step stays bound by memory bandwidth (the weights stream once per
step whatever the grouping), so the gain is the fixed cost of the calls removed
(``benchmarks/decode_profile.py --baseline``).

Parameters are not copied or renamed: ``q_proj.weight`` is still the checkpoint's parameter and
the stacked copy is a non-persistent buffer, so ``state_dict()`` is unchanged. The copy is not
updated if the weights change (inference targets only). Off the CPU, under autograd, or when the
input's dtype differs from the packed copy's, every projection falls back to its own
``F.linear``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculation.model.output_head import onednn_available, packed_path_applies

PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling ``nn.Linear`` children that read the same input in the supported decoder families
(attention: Llama, Mistral, Qwen2/3, Gemma-3; gated MLP: the same)."""

RMS_NORM_CLASSES: frozenset[str] = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
"""Norms computing ``w * (x / sqrt(mean(x^2) + eps))`` (in fp32, cast back before the weight).
Gemma's ``(1 + w)`` norm is not one of them and is left alone."""


class ProjectionGroup(nn.Module):
    """The stacked weight of sibling projections, packed for oneDNN, and the last product.

    Buffers: ``packed``: oneDNN's blocked layout of ``[sum(out_i), in]``; ``bias``: the stacked
    bias ``[sum(out_i)]`` or None. ``sizes``: each member's output width, in member order.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.sizes: list[int] = [lin.out_features for lin in linears]
        stacked = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out_i), in]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(stacked, None), persistent=False)
        has_bias = [lin.bias is not None for lin in linears]
        bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        self.register_buffer("bias", bias, persistent=False)
        # (input, outputs, members not yet served); replaced whole, never mutated, so a reader
        # always sees outputs that belong to the input it checked (a race only recomputes).
        self._stash: tuple[torch.Tensor, tuple[torch.Tensor, ...], frozenset[int]] | None = None

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s product ``x W_member^T (+ b)`` ``[..., out_member]``: computed with
        the whole group's GEMM unless an earlier call for this very tensor left it pending."""
        stash = self._stash
        if stash is not None and stash[0] is x and member in stash[2]:
            outputs, pending = stash[1], stash[2] - {member}
        else:
            rows = x.reshape(-1, x.shape[-1])  # [M, in]
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")  # [M, sum]
            outputs = tuple(part.reshape(*x.shape[:-1], part.shape[-1]) for part in y.split(self.sizes, -1))
            pending = frozenset(range(len(self.sizes))) - {member}
        # Once every sibling is served, drop the references to the input and the outputs.
        self._stash = (x, outputs, pending) if pending else None
        return outputs[member]


class GroupedProjection(nn.Module):
    """An ``nn.Linear`` whose product comes from its :class:`ProjectionGroup`.

    ``weight``/``bias`` are the original parameters (same objects, same state-dict keys). The
    group is registered under the first member only (``group``); the others reach it through a
    plain attribute, so it is moved with the model once and listed once in ``modules()``.

    Shapes: x ``[..., in]`` -> y ``[..., out]``.
    """

    def __init__(self, linear: nn.Linear, group: ProjectionGroup, member: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.member = member
        if member == 0:
            self.group = group
        else:
            object.__setattr__(self, "_group", group)

    def _the_group(self) -> ProjectionGroup:
        return self.group if self.member == 0 else self._group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._the_group()
        if not packed_path_applies(x, self.weight, group.packed):
            return F.linear(x, self.weight, self.bias)
        return group.output(self.member, x)


class FusedRMSNorm(nn.Module):
    """``y = w * rms_norm(x)`` with ``rms_norm(x) = x / sqrt(mean(x^2, -1) + eps)`` as one kernel
    (``F.rms_norm``), computed in fp32 and cast back before the weight, as transformers does.

    Shapes: x ``[..., H]`` -> y ``[..., H]``.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``, the normalisation in fp32 and cast back to
    ``x``'s dtype before the weight (transformers' Llama RMS norm), as one kernel in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _groupable(linears: Sequence[nn.Module]) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    first = linears[0]
    same_input = all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype for lin in linears)
    biases = {lin.bias is not None for lin in linears}
    return same_input and len(biases) == 1 and first.weight.device.type == "cpu"


def fuse_decoder(model: nn.Module) -> int:
    """Group the sibling projections (:data:`PROJECTION_GROUPS`) of every module of ``model`` and
    swap its RMS norms (:data:`RMS_NORM_CLASSES`) for :class:`FusedRMSNorm`. Returns how many
    modules were replaced (0 where torch has no oneDNN for the model's dtype: nothing is done). Run it before
    :func:`~speculation.model.output_head.pack_linears`, which leaves the grouped projections alone.
    """
    param = next(model.parameters(), None)
    if param is None or not onednn_available(param.dtype):
        return 0  # no oneDNN, or none in this dtype on this CPU (bf16 on an AVX2-only host)
    count = 0
    for module in list(model.modules()):
        for names in PROJECTION_GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if any(lin is None for lin in linears) or not _groupable(linears):
                continue
            group = ProjectionGroup(linears)
            for member, (name, lin) in enumerate(zip(names, linears)):
                setattr(module, name, GroupedProjection(lin, group, member))
                count += 1
        for name, child in list(module.named_children()):
            if type(child).__name__ in RMS_NORM_CLASSES and hasattr(child, "variance_epsilon"):
                setattr(module, name, FusedRMSNorm(child))
                count += 1
    return count
