"""The reduced draft vocabulary: the N_d most frequent target ids at trained-on positions.

Steps (docs/algorithms.md §3): count tokens at loss-masked (assistant) positions, keep the N_d
most frequent, sort them by id; the head then stores ``d2t[i] = ids[i] - i`` and
``t2d = 1[v in ids]``. When fewer than N_d distinct tokens were seen (the [gap] in the sources),
the remaining slots go to unseen ids in ascending id order, so the size is always exactly N_d.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from adaptation.data import Sample


@dataclass(frozen=True)
class DraftVocab:
    """Draft token ids (sorted target ids) and how much of the counted mass they cover."""

    ids: torch.Tensor  # [N_d] int64, strictly increasing
    coverage: float
    counted_tokens: int

    def to_dict(self) -> dict:
        return {"ids": self.ids.tolist(), "coverage": self.coverage, "counted_tokens": self.counted_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "DraftVocab":
        return cls(torch.tensor(d["ids"], dtype=torch.long), float(d["coverage"]), int(d["counted_tokens"]))


def token_counts(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """``[V]`` int64 counts of tokens at positions with ``loss_mask = 1``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.long)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        counts.index_add_(0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.long))
    return counts


def select_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Top-``size`` ids by count (ties and unseen ids by ascending id), sorted by id."""
    vocab_size = counts.numel()
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    return DraftVocab(ids=ids, coverage=coverage, counted_tokens=total)
