"""Continuous batching (:class:`speculation.engine.batch.BatchEngine`) on a tiny random Llama.

* fp32 greedy: every sequence's output under batching (different prompt lengths, staggered
  arrivals, different max tokens, EOS mid-batch, more requests than slots) equals its own solo
  vanilla output, for vanilla and every drafter built here. On a mismatch the message shows the
  solo logit margin (top-1 minus top-2) at the first differing token, so a batch-shape near-tie
  is told apart from a bug.
* Sampling: a request's output equals the solo run with the same seed; the chi-square test of
  tests/test_sampling_lossless.py passes with every sample drawn inside a batch.
* Slots and admission: abort frees a slot at once, requests wait for a slot, a request that can
  never fit gets AdmissionError naming the limit, duplicate ids and bad configs are refused.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from speculation.config import BatchConfig, ConfigError, EngineConfig, RetrievalConfig, SamplingConfig
from speculation.drafters.base import Proposal
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.engine.batch import AdmissionError, BatchEngine, QueueFullError, Request
from speculation.engine.sequence import FinishReason
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.spec.tree import DraftTree, NodeSource
from tests.helpers import (
    GreedyOracleDrafter,
    RandomTreeDrafter,
    full_logits,
    shared_tiny_llama,
    tiny_llama,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
PROMPTS = [
    [5],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [10, 20, 10, 20, 10, 20, 10],
    [63, 0, 17, 42, 42, 42, 9, 31, 8, 8, 1, 60, 2],
    [7] * 20,
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
]
NEW = [30, 12, 25, 1, 20, 17]
ARRIVE = [0, 0, 1, 3, 3, 6]  # step at which each request is added (staggered arrivals)
GREEDY = SamplingConfig(temperature=0.0)


def _model(layout: str = "padded"):
    """The tiny Llama; ``"flat"``: the same weights grouped and packed (the lean loop, FLAT batches)."""
    return shared_tiny_llama(vocab_size=VOCAB, seed=42, lean=layout == "flat")


LAYOUTS = ["padded", "flat"]


def _eagle3(target):
    from speculation.config import Eagle3Config
    from speculation.drafters.eagle3 import build_eagle3_drafter

    return build_eagle3_drafter(
        Eagle3Config(checkpoint="random", draft_vocab_size=VOCAB, top_k=3, depth=3, total_tokens=12), target)


def _specblock(target):
    from speculation.config import SpecBlockConfig
    from speculation.drafters.specblock import build_specblock_drafter

    cfg = SpecBlockConfig(checkpoint="random", draft_vocab_size=VOCAB, block_size=3, max_blocks=2, beam=3,
                          slot_widths=(2, 2, 3, 1), total_tokens=10, adaptive_widths=False)
    return build_specblock_drafter(cfg, target)


def _graft(target):
    from speculation.config import GraftConfig
    from speculation.drafters.graft import build_graft_drafter

    cfg = GraftConfig(tree_drafter={"type": "eagle3", "top_k": 3, "checkpoint": "random", "draft_vocab_size": VOCAB},
                      dense_budget=10, graft_budget=4)
    return build_graft_drafter(cfg, target)


# name -> factory(target, request index) of a fresh drafter (one per request, as a server does)
DRAFTERS = {
    "vanilla": None,
    "random-tree": lambda target, i: RandomTreeDrafter(VOCAB, seed=3 + i),
    "oracle": lambda target, i: GreedyOracleDrafter(target.model, seed=5 + i),
    "retrieval": lambda target, i: RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB),
    "eagle3": lambda target, i: _eagle3(target),
    "specblock": lambda target, i: _specblock(target),
    "graft": lambda target, i: _graft(target),
}


def _factory(name, target):
    make = DRAFTERS[name]
    if make is None:
        return None
    counter = iter(range(1000))
    return lambda: make(target, next(counter))


def _solo_vanilla(target, prompt, n, sampling=GREEDY, stop_at_eos=False):
    return generate_vanilla(target, prompt, EngineConfig(max_new_tokens=n, stop_at_eos=stop_at_eos,
                                                         sampling=sampling)).tokens


def _margin_report(model, prompt, ref, got) -> str:
    """Where ``got`` leaves ``ref``, and the solo top-1 minus top-2 logit margin there."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if k >= min(len(ref), len(got)):
        return f"lengths differ: solo {len(ref)} tokens, batched {len(got)}"
    logits = full_logits(model, prompt + ref[:k])[-1]
    top = torch.topk(logits, 2)
    return (f"first difference at token {k}: solo {ref[k]}, batched {got[k]}; solo logit margin "
            f"top1-top2 = {float(top.values[0] - top.values[1]):.3e}, "
            f"logit(solo)-logit(batched) = {float(logits[ref[k]] - logits[got[k]]):.3e}")


def _drive(engine: BatchEngine, requests: list[Request], arrive: list[int]):
    """Add request i at step ``arrive[i]``; step until done. Returns (results, updates by id)."""
    results, updates = {}, {r.request_id: [] for r in requests}
    step = 0
    pending = sorted(zip(arrive, range(len(requests))))
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add(requests[pending.pop(0)[1]])
        for u in engine.step():
            updates[u.request_id].append(u)
        results.update(engine.finished_results())
        step += 1
        assert step < 1000, "the engine made no progress"
    return results, updates


def _check_updates(updates, result, n_max):
    """The updates stream the result: tokens concatenate to it, exactly one finishes it, last."""
    toks = [t for u in updates for t in u.new_tokens]
    assert toks == result.tokens
    finished = [u.finished for u in updates if u.finished is not None]
    assert len(finished) == 1 and updates[-1].finished is not None
    assert len(result.tokens) <= n_max


# ---------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_batched_greedy_equals_solo_vanilla(name, layout):
    model = _model(layout)
    target = tiny_target(model)
    assert target.batch_layout.value == layout
    refs = [_solo_vanilla(target, p, n) for p, n in zip(PROMPTS, NEW)]
    # 4 slots for 6 requests: some wait for a slot; arrivals are staggered.
    engine = BatchEngine(target, _factory(name, target), BatchConfig(max_sequences=4, max_tokens_per_sequence=64))
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, updates = _drive(engine, reqs, ARRIVE)
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        got = results[f"r{i}"].tokens
        assert got == ref, f"{name}, request {i}: {_margin_report(model, p, ref, got)}"
        _check_updates(updates[f"r{i}"], results[f"r{i}"], NEW[i])
        assert updates[f"r{i}"][-1].finished is FinishReason.LENGTH
    assert engine.pool.free == 4 and engine.num_live == 0
    steps = [u.step for ups in updates.values() for u in ups if u.step is not None]
    assert max(s.stats["batch_size"] for s in steps) >= 3  # several sequences per forward
    if name != "vanilla":
        assert sum(s.accepted for s in steps) > 0
    else:
        assert all(s.tree_size == 1 for s in steps)


@pytest.mark.parametrize("name", ["vanilla", "eagle3", "graft"])
def test_prefills_fold_into_the_step_forward_with_the_same_tokens(name, monkeypatch):
    """FLAT layout: arriving prompts are prefilled inside the step's one forward (no prefill
    forward of their own; the step records count their tokens), and the outputs
    equal both the unfolded engine's and solo vanilla (drafters that need the prompt's features,
    EAGLE-3 and Graft, get them from the folded prefill)."""
    target = tiny_target(_model("flat"))
    assert target.folds_prefills
    refs = [_solo_vanilla(target, p, n) for p, n in zip(PROMPTS, NEW)]
    outs = {}
    for fold in (True, False):
        engine = BatchEngine(target, _factory(name, target),
                             BatchConfig(max_sequences=4, max_tokens_per_sequence=64, fold_prefills=fold))
        reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
        with monkeypatch.context() as m:
            if fold:  # a prefill forward of its own would be a failure
                m.setattr(target, "prefill_slot", lambda *a, **k: pytest.fail("a prompt got its own prefill forward"))
            results, updates = _drive(engine, reqs, ARRIVE)
        outs[fold] = {rid: r.tokens for rid, r in results.items()}
        steps = [u.step for ups in updates.values() for u in ups if u.step is not None]
        folded = sum(s.stats["batch_prefill_tokens"] > 0 for s in steps)
        assert (folded > 0) is fold
        for i in range(len(PROMPTS)):
            _check_updates(updates[f"r{i}"], results[f"r{i}"], NEW[i])
            first = updates[f"r{i}"][0]
            if fold:  # the step that prefilled it gave its first token alone; it verifies from the next
                assert len(first.new_tokens) == 1 and first.step is None
    assert outs[True] == outs[False] == {f"r{i}": ref for i, ref in enumerate(refs)}


@pytest.mark.parametrize("name", ["vanilla", "retrieval", "eagle3", "graft"])
def test_chunked_prefill_equals_the_solo_chunked_run(name):
    """``prefill_chunk_tokens=4``: a prompt of n tokens is prefilled over ceil(n / 4) steps (one
    chunk per step, beside the live sequences' trees), each sequence's output equals its solo run
    with the same chunked prefill (EAGLE-3 and Graft read the features of every chunk), and no
    step prefills more than one chunk per prompt."""
    C = 4
    target = tiny_target(_model("flat"))
    refs = [generate_vanilla(target, p, EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=GREEDY,
                                                     prefill_chunk_tokens=C)).tokens
            for p, n in zip(PROMPTS, NEW)]
    engine = BatchEngine(target, _factory(name, target),
                         BatchConfig(max_sequences=4, max_tokens_per_sequence=64, prefill_chunk_tokens=C))
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, updates = {}, {r.request_id: [] for r in reqs}
    first_token_step, seen_prefilling = {}, 0
    pending, step = sorted(zip(ARRIVE, range(len(reqs)))), 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add(reqs[pending.pop(0)[1]])
        for u in engine.step():
            updates[u.request_id].append(u)
            if u.new_tokens:
                first_token_step.setdefault(u.request_id, step)
        seen_prefilling = max(seen_prefilling, engine.num_prefilling)
        results.update(engine.finished_results())
        step += 1
        assert step < 1000
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        assert results[f"r{i}"].tokens == ref, f"{name}, request {i}: {_margin_report(target.model, p, ref, results[f'r{i}'].tokens)}"
        _check_updates(updates[f"r{i}"], results[f"r{i}"], NEW[i])
        chunks = -(-len(p) // C)
        assert first_token_step[f"r{i}"] - ARRIVE[i] >= chunks - 1  # one chunk per step at most
    steps = [u.step for ups in updates.values() for u in ups if u.step is not None]
    assert seen_prefilling >= 1 and max(s.stats["batch_prefill_tokens"] for s in steps) <= C * 4
    assert engine.pool.free == 4 and engine.num_prefilling == 0


def test_prefill_step_budget_caps_the_prompt_tokens_of_every_step():
    """``prefill_step_tokens=8`` with 4-token chunks: six requests arriving together prefill at
    most 8 prompt tokens per step (two chunks), later arrivals wait for the budget rather than
    taking slots, and every output still equals its solo chunked run."""
    target = tiny_target(_model("flat"))
    refs = [generate_vanilla(target, p, EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=GREEDY,
                                                     prefill_chunk_tokens=4)).tokens for p, n in zip(PROMPTS, NEW)]
    engine = BatchEngine(target, None, BatchConfig(max_sequences=6, max_tokens_per_sequence=64,
                                                   prefill_chunk_tokens=4, prefill_step_tokens=8))
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    prefilled, waited = [], False
    real = target.step_batch

    def counting(states, trees, prompts, need_aux=False):
        prefilled.append(sum(len(ids) for _, ids in prompts))
        return real(states, trees, prompts, need_aux=need_aux)

    target.step_batch = counting
    try:
        for r in reqs:
            engine.add(r)
        results = {}
        while engine.has_work():
            engine.step()
            waited |= engine.num_waiting > 0 and engine.pool.free > 0
            results.update(engine.finished_results())
    finally:
        del target.step_batch
    assert max(prefilled) <= 8 and sum(prefilled) == sum(len(p) for p in PROMPTS)
    assert waited  # a request waited for the budget with a slot free
    assert {rid: r.tokens for rid, r in results.items()} == {f"r{i}": ref for i, ref in enumerate(refs)}
    with pytest.raises(ConfigError, match="batch.prefill_step_tokens needs batch.prefill_chunk_tokens"):
        BatchConfig(prefill_step_tokens=64)
    with pytest.raises(ConfigError, match=r"batch.prefill_step_tokens must be in \[16, 1048576\], got 8"):
        BatchConfig(prefill_chunk_tokens=16, prefill_step_tokens=8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_solo_chunked_prefill_equals_the_one_forward_prefill_to_rounding(layout):
    """``TargetModel.prefill(..., chunk_tokens=C)`` on both layouts (the lean loop's masked chunk
    rows, transformers' masked forward): next-token logits and aux features equal the one-forward
    prefill's to fp32 rounding for every chunk size, one-token last chunks included, and the KV it
    leaves decodes the same logits. A bad chunk size is refused by name."""
    target = tiny_target(_model(layout))
    prompt = PROMPTS[3] + PROMPTS[4]  # 33 tokens
    state, logits, aux = target.prefill(prompt, need_aux=True)
    ref_next = target.decode(state, 9)
    for c in (1, 4, 8, 16, 32, 33, 100):
        st, lg, ax = target.prefill(prompt, need_aux=True, chunk_tokens=c)
        assert st.length == len(prompt) and st.tokens == prompt and ax.shape == aux.shape
        torch.testing.assert_close(lg, logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ax, aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(target.decode(st, 9), ref_next, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="prefill chunk_tokens must be a positive integer or None, got 0"):
        target.prefill(prompt, chunk_tokens=0)


def test_chunked_prefill_refuses_targets_and_settings_that_cannot_chunk(monkeypatch):
    """Bad settings get errors naming the field; a target that cannot continue a prompt in its slot
    is refused at construction, not mid-request; an abort mid-prefill frees the slot at once; a
    failed step requeues a half-prefilled request, which then completes unchanged."""
    with pytest.raises(ConfigError, match="batch.prefill_chunk_tokens must be in \\[1, 1048576\\], got"):
        BatchConfig(prefill_chunk_tokens=0)
    with pytest.raises(ConfigError, match="prefill_chunk_tokens needs batch.fold_prefills true"):
        BatchConfig(prefill_chunk_tokens=8, fold_prefills=False)
    with pytest.raises(ConfigError, match="engine.prefill_chunk_tokens must be in \\[1, 1048576\\], got"):
        EngineConfig(prefill_chunk_tokens=-1)
    padded = tiny_target(_model("padded"))
    with pytest.raises(ValueError, match="batch.prefill_chunk_tokens needs a target that continues a prompt"):
        BatchEngine(padded, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64, prefill_chunk_tokens=4))
    target = tiny_target(_model("flat"))
    engine = BatchEngine(target, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64, prefill_chunk_tokens=4))
    engine.add(Request("long", PROMPTS[4], 5, GREEDY, stop_at_eos=False))  # 20 tokens: 5 chunks
    engine.step()
    assert engine.num_prefilling == 1 and engine.pool.free == 1
    engine.abort("long")
    assert engine.num_prefilling == 0 and engine.pool.free == 2
    assert [u.finished for u in engine.step()] == [FinishReason.ABORT]
    engine.add(Request("again", PROMPTS[4], 5, GREEDY, stop_at_eos=False))
    engine.step()
    engine.step()
    real = target.step_batch
    monkeypatch.setattr(target, "step_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.num_prefilling == 0 and engine.num_waiting == 1 and engine.pool.free == 2
    monkeypatch.setattr(target, "step_batch", real)
    results = engine.run([])
    ref = generate_vanilla(target, PROMPTS[4], EngineConfig(max_new_tokens=5, stop_at_eos=False, sampling=GREEDY,
                                                            prefill_chunk_tokens=4)).tokens
    assert results["again"].tokens == ref


def test_a_failed_folded_step_requeues_the_arriving_requests(monkeypatch):
    """If the step's forward fails, the requests whose prompts it was to prefill wait again (first
    in line, slots freed); the next step runs them and nothing is lost or corrupted."""
    target = tiny_target(_model("flat"))
    engine = BatchEngine(target, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64))
    engine.add(Request("a", PROMPTS[1], 6, GREEDY, stop_at_eos=False))
    engine.step()
    engine.add(Request("b", PROMPTS[2], 6, GREEDY, stop_at_eos=False))
    engine.add(Request("c", PROMPTS[3], 6, GREEDY, stop_at_eos=False))
    real = target.step_batch

    def broken(*args, **kwargs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(target, "step_batch", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.num_waiting == 2 and engine.pool.free == 1 and engine.num_live == 1
    monkeypatch.setattr(target, "step_batch", real)
    results = {}
    while engine.has_work():
        engine.step()
        results.update(engine.finished_results())
    # the live sequence "a" goes on too: the failed step committed nothing of its tree
    assert results["b"].tokens == _solo_vanilla(target, PROMPTS[2], 6)
    assert results["c"].tokens == _solo_vanilla(target, PROMPTS[3], 6)
    assert results["a"].tokens == _solo_vanilla(target, PROMPTS[1], 6)
    assert engine.pool.free == 2


def test_eos_and_stop_ids_mid_batch():
    """A sequence that hits EOS (or its own stop id) leaves the batch; the others go on unchanged."""
    base = _model()
    target0 = tiny_target(base)
    refs = [_solo_vanilla(target0, p, 30) for p in PROMPTS]
    eos = refs[0][6]  # an EOS the first prompt reaches mid-way
    model = tiny_llama(vocab_size=VOCAB, seed=42, eos_token_id=eos)  # same weights, an EOS id
    target = tiny_target(model)
    assert target.eos_token_ids == frozenset({eos})
    stop_extra = refs[2][4]
    engine = BatchEngine(target, _factory("random-tree", target), BatchConfig(max_sequences=3))
    reqs = [Request(f"r{i}", p, 30, GREEDY, stop_token_ids=frozenset({stop_extra}) if i == 2 else frozenset())
            for i, p in enumerate(PROMPTS)]
    results, updates = _drive(engine, reqs, [0] * len(reqs))
    for i, p in enumerate(PROMPTS):
        ref = generate_vanilla(target, p, EngineConfig(max_new_tokens=30, stop_at_eos=True, sampling=GREEDY)).tokens
        if i == 2:
            ref = ref[: ref.index(stop_extra) + 1] if stop_extra in ref else ref
        got = results[f"r{i}"].tokens
        assert got == ref, f"request {i}: {_margin_report(model, p, ref, got)}"
        stopped = got[-1] == eos or (i == 2 and got[-1] == stop_extra)
        assert updates[f"r{i}"][-1].finished is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    assert results["r0"].tokens[-1] == eos and len(results["r0"].tokens) <= 7


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_batch_matches_solo_verify(layout):
    """One batched forward over trees of different sizes after different KV lengths gives each
    tree the logits of its own solo verify (to fp32 rounding), and commits the right rows."""
    from speculation.spec.tree import DraftTree
    from tests.helpers import random_tree
    import random

    target = tiny_target(_model(layout))
    assert target.batch_layout.value == layout
    pool = target.new_slot_pool(4, 64)
    rng = random.Random(0)
    states, solos, trees = [], [], []
    for p in PROMPTS[:4]:
        st, _, _ = target.prefill_slot(pool, p)
        so, _, _ = target.prefill(p)
        states.append(st)
        solos.append(so)
        trees.append(random_tree(rng, p[-1], VOCAB, max_nodes=len(p)) if len(p) > 1 else DraftTree(p[-1]))
    for _ in range(3):
        fwds = target.verify_batch(states, trees, need_aux=True)
        for st, so, tree, fwd in zip(states, solos, trees, fwds):
            ref = target.verify(so, tree, need_aux=True)
            assert fwd.logits.shape == ref.logits.shape and fwd.aux_hidden.shape == ref.aux_hidden.shape
            torch.testing.assert_close(fwd.logits, ref.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fwd.aux_hidden, ref.aux_hidden, rtol=1e-5, atol=1e-5)
            path = [0]
            while len(path) < 3 and tree.children(path[-1]):
                path.append(tree.children(path[-1])[-1])  # the last child: rows must move
            target.commit_slot(st, tree, path)
            target.commit(so, tree, path)
            assert st.length == so.length and st.tokens == so.tokens
        trees = [random_tree(rng, int(f.logits[0].argmax()), VOCAB, max_nodes=5) for f in fwds]
    for st in states:
        target.release_slot(st)
    assert pool.free == 4


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["vanilla", "random-tree"])
def test_batched_sampling_equals_solo_with_same_seed(name, layout):
    model = _model(layout)
    target = tiny_target(model)
    samplings = [SamplingConfig(temperature=t, top_p=tp, top_k=k, seed=s)
                 for t, tp, k, s in [(0.8, 0.9, 0, 1), (1.0, 1.0, 0, 2), (0.7, 1.0, 10, 3), (1.3, 0.95, 20, 4),
                                     (0.0, 1.0, 0, 5), (0.9, 0.8, 5, 6)]]
    engine = BatchEngine(target, _factory(name, target), BatchConfig(max_sequences=4))
    reqs = [Request(f"r{i}", p, n, s, stop_at_eos=False)
            for i, (p, n, s) in enumerate(zip(PROMPTS, NEW, samplings))]
    results, _ = _drive(engine, reqs, ARRIVE)
    for i, (p, n, s) in enumerate(zip(PROMPTS, NEW, samplings)):
        cfg = EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=s)
        if name == "vanilla":
            ref = generate_vanilla(target, p, cfg).tokens
        else:
            ref = generate_speculative(target, RandomTreeDrafter(VOCAB, seed=3 + ARRIVE_ORDER[i]), p, cfg).tokens
        assert results[f"r{i}"].tokens == ref, f"{name}, request {i} (seed {s.seed}) differs from its solo run"


# request index -> order in which the engine admits it (the drafter factory's counter)
ARRIVE_ORDER = [i for _, i in sorted((a, i) for i, a in enumerate(ARRIVE))]
ARRIVE_ORDER = [ARRIVE_ORDER.index(i) for i in range(len(ARRIVE))]


def test_batched_sampling_chi_square():
    """Every sample drawn inside a batch of 16 (own seed each): the K-token distribution is the
    target's (same statistic, alpha and N as tests/test_sampling_lossless.py)."""
    from tests import test_sampling_lossless as L

    target = tiny_target(L._model())
    engine = BatchEngine(target, lambda: L._random_tree_drafter(target), BatchConfig(max_sequences=16))
    sampling = L.SAMPLING
    reqs = [Request(f"s{seed}", L.PROMPT, L.K, SamplingConfig(temperature=sampling.temperature,
                                                              top_p=sampling.top_p, seed=seed), stop_at_eos=False)
            for seed in range(L.N)]
    results = engine.run(reqs)
    outs = {int(rid[1:]): r.tokens for rid, r in results.items()}
    stat, df, p, _ = L.run_test(lambda seed: outs[seed])
    assert p >= L.ALPHA, f"batched sampling: X^2={stat:.1f}, df={df}, p={p:.2e}"


# ---------------------------------------------------------------------------- slots and admission
def test_abort_frees_the_slot_and_the_waiting_request_runs():
    target = tiny_target(_model())
    engine = BatchEngine(target, None, BatchConfig(max_sequences=1, max_tokens_per_sequence=64))
    engine.add(Request("a", PROMPTS[1], 40, GREEDY, stop_at_eos=False))
    engine.add(Request("b", PROMPTS[2], 10, GREEDY, stop_at_eos=False))
    engine.add(Request("c", PROMPTS[3], 10, GREEDY, stop_at_eos=False))
    first = engine.step()
    assert [u.request_id for u in first] == ["a"] and engine.num_waiting == 2
    engine.abort("c")  # waiting: leaves the queue
    engine.abort("a")  # live: its slot is free at once
    assert engine.pool.free == 1 and engine.num_live == 0
    engine.abort("never-added")  # ignored
    ups = engine.step()
    assert [(u.request_id, u.finished) for u in ups[:2]] == [("c", FinishReason.ABORT), ("a", FinishReason.ABORT)]
    assert ups[2].request_id == "b"
    out = [t for u in ups[2:] for t in u.new_tokens]
    while engine.has_work():
        out += [t for u in engine.step() for t in u.new_tokens]
    assert out == _solo_vanilla(target, PROMPTS[2], 10)
    assert engine.pool.free == 1


def test_admission_errors_are_clear():
    target = tiny_target(tiny_llama(vocab_size=VOCAB, seed=42, max_position_embeddings=64))
    engine = BatchEngine(target, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=32, max_waiting=2))
    with pytest.raises(AdmissionError, match=r"max_tokens_per_sequence=32") as e:
        engine.add(Request("big", [1] * 20, 13))
    assert "20 tokens" in str(e.value) and "33" in str(e.value)
    assert isinstance(e.value, ValueError)
    engine_wide = BatchEngine(target, None, BatchConfig(max_sequences=1, max_tokens_per_sequence=256))
    with pytest.raises(AdmissionError, match="context"):
        engine_wide.add(Request("ctx", [1] * 40, 40))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add(Request("oov", [1, VOCAB], 4))
    engine.add(Request("x", [1, 2], 4))
    with pytest.raises(ValueError, match="already queued"):
        engine.add(Request("x", [3], 4))
    for rid in ("y", "z", "w"):  # x and y are bound for the 2 free slots; z and w wait
        engine.add(Request(rid, [1, 2], 4))
    with pytest.raises(QueueFullError, match="max_waiting=2 requests already wait for one of batch.max_sequences=2"):
        engine.add(Request("v", [1, 2], 4))
    # nothing was lost: the queued requests run to the end, exactly as solo
    res = engine.run([])
    assert sorted(res) == ["w", "x", "y", "z"]
    assert all(r.tokens == _solo_vanilla(target, [1, 2], 4) for r in res.values())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt_ids": [1, -2]}, "prompt_ids"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"sampling": {"temperature": 0.5}}, "sampling"),
        ({"stop_token_ids": {-1}}, "stop_token_ids"),
    ],
)
def test_request_validation_names_the_field(kwargs, field):
    args = {"request_id": "r", "prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        Request(**args)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_sequences": 0}, "max_sequences"),
        ({"max_tokens_per_sequence": 1}, "max_tokens_per_sequence"),
        ({"max_tree_tokens": 0}, "max_tree_tokens"),
        ({"max_sequences": 8, "step_token_budget": 4}, "step_token_budget"),
        ({"goodput": "yes"}, "goodput"),
        ({"max_waiting": -1}, "max_waiting"),
    ],
)
def test_batch_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        BatchConfig(**kwargs)


def test_kv_memory_is_bounded_by_the_config():
    """The pool is allocated once at its configured size; trees are cut to the rows left in a slot,
    and a long run never grows it."""
    model = _model()
    target = tiny_target(model)
    cfg = BatchConfig(max_sequences=3, max_tokens_per_sequence=40, max_tree_tokens=16)
    engine = BatchEngine(target, _factory("oracle", target), cfg)
    reqs = [Request(f"r{i}", p, 40 - len(p), GREEDY, stop_at_eos=False) for i, p in enumerate(PROMPTS)]
    results, updates = _drive(engine, reqs, [0] * len(reqs))
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert engine.pool.nbytes() == 2 * model.config.num_hidden_layers * 3 * 40 * kv_heads * head_dim * 4
    for i, p in enumerate(PROMPTS):
        assert results[f"r{i}"].tokens == _solo_vanilla(target, p, 40 - len(p))
        for u in updates[f"r{i}"]:
            if u.step is not None:
                assert u.step.tree_size <= u.step.stats["tree_budget"] <= 16


# ---------------------------------------------------------------------------- goodput rule
def test_split_budget_gives_drafts_where_they_pay():
    from speculation.policy.goodput import BatchCostModel, split_budget

    # ~0.01 s per padded query position, whatever the batch size
    cheap = BatchCostModel({64: {1: {1: 1.0, 100: 2.0}, 4: {1: 1.0, 100: 2.0}}})
    good, bad = [0.9, 0.8, 0.7, 0.6, 0.5], [0.02, 0.01, 0.01]
    s = split_budget([good, bad], [5, 3], cheap)
    # the rows are padded to the largest tree: the poor drafter's 3 nodes ride in padding paid anyway
    assert s.drafts == [5, 3] and s.row_tokens == 6, s
    assert s.expected_tokens == pytest.approx(2 + sum(good) + sum(bad))
    assert s.forward_s == pytest.approx(cheap.cost(2, 6, 0))
    s = split_budget([good, bad], [5, 3], cheap, budget=5)
    assert s.drafts == [3, 0] and s.row_tokens == 4  # 2 roots + 3 drafts = the step budget, best q's first
    dear = BatchCostModel({64: {2: {1: 1.0, 2: 3.0}}})  # a draft position triples the step
    assert split_budget([good, bad], [5, 3], dear).drafts == [0, 0]  # batched vanilla


def test_split_budget_prices_the_padded_rows_not_the_real_tokens():
    """c(B, t, L) is paid for B rows of t positions: one sequence's deep tree makes every row deep."""
    from speculation.policy.goodput import BatchCostModel, split_budget

    linear = BatchCostModel({64: {4: {1: 0.4, 16: 6.4}}})  # 0.1 s per padded position at B = 4
    one_good = [[0.5] * 8, [], [], []]
    s = split_budget(one_good, [8, 0, 0, 0], linear)
    # 8 drafts add 4 expected tokens (8 -> 2x) but cost 36 padded positions instead of 4 (9x)
    assert s.drafts == [0, 0, 0, 0] and s.row_tokens == 1
    flat = BatchCostModel({64: {4: {1: 0.4, 16: 0.5}}})
    assert split_budget(one_good, [8, 0, 0, 0], flat).drafts == [8, 0, 0, 0]


def test_split_budget_prices_a_flat_batch_by_its_real_tokens():
    """A FLAT target (the lean forward: one packed pass, attention per row) pays for the tokens the
    step verifies, c(B, 1 + D/B, mean L): one sequence's deep tree no longer makes every row deep,
    and for each D the D best q's over all sequences are taken."""
    from speculation.config import BatchLayout
    from speculation.policy.goodput import BatchCostModel, split_budget

    grid = {64: {4: {1: 0.4, 16: 6.4}}}  # 0.1 s per query position at B = 4, as in the padded test
    one_good = [[0.5] * 8, [], [], []]
    padded, flat = BatchCostModel(grid), BatchCostModel(grid, layout=BatchLayout.FLAT)
    assert split_budget(one_good, [8, 0, 0, 0], padded).drafts == [0, 0, 0, 0]
    # flat, same grid: a draft node costs 0.1 s (a quarter of a row) for 0.5 tokens, 5 tok/s
    # against the step's 10: still none
    assert split_budget(one_good, [8, 0, 0, 0], flat).drafts == [0, 0, 0, 0]
    # a draft node at 0.01 s: the good sequence drafts alone (padded, it would pay 4 x 8 positions)
    cheap = BatchCostModel({64: {4: {1: 0.4, 16: 1.0}}}, layout=BatchLayout.FLAT)
    s = split_budget([[0.9] * 8, [0.05], [0.05], []], [8, 1, 1, 0], cheap)
    assert s.drafts == [8, 0, 0, 0] and s.tree_tokens == 12 and s.row_tokens == 9
    assert s.forward_s == pytest.approx(cheap.cost(4, 1 + 8 / 4, 0))
    # the budget takes the best q's across sequences first
    s = split_budget([[0.9, 0.2], [0.8, 0.7]], [2, 2], BatchCostModel({64: {2: {1: 1.0, 16: 1.1}}},
                                                                      layout=BatchLayout.FLAT), budget=5)
    assert s.drafts == [1, 2] and s.expected_tokens == pytest.approx(2 + 0.9 + 0.8 + 0.7)
    # contexts: the mean, not the longest row (each row attends over its own keys)
    by_l = BatchCostModel({64: {2: {1: 1.0, 16: 1.0}}, 512: {2: {1: 5.0, 16: 5.0}}}, layout=BatchLayout.FLAT)
    assert split_budget([[0.1], [0.1]], [1, 1], by_l, contexts=[64, 512]).forward_s == pytest.approx(
        by_l.cost(2, 1, 288))


def test_split_budget_prices_the_host_overhead_of_verifying_drafts():
    """A step that verifies drafts spends host time a vanilla step does not (acceptance over the
    trees, row moves, the drafters' observation): priced for every candidate with a draft node,
    it turns a marginal draft off; the engine measures it (HostOverhead)."""
    from speculation.config import BatchLayout
    from speculation.policy.goodput import BatchCostModel, HostOverhead, split_budget

    free = BatchCostModel({64: {8: {1: 0.060, 2: 0.062}}}, layout=BatchLayout.FLAT)  # drafts nearly free
    q = [[0.2]] + [[]] * 7  # one sequence, one node at 20%
    assert split_budget(q, [1] + [0] * 7, free).drafts[0] == 1  # 8.2 tokens for 60.25 ms beats 8 for 60
    s = split_budget(q, [1] + [0] * 7, free, verify_overhead_s=0.003)
    assert s.drafts == [0] * 8 and s.predicted_s == pytest.approx(0.060)  # 8.2 / 63.25 ms < 8 / 60 ms
    with pytest.raises(ValueError, match="verify_overhead_s must be >= 0"):
        split_budget(q, [1] + [0] * 7, free, verify_overhead_s=-1.0)
    h = HostOverhead(decay=0.5)
    assert h.extra_s == 0.0
    h.observe(True, 0.004)
    assert h.extra_s == pytest.approx(0.004)  # no vanilla step seen yet: all of it is charged to drafts
    h.observe(False, 0.001)
    assert h.extra_s == pytest.approx(0.003)
    h.observe(False, 0.009)
    assert h.extra_s == 0.0  # never negative


def test_gain_correction_scales_estimates_by_realised_over_expected_gains():
    """The gain side's correction: 1 until a drafted step is seen, then the ratio of the EMAs of
    realised and expected accepted draft nodes (clipped), applied as min(1, g q) in rank order."""
    from speculation.policy.goodput import GainCorrection

    g = GainCorrection(decay=0.5)
    assert g.factor == 1.0 and g.scale([0.9, 0.5]) == [0.9, 0.5]
    g.observe(expected=4.0, realised=1.0)
    assert g.factor == pytest.approx(0.25)
    g.observe(expected=4.0, realised=3.0)  # E = 4, R = 2
    assert g.factor == pytest.approx(0.5)
    assert g.scale([0.9, 0.5, 0.1]) == pytest.approx([0.45, 0.25, 0.05])
    g.observe(expected=0.0, realised=5.0)  # nothing expected: no evidence
    assert g.factor == pytest.approx(0.5)
    lucky = GainCorrection()
    lucky.observe(expected=1.0, realised=9.0)
    assert lucky.factor == GainCorrection.HIGH and lucky.scale([0.8]) == [1.0]  # clipped, q <= 1
    unlucky = GainCorrection()
    unlucky.observe(expected=5.0, realised=0.0)
    assert unlucky.factor == GainCorrection.LOW
    with pytest.raises(ValueError, match=r"GainCorrection decay must be in \[0, 1\)"):
        GainCorrection(decay=1.0)


def test_goodput_engine_learns_that_rejected_drafts_do_not_pay():
    """Random trees are almost never accepted: after the first drafted step the gain correction
    sits at its floor, so the rule never grants a tree again; it only probes (one draft node per
    sequence), and since no probe pays, the probes back off (the gaps between them double).
    Outputs equal solo vanilla.

    The grid prices a draft node at 1/63 of a one-token step (threshold g q > B delta / c1 =
    2 / 63 at B = 2), and it is dearer than the tiny model's steps by more than the cost
    correction's clip, so the measured host seconds (drafting, verify overhead) stay small beside
    it and the verdicts do not hang on how loaded the machine is. That also overprices the
    vanilla step, which is what once let probes that accepted nothing read as paid."""
    from speculation.policy.goodput import BatchCostModel, GainCorrection

    target = tiny_target(_model())
    grid = BatchCostModel({8: {1: {1: 0.05, 64: 0.10}, 4: {1: 0.05, 64: 0.10}}})
    engine = BatchEngine(target, _factory("random-tree", target),
                         BatchConfig(max_sequences=2, max_tokens_per_sequence=64, goodput=True), cost_model=grid)
    reqs = [Request(f"r{i}", p, 40, GREEDY, stop_at_eos=False) for i, p in enumerate(PROMPTS[1:3])]
    results, updates = _drive(engine, reqs, [0, 0])
    for i, p in enumerate(PROMPTS[1:3]):
        assert results[f"r{i}"].tokens == _solo_vanilla(target, p, 40)
    assert engine.budget.gain_correction.observed > 0
    assert engine.budget.gain_correction.factor == GainCorrection.LOW
    steps = [u.step for u in updates["r0"] if u.step is not None]
    assert steps[0].tree_size > 1 and steps[0].stats["goodput_gain_correction"] == 1.0  # drafts before it learns
    assert sum(s.accepted for s in steps) == 0
    later = steps[1:]
    assert all(s.stats["goodput_gain_correction"] == GainCorrection.LOW for s in later)
    probes = [i for i, s in enumerate(later) if s.stats["goodput_drafting_probe"]]
    assert all(s.tree_size == 1 for i, s in enumerate(later) if i not in probes)  # no tree but a probe's
    assert all(later[i].tree_size <= 1 + engine.budget.PROBE_DRAFTS for i in probes)
    assert len(probes) >= 3
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:])), f"probes that verified nothing must back off: at {probes}"


def test_split_budget_prices_the_context_and_the_correction():
    from speculation.policy.goodput import BatchCostModel, CostCorrection, split_budget

    # drafts are nearly free over 64 committed tokens, 16x dearer over 512 (attention over the context)
    cost = BatchCostModel({64: {1: {1: 1.0, 16: 1.15}}, 512: {1: {1: 1.0, 16: 16.0}}})
    q = [[0.6, 0.5, 0.4, 0.3]]
    assert split_budget(q, [4], cost, contexts=[64]).drafts == [4]
    assert split_budget(q, [4], cost, contexts=[500]).drafts == [0]
    assert cost.cost(1, 16, 1000) > cost.cost(1, 16, 512)  # linear beyond the longest context
    # the correction scales the forward; drafting seconds do not scale, so a dearer forward
    # makes the fixed drafting cost matter less
    assert split_budget(q, [4], cost, contexts=[64], correction=2.0).forward_s == pytest.approx(2 * cost.cost(1, 5, 64))
    k = CostCorrection(decay=0.5)
    assert k.factor == 1.0
    k.observe(1.0, 2.0)
    assert k.factor == 2.0  # the first observation replaces the prior
    k.observe(1.0, 100.0)
    assert k.factor == pytest.approx(0.5 * 2.0 + 0.5 * CostCorrection.HIGH)  # clipped at 4
    with pytest.raises(ValueError, match="decay must be in"):
        CostCorrection(decay=1.0)
    with pytest.raises(ValueError, match="positive"):
        BatchCostModel({64: {1: {1: 0.0}}})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["cheap", "dear"])
def test_goodput_engine_is_exact_and_reports_the_split(kind, layout):
    from speculation.config import BatchLayout
    from speculation.policy.goodput import BatchCostModel

    model = _model(layout)
    target = tiny_target(model)
    lay = BatchLayout(layout)
    cost = (BatchCostModel({8: {1: {1: 1.0, 64: 1.5}, 4: {1: 1.0, 64: 1.5}}}, layout=lay) if kind == "cheap"
            else BatchCostModel({8: {1: {1: 1.0, 2: 5.0}, 4: {1: 1.0, 2: 5.0}}}, layout=lay))
    cfg = BatchConfig(max_sequences=4, max_tokens_per_sequence=64, goodput=True, step_token_budget=24)
    engine = BatchEngine(target, _factory("oracle", target), cfg, cost_model=cost)
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, updates = _drive(engine, reqs, ARRIVE)
    for i, p in enumerate(PROMPTS):
        ref = _solo_vanilla(target, p, NEW[i])
        assert results[f"r{i}"].tokens == ref, f"request {i}: {_margin_report(model, p, ref, results[f'r{i}'].tokens)}"
    steps = [u.step for ups in updates.values() for u in ups if u.step is not None]
    assert all(s.stats["batch_tree_tokens"] <= 24 and s.tree_size == s.stats["tree_budget"] for s in steps)
    assert all("goodput_expected_tokens" in s.stats for s in steps)
    assert all(s.tree_size <= s.stats["goodput_row_tokens"] for s in steps)  # rows padded to the largest tree
    # the grid says ~1 s a step; the tiny model takes milliseconds: the correction learns it (clipped)
    assert engine.budget.cost_correction.observed > 0
    assert engine.budget.cost_correction.factor == pytest.approx(0.25)
    if kind == "dear":
        assert all(s.tree_size == 1 for s in steps)  # speculation turned off: it never pays
    else:
        assert sum(s.accepted for s in steps) > 0 and max(s.tree_size for s in steps) > 1


class _CountingRetrieval(RetrievalDrafter):
    """Retrieval that counts its proposals (it stays a SkippableDrafter)."""

    proposals = 0

    def propose(self, ctx):
        type(self).proposals += 1
        return super().propose(ctx)


def test_goodput_skips_drafting_when_no_draft_node_can_pay():
    """A curve where one draft position quintuples the step: the rule's pre-drafting check finds
    nothing can pay, so the retrieval drafters never propose (they skip), every step verifies roots
    alone, and every output equals solo vanilla."""
    from speculation.policy.goodput import BatchCostModel

    target = tiny_target(_model())
    dear = BatchCostModel({8: {1: {1: 1.0, 2: 5.0}, 4: {1: 1.0, 2: 5.0}}})
    _CountingRetrieval.proposals = 0
    cfg = BatchConfig(max_sequences=4, max_tokens_per_sequence=64, goodput=True)
    engine = BatchEngine(target, lambda: _CountingRetrieval(RetrievalConfig(budget=8, cost_aware=False), VOCAB), cfg,
                         cost_model=dear)
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, updates = _drive(engine, reqs, ARRIVE)
    for i, p in enumerate(PROMPTS):
        assert results[f"r{i}"].tokens == _solo_vanilla(target, p, NEW[i])
    steps = [u.step for ups in updates.values() for u in ups if u.step is not None]
    assert steps and all(s.stats["goodput_drafting_skipped"] == 1.0 and s.tree_size == 1 for s in steps)
    assert _CountingRetrieval.proposals == 0
    # the same engine on a cheap curve drafts
    cheap = BatchCostModel({8: {1: {1: 1.0, 64: 1.5}, 4: {1: 1.0, 64: 1.5}}})
    engine = BatchEngine(target, lambda: _CountingRetrieval(RetrievalConfig(budget=8, cost_aware=False), VOCAB), cfg,
                         cost_model=cheap)
    results, updates = _drive(engine, reqs, ARRIVE)
    assert _CountingRetrieval.proposals > 0
    assert all(results[f"r{i}"].tokens == _solo_vanilla(target, p, NEW[i]) for i, p in enumerate(PROMPTS))


class _SilentRetrieval(RetrievalDrafter):
    """A skippable drafter that, when called, proposes nothing (the root alone) and counts calls."""

    proposals = 0

    def propose(self, ctx):
        type(self).proposals += 1
        self.skip(ctx)
        return Proposal(DraftTree(ctx.root_token))


def test_goodput_skips_drafters_that_propose_nothing_and_probes_them_with_backoff():
    """On a curve where full trees would pay, a drafter that lately proposed nothing is not called
    every step: the pre-drafting check prices each sequence's expected tree (an EMA of what it
    proposed), skips, and re-measures with probes whose spacing doubles (2, 3, 5, 9, ... steps)
    while they verify nothing. Without the estimate it would be called on every step."""
    from speculation.policy.goodput import BatchCostModel

    target = tiny_target(_model())
    cheap = BatchCostModel({8: {1: {1: 1.0, 64: 1.5}, 4: {1: 1.0, 64: 1.5}}})
    cfg = BatchConfig(max_sequences=4, max_tokens_per_sequence=64, goodput=True)
    _SilentRetrieval.proposals = 0
    engine = BatchEngine(target, lambda: _SilentRetrieval(RetrievalConfig(budget=8, cost_aware=False), VOCAB), cfg,
                         cost_model=cheap)
    reqs = [Request(f"r{i}", p, 48, GREEDY, stop_at_eos=False) for i, p in enumerate(PROMPTS[:2])]
    results, updates = _drive(engine, reqs, [0, 0])
    for i, p in enumerate(PROMPTS[:2]):
        assert results[f"r{i}"].tokens == _solo_vanilla(target, p, 48)
    steps = [u.step for u in updates["r0"] if u.step is not None]
    drafted = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_skipped"] == 0.0]
    probes = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_probe"] == 1.0]
    assert drafted[0] == 0 and probes == drafted[1:], (drafted, probes)  # the first step drafts (no estimate yet)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps  # the backoff doubles
    assert _SilentRetrieval.proposals == 2 * len(drafted) < len(steps)  # both sequences, on drafted steps only
    assert engine.budget._probe_every > 1


class _SlowRetrieval(_CountingRetrieval):
    """Retrieval whose drafting costs 30 ms a call (a neural drafter's forwards on a CPU)."""

    proposals = 0

    def propose(self, ctx):
        time.sleep(0.03)
        return super().propose(ctx)


def test_goodput_charges_drafting_to_the_trees_and_steps_aside_when_it_costs_more_than_it_gains():
    """The pre-drafting check prices drafting into the splits that verify drafts, not into the
    vanilla split that would not draft. A drafter whose drafting costs several forwards (30 ms
    against a 5 ms step) drafts on the first step, then only on probes whose spacing grows, while
    the same engine with free drafting drafts on most steps; outputs equal solo vanilla."""
    from speculation.policy.goodput import BatchCostModel

    target = tiny_target(_model())
    fast = BatchCostModel({8: {1: {1: 0.005, 64: 0.0075}, 4: {1: 0.005, 64: 0.0075}}})
    cfg = BatchConfig(max_sequences=4, max_tokens_per_sequence=64, goodput=True)
    reqs = [Request(f"r{i}", p, 40, GREEDY, stop_at_eos=False) for i, p in enumerate(PROMPTS[1:3])]
    drafted_share = {}
    for drafter in (_SlowRetrieval, _CountingRetrieval):
        drafter.proposals = 0
        engine = BatchEngine(target, lambda d=drafter: d(RetrievalConfig(budget=8, cost_aware=False), VOCAB), cfg,
                             cost_model=fast)
        results, updates = _drive(engine, reqs, [0, 0])
        for i, p in enumerate(PROMPTS[1:3]):
            assert results[f"r{i}"].tokens == _solo_vanilla(target, p, 40)
        steps = [u.step for u in updates["r0"] if u.step is not None]
        drafted = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_skipped"] == 0.0]
        drafted_share[drafter.__name__] = len(drafted) / len(steps)
        if drafter is _SlowRetrieval:
            probes = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_probe"] == 1.0]
            assert drafted[0] == 0 and probes == drafted[1:], (drafted, probes)
            gaps = [b - a for a, b in zip(drafted, drafted[1:])]
            assert gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps  # the backoff doubles
    # the cheap drafter drafts in most steps (fewer than every one: the gain correction scales its
    # estimates by the tokens drafted steps really gained), the slow one only in its probes
    assert drafted_share["_SlowRetrieval"] < 0.3 < 0.5 < drafted_share["_CountingRetrieval"], drafted_share


def test_goodput_opens_ranks_by_doubling_and_new_sequences_start_from_the_pool():
    """A fresh engine knows nothing about its drafter: its first step verifies one draft per tree
    (not every rank at the uninformed 1/2); ranks open 1, 3, 7, ... as they are verified, and a
    request that joins later starts from the pooled estimate instead of from scratch."""
    from speculation.policy.goodput import BatchCostModel, exploration_cap

    assert [exploration_cap(e) for e in (0, 1, 3, 7)] == [1, 3, 7, 15]
    target = tiny_target(_model())
    cheap = BatchCostModel({8: {1: {1: 1.0, 64: 1.5}, 4: {1: 1.0, 64: 1.5}}})
    cfg = BatchConfig(max_sequences=4, max_tokens_per_sequence=64, goodput=True, max_tree_tokens=16)
    engine = BatchEngine(target, _factory("oracle", target), cfg, cost_model=cheap)
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, updates = _drive(engine, reqs, ARRIVE)
    for i, p in enumerate(PROMPTS):
        assert results[f"r{i}"].tokens == _solo_vanilla(target, p, NEW[i])
    first = [next(u.step for u in updates[f"r{i}"] if u.step is not None) for i in (0, 1)]  # arrived at step 0
    assert all(s.tree_size <= 2 for s in first), [s.tree_size for s in first]
    r0 = [u.step.tree_size for u in updates["r0"] if u.step is not None]
    assert max(r0) > 2, r0  # ranks opened as they were verified
    assert engine.budget.pooled_ranks.explored >= 7
    late = next(u.step for u in updates["r5"] if u.step is not None)  # joined at step 6
    assert late.tree_size > 2, late.tree_size


def test_measure_batch_cost_on_the_target():
    from speculation.policy.goodput import measure_batch_cost

    target = tiny_target(_model())
    cost = measure_batch_cost(target, [1, 2], row_tokens=(1, 4), contexts=(8, 16), repeats=1)
    assert set(cost.grid) == {8, 16} and set(cost.grid[8]) == {1, 2} and set(cost.grid[16][2]) == {1, 4}
    assert cost.cost(2, 4, 8) > 0 and cost.cost(3, 100, 1000) > 0
    with pytest.raises(ValueError, match="at least one context"):
        measure_batch_cost(target, [1], contexts=())


# ---------------------------------------------------------------------------- real weights
def test_smollm2_batched_equals_solo_vanilla(smol_fp32):
    """SmolLM2-135M fp32: three chat prompts batched (vanilla, then retrieval) equal their solo
    vanilla output for 24 tokens; a mismatch shows the solo logit margin where it flipped."""
    from speculation import assets

    tok = smol_fp32.tokenizer
    texts = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime.",
             "Translate 'good morning, my friend' into French."]
    prompts = [assets.encode_turn(tok, [], t) for t in texts]
    refs = [_solo_vanilla(smol_fp32, p, 24, stop_at_eos=True) for p in prompts]
    for name, factory in [("vanilla", None),
                          ("retrieval", lambda: RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False),
                                                                 smol_fp32.vocab_size))]:
        engine = BatchEngine(smol_fp32, factory, BatchConfig(max_sequences=3, max_tokens_per_sequence=256))
        res = engine.run([Request(f"r{i}", p, 24, GREEDY) for i, p in enumerate(prompts)])
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            got = res[f"r{i}"].tokens
            assert got == ref, f"{name}, prompt {i}: {_margin_report(smol_fp32.model, p, ref, got)}"


def test_realised_payoff_compares_drafted_and_plain_steps_at_the_grids_vanilla_rate():
    """rho = (tokens / seconds) / (B / c(B, 1, L)) per step, EMAs per kind; LOSES only once both
    kinds were seen min_steps times and drafted steps realised less."""
    from speculation.policy.goodput import RealisedPayoff

    p = RealisedPayoff(decay=0.5, min_steps=2)
    p.observe(True, tokens=10, seconds=0.1, vanilla_s=0.05, batch=8)  # 100 tok/s against 160: rho 0.625
    p.observe(True, tokens=10, seconds=0.1, vanilla_s=0.05, batch=8)
    assert p.rate[True] == pytest.approx(0.625) and not p.loses  # no plain step yet: nothing to compare
    p.observe(False, tokens=8, seconds=0.05, vanilla_s=0.05, batch=8)  # as the grid says: rho 1
    assert not p.loses  # plain seen once, min_steps 2
    p.observe(False, tokens=4, seconds=0.025, vanilla_s=0.025, batch=4)  # another batch size, same rho
    assert p.rate[False] == pytest.approx(1.0) and p.loses
    p.observe(True, tokens=30, seconds=0.1, vanilla_s=0.05, batch=8)  # rho 1.875: EMA 1.25
    assert p.rate[True] == pytest.approx(1.25) and not p.loses
    p.observe(True, tokens=5, seconds=0.0, vanilla_s=0.05, batch=8)  # no time measured: no evidence
    assert p.steps[True] == 3
    with pytest.raises(ValueError, match=r"RealisedPayoff decay must be in \[0, 1\)"):
        RealisedPayoff(decay=1.0)
    with pytest.raises(ValueError, match="RealisedPayoff min_steps must be >= 1"):
        RealisedPayoff(min_steps=0)


class _HalfSilentLookup:
    """Proposes the true greedy continuation (looked up in the solo reference: drafting costs
    nothing) as a chain of ``depth`` on every other call, the root alone on the others; can sit out."""

    name = "half-silent-lookup"
    needs_aux = False
    target_topk = 0

    def __init__(self, full_texts: list[list[int]], depth: int = 4):
        self.texts, self.depth, self.calls = full_texts, depth, 0

    def begin(self, ctx, prompt_aux):
        pass

    def propose(self, ctx):
        self.calls += 1
        tree = DraftTree(ctx.root_token)
        n = len(ctx.tokens)
        text = next((t for t in self.texts if t[:n] == ctx.tokens), None)
        if self.calls % 2 and text is not None and len(text) > n:
            chain = text[n: n + self.depth]
            tree.add_chain(0, chain, [-(i + 1) * 0.5 for i in range(len(chain))], NodeSource.DRAFTER)
        return Proposal(tree)

    def skip(self, ctx):
        pass

    def observe(self, ctx, outcome):
        pass


class _DearTrees:
    """The tiny target, except that a verify with any draft node sleeps ``extra_s`` more: drafted
    forwards far dearer than the grid the engine was given says."""

    def __init__(self, target, extra_s: float):
        self._target, self.extra_s = target, extra_s

    def __getattr__(self, name):
        return getattr(self._target, name)

    def verify_batch(self, states, trees, **kw):
        if any(len(t) > 1 for t in trees):
            time.sleep(self.extra_s)
        return self._target.verify_batch(states, trees, **kw)


def test_goodput_vetoes_drafting_that_realises_less_than_plain_steps_and_retests_with_backoff():
    """The grid says draft nodes are almost free, and the oracle's trees are accepted, so the rule
    keeps drafting; but every drafted forward really costs 60 ms more. Once drafted steps have
    realised fewer tokens per second than plain ones, the engine vetoes the rule's drafting
    (sits out) and re-tests it at doubling spacing; the same engine without the delay keeps
    drafting. Outputs equal solo vanilla either way."""
    from speculation.policy.goodput import BatchCostModel

    target = tiny_target(_model())
    flat = BatchCostModel({8: {1: {1: 0.004, 64: 0.0042}, 4: {1: 0.004, 64: 0.0042}}})  # trees look free
    cfg = BatchConfig(max_sequences=2, max_tokens_per_sequence=96, goodput=True, fold_prefills=False)
    reqs = [Request(f"r{i}", p, 60, GREEDY, stop_at_eos=False) for i, p in enumerate(PROMPTS[1:3])]
    texts = [p + _solo_vanilla(target, p, 61) for p in PROMPTS[1:3]]
    counts = {}
    for extra, veto in ((0.06, True), (0.0, True), (0.06, False)):
        engine = BatchEngine(_DearTrees(target, extra), lambda: _HalfSilentLookup(texts),
                             dataclasses.replace(cfg, payoff_veto=veto), cost_model=flat)
        results, updates = _drive(engine, reqs, [0, 0])
        for i, p in enumerate(PROMPTS[1:3]):
            assert results[f"r{i}"].tokens == _solo_vanilla(target, p, 60)
        steps = [u.step for u in updates["r0"] if u.step is not None]
        vetoed = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_vetoed"] == 1.0]
        retests = [i for i, s in enumerate(steps) if s.stats["goodput_drafting_retest"] == 1.0]
        assert all(steps[i].tree_size == 1 for i in vetoed)
        counts[extra, veto] = (len(vetoed), retests, engine)
    vetoed, retests, engine = counts[0.06, True]
    assert engine.budget.payoff.loses and vetoed > 10, (vetoed, engine.budget.payoff.rate)
    assert len(retests) >= 2
    gaps = [b - a for a, b in zip(retests, retests[1:])]
    assert gaps == sorted(gaps), gaps  # re-tests back off while drafting keeps losing
    assert engine.budget._retest_every > 1
    assert counts[0.0, True][0] == 0 and not counts[0.0, True][2].budget.payoff.loses  # nothing to veto when drafting pays
    # payoff_veto false (the A/B baseline): the same losing drafts are measured, never vetoed
    assert counts[0.06, False][0] == 0 and not counts[0.06, False][1] and counts[0.06, False][2].budget.payoff.loses
    with pytest.raises(ConfigError, match="batch.payoff_veto must be true or false"):
        BatchConfig(payoff_veto="yes")


def test_bench_reports_the_goodput_verdict_shares():
    """bench --concurrency --goodput: the share of sequence steps per verdict before drafting, read
    from the step records (VETO steps also carry goodput_drafting_skipped = 1)."""
    from types import SimpleNamespace

    from speculation.bench.runner import _goodput_verdicts

    def rec(skipped=0.0, probe=0.0, vetoed=0.0, retest=0.0):
        return SimpleNamespace(stats={"goodput_drafting_skipped": skipped, "goodput_drafting_probe": probe,
                                      "goodput_drafting_vetoed": vetoed, "goodput_drafting_retest": retest})

    steps = [rec(), rec(), rec(skipped=1.0), rec(skipped=1.0, vetoed=1.0), rec(probe=1.0), rec(retest=1.0),
             rec(skipped=1.0, vetoed=1.0), rec()]
    assert _goodput_verdicts(steps) == {"draft": 3 / 8, "probe": 1 / 8, "retest": 1 / 8, "skip": 1 / 8, "veto": 2 / 8}
    assert _goodput_verdicts([SimpleNamespace(stats={})]) is None  # no goodput rule, no shares
