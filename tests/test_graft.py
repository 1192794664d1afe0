"""Graft (speculation/drafters/graft.py) on a tiny random Llama: the hybrid tree's invariants, the stage
decisions, the adjacency-table feedback, K_max sizing, config errors and greedy exactness.

Greedy fp32 output must equal vanilla token for token for every prune stage, "retrieval only"
(stage 0) included, over both tree drafters (EAGLE-3: one level per forward; SpecBlock: a block of
K levels per forward); the sampling-distribution test lives with the other drafters in
``tests/test_sampling_lossless.py``.
"""

from __future__ import annotations

import functools
import math
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
from speculation.policy.cost import RankAcceptance, VerifyCostModel, measure_cost_model
from speculation.drafters import build_drafter, resolve_methods
from speculation.drafters.base import DraftContext, Proposal, StepOutcome
from speculation.drafters.eagle3 import Eagle3Drafter
from speculation.drafters.graft import (
    TREE_BUILDERS,
    DrafterGate,
    GateVerdict,
    GraftDrafter,
    GraftSource,
    build_graft_drafter,
    graft,
    graft_anchored,
)
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.drafters.specblock import SpecBlockDrafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.spec.tree import ROOT, DraftTree, NodeSource
from tests.helpers import RecordingDrafter, assert_lossless_on_refs, shared_tiny_llama, tiny_target

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


@functools.lru_cache(maxsize=None)
def _vanilla_of(model, prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(generate_vanilla(tiny_target(model), list(prompt), GREEDY).tokens)


def _vanilla(target, prompt: list[int]) -> list[int]:
    """Vanilla greedy (:data:`GREEDY`) of ``prompt`` on ``target``'s model, decoded once per model
    and prompt: the settings below all compare with the same references (the shared model is
    never modified)."""
    return list(_vanilla_of(target.model, tuple(prompt)))


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
        {"stages": [2, 4], "threshold": 0.0},  # never stopped: dense
        {"stages": [0, 1, 3], "gate_warmup": 0},  # no evidence the drafter pays: always retrieval only
        {"stages": [0, 1, 3], "graft_anchors": 0},  # root-anchored grafts only
        {"stages": [0, 2, 4], "graft_budget": 0},  # pruned only
        {"dense_budget": 0, "stages": [0, 2, 4]},  # K_max from c(T)
        {"dense_budget": 12, "stage_budgets": [0, 3, 11], "stages": [0, 1, 4]},
        # SpecBlock (K = 2): stages are multiples of the block size
        {"tree_drafter": SPECBLOCK},  # stages (0, 2, 4)
        {"tree_drafter": SPECBLOCK, "stages": [2]},  # one block, every step
        {"tree_drafter": SPECBLOCK, "stages": [2, 6], "threshold": 1.0},  # always stopped after block 1
        {"tree_drafter": SPECBLOCK, "stages": [2, 6], "threshold": 0.0},
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
        assert generate_speculative(target, drafter, prompt, GREEDY).tokens == _vanilla(target, prompt)
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
    only = run(stages=[0, 5], gate_warmup=0)
    assert all(p.stats["stage"] == 0.0 and p.drafter_forwards == 0 for p in only)
    assert all(set(p.tree.sources[1:]) <= {NodeSource.RETRIEVAL} for p in only)
    mixed = run(stages=[0, 1, 5], threshold=0.5)
    assert all(("beam_mass" in p.stats) == (p.stats["stage"] > 0) for p in mixed)
    for p in mixed:
        if p.stats["stage"] == 0:  # the gate said no, and why: the value did not exceed the cost
            assert p.stats["gate_call"] == 0.0 and p.stats["gate_verdict"] == GateVerdict.DOES_NOT_PAY
            assert p.stats["gate_value_s"] <= p.stats["gate_cost_s"]
            continue
        assert p.stats["gate_verdict"] in (GateVerdict.WARMUP, GateVerdict.PAYS)
        if p.stats["gate_verdict"] == GateVerdict.PAYS:
            assert p.stats["gate_value_s"] > p.stats["gate_cost_s"]
        if p.stats["stage"] == 1:
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


def _ranks(rates: list[float], n: int = 400) -> RankAcceptance:
    """A posterior fed ``n`` verifications of each rank, accepted at ``rates[r]``."""
    ranks = RankAcceptance(len(rates), decay=1.0)
    for i in range(n):
        ranks.update([(r, (i + 0.5) / n < p) for r, p in enumerate(rates)])
    return ranks


def test_rank_acceptance_is_a_beta_posterior_over_verified_ranks_only():
    ranks = RankAcceptance(4, decay=1.0)
    assert ranks.rates == [0.5, 0.5, 0.5, 0.5]  # uniform prior, no evidence yet
    for _ in range(8):
        ranks.update([(0, True), (1, False)])  # ranks 2 and 3 were not in the tree
    assert ranks.rates[0] == pytest.approx(9 / 10) and ranks.rates[1] == pytest.approx(1 / 10)
    assert ranks.verified[2:] == [0.0, 0.0]  # not in the tree: no failure recorded
    assert ranks.rates[2:] == [pytest.approx(1 / 10)] * 2  # never rated above an earlier rank
    drifting = RankAcceptance(1, decay=0.9)
    for _ in range(100):
        drifting.update([(0, False)])
    for _ in range(30):
        drifting.update([(0, True)])
    assert drifting.rates[0] > 0.8  # discounted: recent evidence dominates (undiscounted: 31/132)


def test_auto_dense_budget_maximises_expected_tokens_per_second():
    ranks = _ranks([0.9, 0.8, 0.5, 0.1, 0.05, 0.01, 0.0, 0.0])
    flat = VerifyCostModel((1, 128), (1.0, 1.0))
    steep = VerifyCostModel((1, 2, 128), (1.0, 10.0, 1000.0))
    assert ranks.best_size(flat, cap=9) == 9  # every positive rate pays when verifying is free
    assert ranks.best_size(steep, cap=9) == 2  # nothing pays: the smallest tree
    linear = VerifyCostModel((1, 128), (1.0, 1.0 + 127 * 0.05))
    free_draft = ranks.best_size(linear, cap=9)
    # a long drafting time d makes every verified token relatively cheaper: K_max grows with d
    assert ranks.best_size(linear, cap=9, drafting_s=10.0) > free_draft
    # c(T, L): at a long context the same tree costs more per node, so K_max shrinks
    grid = VerifyCostModel((1, 128), (1.0, 1.0), contexts=(64, 4096), grid=((1.0, 1.0), (1.0, 1.0 + 127 * 0.5)))
    assert ranks.best_size(grid, cap=9, context=64) == 9 > ranks.best_size(grid, cap=9, context=4096)
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


def test_a_missing_cost_model_is_measured_by_the_builder_or_a_clear_error():
    cfg = GraftConfig(**TINY, dense_budget=0)
    assert cfg.verify_curve_size() == GraftConfig.AUTO_MAX
    assert GraftConfig(**TINY).verify_curve_size() == 48  # the gate prices nodes by c(T) up to K_max
    assert GraftConfig(**TINY, stages=(1, 5)).verify_curve_size() == 48  # no gate, but the cost cut prices nodes
    assert GraftConfig(**TINY, stages=(1, 5), cost_cut=False).verify_curve_size() == 0  # fixed K_max, no pricing
    built = build_graft_drafter(cfg, _target(), None)  # measures c(T, L) on the target itself
    assert built.cost_model is not None and built.cost_model.contexts and built.cost_model.sizes[-1] == 128
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    with pytest.raises(ConfigError, match=r"graft.dense_budget = 0 \(auto\) needs the measured verify curve"):
        GraftDrafter(GraftConfig(stages=(0,), dense_budget=0), None, retrieval, None)
    drafter = built.drafter
    with pytest.raises(ConfigError, match=r"graft.stages \[0, 1, 5\] \(stage 0: the drafter gate\) needs"):
        GraftDrafter(GraftConfig(**TINY), drafter, retrieval, None)


def test_the_cost_model_reaches_graft_and_its_retrieval_source_only_when_needed():
    curve = VerifyCostModel((1, 128), (1.0, 2.0))
    target = _target()
    auto = build_graft_drafter(GraftConfig(**TINY, dense_budget=0), target, curve)
    assert auto.cost_model is curve and auto.dense_budget() == auto.ranks.best_size(curve, GraftConfig.AUTO_MAX)
    assert auto.retrieval.cost_model is None  # its own cost cut stays off: the hybrid tree is sized by Graft
    gated = build_graft_drafter(GraftConfig(**TINY, dense_budget=20), target, curve)
    assert gated.cost_model is curve and gated.dense_budget() == 20
    fixed = build_graft_drafter(GraftConfig(**TINY, stages=(1, 5), dense_budget=20, cost_cut=False), target, curve)
    assert fixed.cost_model is None and fixed.dense_budget() == 20
    cut = build_graft_drafter(GraftConfig(**TINY, stages=(1, 5), dense_budget=20), target, curve)
    assert cut.cost_model is curve and cut.dense_budget() == 20


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
        ({"cost_cut": "yes"}, "graft.cost_cut must be true or false, got 'yes'"),
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
        ({"stage_unit": "blocks"}, "graft.stage_unit must be one of levels, forwards, got 'blocks'"),
        ({"tree_drafter": {"type": "specblock", "block_size": 2}, "stages": [0, 9], "stage_unit": "forwards"},
         "graft.stages[] (forwards) must be in [0, 8]"),
    ],
)
def test_bad_config_is_a_clear_error(kw, message):
    with pytest.raises(ConfigError) as err:
        resolve_methods(["graft"], {"graft": kw})
    assert message in str(err.value)


# ---------------------------------------------------------------------- anchored grafts and the gate
class StagedOracle:
    """A :class:`StagedDrafter` that knows each prompt's vanilla greedy output (computed up front, so
    drafting costs microseconds): one level per call, a single chain, each level's token the
    reference's next token shifted by ``shift`` (0 = a perfect drafter; 1 = never accepted under
    greedy). Draft scores are log 0.9 per level, so the beam mass stays confident."""

    name = "staged-oracle"
    STANDALONE_DEPTH = 4
    needs_aux = False
    target_topk = 0

    def __init__(self, refs: dict[tuple[int, ...], list[int]], shift: int = 0) -> None:
        self.refs, self.shift = refs, shift

    def begin(self, ctx, prompt_aux) -> None:
        pass

    def observe(self, ctx, outcome) -> None:
        pass

    def propose(self, ctx):
        """Standalone use: a chain of ``STANDALONE_DEPTH`` levels (Graft calls :meth:`draft`)."""
        tree, forwards, _ = self.draft(ctx, self.STANDALONE_DEPTH, lambda levels, _s: levels >= self.STANDALONE_DEPTH)
        return Proposal(tree, drafter_forwards=forwards)

    def draft(self, ctx, budget, stop=None):
        ref = self.refs[tuple(ctx.tokens[: ctx.prompt_len])]
        pos = len(ctx.tokens) - ctx.prompt_len
        tree, node, levels = DraftTree(ctx.root_token), ROOT, 0
        while True:
            tok = ref[pos + levels] if pos + levels < len(ref) else 0
            levels += 1
            node = tree.add(node, (tok + self.shift) % VOCAB, levels * math.log(0.9), NodeSource.DRAFTER)
            if stop is not None and stop(levels, torch.tensor([levels * math.log(0.9)])):
                break
        keep = budget(levels) if callable(budget) else budget
        return tree.pruned_to(keep), levels, levels


def _refs(target) -> tuple[EngineConfig, list[list[int]], list[list[int]]]:
    """(config, prompts, vanilla outputs) of :data:`PROMPTS`, for :func:`assert_lossless_on_refs`."""
    return GREEDY, PROMPTS, [_vanilla(target, p) for p in PROMPTS]


def _oracle_graft(target, shift: int, prompts, **kw) -> GraftDrafter:
    refs = {tuple(p): _vanilla(target, p) for p in prompts}
    cfg = GraftConfig(**TINY, **kw)
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    cost = measure_cost_model(target, max_size=cfg.verify_curve_size()) if cfg.verify_curve_size() else None
    return GraftDrafter(cfg, StagedOracle(refs, shift), retrieval, cost)


def test_anchored_retrieval_grafts_a_continuation_under_a_drafter_node_that_root_retrieval_cannot():
    """Context ``1 2 3 4 5 9``: after the root 9 nothing was ever seen, so root-anchored retrieval
    proposes nothing; the drafter's kept leaf 1 has a known continuation ``2 3 4 5``."""
    cfg = GraftConfig(**TINY, transition_topk=0)
    retrieval = RetrievalDrafter(cfg.retrieval(), VOCAB)
    ctx = DraftContext(tokens=[1, 2, 3, 4, 5, 9], prompt_len=6)
    retrieval.begin(ctx)
    root_only = retrieval.propose(ctx).tree
    assert len(root_only) == 1
    pruned = _tree(9, [[1], [6]], NodeSource.DRAFTER)
    leaf = pruned.child(ROOT, 1)
    below = retrieval.continuations(ctx.tokens, [1], budget=8)
    assert below.root_token == 1 and below.path_tokens(len(below) - 1)[:5] == [1, 2, 3, 4, 5]
    assert graft(pruned.subtree(range(len(pruned))), root_only, room=8) == 0
    origin = graft_anchored(pruned, [GraftSource(ROOT, root_only), GraftSource(leaf, below, math.log(0.5))], room=3)
    assert set(origin.values()) == {leaf} and len(origin) == 3  # room respected
    deepest = max(origin, key=lambda n: pruned.depths[n])
    assert pruned.path_tokens(deepest) == [9, 1, 2, 3, 4] and pruned.sources[leaf] == NodeSource.DRAFTER
    # scores: the anchor's calibrated log probability plus the continuation's
    assert pruned.scores[deepest] == pytest.approx(math.log(0.5) + below.scores[below.child(below.child(below.child(ROOT, 2), 3), 4)])


def test_grafting_the_freed_slots_raises_acceptance_over_pruning_alone():
    """Graft's central claim on the tiny model: the same pruned EAGLE-3 trees (one level, 4 nodes,
    no stage 0) accept more tokens per step when retrieved tokens fill the freed slots."""
    target = _target()

    refs = _refs(target)

    def tau(**kw) -> float:
        return assert_lossless_on_refs(target, _drafter(target, stages=[1], stage_budgets=[4], dense_budget=16, **kw), refs)

    pruned, grafted = tau(graft_budget=0), tau(graft_budget=11)
    assert grafted > 1.2 * pruned, (pruned, grafted)


def test_anchored_grafts_are_accepted_beyond_pruned_leaves():
    """A perfect one-level drafter (stages [1]: every kept drafter node is a pruned leaf at depth
    1): retrieved continuations anchored under those leaves are accepted, and they raise tau over
    root-anchored grafting alone."""
    target = _target()

    refs = _refs(target)

    def run(anchors: int) -> tuple[float, GraftDrafter]:
        d = _oracle_graft(target, 0, PROMPTS, stages=(1,), stage_budgets=(1,), dense_budget=12, graft_anchors=anchors)
        return assert_lossless_on_refs(target, d, refs), d

    tau_root, root_only = run(0)
    tau_anchored, anchored = run(4)
    assert root_only.counters["grafted_anchored"] == 0 == root_only.counters["accepted_anchored_graft"]
    assert anchored.counters["accepted_anchored_graft"] > 0
    assert tau_anchored >= tau_root, (tau_root, tau_anchored)


def test_gate_stops_calling_a_drafter_that_is_never_accepted():
    target = _target()
    d = RecordingDrafter(_oracle_graft(target, 1, PROMPTS, stages=(0, 2, 5), gate_warmup=2))
    last_steps = set()  # a sequence's final step is never observed (it ended), so it books no warm-up
    for prompt in PROMPTS:
        assert generate_speculative(target, d, prompt, GREEDY).tokens == _vanilla(target, prompt)
        last_steps.add(len(d.proposals) - 1)
    called = [p for p in d.proposals if p.drafter_forwards > 0]
    assert called and all(p.stats["gate_verdict"] == GateVerdict.WARMUP for p in called)  # only while warming up
    observed_calls = [i for i, p in enumerate(d.proposals) if p.drafter_forwards > 0 and i not in last_steps]
    assert len(observed_calls) <= 2 * (len(DrafterGate.EDGES) + 1)  # warm-up: 2 observed calls per bucket
    skipped = [p for p in d.proposals if p.drafter_forwards == 0]
    assert all(p.stats["stage"] == 0.0 and p.stats["gate_verdict"] == GateVerdict.DOES_NOT_PAY for p in skipped)
    assert len(skipped) > 2 * len(called), (len(skipped), len(called))
    assert all(d.inner.gate.gain(b) <= 0.0 for b, n in enumerate(d.inner.gate.count) if n)


def test_gate_always_calls_a_perfect_drafter():
    """Retrieval proposes at most 2 nodes here, so a perfect 5-level drafter always adds tokens."""
    target = _target()
    d = RecordingDrafter(_oracle_graft(target, 0, PROMPTS, stages=(0, 2, 5), threshold=0.0, gate_warmup=2,
                                       retrieval_budget=2))
    for prompt in PROMPTS:
        assert generate_speculative(target, d, prompt, GREEDY).tokens == _vanilla(target, prompt)
    assert all(p.stats["gate_call"] == 1.0 and p.drafter_forwards > 0 for p in d.proposals)
    assert any(p.stats["gate_verdict"] == GateVerdict.PAYS for p in d.proposals)
    for p in d.proposals:
        if p.stats["gate_verdict"] == GateVerdict.PAYS:
            assert p.stats["gate_value_s"] > p.stats["gate_cost_s"] > 0.0
    report = d.inner.report()
    assert report["drafting_s_by_stage"] and report["drafting_s_expected"] > 0.0
    assert report["counters"]["drafter_calls"] == len(d.proposals)


def test_cost_model_interpolates_over_context_length_and_is_measured_per_context():
    grid = VerifyCostModel((1, 9), (1.0, 2.0), contexts=(100, 300), grid=((1.0, 2.0), (3.0, 6.0)))
    assert grid.cost(5) == pytest.approx(1.5)  # the 1-D curve
    assert grid.cost(5, 100) == pytest.approx(1.5) and grid.cost(5, 300) == pytest.approx(4.5)
    assert grid.cost(5, 200) == pytest.approx(3.0) and grid.cost(5, 50) == pytest.approx(1.5)  # flat below
    assert grid.cost(5, 10_000) == pytest.approx(4.5 + (4.5 - 1.5) / 200 * 9_700)  # last slope beyond
    with pytest.raises(ValueError, match="grid must be"):
        VerifyCostModel((1, 9), (1.0, 2.0), contexts=(100,), grid=((1.0,),))
    measured = measure_cost_model(_target(), max_size=4, repeats=1, contexts=(16, 64))
    assert measured.contexts == (16, 64) and measured.sizes == (1, 2, 4)
    assert all(s > 0 for row in measured.grid for s in row)


def test_staged_oracle_alone_accepts_its_whole_chain():
    """The test drafter above, used on its own: shift 0 drafts the reference, so every step accepts
    all ``STANDALONE_DEPTH`` levels (until the end of the output); shift 1 is never accepted."""
    target = _target()
    refs = {tuple(p): _vanilla(target, p) for p in PROMPTS}
    for shift, accepted in ((0, StagedOracle.STANDALONE_DEPTH), (1, 0)):
        for prompt in PROMPTS:
            res = generate_speculative(target, StagedOracle(refs, shift), prompt, GREEDY)
            assert res.tokens == refs[tuple(prompt)]
            assert all(s.accepted == accepted for s in res.steps[:-1]), [s.accepted for s in res.steps]


# ---------------------------------------------------------------------- the cost cut
def _graft_with_curve(curve: VerifyCostModel, **kw) -> GraftDrafter:
    cfg = GraftConfig(**TINY, **kw)
    return GraftDrafter(cfg, build_graft_drafter(GraftConfig(**TINY), _target(), curve).drafter,
                        RetrievalDrafter(cfg.retrieval(), VOCAB), curve)


def test_cost_cut_keeps_the_best_first_prefix_that_pays_and_stays_ancestor_closed():
    """Root 9 with a drafter chain 1 -> 2 (p 0.9, 0.8) and grafts 3 (p 0.5) under the root and
    4 -> 5 (p 0.2, then 0.6 claimed, capped at its parent's 0.2) under drafter node 1."""
    tree = _tree(9, [[1, 2]], NodeSource.DRAFTER)
    g3 = tree.add(ROOT, 3, math.log(0.5), NodeSource.RETRIEVAL)
    g4 = tree.add(1, 4, math.log(0.2), NodeSource.RETRIEVAL)
    g5 = tree.add(g4, 5, math.log(0.6), NodeSource.RETRIEVAL)
    probs = [1.0, 0.9, 0.8, 0.5, 0.2, 0.6]
    # flat c(T): every node is free, nothing is cut
    flat = _graft_with_curve(VerifyCostModel((1, 64), (1.0, 1.0)))
    assert flat._cost_cut(tree, probs, 0.0, 10) == (tree, None)
    # each node costs 0.25 of a root verify: rate (1 + sum p) / (1 + 0.25 n) is 1.52, 1.80, 1.83, 1.70
    # for n = 1..4, so the best prefix is 0.9, 0.8, 0.5 (two drafter nodes and the root graft)
    mid = _graft_with_curve(VerifyCostModel((1, 64), (1.0, 1.0 + 0.25 * 63)))
    cut, remap = mid._cost_cut(tree, probs, 0.0, 10)
    assert remap is not None and set(remap) == {ROOT, 1, 2, g3}
    assert sorted(cut.path_tokens(i)[-1] for i in range(1, len(cut))) == [1, 2, 3]
    assert g5 not in remap  # its own claim (0.6) is capped by its parent 4 (0.2): never kept without it
    # each node costs as much as the root: even 0.9 does not pay (1.9 / 2 < 1 / 1)
    dear = _graft_with_curve(VerifyCostModel((1, 64), (1.0, 64.0)))
    cut, remap = dear._cost_cut(tree, probs, 0.0, 10)
    assert len(cut) == 1 and remap == {ROOT: ROOT}
    # drafting seconds already spent make each verify second relatively cheaper: more is kept
    cut_d, _ = dear._cost_cut(tree, probs, 5.0, 10)
    assert len(cut_d) > 1
    off = _graft_with_curve(VerifyCostModel((1, 64), (1.0, 64.0)), cost_cut=False)
    assert off._cost_cut(tree, probs, 0.0, 10) == (tree, None)


@pytest.mark.parametrize("tree_drafter", [EAGLE3, SPECBLOCK])
def test_cost_cut_trees_stay_lossless_and_shrink_when_nodes_are_dear(tree_drafter):
    """Graft over both tree drafters with a verify curve where a node costs as much as the root:
    the verified trees shrink (every proposal reports what it cut) and greedy equals vanilla; on a
    flat curve nothing is cut."""
    target = _target()
    refs = _refs(target)
    stages = [0, 2, 4]
    sizes = {}
    for name, curve in (("flat", VerifyCostModel((1, 64), (1.0, 1.0))), ("dear", VerifyCostModel((1, 64), (1.0, 64.0)))):
        cfg = GraftConfig(tree_drafter=tree_drafter, stages=stages, dense_budget=16, gate_warmup=1000)
        d = RecordingDrafter(build_graft_drafter(cfg, target, curve))
        assert d.inner.cost_model is curve
        assert_lossless_on_refs(target, d, refs, max_new_tokens=24)
        sizes[name] = sum(len(p.tree) for p in d.proposals) / len(d.proposals)
        cut = [p.stats["cost_cut"] for p in d.proposals]
        if name == "flat":
            assert all(c == 0 for c in cut)
        else:
            assert sum(cut) > 0 and all(c >= 0 for c in cut)
    assert sizes["dear"] < sizes["flat"], sizes


def test_cost_cut_makes_retrieval_only_graft_step_aside_when_nodes_are_dear():
    """Stage 0 alone (no tree drafter): the retrieval-only tree gets the same cut; at a node as dear
    as the root no retrieved node pays, so every step verifies the root alone (plain decoding)."""
    target = _target()
    refs = _refs(target)
    cfg = GraftConfig(stages=(0,), dense_budget=16)
    assert cfg.verify_curve_size() == 16
    d = RecordingDrafter(build_graft_drafter(cfg, target, VerifyCostModel((1, 64), (1.0, 64.0))))
    assert assert_lossless_on_refs(target, d, refs, max_new_tokens=24) == 1.0
    assert all(len(p.tree) == 1 for p in d.proposals) and sum(p.stats["cost_cut"] for p in d.proposals) > 0
