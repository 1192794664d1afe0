"""Graft (speculation/drafters/graft.py) on a tiny random Llama: the hybrid tree's invariants, the stage
decisions, the adjacency-table feedback, K_max sizing, config errors and greedy exactness.

Greedy fp32 output must equal vanilla token for token for every prune stage, "retrieval only"
(stage 0) included; the sampling-distribution test lives with the other drafters in
``tests/test_sampling_lossless.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculation.config import ConfigError, EngineConfig, GraftConfig, SamplingConfig
from speculation.cost import VerifyCostModel
from speculation.drafters import build_drafter, resolve_methods
from speculation.drafters.base import DraftContext, StepOutcome
from speculation.engine import generate_speculative, generate_vanilla
from speculation.drafters.graft import GraftDrafter, RankAcceptance, graft
from speculation.tree import ROOT, DraftTree, NodeSource
from tests.helpers import RecordingDrafter, shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
GREEDY = EngineConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0.0))
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8] * 3, [10, 20, 10, 20, 10, 20, 10], [7] * 20]
TINY = dict(checkpoint="random", draft_vocab_size=48, top_k=4)


def _target():
    return tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))


def _drafter(target, **kw) -> GraftDrafter:
    spec = resolve_methods(["graft"], {"graft": {**TINY, **kw}})[0]
    return build_drafter(spec, target)


# ---------------------------------------------------------------------- graft() on hand-made trees
def _tree(root: int, paths: list[list[int]], source: NodeSource, score: float = -1.0) -> DraftTree:
    t = DraftTree(root)
    for path in paths:
        t.add_chain(ROOT, path, [score * (i + 1) for i in range(len(path))], source)
    return t


def test_graft_hangs_retrieved_nodes_under_the_matching_path_and_merges_duplicates():
    pruned = _tree(9, [[1, 2], [3]], NodeSource.DRAFTER)
    retrieved = _tree(9, [[1, 2, 4, 5], [3, 6], [7]], NodeSource.RETRIEVAL, score=-0.5)
    n = graft(pruned, retrieved, room=10)
    assert n == 4  # 4, 5 under 1-2; 6 under 3; 7 under the root
    paths = {tuple(pruned.path_tokens(i)[1:]): pruned.sources[i] for i in range(1, len(pruned))}
    assert paths == {
        (1,): NodeSource.DRAFTER, (1, 2): NodeSource.DRAFTER, (3,): NodeSource.DRAFTER,  # merged, tags kept
        (1, 2, 4): NodeSource.RETRIEVAL, (1, 2, 4, 5): NodeSource.RETRIEVAL,
        (3, 6): NodeSource.RETRIEVAL, (7,): NodeSource.RETRIEVAL,
    }


def test_graft_respects_room_and_refuses_another_root():
    pruned = _tree(9, [[1]], NodeSource.DRAFTER)
    retrieved = _tree(9, [[1, 2, 3, 4], [5, 6]], NodeSource.RETRIEVAL)
    assert graft(pruned, retrieved, room=2) == 2 and len(pruned) == 4
    assert graft(pruned, retrieved, room=0) == 0
    with pytest.raises(ValueError, match="rooted at token 8"):
        graft(pruned, _tree(8, [[1]], NodeSource.RETRIEVAL), room=3)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 20))
def test_graft_invariants_on_random_trees(seed, room):
    rng = random.Random(seed)

    def rand_tree(source):
        t = DraftTree(0)
        for _ in range(rng.randrange(1, 15)):
            t.add(rng.randrange(len(t)), rng.randrange(1, 6), -rng.random(), source)
        return t

    pruned, retrieved = rand_tree(NodeSource.DRAFTER), rand_tree(NodeSource.RETRIEVAL)
    before = {tuple(pruned.path_tokens(i)) for i in range(len(pruned))}
    retrieved_paths = {tuple(retrieved.path_tokens(i)) for i in range(len(retrieved))}
    n = graft(pruned, retrieved, room)
    assert n <= room and len(pruned) == len(before) + n
    for i in range(1, len(pruned)):
        assert pruned.parents[i] < i  # parents first
        kids = [pruned.tokens[c] for c in pruned.children(i)]
        assert len(kids) == len(set(kids))  # siblings unique
        path = tuple(pruned.path_tokens(i))
        if pruned.sources[i] == NodeSource.RETRIEVAL:
            assert path in retrieved_paths and path not in before  # under its retrieved context
        else:
            assert path in before


# ---------------------------------------------------------------------- the drafter in the loop
@pytest.mark.parametrize(
    "kw",
    [
        {},  # stages (0, 1, 5)
        {"stages": [0]},  # retrieval only
        {"stages": [1]},  # one drafter level, every step
        {"stages": [1, 3], "threshold": 1.0},  # always stopped at the first stage
        {"stages": [0, 2, 4], "threshold": 0.0, "retrieval_confidence": 1024.0},  # never stopped: dense
        {"stages": [0, 1, 3], "retrieval_confidence": 0.0},  # always retrieval only
        {"stages": [0, 2, 4], "graft_budget": 0},  # pruned only
        {"dense_budget": 0, "stages": [0, 2, 4]},  # K_max from c(T)
        {"dense_budget": 12, "stage_budgets": [0, 3, 11], "stages": [0, 1, 4]},
    ],
)
def test_greedy_equals_vanilla_for_every_stage_setting(kw):
    target = _target()
    drafter = RecordingDrafter(_drafter(target, **kw))
    for prompt in PROMPTS:
        assert generate_speculative(target, drafter, prompt, GREEDY).tokens == generate_vanilla(target, prompt, GREEDY).tokens
    cfg = drafter.inner.config
    for p in drafter.proposals:
        k_max = int(p.stats["k_max"])
        assert len(p.tree) <= k_max, "the hybrid tree exceeds the dense budget"
        stage = int(p.stats["stage"])
        assert stage in cfg.stages
        assert p.tree.count_source(NodeSource.DRAFTER) <= cfg.stage_budget(stage, k_max)
        assert p.stats["grafted"] <= cfg.graft_budget
        if stage == 0:
            assert p.drafter_forwards == 0 and p.tree.count_source(NodeSource.DRAFTER) == 0


def _drafter_depth(tree: DraftTree) -> int:
    return max((tree.depths[i] for i in range(len(tree)) if tree.sources[i] == NodeSource.DRAFTER), default=0)


def test_stage_decisions_follow_the_threshold_and_count_forwards():
    target = _target()
    prompt = PROMPTS[1]

    def run(**kw):
        d = RecordingDrafter(_drafter(target, **kw))
        generate_speculative(target, d, prompt, GREEDY)
        return d.proposals

    stopped = run(stages=[2, 5], threshold=1.0)  # beam mass is always < 1: stop at depth 2
    assert {p.stats["stage"] for p in stopped} == {2.0}
    assert all(p.drafter_forwards <= 2 and _drafter_depth(p.tree) <= 2 for p in stopped)
    dense = run(stages=[2, 5], threshold=0.0)  # never stop: every step drafts 5 levels
    assert {p.stats["stage"] for p in dense} == {5.0}
    assert all(p.drafter_forwards >= 4 and _drafter_depth(p.tree) <= 5 for p in dense)
    assert max(_drafter_depth(p.tree) for p in dense) > 2
    assert sum(p.drafter_forwards for p in stopped) < sum(p.drafter_forwards for p in dense)
    only = run(stages=[0, 5], retrieval_confidence=0.0)
    assert all(p.stats["stage"] == 0.0 and p.drafter_forwards == 0 for p in only)
    assert all(set(p.tree.sources[1:]) <= {NodeSource.RETRIEVAL} for p in only)
    mixed = run(stages=[0, 1, 5], threshold=0.5, retrieval_confidence=2.0)
    assert all(("beam_mass" in p.stats) == (p.stats["stage"] > 0) for p in mixed)
    for p in mixed:
        if p.stats["stage"] == 0:
            assert p.stats["retrieval_expected"] >= 2.0
        elif p.stats["stage"] == 1:
            assert p.stats["beam_mass"] < 0.5
        else:
            assert p.stats["beam_mass"] >= 0.5


def test_adjacency_table_updates_from_verification():
    target = _target()
    d = _drafter(target, stages=[0])
    ctx = DraftContext(tokens=[3, 4, 5], prompt_len=2)
    d.begin(ctx, None)
    tree = d.propose(ctx).tree
    topk = torch.arange(len(tree) * d.target_topk).reshape(len(tree), d.target_topk) % VOCAB
    ctx.tokens.append(11)
    d.observe(ctx, StepOutcome(tree=tree, accepted=[ROOT], accepted_tokens=[tree.tokens[ROOT]], bonus_token=11,
                               target_topk=topk))
    table = d.retrieval.table.table
    for i, tok in enumerate(tree.tokens):
        last = max(j for j, t in enumerate(tree.tokens) if t == tok)  # a repeated token keeps its last row
        assert table[tok].tolist() == topk[last].tolist()


def test_auto_dense_budget_maximises_expected_tokens_per_second():
    ranks = RankAcceptance(8)
    ranks.rates = [0.9, 0.8, 0.5, 0.1, 0.05, 0.01, 0.0, 0.0]
    flat = VerifyCostModel((1, 128), (1.0, 1.0))
    steep = VerifyCostModel((1, 2, 128), (1.0, 10.0, 1000.0))
    assert ranks.best_size(flat, cap=9) == 7  # every positive rate pays when verifying is free
    assert ranks.best_size(steep, cap=9) == 2  # nothing pays: the smallest tree
    target = _target()
    d = _drafter(target, dense_budget=0)
    assert d.cost_model is not None  # measured by build_drafter
    assert 2 <= d.dense_budget() <= GraftConfig.AUTO_MAX
    report = d.report()
    assert report["k_max_now"] == d.dense_budget() and "verify_curve_s" in report


def test_graft_needs_a_drafter_that_can_stop_early():
    from speculation.drafters.retrieval import RetrievalDrafter

    cfg = GraftConfig(**TINY)
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    with pytest.raises(TypeError, match="cannot"):
        GraftDrafter(cfg, RetrievalDrafter(cfg.retrieval(), VOCAB), retrieval)
    with pytest.raises(ValueError, match="need a tree drafter"):
        GraftDrafter(cfg, None, retrieval)


def test_auto_dense_budget_without_a_cost_model_is_a_clear_error():
    d = _drafter(_target(), dense_budget=0)
    d.cost_model = None
    with pytest.raises(RuntimeError, match="dense_budget = 0"):
        d.dense_budget()


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"stages": []}, "graft.stages must be a non-empty list"),
        ({"stages": [5, 1]}, "strictly ascending"),
        ({"stages": [0, 40]}, "graft.stages[] must be in [0, 33]"),
        ({"threshold": 1.5}, "graft.threshold must be in [0.0, 1.0]"),
        ({"dense_budget": 1}, "graft.dense_budget must be 0 (auto) or in [2, 1024]"),
        ({"graft_budget": -1}, "graft.graft_budget"),
        ({"stage_budgets": [0, 3]}, "one entry per stage"),
        ({"stage_budgets": [2, 3, 4]}, "stage 0 must keep 0 nodes"),
        ({"min_match_len": 5, "max_match_len": 3}, "graft.min_match_len"),
        ({"bogus": 1}, "unknown key(s) ['bogus']"),
        ({"drafter": "retrieval"}, "graft.drafter must be one of ['eagle3']"),
    ],
)
def test_bad_config_is_a_clear_error(kw, message):
    with pytest.raises(ConfigError) as err:
        resolve_methods(["graft"], {"graft": kw})
    assert message in str(err.value)
