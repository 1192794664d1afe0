"""Batches of cached features for TTT: length-sorted packing under a token budget, right padding."""

from __future__ import annotations

import random

import torch

from adaptation.features import ShardData
from adaptation.eagle3_loss import TTTBatch


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


def make_batch(shard: ShardData, indices: list[int]) -> TTTBatch:
    """A right-padded :class:`TTTBatch` of the given sequences of ``shard``."""
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
    return TTTBatch(aux=aux, input_ids=ids, loss_mask=mask, topk_values=vals, topk_indices=idx,
                    num_tokens=sum(n for _, n in spans))
