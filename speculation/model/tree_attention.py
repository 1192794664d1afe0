"""Inputs of tree-attention forwards: 4D masks and positions of one tree, of a batch of trees
over per-row KV lengths, of a flat (ragged) batched pass, and of chunked prefills.

Every target backend builds its forwards from these (the in-process
:class:`~speculation.model.target.TargetModel` and each pipeline shard), so all of them
attend the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculation.model.lean_forward import RaggedRows


def tree_attention_inputs(
    ancestor_mask: torch.Tensor, depths: torch.Tensor, past_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4D mask and positions of a tree forward over ``n = past_len`` cached tokens.

    For T tree nodes with ancestor-or-self mask ``A`` (``[T, T]`` bool) and depths ``d`` (``[T]``)::

        M[0, 0, i, :] = [1] * n ++ A[i]         # [1, 1, T, n + T] bool
        position_i    = n + d_i                 # [1, T] int64

    so node i attends to the committed text and its own path, at the position it would have in
    a sequential decode. Used by :class:`TargetModel` and by every pipeline shard.
    """
    T = int(depths.shape[0])
    mask = torch.ones(1, 1, T, past_len + T, dtype=torch.bool, device=device)  # [1, 1, T, n+T]
    mask[0, 0, :, past_len:] = ancestor_mask.to(device=device, dtype=torch.bool)
    positions = (depths.to(device=device, dtype=torch.long) + past_len).view(1, T)  # [1, T]
    return mask, positions


def prompt_chunks(ids: Sequence[int], chunk_tokens: int | None) -> list[tuple[int, list[int]]]:
    """``(start, tokens)`` of each forward of a chunked prefill: tokens ``jC .. (j+1)C - 1`` for
    ``C = chunk_tokens`` (None: the whole prompt in one). A bad ``chunk_tokens`` is refused by name."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"prefill chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    step = len(ids) if chunk_tokens is None else chunk_tokens
    return [(lo, list(ids[lo: lo + step])) for lo in range(0, len(ids), max(step, 1))]


def chunk_attention_inputs(
    past_len: int, length: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Mask and positions of a prompt chunk of ``length`` tokens after ``past_len`` cached ones.

    A first chunk (``past_len = 0``) and a one-token chunk need none: (None, None), the plain
    causal call. Otherwise the chunk is a chain over the cache::

        M[0, 0, i, :] = [1] * n ++ [j <= i for j < T]     # [1, 1, T, n + T] bool
        position_i    = n + i                             # [1, T] int64
    """
    if past_len == 0 or length == 1:
        return None, None
    chain = torch.ones(length, length, dtype=torch.bool).tril_()  # [T, T]: i sees j <= i
    return tree_attention_inputs(chain, torch.arange(length), past_len, device)


def batch_tree_attention_inputs(
    trees: list, past_lens: list[int], kv_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, 4D mask and positions of one batched tree forward over per-row KV lengths.

    Row b has ``n_b = past_lens[b]`` valid KV rows and a tree of ``T_b`` nodes (``trees[b]``, a
    :class:`~speculation.spec.tree.TreeTensors`) written at ``n_b .. n_b + T_b``; ``T = max T_b``::

        ids[b, i]          = token_i (i < T_b), 0 for padding               # [B, T] int64
        M[b, 0, i, :]      = [1]*n_b ++ A_b[i] ++ [0]*(kv_len - n_b - T_b)  # [B, 1, T, kv_len] bool
        M[b, 0, i, :]      = [1] ++ [0]*(kv_len - 1)     for padding i >= T_b (any finite row)
        position[b, i]     = n_b + d_b[i]  (n_b + i for padding)            # [B, T] int64

    Padding queries read row 0 of their own slot only, so they stay finite and touch nobody.
    """
    B = len(trees)
    T = max(int(t.tokens.shape[0]) for t in trees)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, 1, T, kv_len, dtype=torch.bool)
    positions = torch.arange(T, dtype=torch.long).repeat(B, 1)
    for b, (tt, n) in enumerate(zip(trees, past_lens)):
        tb = int(tt.tokens.shape[0])
        ids[b, :tb] = tt.tokens
        mask[b, 0, :tb, :n] = True
        mask[b, 0, :tb, n : n + tb] = tt.ancestor_mask
        mask[b, 0, tb:, 0] = True
        positions[b, :tb] = tt.depths
        positions[b] += n
    return ids.to(device), mask.to(device), positions.to(device)


def ragged_tree_inputs(
    trees: list, past_lens: list[int], device: torch.device, prompts: Sequence[Sequence[int]] = (),
    prompt_past: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RaggedRows]:
    """Token ids, positions and rows of one flat (ragged) batched forward: tree rows, then prompts.

    Row b's ``T_b`` nodes (``trees[b]``, a :class:`~speculation.spec.tree.TreeTensors`) after its
    ``n_b = past_lens[b]`` committed tokens take tokens ``o_b .. o_b + T_b`` of the packed pass::

        ids[0, o_b + i]       = token_i                                     # [1, sum T_b] int64
        position[0, o_b + i]  = n_b + d_b[i]                                # [1, sum T_b] int64
        mask_b                = [1]*n_b ++ A_b  (tree_attention_inputs)     # [1, 1, T_b, n_b + T_b]

    and ``mask_b`` is None for a one-token row (a decode step: it attends to every key of its row).
    Each prompt of ``prompts`` follows as one row of its n tokens at positions ``s..s+n-1``, ``s``
    its slot's prefilled tokens (``prompt_past``, None: all 0): a prefill of an empty slot has
    ``mask`` None (causal over its own keys, as a solo prefill); a later chunk of a chunked prefill
    attends to its slot's earlier chunks and causally to itself (:func:`chunk_attention_inputs`).
    """
    past = [0] * len(prompts) if prompt_past is None else list(prompt_past)
    if len(past) != len(prompts):
        raise ValueError("ragged_tree_inputs needs one prompt_past per prompt")
    n_tree = [int(tt.tokens.shape[0]) for tt in trees]
    ids = torch.cat([*(tt.tokens for tt in trees), *(torch.tensor(p, dtype=torch.long) for p in prompts)])
    positions = torch.cat([*(tt.depths.to(torch.long) + n for tt, n in zip(trees, past_lens)),
                           *(torch.arange(s, s + len(p), dtype=torch.long) for p, s in zip(prompts, past))])
    masks: list[torch.Tensor | None] = []
    for tt, n, t in zip(trees, past_lens, n_tree):
        masks.append(None if t == 1 else tree_attention_inputs(tt.ancestor_mask, tt.depths, n, device)[0])
    masks += [chunk_attention_inputs(s, len(p), device)[0] for p, s in zip(prompts, past)]
    sizes = (*n_tree, *(len(p) for p in prompts))
    return ids.view(1, -1).to(device), positions.view(1, -1).to(device), RaggedRows(sizes=sizes, masks=tuple(masks))


def causal_positions(past_len: int, length: int, device: torch.device) -> torch.Tensor:
    """``[1, T]`` positions ``n + arange(T)`` of T tokens appended after ``n = past_len`` cached ones."""
    return torch.arange(past_len, past_len + length, dtype=torch.long, device=device).view(1, length)
