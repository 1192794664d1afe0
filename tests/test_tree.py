"""Unit tests for :class:`speculation.spec.tree.DraftTree` (construction, merging, masks, pruning)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculation.spec.tree import ROOT, DraftTree, NodeSource


# ---------------------------------------------------------------------------- helpers
def check_invariants(tree: DraftTree) -> None:
    """Parents-first order, consistent depths, unique sibling tokens, consistent child index."""
    n = len(tree)
    assert len(tree.tokens) == len(tree.parents) == len(tree.depths) == len(tree.scores) == len(tree.sources) == n
    assert tree.parents[ROOT] == -1
    assert tree.depths[ROOT] == 0
    assert tree.sources[ROOT] == NodeSource.ROOT
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i, f"node {i} has parent {p}: not parents-first"
        assert tree.depths[i] == tree.depths[p] + 1
    for i in range(n):
        kids = tree.children(i)
        assert kids == [j for j in range(n) if tree.parents[j] == i]  # insertion order == index order
        toks = [tree.tokens[j] for j in kids]
        assert len(toks) == len(set(toks)), f"duplicate sibling tokens under node {i}: {toks}"
        for j in kids:
            assert tree.child(i, tree.tokens[j]) == j


def brute_ancestors(tree: DraftTree, i: int) -> set[int]:
    """Ancestor-or-self set of node i by walking parent pointers."""
    out = set()
    while i >= 0:
        out.add(i)
        i = tree.parents[i]
    return out


def node_key(tree: DraftTree, i: int) -> tuple[int, ...]:
    """A node's identity independent of indices: its root..node token path (siblings are unique)."""
    return tuple(tree.path_tokens(i))


@st.composite
def parent_arrays(draw, max_nodes: int = 30, vocab: int = 6):
    """(parents, tokens, scores) for a random parents-first tree of 1..max_nodes non-root nodes."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(0, i - 1)) for i in range(1, n + 1)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    scores = draw(st.lists(st.floats(-20, 0, allow_nan=False), min_size=n, max_size=n))
    return parents, tokens, scores


def build(parents, tokens, scores, root_token: int = 99) -> tuple[DraftTree, list[int]]:
    """Build a tree with :meth:`DraftTree.add` from a parent array (index 0 of the arrays is node 1).

    Returns the tree and ``where[k]`` = tree index of array node k+1 (duplicates merge).
    """
    tree = DraftTree(root_token)
    where = [ROOT]
    for p, t, s in zip(parents, tokens, scores):
        where.append(tree.add(where[p], t, s, NodeSource.DRAFTER))
    return tree, where[1:]


def decreasing_tree(rng: random.Random, n: int, vocab: int = 5) -> DraftTree:
    """A random tree whose scores strictly decrease along every path and are all distinct."""
    tree = DraftTree(0)
    used: set[float] = set()
    while len(tree) - 1 < n:
        p = rng.randrange(len(tree))
        tok = rng.randrange(vocab)
        if tree.child(p, tok) is not None:
            continue
        s = tree.scores[p] - rng.uniform(0.01, 3.0)
        if s in used:
            continue
        used.add(s)
        tree.add(p, tok, s, NodeSource.DRAFTER)
    return tree


# ---------------------------------------------------------------------------- construction
def test_root_only_tree():
    tree = DraftTree(7)
    assert len(tree) == 1
    assert tree.root_token == 7
    assert tree.max_depth() == 0
    assert tree.leaves() == [ROOT]
    assert tree.ancestor_mask().tolist() == [[True]]
    assert tree.retrieve_paths() == [[ROOT]]
    check_invariants(tree)


@settings(max_examples=200, deadline=None)
@given(parent_arrays())
def test_parents_first_invariant_under_add(arr):
    parents, tokens, scores = arr
    tree, where = build(parents, tokens, scores)
    check_invariants(tree)
    # Every array node landed on a tree node with its token under the (merged) parent.
    full_where = [ROOT, *where]
    for k, (p, t) in enumerate(zip(parents, tokens)):
        idx = full_where[k + 1]
        assert tree.tokens[idx] == t
        assert tree.parents[idx] == full_where[p]


def test_add_rejects_bad_parent():
    tree = DraftTree(0)
    with pytest.raises(IndexError):
        tree.add(1, 3, 0.0, NodeSource.DRAFTER)
    with pytest.raises(IndexError):
        tree.add(-1, 3, 0.0, NodeSource.DRAFTER)


def test_sibling_dedup_returns_same_index_and_keeps_max_score():
    tree = DraftTree(0)
    a = tree.add(ROOT, 5, -2.0, NodeSource.DRAFTER)
    b = tree.add(ROOT, 5, -1.0, NodeSource.RETRIEVAL)  # higher score: replaces the score
    assert a == b
    assert len(tree) == 2
    assert tree.scores[a] == -1.0
    assert tree.sources[a] == NodeSource.DRAFTER  # first proposer owns the node
    c = tree.add(ROOT, 5, -3.0, NodeSource.DRAFTER)  # lower score: keeps the max
    assert c == a
    assert tree.scores[a] == -1.0
    # Same token under a different parent is a different node.
    d = tree.add(a, 5, -4.0, NodeSource.DRAFTER)
    assert d != a and tree.parents[d] == a
    assert len(tree) == 3
    check_invariants(tree)


@settings(max_examples=100, deadline=None)
@given(parent_arrays(vocab=3))
def test_dedup_score_is_max_over_merged_adds(arr):
    parents, tokens, scores = arr
    tree, where = build(parents, tokens, scores)
    best: dict[int, float] = {}
    for idx, s in zip(where, scores):
        best[idx] = max(best.get(idx, -float("inf")), s)
    for idx, s in best.items():
        assert tree.scores[idx] == pytest.approx(s)


# ---------------------------------------------------------------------------- add_chain
def test_add_chain_descends_through_existing_children():
    tree = DraftTree(0)
    assert tree.add_chain(ROOT, [1, 2, 3], [-1.0, -2.0, -3.0], NodeSource.DRAFTER) == 3
    assert len(tree) == 4
    # Shares the prefix 1, 2; only 4 is new and hangs under the node of token 2.
    created = tree.add_chain(ROOT, [1, 2, 4], [-0.5, -0.5, -0.5], NodeSource.RETRIEVAL)
    assert created == 1
    assert len(tree) == 5
    node2 = tree.child(tree.child(ROOT, 1), 2)
    node4 = tree.child(node2, 4)
    assert node4 == 4 and tree.sources[node4] == NodeSource.RETRIEVAL
    assert tree.path_tokens(node4) == [0, 1, 2, 4]
    # Descending through existing nodes does not touch their scores or sources.
    assert tree.scores[tree.child(ROOT, 1)] == -1.0
    assert tree.sources[node2] == NodeSource.DRAFTER
    # A fully present chain creates nothing.
    assert tree.add_chain(ROOT, [1, 2, 3], [0.0, 0.0, 0.0], NodeSource.DRAFTER) == 0
    assert len(tree) == 5
    check_invariants(tree)


def test_add_chain_under_inner_node_and_budget():
    tree = DraftTree(0)
    tree.add_chain(ROOT, [1, 2], [-1.0, -2.0], NodeSource.DRAFTER)
    n1 = tree.child(ROOT, 1)
    # Budget counts only new nodes: the existing 2 is traversed for free, then 2 new of 3 wanted.
    created = tree.add_chain(n1, [2, 7, 8, 9], [-1, -2, -3, -4], NodeSource.DRAFTER, max_new_nodes=2)
    assert created == 2
    assert tree.path_tokens(len(tree) - 1) == [0, 1, 2, 7, 8]
    assert tree.add_chain(ROOT, [5, 6], [-1, -2], NodeSource.DRAFTER, max_new_nodes=0) == 0
    assert len(tree) == 5
    check_invariants(tree)


def test_add_chain_uses_shorter_of_tokens_and_scores():
    tree = DraftTree(0)
    assert tree.add_chain(ROOT, [1, 2, 3], [-1.0], NodeSource.DRAFTER) == 1
    assert len(tree) == 2


# ---------------------------------------------------------------------------- attach
def test_attach_merges_duplicates_and_preserves_sources():
    base = DraftTree(0)
    a = base.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    base.add(a, 2, -2.0, NodeSource.DRAFTER)

    sub = DraftTree(123)  # root token ignored: it stands for `a`
    s2 = sub.add(ROOT, 2, -0.5, NodeSource.RETRIEVAL)  # duplicates base node (a, 2)
    s3 = sub.add(s2, 3, -0.7, NodeSource.RETRIEVAL)
    s4 = sub.add(ROOT, 4, -0.9, NodeSource.RETRIEVAL)

    placed = base.attach(a, sub, score_offset=-1.0)
    assert placed[ROOT] == a
    assert placed[s2] == base.child(a, 2) == 2  # merged into the existing node
    assert base.sources[placed[s2]] == NodeSource.DRAFTER  # existing node keeps its owner
    assert base.scores[placed[s2]] == -1.5  # max(-2.0, -0.5 + -1.0)
    assert base.parents[placed[s3]] == placed[s2]
    assert base.parents[placed[s4]] == a
    assert base.sources[placed[s3]] == NodeSource.RETRIEVAL
    assert base.sources[placed[s4]] == NodeSource.RETRIEVAL
    assert base.scores[placed[s3]] == pytest.approx(-1.7)
    assert base.path_tokens(placed[s3]) == [0, 1, 2, 3]
    assert len(base) == 5
    check_invariants(base)


def test_attach_respects_max_new_nodes_and_skips_orphans():
    base = DraftTree(0)
    base.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    sub = DraftTree(0)
    x = sub.add(ROOT, 1, -1.0, NodeSource.RETRIEVAL)  # duplicate: free
    y = sub.add(ROOT, 2, -1.0, NodeSource.RETRIEVAL)  # new #1
    z = sub.add(y, 3, -1.0, NodeSource.RETRIEVAL)  # new #2
    w = sub.add(ROOT, 4, -1.0, NodeSource.RETRIEVAL)  # over budget
    v = sub.add(w, 5, -1.0, NodeSource.RETRIEVAL)  # parent not placed -> skipped
    u = sub.add(x, 6, -1.0, NodeSource.RETRIEVAL)  # over budget
    placed = base.attach(ROOT, sub, max_new_nodes=2)
    assert placed[x] == 1
    assert placed[y] > 0 and placed[z] > 0
    assert placed[w] == -1 and placed[v] == -1 and placed[u] == -1
    assert len(base) == 4
    check_invariants(base)

    # Zero budget still merges duplicates (and descends through them).
    base2 = DraftTree(0)
    n1 = base2.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    base2.add(n1, 6, -3.0, NodeSource.DRAFTER)
    placed2 = base2.attach(ROOT, sub, max_new_nodes=0)
    assert placed2[x] == n1 and placed2[u] == base2.child(n1, 6)
    assert [placed2[k] for k in (y, z, w, v)] == [-1, -1, -1, -1]
    assert len(base2) == 3


@settings(max_examples=150, deadline=None)
@given(
    parent_arrays(max_nodes=12, vocab=3),
    parent_arrays(max_nodes=12, vocab=3),
    st.integers(0, 12),
    st.one_of(st.none(), st.integers(0, 15)),
)
def test_attach_property(base_arr, sub_arr, at, budget):
    base, _ = build(*base_arr)
    at = at % len(base)
    sources = [NodeSource.RETRIEVAL if k % 2 else NodeSource.DRAFTER for k in range(len(sub_arr[0]))]
    sub = DraftTree(0)
    where = [ROOT]
    for (p, t, s), src in zip(zip(*sub_arr), sources):
        where.append(sub.add(where[p], t, s, src))
    before_len = len(base)
    before_keys = {node_key(base, i) for i in range(len(base))}
    before_sources = list(base.sources)
    placed = base.attach(at, sub, max_new_nodes=budget)
    check_invariants(base)
    created = len(base) - before_len
    if budget is not None:
        assert created <= budget
    assert base.sources[:before_len] == before_sources  # existing nodes keep their owners
    prefix = base.path_tokens(at)
    for j in range(1, len(sub)):
        if placed[j] < 0:
            continue
        i = placed[j]
        assert base.tokens[i] == sub.tokens[j]
        assert base.parents[i] == placed[sub.parents[j]]  # under the right parent
        assert base.path_tokens(i) == prefix + sub.path_tokens(j)[1:]
        if i >= before_len:  # a new node: carries the subtree's source and score
            assert base.sources[i] == sub.sources[j]
            assert base.scores[i] == pytest.approx(sub.scores[j])
        else:
            assert base.scores[i] >= sub.scores[j] - 1e-12
    # Subtree nodes that would have merged into existing nodes are never dropped for budget.
    for j in range(1, len(sub)):
        if placed[sub.parents[j]] >= 0 and placed[j] < 0:
            key = tuple(base.path_tokens(placed[sub.parents[j]])) + (sub.tokens[j],)
            assert key not in before_keys
    if budget is None:
        assert all(p >= 0 for p in placed)


# ---------------------------------------------------------------------------- ancestor mask
@settings(max_examples=150, deadline=None)
@given(parent_arrays(max_nodes=40, vocab=4))
def test_ancestor_mask_matches_brute_force(arr):
    tree, _ = build(*arr)
    mask = tree.ancestor_mask()
    n = len(tree)
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        assert {j for j in range(n) if mask[i, j]} == brute_ancestors(tree, i)
    # depth = |ancestors| - 1 (docs/algorithms.md §1)
    assert (mask.sum(-1) - 1).tolist() == tree.depths
    tt = tree.to_tensors()
    assert torch.equal(tt.ancestor_mask, mask)
    assert tt.tokens.tolist() == tree.tokens and tt.depths.tolist() == tree.depths
    assert tt.tokens.dtype == torch.long and tt.depths.dtype == torch.long


@settings(max_examples=80, deadline=None)
@given(parent_arrays(max_nodes=25, vocab=4))
def test_paths_leaves_and_retrieve(arr):
    tree, _ = build(*arr)
    leaves = tree.leaves()
    assert leaves == [i for i in range(len(tree)) if not tree.children(i)]
    paths = tree.retrieve_paths()
    assert [p[-1] for p in paths] == leaves
    for p in paths:
        assert p[0] == ROOT
        assert all(tree.parents[b] == a for a, b in zip(p, p[1:]))
    assert tree.max_depth() == max(len(p) for p in paths) - 1
    assert tree.count_source(NodeSource.DRAFTER) == len(tree) - 1
    assert tree.count_source(NodeSource.ROOT) == 1


# ---------------------------------------------------------------------------- pruning
def test_pruned_to_negative_budget_raises():
    tree = DraftTree(0)
    tree.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    with pytest.raises(ValueError, match="budget"):
        tree.pruned_to(-1)


def test_pruned_to_zero_and_large_budget():
    rng = random.Random(0)
    tree = decreasing_tree(rng, 10)
    root_only = tree.pruned_to(0)
    assert len(root_only) == 1 and root_only.root_token == tree.root_token
    same = tree.pruned_to(10)
    assert same.tokens == tree.tokens and same.parents == tree.parents
    assert tree.pruned_to(100).tokens == tree.tokens


@settings(max_examples=150, deadline=None)
@given(parent_arrays(max_nodes=30, vocab=4), st.integers(0, 35))
def test_pruned_to_budget_and_ancestor_closed(arr, budget):
    tree, _ = build(*arr)
    pruned = tree.pruned_to(budget)
    check_invariants(pruned)
    assert len(pruned) - 1 <= budget
    assert pruned.root_token == tree.root_token
    original = {node_key(tree, i): i for i in range(len(tree))}
    kept = []
    for i in range(len(pruned)):
        key = node_key(pruned, i)
        assert key in original, "pruning invented a node"
        j = original[key]
        kept.append(j)
        assert pruned.scores[i] == tree.scores[j]
        assert pruned.sources[i] == tree.sources[j]
    kept_set = set(kept)
    for j in kept:  # ancestor-closed in the original tree
        assert brute_ancestors(tree, j) <= kept_set
    assert kept == sorted(kept), "pruning must keep the original (parents-first) order"


@pytest.mark.parametrize("seed", range(30))
def test_pruned_to_keeps_highest_scored_when_scores_decrease(seed):
    rng = random.Random(seed)
    tree = decreasing_tree(rng, rng.randint(1, 30))
    for budget in range(0, len(tree) + 1):
        pruned = tree.pruned_to(budget)
        k = min(budget, len(tree) - 1)
        top = sorted(range(1, len(tree)), key=lambda i: -tree.scores[i])[:k]
        expect = {node_key(tree, i) for i in top}
        got = {node_key(pruned, i) for i in range(1, len(pruned))}
        assert got == expect
        # Pruning is greedy-fill: with decreasing scores every budget slot is used.
        assert len(pruned) - 1 == k


def test_pruned_to_skips_a_deep_node_whose_ancestors_do_not_fit():
    tree = DraftTree(0)
    a = tree.add(ROOT, 1, -5.0, NodeSource.DRAFTER)
    b = tree.add(a, 2, -6.0, NodeSource.DRAFTER)
    tree.add(b, 3, -0.1, NodeSource.DRAFTER)  # best score, but needs 2 ancestors
    tree.add(ROOT, 4, -1.0, NodeSource.DRAFTER)
    pruned = tree.pruned_to(2)
    keys = {node_key(pruned, i) for i in range(1, len(pruned))}
    # Node 3 (with ancestors = 3 nodes) does not fit; 4 then 1 are taken.
    assert keys == {(0, 4), (0, 1)}
    pruned3 = tree.pruned_to(3)
    assert {node_key(pruned3, i) for i in range(1, len(pruned3))} == {(0, 1), (0, 1, 2), (0, 1, 2, 3)}


# ---------------------------------------------------------------------------- subtree
def test_subtree_raises_on_non_ancestor_closed_set():
    tree = DraftTree(0)
    a = tree.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    b = tree.add(a, 2, -2.0, NodeSource.DRAFTER)
    with pytest.raises(ValueError, match="ancestor-closed"):
        tree.subtree([ROOT, b])
    with pytest.raises(ValueError, match="ancestor-closed"):
        tree.subtree([b])  # root is implicit but a is missing


def test_subtree_keeps_selected_nodes_in_order():
    tree = DraftTree(0)
    a = tree.add(ROOT, 1, -1.0, NodeSource.DRAFTER)
    b = tree.add(ROOT, 2, -1.5, NodeSource.RETRIEVAL)
    c = tree.add(a, 3, -2.0, NodeSource.DRAFTER)
    tree.add(b, 4, -2.5, NodeSource.RETRIEVAL)
    sub = tree.subtree([c, a, b])  # any order, root implicit
    assert sub.tokens == [0, 1, 2, 3]
    assert sub.parents == [-1, 0, 0, 1]
    assert sub.sources[1:] == [NodeSource.DRAFTER, NodeSource.RETRIEVAL, NodeSource.DRAFTER]
    assert sub.scores == [0.0, -1.0, -1.5, -2.0]
    check_invariants(sub)
