"""Retrieval drafter pieces: suffix index, datastore, transition table, tree building, sizing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from speculation.config import ConfigError, RetrievalConfig
from speculation.policy.cost import OnlineCostModel, VerifyCostModel, online
from speculation.drafters.base import DraftContext, StepOutcome
from speculation.drafters.retrieval import RetrievalDrafter, SuffixArrayDatastore, SuffixIndex, TransitionTable
from speculation.spec.tree import DraftTree, NodeSource


def test_suffix_index_counts_and_matches():
    idx = SuffixIndex(depth=4)
    idx.extend([1, 2, 3, 1, 2])
    # Suffix "1 2" occurred twice; once followed by 3.
    matches = idx.matches(1, 4)
    lengths = [m for m, _ in matches]
    assert lengths == sorted(lengths, reverse=True)
    trie, two = idx.trie, dict(matches)[2]
    assert trie.count[two] == 2 and trie.top(two) == [3] and trie.total[two] == 1
    assert trie.count[trie.child(two, 3)] == 1 and trie.child(two, 1) is None


def test_count_trie_keeps_the_most_frequent_children_first():
    from speculation.drafters.count_trie import _TOP_CHILDREN, CountTrie

    trie = CountTrie()
    seq = [7, 8, 8, 9, 9, 9, 10, 11, 12, 12, 12, 12]  # 12 arrives last, overtakes everything
    for t in seq:
        trie.bump(0, t)
    assert trie.total[0] == len(seq) and len(trie.top(0)) == _TOP_CHILDREN
    assert trie.top(0) == [12, 9, 8, 7]  # by count; 10 and 11 (once each) never beat the listed 7
    assert [trie.count[trie.child(0, t)] for t in (12, 9, 8)] == [4, 3, 2]
    assert trie.child(0, 11) is not None and 11 not in trie.top(0)  # counted, just not listed


def test_suffix_index_adds_no_garbage_collected_objects_per_token():
    """A node-object trie added ~3 tracked objects per token per depth level, and every full
    collection walked them (a 0.3 s stall per gen-2 collection with 16 contexts indexed). The flat
    trie's growth is arrays and an int-to-int dict: nothing the collector tracks per node."""
    import gc

    idx = SuffixIndex(depth=14)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 49152, size=4000).tolist()
    gc.collect()
    before = len(gc.get_objects())
    idx.extend(tokens)
    gc.collect()
    assert len(idx.trie) > 14 * 3000  # tens of thousands of nodes were created...
    assert len(gc.get_objects()) - before < 50  # ...and no tracked object per node


def test_suffix_index_append_touches_at_most_depth_nodes():
    """The per-token cost is bounded by the depth, not by the context length."""
    idx = SuffixIndex(depth=6)
    rng = np.random.default_rng(0)
    idx.extend(rng.integers(0, 5, size=5000).tolist())
    assert len(idx.active) <= 6
    before = len(idx.active)
    idx.append(1)
    assert len(idx.active) <= before + 1 <= 7


def test_retrieval_proposes_the_repeated_continuation():
    cfg = RetrievalConfig(budget=8, transition_topk=0, cost_aware=False)
    d = RetrievalDrafter(cfg, vocab_size=100)
    text = [10, 11, 12, 13, 14, 15, 16, 50, 51, 10, 11, 12]
    ctx = DraftContext(tokens=list(text), prompt_len=len(text))
    d.begin(ctx, None)
    tree = d.propose(ctx).tree
    assert tree.root_token == 12
    # The best path continues the earlier occurrence: 13 14 15 ...
    first = tree.children(0)
    assert tree.tokens[first[0]] == 13
    assert tree.path_tokens(tree.child(tree.child(first[0], 14), 15))[-3:] == [13, 14, 15]
    assert len(tree) - 1 <= cfg.budget
    assert all(s == NodeSource.RETRIEVAL for s in tree.sources[1:])


def test_skipped_steps_leave_the_index_behind_and_propose_catches_up():
    """A drafter that sat steps out (the batch engine's skip) does not index their tokens in
    ``observe``; its next proposal equals that of a twin that proposed on every step."""
    cfg = RetrievalConfig(budget=8, transition_topk=0, cost_aware=False)
    text = [10, 11, 12, 13, 14, 15, 16, 50, 51]
    later = [10, 11, 12, 13, 14, 60, 10, 11, 12]  # repeats what both must have indexed
    a, b = RetrievalDrafter(cfg, vocab_size=100), RetrievalDrafter(cfg, vocab_size=100)
    ctx_a, ctx_b = DraftContext(tokens=list(text), prompt_len=len(text)), DraftContext(tokens=list(text), prompt_len=len(text))
    a.begin(ctx_a, None)
    b.begin(ctx_b, None)
    for tok in later:
        root = ctx_a.tokens[-1]
        a.skip(ctx_a)
        b.propose(ctx_b)
        for d, ctx in ((a, ctx_a), (b, ctx_b)):
            ctx.tokens.append(tok)
            d.observe(ctx, StepOutcome(tree=DraftTree(root), accepted=[0], accepted_tokens=[root], bonus_token=tok))
    assert a.index.length == len(text) < b.index.length == len(text) + len(later)  # a is behind
    ta, tb = a.propose(ctx_a).tree, b.propose(ctx_b).tree
    assert a.index.length == b.index.length
    assert ta.tokens == tb.tokens and ta.parents == tb.parents
    assert ta.tokens[ta.children(0)[0]] == 13  # "10 11 12" continued as it did twice before


def test_budget_and_depth_are_respected():
    cfg = RetrievalConfig(budget=5, max_depth=3, transition_topk=0, cost_aware=False)
    d = RetrievalDrafter(cfg, vocab_size=100)
    text = list(range(20)) * 3
    ctx = DraftContext(tokens=text[:-10], prompt_len=len(text) - 10)
    d.begin(ctx, None)
    tree = d.propose(ctx).tree
    assert len(tree) - 1 <= 5
    assert tree.max_depth() <= 3


def test_transition_table_recycles_target_topk_and_pairs():
    table = TransitionTable(vocab_size=10, topk=3)
    topk = torch.tensor([[1, 2, 3], [4, 5, 6]])
    table.recycle([7, 8], [None, 7], topk)
    assert table.successors(None, 7, 3) == ([1, 2, 3], False)
    assert table.successors(7, 8, 2) == ([4, 5], True)  # second-order row preferred
    assert table.successors(9, 8, 2) == ([4, 5], False)  # unknown pair -> first-order row


def test_adjacency_table_updates_from_verification():
    cfg = RetrievalConfig(budget=4, transition_topk=2, cost_aware=False)
    d = RetrievalDrafter(cfg, vocab_size=20)
    ctx = DraftContext(tokens=[1, 2, 3], prompt_len=3)
    d.begin(ctx, None)
    prop = d.propose(ctx)
    tree = prop.tree
    topk = torch.stack([torch.tensor([9, 8]) for _ in range(len(tree))])
    ctx.tokens.extend([5])
    d.observe(ctx, StepOutcome(tree=tree, accepted=[0], accepted_tokens=[3], bonus_token=5, target_topk=topk))
    assert d.table.successors(None, 3, 2)[0] == [9, 8]
    assert d.table.successors(2, 3, 2) == ([9, 8], True)


def test_datastore_lookup_returns_corpus_continuation(tmp_path):
    corpus = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 8, 2, 3], dtype=np.int32)
    ds = SuffixArrayDatastore(corpus, match_len=4)
    k, trie = ds.lookup([0, 5, 6, 7], min_len=1, max_depth=3)
    assert k == 3
    assert trie.top(0) == [8] and trie.count[trie.child(0, 8)] == 2  # both occurrences of 5 6 7 go on with 8
    path = tmp_path / "ds.npy"
    np.save(path, corpus)
    d = RetrievalDrafter(RetrievalConfig(datastore=str(path), transition_topk=0, cost_aware=False), vocab_size=20)
    ctx = DraftContext(tokens=[1, 5, 6, 7], prompt_len=4)
    d.begin(ctx, None)
    tree = d.propose(ctx).tree
    assert tree.child(0, 8) is not None


def test_retrieval_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="budget"):
        RetrievalConfig(budget=0)
    with pytest.raises(ConfigError, match="min_match_len"):
        RetrievalConfig(max_match_len=4, min_match_len=5)
    with pytest.raises(ConfigError, match="datastore"):
        RetrievalConfig(datastore=str(tmp_path / "missing.npy"))


def test_cost_model_interpolates_and_extrapolates():
    m = VerifyCostModel.from_curve({1: 0.05, 2: 0.06, 8: 0.12})
    assert m.cost(1) == pytest.approx(0.05)
    assert m.cost(5) == pytest.approx(0.09)
    assert m.cost(14) == pytest.approx(0.18)  # last slope 0.01/token


def test_cost_model_best_prefix_follows_the_marginal_rule():
    flat = VerifyCostModel.from_curve({1: 0.1, 64: 0.1})
    assert flat.best_prefix([0.5, 0.1, 0.01]) == 3  # free verification: take everything
    steep = VerifyCostModel.from_curve({1: 0.05, 2: 0.1, 64: 0.2})
    assert steep.best_prefix([0.3, 0.2]) == 0  # 1.5 tokens for 2x the cost: don't speculate
    assert steep.best_prefix([0.9, 0.8, 0.7]) == 3


def test_online_cost_model_moves_every_size_toward_live_steps_by_octave_distance():
    """f_j <- f_j + (1 - decay) 2^-|log2 s_j - log2 T| (r - f_j), ratios clipped to [1/4, 4]."""
    base = VerifyCostModel((1, 2, 4), (0.1, 0.1, 0.1), measured=True)  # read flat: a busy host
    m = OnlineCostModel(base, decay=0.5)
    m.observe(2, None, 0.3)  # r = 3; weights 1/2, 1, 1/2
    assert m.factors == pytest.approx([1.5, 2.0, 1.5])
    m.observe(4, None, 10.0)  # r = 100, clipped to 4; weights 1/4, 1/2, 1
    assert m.factors == pytest.approx([1.8125, 2.5, 2.75])
    assert m.cost(3) == pytest.approx(0.1 * (2.5 + 2.75) / 2)  # f linear between measured sizes
    assert m.cost(40) == pytest.approx(0.1 * 2.75)  # flat beyond the largest measured size
    assert m.observed == 2 and m.seconds == pytest.approx((0.18125, 0.25, 0.275))


def test_online_correction_shrinks_trees_a_flat_measurement_made_too_large():
    """A curve measured flat prices 16 drafts as free; once live steps show a 17-token verify
    costing 3x a 1-token one, the same probabilities buy a shorter tree."""
    base = VerifyCostModel((1, 17), (0.1, 0.1), measured=True)
    m = OnlineCostModel(base, decay=0.5)
    probs = [0.6, 0.3] + [0.05] * 14
    assert m.best_prefix(probs) == 16
    for _ in range(8):
        m.observe(1, None, 0.1)
        m.observe(17, None, 0.3)
    assert m.cost(17) / m.cost(1) > 2.4
    assert m.best_prefix(probs) < 16


def test_only_a_measured_curve_is_corrected_online():
    given = VerifyCostModel.from_curve({1: 0.1, 8: 0.2})
    assert online(given) is given and online(None) is None
    measured = dataclasses.replace(given, measured=True)
    wrapped = online(measured)
    assert isinstance(wrapped, OnlineCostModel) and wrapped.base is measured
    assert online(wrapped) is wrapped  # drafters sharing a curve share its corrections
    with pytest.raises(ValueError, match="decay"):
        OnlineCostModel(measured, decay=1.0)


def test_cost_model_rejects_bad_curves():
    with pytest.raises(ValueError, match="increasing"):
        VerifyCostModel((2, 1), (0.1, 0.2))
    with pytest.raises(ValueError, match="positive"):
        VerifyCostModel((1, 2), (0.1, 0.0))


def test_cost_aware_drafter_cuts_low_value_nodes():
    cfg = RetrievalConfig(budget=16, transition_topk=2, cost_aware=True)
    ruinous = VerifyCostModel.from_curve({1: 0.05, 2: 0.5})  # any speculation is ruinous
    d = RetrievalDrafter(cfg, vocab_size=50, cost_model=ruinous)
    ctx = DraftContext(tokens=[1, 2, 3, 1, 2], prompt_len=5)
    d.begin(ctx, None)
    assert len(d.propose(ctx).tree) == 1


def test_cost_aware_drafter_without_a_cost_model_names_the_field():
    with pytest.raises(ConfigError, match=r"retrieval\.cost_aware"):
        RetrievalDrafter(RetrievalConfig(cost_aware=True), vocab_size=50)
    assert RetrievalDrafter(RetrievalConfig(cost_aware=False), vocab_size=50).cost_model is None


def test_verify_curve_size_is_budget_plus_root_when_cost_aware():
    assert RetrievalConfig(budget=24, cost_aware=True).verify_curve_size() == 25
    assert RetrievalConfig(budget=24, cost_aware=False).verify_curve_size() == 0


def test_build_drafter_measures_the_curve_only_when_none_is_given(monkeypatch):
    """build_drafter passes a given c(T) through, and measures one on the target otherwise."""
    import speculation.drafters as drafters
    from tests.helpers import shared_tiny_llama, tiny_target

    target = tiny_target(shared_tiny_llama(vocab_size=50))
    spec = drafters.resolve_methods(["retrieval"], {"retrieval": {"budget": 6}})[0]
    given = VerifyCostModel.from_curve({1: 0.1, 7: 0.2})
    calls: list[int] = []

    def fake_measure(t, max_size: int) -> VerifyCostModel:
        assert t is target
        calls.append(max_size)
        return VerifyCostModel.from_curve({1: 0.1, max_size: 0.3})

    monkeypatch.setattr(drafters, "measure_cost_model", fake_measure)
    assert drafters.build_drafter(spec, target, given).cost_model is given
    assert calls == []
    measured = drafters.build_drafter(spec, target).cost_model
    assert calls == [7] and measured is not None and measured.sizes == (1, 7)
    fixed = drafters.resolve_methods(["retrieval"], {"retrieval": {"cost_aware": False}})[0]
    assert drafters.build_drafter(fixed, target).cost_model is None and calls == [7]


def test_measured_cost_model_is_reused_per_target():
    """c(T) is measured once per target and size (a second drafter pays nothing)."""
    from speculation.policy.cost import measure_cost_model
    from tests.helpers import shared_tiny_llama, tiny_target

    target = tiny_target(shared_tiny_llama(vocab_size=50))
    first = measure_cost_model(target, max_size=4, repeats=1)
    assert first.sizes == (1, 2, 4)
    assert measure_cost_model(target, max_size=4, repeats=1) == first
