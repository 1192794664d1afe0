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


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch's oneDNN (mkldnn) linear kernels can be used on this CPU in ``dtype``.

    fp32 needs only a oneDNN build; bf16 and fp16 also need the CPU's instructions (oneDNN's bf16
    path wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT, so an AVX2-only host has none): the answer
    comes from packing and multiplying one small weight in ``dtype``, once per process and dtype.
    """
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype not in _ONEDNN_DTYPE_WORKS:
        _ONEDNN_DTYPE_WORKS[dtype] = _onednn_probe(dtype)
    return _ONEDNN_DTYPE_WORKS[dtype]


_ONEDNN_DTYPE_WORKS: dict[torch.dtype, bool] = {}
"""Per dtype, whether oneDNN's packed linear ran on this CPU (filled by :func:`onednn_available`)."""


@torch.inference_mode()
def _onednn_probe(dtype: torch.dtype) -> bool:
    w = torch.ones(16, 16, dtype=dtype)  # [out, in]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:  # "bf16 path needs the cpu support ..."
        return False
    return True


def packed_path_applies(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether a product of ``x`` may use the oneDNN-packed copy ``packed`` of ``weight``: on the
    CPU, in the packed copy's dtype, and with no gradient to compute (oneDNN's op has no backward)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return x.device.type == "cpu" and not needs_grad and x.dtype == packed.dtype


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` through oneDNN with ``W`` reordered once into oneDNN's blocked layout.

    Measured on the AVX2 host of BENCHMARKS.md (fp32, 2 threads; 200-400 calls, hot weights),
    per product in ms, ``F.linear`` against this:

        SmolLM2 lm_head 49152 x 576:  M = 1: 8.7 vs 2.9;  M = 8: 15.9 vs 3.2;  M = 32: 24.4 vs 6.5
        MLP gate/up 1536 x 576:       M = 1: 0.060 vs 0.042;  M = 8: 0.178 vs 0.058

    M is the rows of the product: 1 for a decode step, the tree size for a verify pass, which is
    why tree verification gains most. The result differs from ``F.linear`` by rounding only
    (about 5e-6 absolute on these layers). ``weight`` and ``bias`` stay the original parameters
    (shared, still tied where the model ties them); the packed copy is not a parameter or buffer,
    so state dicts are unchanged. Off the CPU (a model moved to CUDA) or when autograd needs the
    product (oneDNN's op has no backward here), it falls back to ``F.linear``.

    The packed copy follows the weight: it remembers which tensor it was packed from (object,
    storage, dtype and in-place version) and packs again before the next product if any of
    those changed (``load_state_dict``, an optimizer step, ``.to(dtype)``, a ``deepcopy``). A
    weight that is an inference tensor has no version counter, so its products use ``F.linear``.

    Shapes: x ``[..., in]`` -> y ``[..., out]``.
    """

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._copy = _PackedCopy()
        self.current_packed()

    @property
    def packed(self) -> torch.Tensor | None:
        """oneDNN's blocked layout of the weight as it is now (see :meth:`current_packed`)."""
        return self.current_packed()

    def current_packed(self) -> torch.Tensor | None:
        """The packed copy of the weight as it is now (packed again if the weight changed since),
        or None when the weight cannot be tracked (an inference tensor), is not on the CPU, or is in a
        dtype this CPU's oneDNN has no kernels for (:func:`onednn_available`)."""
        key = _weight_key(self.weight)
        if key is None or self.weight.device.type != "cpu":
            return None
        held = self._copy.held
        if held is None or held[0] != key:  # the dtype is in the key: a cast asks oneDNN again
            usable = onednn_available(self.weight.dtype)
            held = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None) if usable else None)
            self._copy.held = held  # one assignment: a concurrent reader sees an old or a new pair
        return held[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.current_packed() if x.device.type == "cpu" else None
        if packed is None or not packed_path_applies(x, self.weight, packed):
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # [M, in]
        y = torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [], "")  # [M, out]
        return y.reshape(*x.shape[:-1], self.out_features)


class _PackedCopy:
    """Holder of ``(weight key, packed tensor)``. Not a buffer: ``.to()`` leaves it alone (a cast
    weight has a new key, so it is packed again), and a copy or pickle gets an empty holder
    (oneDNN's opaque tensors cannot be copied; the copy packs its own weight on first use)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: tuple[tuple, torch.Tensor] | None = None

    def __reduce__(self) -> tuple:
        return (_PackedCopy, ())


def _weight_key(weight: torch.Tensor) -> tuple | None:
    """What identifies a weight's values without reading them: (object, storage, dtype, in-place
    version), or None for an inference tensor (no version counter)."""
    if weight.is_inference():
        return None
    return (id(weight), weight.data_ptr(), weight.dtype, weight._version)


def pack_linears(model: nn.Module, skip: nn.Module | None = None) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (the output head included, a
    :class:`TransposedHead` too) except ``skip`` (e.g. the head of a pipeline shard that never
    runs it) by a :class:`PackedLinear`; returns how many (already packed layers are left as
    they are). The packed copies follow later weight changes (see :class:`PackedLinear`)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child is skip or (isinstance(child, nn.Linear) and not onednn_available(child.weight.dtype)):
                continue
            if type(child) is nn.Linear or isinstance(child, TransposedHead):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
