"""Batched neural drafting (issue #12 item 3): one draft-network forward per drafting stage for all
the sequences of a batch that share the network, on a tiny random Llama in fp32.

* The batched forward proposes exactly what each sequence proposes alone (same tree tokens and
  parents, scores within 1e-5) for EAGLE-3 and SpecBlock, with contexts of different lengths,
  over several steps (incremental encodes of different sizes) and with per-row prune rules
  (Graft's dynamic depth: rows stop at different levels).
* Through :class:`~speculation.engine.batch.BatchEngine` (staggered arrivals, more requests than slots)
  fp32 greedy output equals each request's solo vanilla output for EAGLE-3, SpecBlock and
  Graft-over-SpecBlock; the network's own forward counter (``forward_calls``, incremented in the
  drafter code) grows per step by the forwards of ONE sequence's proposal, not by the sum over
  the batch.
"""

from __future__ import annotations

import pytest
import torch

from speculation.spec import verify as V
from speculation.config import BatchConfig, Eagle3Config, EngineConfig, GraftConfig, SamplingConfig, SpecBlockConfig
from speculation.policy.cost import measure_cost_model
from speculation.drafters.base import BatchDrafter, BatchStagedDrafter, DraftContext, StepOutcome, propose_many
from speculation.drafters.eagle3 import Eagle3Drafter, build_eagle3_drafter
from speculation.drafters.graft import GraftDrafter, build_graft_drafter
from speculation.drafters.specblock import SpecBlockDrafter, build_specblock_drafter
from speculation.engine.batch import BatchEngine, Request
from speculation.engine.solo import generate_vanilla
from tests.helpers import shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 10, 20, 10, 20, 10], [63, 0, 17, 42, 42, 42, 9, 31, 8, 8, 1, 60, 2],
           [7] * 20]
NEW = [24, 14, 20, 9, 18]
ARRIVE = [0, 0, 1, 3, 4]  # step at which each request is added
GREEDY = SamplingConfig(temperature=0.0)
SPECBLOCK_TREE = {"type": "specblock", "checkpoint": "random", "draft_vocab_size": VOCAB, "block_size": 2, "beam": 3,
                  "slot_widths": [2, 2, 3, 1], "adaptive_widths": False}


def _target():
    return tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))


def _eagle3(target):
    return build_eagle3_drafter(
        Eagle3Config(checkpoint="random", draft_vocab_size=VOCAB, top_k=3, depth=3, total_tokens=12), target)


def _specblock(target):
    cfg = SpecBlockConfig(checkpoint="random", draft_vocab_size=VOCAB, block_size=3, max_blocks=3, beam=3,
                          slot_widths=(2, 2, 3, 1), total_tokens=16, adaptive_widths=False)
    return build_specblock_drafter(cfg, target)


BUILDERS = {"eagle3": _eagle3, "specblock": _specblock}


def _same_tree(got, ref, what: str) -> None:
    assert got.tokens == ref.tokens, f"{what}: tokens differ"
    assert got.parents == ref.parents, f"{what}: parents differ"
    assert torch.allclose(torch.tensor(got.scores), torch.tensor(ref.scores), atol=1e-5, rtol=0), f"{what}: scores"


class _Solo:
    """One sequence decoded with a solo drafter (the reference): prefill, verify, commit."""

    def __init__(self, target, drafter, prompt):
        self.target, self.drafter = target, drafter
        self.state, logits, aux = target.prefill(prompt, need_aux=True)
        self.ctx = DraftContext(tokens=[*prompt, int(logits.argmax())], prompt_len=len(prompt))
        self.prompt_aux = aux
        drafter.begin(self.ctx, aux)

    def outcome(self, tree) -> StepOutcome:
        fwd = self.target.verify(self.state, tree, need_aux=True)
        res = V.greedy(tree, fwd.logits)
        self.target.commit(self.state, tree, res.accepted)
        new = [tree.tokens[a] for a in res.accepted[1:]] + [res.bonus_token]
        self.ctx.tokens.extend(new)
        return StepOutcome(tree=tree, accepted=res.accepted, accepted_tokens=[tree.tokens[a] for a in res.accepted],
                           bonus_token=res.bonus_token, aux_hidden=fwd.aux_hidden[res.accepted])


@pytest.mark.parametrize("family", list(BUILDERS))
def test_batched_proposals_equal_per_sequence_proposals(family):
    target = _target()
    build = BUILDERS[family]
    prompts = PROMPTS[1:]  # 7 to 20 tokens: different context lengths, different pending pairs per step
    solos = [_Solo(target, build(target), p) for p in prompts]
    batched = [build(target) for _ in prompts]
    assert len({id(d.model) for d in batched + [s.drafter for s in solos]}) == 1  # one shared network
    assert all(isinstance(d, BatchStagedDrafter) for d in batched)
    ctxs = [DraftContext(tokens=list(s.ctx.tokens), prompt_len=s.ctx.prompt_len) for s in solos]
    for d, s, ctx in zip(batched, solos, ctxs):
        d.begin(ctx, s.prompt_aux)
    model = batched[0].model
    for step in range(4):
        before = model.forward_calls
        got = type(batched[0]).propose_batch(batched, ctxs)
        batched_calls = model.forward_calls - before
        refs = [s.drafter.propose(s.ctx) for s in solos]
        solo_calls = model.forward_calls - before - batched_calls
        for i, (g, r) in enumerate(zip(got, refs)):
            _same_tree(g.tree, r.tree, f"{family} step {step} sequence {i}")
            assert g.drafter_forwards == r.drafter_forwards
        # one forward per drafting stage for the whole batch; the solo path pays it per sequence
        assert batched_calls == max(r.drafter_forwards for r in refs)
        assert solo_calls == sum(r.drafter_forwards for r in refs)
        for d, s, ctx, r in zip(batched, solos, ctxs, refs):
            out = s.outcome(r.tree)
            ctx.tokens.extend(s.ctx.tokens[len(ctx.tokens):])
            s.drafter.observe(s.ctx, out)
            d.observe(ctx, out)

    # per-row prune rules (Graft's dynamic depth): rows stop after different numbers of levels
    step_levels = 1 if family == "eagle3" else batched[0].K
    limits = [step_levels * (1 + i % 3) for i in range(len(prompts))]

    def stopper(limit):
        return lambda levels, scores: levels > limit

    got = type(batched[0]).draft_batch(batched, ctxs, [9] * len(prompts), [stopper(m) for m in limits])
    refs = [s.drafter.draft(s.ctx, 9, stopper(m)) for s, m in zip(solos, limits)]
    assert len({r[2] for r in refs}) > 1, "the rows should stop at different depths"
    for i, (g, r) in enumerate(zip(got, refs)):
        _same_tree(g[0], r[0], f"{family} pruned, sequence {i}")
        assert g[1:] == r[1:]


def _drive(engine, requests, arrive, model):
    """Add request i at step ``arrive[i]``; step until done. Returns (results, per-step forward
    counts: (network forwards this step, [drafter_forwards of each sequence's proposal]))."""
    results, counts = {}, []
    step = 0
    pending = sorted(zip(arrive, range(len(requests))))
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add(requests[pending.pop(0)[1]])
        before = model.forward_calls
        updates = engine.step()
        counts.append((model.forward_calls - before, [u.step.drafter_forwards for u in updates if u.step is not None]))
        results.update(engine.finished_results())
        step += 1
        assert step < 500, "the engine made no progress"
    return results, counts


def _graft_factory(target):
    cfg = GraftConfig(tree_drafter=SPECBLOCK_TREE, stages=[0, 2, 6], threshold=0.5, dense_budget=12,
                      graft_budget=4, gate_warmup=2)
    cost = measure_cost_model(target, max_size=cfg.verify_curve_size())
    return lambda: build_graft_drafter(cfg, target, cost)


FACTORIES = {
    "eagle3": lambda target: (lambda: _eagle3(target)),
    "specblock": lambda target: (lambda: _specblock(target)),
    "graft-specblock": _graft_factory,
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_batch_engine_with_batched_drafting_equals_solo_vanilla(name):
    target = _target()
    refs = [generate_vanilla(target, p, EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=GREEDY)).tokens
            for p, n in zip(PROMPTS, NEW)]
    factory = FACTORIES[name](target)
    probe = factory()
    assert isinstance(probe, BatchDrafter)
    model = (probe.drafter if isinstance(probe, GraftDrafter) else probe).model
    engine = BatchEngine(target, factory, BatchConfig(max_sequences=4, max_tokens_per_sequence=64))
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, counts = _drive(engine, reqs, ARRIVE, model)
    for i, ref in enumerate(refs):
        assert results[f"r{i}"].tokens == ref, f"{name}, request {i}"
    # one network forward per drafting stage for every sequence that drafts (a Graft sequence whose
    # gate says no joins no forward): the step's forwards = the most any one proposal spent
    multi = 0
    for forwards, per_seq in counts:
        assert forwards == max(per_seq, default=0), (forwards, per_seq)
        multi += sum(1 for f in per_seq if f) > 1
    assert multi >= 3, "several steps should batch two or more drafting sequences"
    assert sum(sum(p) for _, p in counts) > sum(f for f, _ in counts)


def test_groups_split_by_network_and_keep_retrieval_per_sequence():
    """Drafters with different networks (a swapped-in copy) draft in separate groups; each still
    proposes what it proposes alone."""
    target = _target()
    a, b = _eagle3(target), _eagle3(target)
    b.load_state_dict({k: v * 1.01 for k, v in a.state_dict().items()})  # another network object
    assert a.model is not b.model and a.batch_key() != b.batch_key()
    solos = [_Solo(target, _eagle3(target), PROMPTS[1]), _Solo(target, _eagle3(target), PROMPTS[2])]
    solos[1].drafter.load_state_dict(b.state_dict())
    for d, s in zip((a, b), solos):
        d.begin(DraftContext(list(s.ctx.tokens), s.ctx.prompt_len), s.prompt_aux)
    got = propose_many([a, b], [s.ctx for s in solos])
    for (p, _), s in zip(got, solos):
        _same_tree(p.tree, s.drafter.propose(s.ctx).tree, "separate groups")
    assert isinstance(a, Eagle3Drafter) and not isinstance(a, SpecBlockDrafter)
