"""Graft (speculation/drafters/graft.py) on a tiny random Llama: the hybrid tree's invariants, the stage
decisions, the adjacency-table feedback, K_max sizing, config errors and greedy exactness.

Greedy fp32 output must equal vanilla token for token for every prune stage, "retrieval only"
(stage 0) included, over both tree drafters (EAGLE-3: one level per forward; SpecBlock: a block of
K levels per forward); the sampling-distribution test lives with the other drafters in
``tests/test_sampling_lossless.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speculation.config import (
    TREE_DRAFTER_CONFIGS,
    ConfigError,
    EngineConfig,
    GraftConfig,
    SamplingConfig,
    to_dict,
)
from speculation.cost import VerifyCostModel
from speculation.drafters import build_drafter, resolve_methods
from speculation.drafters.base import DraftContext, StepOutcome
from speculation.drafters.eagle3 import Eagle3Drafter
from speculation.drafters.graft import TREE_BUILDERS, GraftDrafter, RankAcceptance, build_graft_drafter, graft
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.drafters.specblock import SpecBlockDrafter
from speculation.engine import generate_speculative, generate_vanilla
from speculation.tree import ROOT, DraftTree, NodeSource
from tests.helpers import RecordingDrafter, shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
GREEDY = EngineConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0.0))
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8] * 3, [10, 20, 10, 20, 10, 20, 10], [7] * 20]
EAGLE3 = {"type": "eagle3", "checkpoint": "random", "draft_vocab_size": 48, "top_k": 4}
SPECBLOCK = {"type": "specblock", "checkpoint": "random", "draft_vocab_size": 48, "block_size": 2, "beam": 4,
             "slot_widths": [2, 2, 3, 1]}  # a random rank head says "give up" often: no give-up, deeper trees
TINY = dict(tree_drafter=EAGLE3)


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
        # SpecBlock (K = 2): stages are multiples of the block size
        {"tree_drafter": SPECBLOCK},  # stages (0, 2, 4)
        {"tree_drafter": SPECBLOCK, "stages": [2]},  # one block, every step
        {"tree_drafter": SPECBLOCK, "stages": [2, 6], "threshold": 1.0},  # always stopped after block 1
        {"tree_drafter": SPECBLOCK, "stages": [0, 2, 6], "threshold": 0.0, "retrieval_confidence": 1024.0},
        {"tree_drafter": {**SPECBLOCK, "rank_head": False, "top_k": 3}, "stages": [0, 2, 4], "graft_budget": 0},
        {"tree_drafter": SPECBLOCK, "dense_budget": 0},  # K_max from c(T)
        {"tree_drafter": SPECBLOCK, "dense_budget": 12, "stage_budgets": [0, 3, 11], "stages": [0, 2, 4]},
        {"tree_drafter": {**SPECBLOCK, "slot_widths": [2, 4, 6, 0]}, "stages": [0, 2, 4]},  # give-up stops chains
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


def test_specblock_stage_decisions_follow_the_threshold_and_count_blocks():
    """Under Graft a SpecBlock step stops between blocks: stage 2 = block 1 only (the encode
    forward), stage 6 = up to 3 blocks."""
    target = _target()
    prompt = PROMPTS[1]

    def run(**kw):
        d = RecordingDrafter(_drafter(target, tree_drafter=SPECBLOCK, **kw))
        generate_speculative(target, d, prompt, GREEDY)
        assert isinstance(d.inner.drafter, SpecBlockDrafter) and d.inner.drafter.config.max_blocks == 3
        return d.proposals

    stopped = run(stages=[2, 6], threshold=1.0)
    assert {p.stats["stage"] for p in stopped} == {2.0}
    assert all(p.drafter_forwards == 1 and _drafter_depth(p.tree) <= 2 for p in stopped)
    dense = run(stages=[2, 6], threshold=0.0)
    assert {p.stats["stage"] for p in dense} <= {2.0, 6.0} and 6.0 in {p.stats["stage"] for p in dense}
    assert all(p.drafter_forwards <= 3 and _drafter_depth(p.tree) <= 6 for p in dense)
    assert max(_drafter_depth(p.tree) for p in dense) > 2
    assert sum(p.drafter_forwards for p in stopped) < sum(p.drafter_forwards for p in dense)


def test_graft_needs_a_drafter_that_can_stop_early():
    cfg = GraftConfig(**TINY)
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    with pytest.raises(TypeError, match="cannot"):
        GraftDrafter(cfg, RetrievalDrafter(cfg.retrieval(), VOCAB), retrieval)
    with pytest.raises(ValueError, match="need a tree drafter"):
        GraftDrafter(cfg, None, retrieval)


def test_auto_dense_budget_without_a_cost_model_is_a_clear_error():
    cfg = GraftConfig(**TINY, dense_budget=0)
    assert cfg.verify_curve_size() == GraftConfig.AUTO_MAX and GraftConfig(**TINY).verify_curve_size() == 0
    with pytest.raises(ConfigError, match=r"graft.dense_budget = 0 \(auto\) needs the measured verify curve"):
        build_graft_drafter(cfg, _target(), None)
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    with pytest.raises(ConfigError, match="graft.dense_budget"):
        GraftDrafter(GraftConfig(stages=(0,), dense_budget=0), None, retrieval, None)


def test_the_cost_model_reaches_graft_and_its_retrieval_source_only_when_needed():
    curve = VerifyCostModel((1, 128), (1.0, 2.0))
    target = _target()
    auto = build_graft_drafter(GraftConfig(**TINY, dense_budget=0), target, curve)
    assert auto.cost_model is curve and auto.dense_budget() == auto.ranks.best_size(curve, GraftConfig.AUTO_MAX)
    assert auto.retrieval.cost_model is None  # its own cost cut stays off: the hybrid tree is sized by Graft
    fixed = build_graft_drafter(GraftConfig(**TINY, dense_budget=20), target, curve)
    assert fixed.cost_model is None and fixed.dense_budget() == 20


@pytest.mark.parametrize("tree, cls", [(EAGLE3, Eagle3Drafter), (SPECBLOCK, SpecBlockDrafter)])
def test_the_tree_drafter_is_built_from_its_nested_config(tree, cls):
    d = _drafter(_target(), tree_drafter=tree, stages=[0, 2, 4], dense_budget=20)
    assert isinstance(d.drafter, cls)
    assert d.drafter.config == d.config.tree
    if cls is Eagle3Drafter:  # depth 4 levels = first level + 3 expansions
        assert (d.drafter.config.depth, d.drafter.config.total_tokens, d.drafter.config.top_k) == (3, 20, 4)
    else:  # depth 4 levels = 2 blocks of K = 2
        assert (d.drafter.config.max_blocks, d.drafter.config.total_tokens, d.drafter.config.beam) == (2, 20, 4)
    assert d.report()["tree_drafter"] == tree["type"]


def test_nested_config_defaults_round_trip_and_registry():
    assert set(TREE_BUILDERS) == set(TREE_DRAFTER_CONFIGS)  # a tree drafter type has a config and a builder
    default = GraftConfig()
    assert default.tree_type == "eagle3" and default.stages == (0, 1, 5)
    assert (default.tree.depth, default.tree.total_tokens) == (4, 48)
    sb = GraftConfig(tree_drafter={"type": "specblock", "block_size": 4, "checkpoint": "random"}, dense_budget=32)
    assert sb.stages == (0, 4, 8) and (sb.tree.max_blocks, sb.tree.total_tokens) == (2, 32)
    assert sb.stage_budget(4, 32) == 16  # ceil(31 * 4 / 8); the floor is SpecBlock's beam (8)
    for cfg in (default, sb):  # what the bench JSON and MLflow record loads back as the same config
        data = to_dict(cfg)
        assert data["tree_drafter"]["type"] == cfg.tree_type and "total_tokens" not in data["tree_drafter"]
        assert resolve_methods(["graft"], {"graft": data})[0].config == cfg


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"stages": 5}, "graft.stages must be a list of depths"),
        ({"stages": [5, 1]}, "strictly ascending"),
        ({"stages": [0, 40]}, "graft.stages[] must be in [0, 33]"),
        ({"threshold": 1.5}, "graft.threshold must be in [0.0, 1.0]"),
        ({"dense_budget": 1}, "graft.dense_budget must be 0 (auto) or in [2, 1024]"),
        ({"graft_budget": -1}, "graft.graft_budget"),
        ({"stage_budgets": [0, 3]}, "one entry per stage"),
        ({"stage_budgets": [2, 3, 4]}, "stage 0 must keep 0 nodes"),
        ({"min_match_len": 5, "max_match_len": 3}, "graft.min_match_len"),
        ({"bogus": 1}, "unknown key(s) ['bogus']"),
        ({"top_k": 4}, "unknown key(s) ['top_k']"),  # the tree drafter's knobs live in tree_drafter
        ({"tree_drafter": {"type": "retrieval"}}, "graft.tree_drafter.type must be one of ['eagle3', 'specblock']"),
        ({"tree_drafter": "eagle3"}, "graft.tree_drafter must be a mapping"),
        ({"tree_drafter": {"checkpoint": "/no/such/dir"}}, "graft.tree_drafter.checkpoint: no such file or directory"),
        ({"tree_drafter": {"type": "specblock", "checkpoint": "/no/such/dir"}},
         "graft.tree_drafter.checkpoint: no such file or directory '/no/such/dir'"),
        ({"tree_drafter": {"top_k": 0}}, "graft.tree_drafter.top_k must be in [1, 64]"),
        ({"tree_drafter": {"type": "specblock", "slot_widths": [0, 1, 1, 0]}}, "graft.tree_drafter.slot_widths[0]"),
        ({"tree_drafter": {"depth": 3}}, "graft.tree_drafter.depth is set by Graft"),
        ({"tree_drafter": {"type": "specblock", "max_blocks": 3, "total_tokens": 9}},
         "graft.tree_drafter.max_blocks/total_tokens is set by Graft"),
        ({"tree_drafter": {"type": "specblock", "bogus": 1}},
         "graft.tree_drafter: unknown key(s) ['bogus'] for tree drafter type specblock"),
        ({"tree_drafter": {"type": "specblock"}, "stages": [0, 1, 5]}, "graft.stages must be multiples of 4"),
        ({"tree_drafter": {"type": "specblock", "block_size": 2}, "stages": [0, 18]}, "graft.stages[] must be in [0, 16]"),
    ],
)
def test_bad_config_is_a_clear_error(kw, message):
    with pytest.raises(ConfigError) as err:
        resolve_methods(["graft"], {"graft": kw})
    assert message in str(err.value)
