"""Batches of cached target features: length-sorted packing under a token budget, right padding."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from adaptation.features import ShardData


@dataclass
class FeatureBatch:
    """A right-padded batch of cached target features (what every family's loss reads).

    Attributes:
        aux: ``[B, S, 3H]`` aux features f_t.
        input_ids: ``[B, S]`` int64 tokens x_t (0 in padding).
        loss_mask: ``[B, S]`` bool m_t (False in padding).
        topk_values: ``[B, S, K]`` the target's top-K logits at t (descending).
        topk_indices: ``[B, S, K]`` int64 their token ids.
        num_tokens: real (unpadded) tokens in the batch.
    """

    aux: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    topk_values: torch.Tensor
    topk_indices: torch.Tensor
    num_tokens: int = 0

    def to(self, device: torch.device) -> FeatureBatch:
        """The same batch on ``device`` (itself when it is already there)."""
        if self.aux.device == device:
            return self
        return FeatureBatch(aux=self.aux.to(device), input_ids=self.input_ids.to(device),
                            loss_mask=self.loss_mask.to(device), topk_values=self.topk_values.to(device),
                            topk_indices=self.topk_indices.to(device), num_tokens=self.num_tokens)


def plan_batches(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Sequence indices per batch: sorted by length, packed while ``B * max_len <= batch_tokens``,
    then the batch order shuffled with ``seed`` (deterministic, so a resumed run sees the same)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def make_batch(shard: ShardData, indices: list[int]) -> FeatureBatch:
    """A right-padded :class:`FeatureBatch` of the given sequences of ``shard``."""
    spans = [shard.sequence(i) for i in indices]
    S = max(n for _, n in spans)
    B = len(spans)
    K = shard.topk_values.shape[1]
    aux = torch.zeros(B, S, shard.aux.shape[1], dtype=shard.aux.dtype)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    vals = torch.zeros(B, S, K, dtype=shard.topk_values.dtype)
    idx = torch.zeros(B, S, K, dtype=torch.long)
    for r, (sl, n) in enumerate(spans):
        aux[r, :n] = shard.aux[sl]
        ids[r, :n] = shard.input_ids[sl]
        mask[r, :n] = shard.loss_mask[sl]
        vals[r, :n] = shard.topk_values[sl]
        idx[r, :n] = shard.topk_indices[sl]
    return FeatureBatch(aux=aux, input_ids=ids, loss_mask=mask, topk_values=vals, topk_indices=idx,
                        num_tokens=sum(n for _, n in spans))
