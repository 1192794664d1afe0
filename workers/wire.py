"""Tensors on the wire between actors: numpy arrays (zero-copy in Ray's object store).

numpy has no bfloat16, so a bf16 tensor travels as its raw 16-bit pattern (``int16``) and is
viewed back on arrival: exact, no conversion cost. Other dtypes travel as themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor as a numpy array plus the torch dtype to view it back as.

    Attributes:
        array: the data (``int16`` bit pattern for bfloat16).
        dtype: the torch dtype name, e.g. ``"bfloat16"``.
    """

    array: np.ndarray
    dtype: str

    def to_torch(self, device: torch.device | str = "cpu") -> torch.Tensor:
        arr = self.array
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            # Ray hands out read-only views of its shared memory; consumers may write in place.
            arr = np.array(arr, copy=True, order="C")
        t = torch.from_numpy(arr)
        want = getattr(torch, self.dtype)
        if want == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.to(device)


def to_wire(t: torch.Tensor) -> WireTensor:
    """Detach ``t`` to CPU and wrap it for transfer."""
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        return WireTensor(t.view(torch.int16).numpy(), name)
    return WireTensor(t.numpy(), name)
