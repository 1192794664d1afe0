"""Acceptance over a draft tree: greedy and lossless stochastic (docs/algorithms.md §2).

Greedy (T = 0): starting at the root, descend to the child whose token equals
``argmax z_cur``; stop when no child matches. The bonus is ``argmax z_last``. Siblings are unique
by token (see :mod:`speculation.spec.tree`), so the accepted path is the unique longest match.

Stochastic (multi-draft rejection with deterministic candidates, SpecInfer / EAGLE)::

    cur = root; P = p(. | prefix + path(cur))          # processed target distribution at cur
    for x in children(cur) in sibling order:
        if U <= P(x):  accept x; cur = x; restart with a fresh P at cur
        else:          P(x) = 0; P = P / sum(P)
    bonus ~ P                                          # residual, or fresh p at a leaf

For candidates x_1..x_k fixed before the uniforms are drawn, P(out = x_j) telescopes to p(x_j)
and every other token keeps p(y), so the output distribution is the target's exactly.
The processors (temperature, then top-p, then top-k) are applied once per node, before the loop;
vanilla sampling uses the same :func:`target_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from speculation.config import SamplingConfig
from speculation.spec.tree import ROOT, DraftTree


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        accepted: node indices of the accepted path, root first (``len - 1`` drafts accepted).
        bonus_token: the token the target emits after the accepted path (the next root).
    """

    accepted: list[int]
    bonus_token: int

    @property
    def accept_length(self) -> int:
        """Draft tokens accepted (bonus excluded)."""
        return len(self.accepted) - 1


def build_processors(sampling: SamplingConfig) -> LogitsProcessorList:
    """Temperature, then top-p, then top-k (the order EAGLE uses), with HF's own warpers."""
    procs = LogitsProcessorList()
    if sampling.greedy:
        return procs  # greedy decoding never consults the processors
    if sampling.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_p < 1.0:
        procs.append(TopPLogitsWarper(sampling.top_p))
    if sampling.top_k > 0:
        procs.append(TopKLogitsWarper(sampling.top_k))
    return procs


def target_probs(logits: torch.Tensor, processors: LogitsProcessorList) -> torch.Tensor:
    """``[N, V]`` processed target distributions (fp32) from raw logits ``[N, V]``."""
    scores = processors(None, logits.float())  # HF warpers ignore input_ids
    return torch.softmax(scores, dim=-1)


def greedy(tree: DraftTree, logits: torch.Tensor, argmax: list[int] | None = None) -> VerifyResult:
    """Greedy acceptance. ``logits``: ``[T, V]`` target logits at each tree node; ``argmax``: their
    ``argmax`` per node when already taken (:func:`batch_argmax`), else taken here."""
    if argmax is None:
        argmax = first_argmax(logits).tolist()  # [T]
    cur = ROOT
    accepted = [ROOT]
    while True:
        nxt = tree.child(cur, argmax[cur])
        if nxt is None:
            break
        accepted.append(nxt)
        cur = nxt
    return VerifyResult(accepted=accepted, bonus_token=int(argmax[cur]))


def _rows(logits: list[torch.Tensor]) -> torch.Tensor:
    """``[sum T_b, V]``: the trees' logits as one tensor. When they are consecutive row blocks of
    one tensor (the in-process flat step's outputs), a view of those rows, else a copy
    (``torch.cat``: 0.25 ms for 8 rows of SmolLM2's vocabulary on this host)."""
    first = logits[0]
    if len(logits) == 1:
        return first
    storage = first.untyped_storage().data_ptr()
    nxt = first.data_ptr()
    for rows in logits:
        if (not rows.is_contiguous() or rows.data_ptr() != nxt or rows.shape[1:] != first.shape[1:]
                or rows.untyped_storage().data_ptr() != storage):
            return torch.cat(logits)
        nxt += rows.numel() * rows.element_size()
    total = sum(rows.shape[0] for rows in logits)
    return first.as_strided((total, *first.shape[1:]), first.stride())  # within the storage: checked above


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the last dimension (``[..., V]`` -> ``[...]``): the first maximal index, as
    ``Tensor.argmax`` gives, taken as the indices of ``torch.max(logits, dim=-1)``.

    Both are documented to return the first maximal index (equal on tie-heavy inputs, tested);
    the reduction behind ``max`` is several times faster on the CPU for bf16 logits (measured on
    the Intel Xeon with AMX-BF16 of BENCHMARKS.md's AMX tables): over
    SmolLM2's 49,152-token vocabulary, 16 rows took 0.32 ms against 1.46 ms for ``argmax``, 60
    rows 1.2 against 5.5 ms (2 threads; fp32 0.19 against 0.58 ms). Every greedy pick of the
    target goes through it, the solo loops' and the batched step's alike."""
    return torch.max(logits, dim=-1).indices


def batch_argmax(logits: list[torch.Tensor]) -> list[list[int]]:
    """``argmax`` of every node of every tree in one call (``logits[b]``: ``[T_b, V]``).

    One reduction over ``[sum T_b, V]`` instead of one per sequence: at B = 8 single-node trees of
    SmolLM2's 49,152-token vocabulary, 0.23 ms against 0.44 ms on this host. Each row's argmax is
    the same as taken alone (first maximal index)."""
    if not logits:
        return []
    flat = first_argmax(_rows(logits)).tolist()  # [sum T_b]
    out, lo = [], 0
    for rows in logits:
        out.append(flat[lo: lo + rows.shape[0]])
        lo += rows.shape[0]
    return out


def batch_topk(logits: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The ``k`` largest tokens' ids of every node of every tree in one call: ``[T_b, k]`` per tree."""
    if not logits:
        return []
    ids = torch.topk(_rows(logits), k, dim=-1).indices  # [sum T_b, k]
    return list(ids.split([rows.shape[0] for rows in logits]))


def sample(
    tree: DraftTree,
    logits: torch.Tensor,
    processors: LogitsProcessorList,
    generator: torch.Generator,
) -> VerifyResult:
    """Lossless stochastic acceptance over ``tree``. ``logits``: ``[T, V]``.

    Uniforms and the bonus draw come from ``generator`` (CPU), so a seeded run is reproducible.
    """
    cur = ROOT
    accepted = [ROOT]
    while True:
        probs = target_probs(logits[cur : cur + 1], processors)[0]  # [V]
        moved = False
        for child in tree.children(cur):
            x = tree.tokens[child]
            px = float(probs[x])
            u = float(torch.rand((), generator=generator))
            if px > 0.0 and u <= px:
                accepted.append(child)
                cur = child
                moved = True
                break
            # Reject x: remove it and renormalise the residual.
            probs[x] = 0.0
            total = float(probs.sum())
            if total <= 0.0:  # only possible if every token with mass was a rejected candidate
                break
            probs = probs / total
        if not moved:
            bonus = int(torch.multinomial(probs, 1, generator=generator))
            return VerifyResult(accepted=accepted, bonus_token=bonus)


def sample_token(logits: torch.Tensor, processors: LogitsProcessorList, generator: torch.Generator) -> int:
    """One plain sample from the processed distribution at ``logits`` (``[V]``): vanilla decoding."""
    probs = target_probs(logits.view(1, -1), processors)[0]
    return int(torch.multinomial(probs, 1, generator=generator))
