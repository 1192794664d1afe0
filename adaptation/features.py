"""Target features for drafter training, extracted once and cached on disk in shards.

For every token t of a training sequence the cache holds the target's fused aux features
``f_t = [h_low; h_mid; h_high]`` ``[3H]`` (bf16) and, where the target's prediction is trained on
(``loss_mask[t+1] = 1``), its top-K logits (values bf16, ids int32; zeros elsewhere). The LM
head runs only on those rows.

Layout of ``<root>/``: ``shard_00000.safetensors`` ... (concatenated sequences of one shard:
``aux [N, 3H]``, ``topk_values [N, K]``, ``topk_indices [N, K]``, ``input_ids [N]``,
``loss_mask [N]``, ``offsets [n_seq + 1]``) and ``meta.json`` (target fingerprint, K, aux
layers). Each shard is written to a temporary file and renamed, so an interrupted extraction
resumes at the first missing shard and never reads a partial one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adaptation.data import Sample


@dataclass
class ShardData:
    """One loaded shard (see the module docstring for shapes)."""

    aux: torch.Tensor
    topk_values: torch.Tensor
    topk_indices: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def sequence(self, i: int) -> tuple[slice, int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return slice(a, b), b - a


@torch.inference_mode()
def extract_sequence(model: Any, aux_layers: tuple[int, ...], sample: Sample, topk: int) -> dict[str, torch.Tensor]:
    """Features of one sequence from an HF causal LM on any device, in any dtype; returned on the
    CPU as bf16 / int32 (what the cache stores)."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.input_ids], dtype=torch.long, device=device)  # [1, S]
    out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1)  # [S, 3H]
    S = ids.shape[1]
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    rows = torch.zeros(S, dtype=torch.bool)
    rows[:-1] = mask[1:]  # logits at t predict token t+1
    idx = rows.nonzero().squeeze(-1)
    values = torch.zeros(S, topk, dtype=torch.bfloat16)
    indices = torch.zeros(S, topk, dtype=torch.int32)
    if idx.numel():
        logits = model.lm_head(out.last_hidden_state[0, idx.to(device)]).float()  # [M, V]
        top = logits.topk(topk, dim=-1)
        values[idx] = top.values.to(torch.bfloat16).cpu()
        indices[idx] = top.indices.to(torch.int32).cpu()
    return {
        "aux": aux.to(torch.bfloat16).cpu().contiguous(),
        "topk_values": values,
        "topk_indices": indices,
        "input_ids": ids[0].to(torch.int32).cpu(),
        "loss_mask": mask.to(torch.uint8),
    }


class FeatureCache:
    """Sharded on-disk cache of target features (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def shard_path(self, name: int | str) -> Path:
        stem = f"shard_{name:05d}" if isinstance(name, int) else f"shard_{name}"
        return self.root / f"{stem}.safetensors"

    def has(self, name: int | str) -> bool:
        return self.shard_path(name).is_file()

    def check_meta(self, meta: dict) -> None:
        """Write ``meta.json`` on first use; refuse a cache made for other settings."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "meta.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old != meta:
                diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
                raise ValueError(f"feature cache {self.root} was built with other settings ({diff}); use another --workdir")
        else:
            path.write_text(json.dumps(meta, indent=1))

    def write(self, name: int | str, parts: list[dict[str, torch.Tensor]]) -> None:
        lengths = [p["input_ids"].numel() for p in parts]
        offsets = torch.zeros(len(parts) + 1, dtype=torch.long)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
        tensors["offsets"] = offsets
        path = self.shard_path(name)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.chmod(tmp, 0o644)
        tmp.replace(path)

    def load(self, name: int | str) -> ShardData:
        t = load_file(str(self.shard_path(name)))
        return ShardData(
            aux=t["aux"],
            topk_values=t["topk_values"],
            topk_indices=t["topk_indices"].long(),
            input_ids=t["input_ids"].long(),
            loss_mask=t["loss_mask"].bool(),
            offsets=t["offsets"],
        )

    def get_or_extract(
        self, name: int | str, samples: list[Sample], model: Any, aux_layers: tuple[int, ...], topk: int
    ) -> ShardData:
        """Load shard ``name``, extracting it from ``samples`` first if it is not on disk."""
        if not self.has(name):
            parts = [extract_sequence(model, aux_layers, s, topk) for s in samples]
            self.write(name, parts)
        return self.load(name)
