"""The batch engine's one-call argmax and top-k over every sequence's tree rows
(:func:`speculation.spec.verify.batch_argmax`, :func:`~speculation.spec.verify.batch_topk`): each tree's
result must be what a call on its own rows gives, whether the rows are views of one flat step
output (no copy) or separate tensors (the Ray path's), including exact ties."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculation.spec import verify as V
from speculation.spec.tree import DraftTree, NodeSource


def _blocks(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, lo = [], 0
    for n in sizes:
        out.append(flat[lo: lo + n])
        lo += n
    return out


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8), seed=st.integers(0, 10_000),
       copies=st.booleans(), ties=st.booleans())
def test_batched_picks_equal_per_tree_calls(sizes, seed, copies, ties):
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(1, sum(sizes) + 2, 97, generator=gen)[0]  # [K, V], rows past the trees too
    if ties:  # equal maxima: argmax must still pick the first, as a call of its own does
        flat[:, 5] = flat.max() + 1.0
        flat[:, 40] = flat.max()
    blocks = _blocks(flat, sizes)
    if copies:
        blocks = [b.clone() for b in blocks]
    assert V.batch_argmax(blocks) == [b.argmax(dim=-1).tolist() for b in blocks]
    for got, b in zip(V.batch_topk(blocks, 4), blocks):
        assert torch.equal(got, torch.topk(b, 4, dim=-1).indices)
    assert torch.equal(V._rows(blocks), torch.cat(blocks))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.sampled_from([2, 97, 4096, 49_152]), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), levels=st.sampled_from([2, 7, 0]))
def test_first_argmax_is_argmax_first_maximal_index(rows, vocab, seed, dtype, levels):
    """The greedy pick (``torch.max(...).indices``, faster in bf16) is ``argmax``: the FIRST maximal
    index, on inputs where ties are the rule (``levels`` distinct values) or rare (0: Gaussian)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, levels, (rows, vocab), generator=gen).float() if levels
         else torch.randn(rows, vocab, generator=gen)).to(dtype)
    assert torch.equal(V.first_argmax(x), x.argmax(dim=-1))
    assert int(V.first_argmax(x[0])) == int(x[0].argmax())


def test_rows_is_a_view_only_for_consecutive_blocks_of_one_tensor():
    flat = torch.randn(10, 33)
    consecutive = [flat[0:2], flat[2:3], flat[3:7]]
    assert V._rows(consecutive).data_ptr() == flat.data_ptr()
    gapped = [flat[0:2], flat[3:4]]  # a prompt row between two trees
    out = V._rows(gapped)
    assert out.data_ptr() != flat.data_ptr() and torch.equal(out, torch.cat(gapped))
    assert V.batch_argmax([]) == [] and V.batch_topk([], 3) == []


def test_greedy_with_precomputed_argmax_equals_greedy_on_logits():
    tree = DraftTree(7)
    a = tree.add(0, 3, -0.1, NodeSource.RETRIEVAL)
    tree.add(a, 4, -0.2, NodeSource.RETRIEVAL)
    tree.add(0, 9, -0.5, NodeSource.RETRIEVAL)
    logits = torch.full((4, 12), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 11] = logits[3, 2] = 1.0
    want = V.greedy(tree, logits)
    got = V.greedy(tree, logits, V.batch_argmax([logits])[0])
    assert got == want and want.accepted == [0, 1, 2] and want.bonus_token == 11
