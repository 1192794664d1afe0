"""Property tests of the one-pass tree forward and the KV compaction in :mod:`speculation.model.target`.

On a tiny random Llama (fp32, sdpa), for random prompts and random tree shapes:

* ``TargetModel.verify`` logits (and aux hidden states) at every node equal those of a fresh
  sequential forward over prompt + path(root..node) through the plain HF model;
* after ``commit`` of a random root-to-node path, ``decode`` continues exactly as a fresh forward
  over prompt + committed path + next token, and a second ``verify`` after that partial
  acceptance is again exact.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculation.model.target import TargetModel
from speculation.spec.tree import DraftTree, NodeSource
from tests.helpers import TINY_AUX_LAYERS, full_logits, shared_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
ATOL = 1e-4


def _model():
    return shared_tiny_llama(vocab_size=VOCAB, seed=1234)


def _target() -> TargetModel:
    return TargetModel(_model(), None, aux_layers=TINY_AUX_LAYERS)


@torch.inference_mode()
def reference(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-position logits ``[V]``, last-position aux features ``[3H]``) of a plain forward."""
    out = _model()(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0, -1] for k in TINY_AUX_LAYERS], dim=-1)
    return out.logits[0, -1].float(), aux.float()


def assert_same_argmax(got: torch.Tensor, ref: torch.Tensor) -> None:
    g, r = int(got.argmax()), int(ref.argmax())
    if g != r:  # only acceptable for an exact numerical tie at the reference
        assert float(ref[r] - ref[g]) < 1e-6, f"argmax {g} != reference argmax {r}"


@st.composite
def trees(draw, max_nodes: int = 24):
    """A random DraftTree of 1..max_nodes nodes (root included) from a parents-first array."""
    n = draw(st.integers(1, max_nodes))
    root = draw(st.integers(0, VOCAB - 1))
    tree = DraftTree(root)
    where = [0]
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        tok = draw(st.integers(0, VOCAB - 1))
        where.append(tree.add(where[p], tok, -float(i), NodeSource.DRAFTER))
    return tree


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)


def check_tree_forward(target: TargetModel, state, context: list[int], tree: DraftTree):
    """Verify ``tree`` over ``state`` (holding ``context``) and compare every node to a fresh forward."""
    assert state.length == len(context)
    fwd = target.verify(state, tree, need_aux=True)
    T = len(tree)
    assert fwd.logits.shape == (T, VOCAB)
    assert fwd.aux_hidden is not None and fwd.aux_hidden.shape == (T, 3 * target.hidden_size)
    assert state.length == len(context) + T  # provisional until commit
    for i in range(T):
        ref_logits, ref_aux = reference(context + tree.path_tokens(i))
        torch.testing.assert_close(fwd.logits[i].float(), ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(fwd.aux_hidden[i].float(), ref_aux, atol=ATOL, rtol=0)
        assert_same_argmax(fwd.logits[i], ref_logits)
    return fwd


def cache_rows(state) -> int:
    return state.cache.get_seq_length()


@settings(max_examples=40, deadline=None)
@given(prompt=prompts, tree=trees())
def test_verify_logits_match_sequential_forward(prompt, tree):
    target = _target()
    state, logits, _ = target.prefill(prompt)
    ref_logits, _ = reference(prompt)
    torch.testing.assert_close(logits.float(), ref_logits, atol=ATOL, rtol=0)
    check_tree_forward(target, state, prompt, tree)


@settings(max_examples=40, deadline=None)
@given(
    prompt=prompts,
    tree1=trees(),
    tree2=trees(),
    pick1=st.integers(0, 10**6),
    pick2=st.integers(0, 10**6),
    next1=st.integers(0, VOCAB - 1),
    next2=st.integers(0, VOCAB - 1),
)
def test_commit_then_decode_and_reverify_are_exact(prompt, tree1, tree2, pick1, pick2, next1, next2):
    target = _target()
    state, _, _ = target.prefill(prompt)
    context = list(prompt)

    # Step 1: verify, accept a random root-to-node path (partial acceptance in general).
    check_tree_forward(target, state, context, tree1)
    path1 = tree1.path(pick1 % len(tree1))
    target.commit(state, tree1, path1)
    context += [tree1.tokens[a] for a in path1]
    assert state.length == len(context) == cache_rows(state)
    assert state.tokens == context

    # Decode continues exactly after the accepted path.
    logits = target.decode(state, next1)
    context.append(next1)
    ref, _ = reference(context)
    torch.testing.assert_close(logits.float(), ref, atol=ATOL, rtol=0)
    assert_same_argmax(logits, ref)
    assert state.length == len(context) == cache_rows(state)

    # Step 2: a second tree verify over the compacted cache is exact too.
    check_tree_forward(target, state, context, tree2)
    path2 = tree2.path(pick2 % len(tree2))
    target.commit(state, tree2, path2)
    context += [tree2.tokens[a] for a in path2]
    assert state.length == len(context) == cache_rows(state)

    logits = target.decode(state, next2)
    context.append(next2)
    ref, _ = reference(context)
    torch.testing.assert_close(logits.float(), ref, atol=ATOL, rtol=0)
    assert_same_argmax(logits, ref)


@settings(max_examples=25, deadline=None)
@given(prompt=prompts, tree1=trees(), tree2=trees(), pick1=st.integers(0, 10**6))
def test_verify_directly_after_commit_matches(prompt, tree1, tree2, pick1):
    """The engine's pattern: commit, then verify the next tree (rooted at the bonus) at once."""
    target = _target()
    state, _, _ = target.prefill(prompt)
    check_tree_forward(target, state, list(prompt), tree1)
    path = tree1.path(pick1 % len(tree1))
    target.commit(state, tree1, path)
    context = list(prompt) + [tree1.tokens[a] for a in path]
    check_tree_forward(target, state, context, tree2)


def test_non_contiguous_accepted_path_is_compacted():
    """A path through the last sibling (indices not 0..m) must move KV rows, not just cut them."""
    target = _target()
    prompt = [3, 14, 15, 9, 26]
    state, _, _ = target.prefill(prompt)
    tree = DraftTree(5)
    a = tree.add(0, 1, -1.0, NodeSource.DRAFTER)
    tree.add(a, 2, -2.0, NodeSource.DRAFTER)
    b = tree.add(0, 7, -1.5, NodeSource.DRAFTER)
    tree.add(b, 8, -2.5, NodeSource.DRAFTER)
    c = tree.add(b, 9, -3.0, NodeSource.DRAFTER)
    target.verify(state, tree)
    target.commit(state, tree, [0, b, c])
    ctx = prompt + [5, 7, 9]
    logits = target.decode(state, 11)
    ref, _ = reference(ctx + [11])
    torch.testing.assert_close(logits.float(), ref, atol=ATOL, rtol=0)


def test_commit_rejects_path_not_starting_at_root():
    target = _target()
    state, _, _ = target.prefill([1, 2, 3])
    tree = DraftTree(4)
    n = tree.add(0, 5, -1.0, NodeSource.DRAFTER)
    target.verify(state, tree)
    with pytest.raises(ValueError, match="root"):
        target.commit(state, tree, [n])


def test_full_logits_helper_agrees_with_reference():
    ids = [1, 2, 3, 4]
    torch.testing.assert_close(full_logits(_model(), ids)[-1], reference(ids)[0], atol=0, rtol=0)


def test_reserved_kv_rows_append_in_place_and_stay_exact_past_a_regrowth():
    """The solo cache's layers (speculation.model.kv_reserve) write appends into spare rows instead of
    concatenating: the buffer is reused between appends, regrows past its capacity, survives the
    tree compaction and truncation, and every step's logits equal a fresh forward's."""
    from speculation.model.kv_reserve import RESERVE_MIN_ROWS, ReservedLayer

    target = _target()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(VOCAB, (20,), generator=g).tolist()
    state, logits, _ = target.prefill(ids)
    layer = state.cache.layers[0]
    assert isinstance(layer, ReservedLayer)
    buf = layer._kbuf.data_ptr()
    tok = int(logits.argmax())
    for i in range(RESERVE_MIN_ROWS + 20):  # crosses the first capacity (20 + 256 rows)
        if i % 40 == 7:  # a tree step with a non-contiguous accepted path, then the compaction
            tree = DraftTree(tok)
            a = tree.add(0, (tok + 1) % VOCAB, 0.0, NodeSource.DRAFTER)
            tree.add(0, (tok + 2) % VOCAB, 0.0, NodeSource.DRAFTER)
            tree.add(a, (tok + 3) % VOCAB, 0.0, NodeSource.DRAFTER)
            fwd = target.verify(state, tree)
            target.commit(state, tree, [0, 2])
            logits = fwd.logits[2]
        else:
            logits = target.decode(state, tok)
        if i == 30:
            assert layer._kbuf.data_ptr() == buf  # appends and compactions reused the buffer
        tok = int(logits.argmax())
        if i % 97 == 0 or i == RESERVE_MIN_ROWS + 19:
            torch.testing.assert_close(logits, reference(state.tokens)[0], atol=ATOL, rtol=0)
    assert layer._kbuf.data_ptr() != buf and layer._kbuf.shape[-2] >= state.length  # it regrew once full
    target.truncate(state, 25)
    logits = target.decode(state, 5)
    torch.testing.assert_close(logits, reference(state.tokens)[0], atol=ATOL, rtol=0)
