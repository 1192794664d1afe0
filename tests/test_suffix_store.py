"""The cross-request suffix store: matching, frequency scores, adaptive depth, the memory bound and
eviction, thread safety, and losslessness when it is shared by a solo loop and a batched engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from speculation.config import ConfigError, EngineConfig, RetrievalConfig, SamplingConfig
from speculation.drafters import drafter_factory, resolve_methods
from speculation.drafters.base import FinishingDrafter
from speculation.drafters.retrieval import RetrievalDrafter, new_store
from speculation.drafters.suffix_store import SuffixStore
from speculation.engine.batch import BatchEngine, Request
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.config import BatchConfig
from tests.helpers import shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64


def test_lookup_takes_the_longest_match_and_counts_its_continuations():
    store = SuffixStore(max_tokens=1000, key_len=2, depth_factor=1.0)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([9, 2, 3, 4, 7, 7, 7])
    store.add([8, 2, 3, 4, 7, 1, 1])
    # "2 3 4" occurred three times: followed by 5 once, by 7 twice.
    hit = store.lookup([0, 2, 3, 4], max_depth=8)
    assert hit is not None and hit.length == 3
    assert hit.trie.top(0) == [7, 5]
    seven = hit.trie.child(0, 7)
    assert hit.trie.count[seven] == 2 and hit.trie.total[0] == 3
    assert sorted(hit.docs) == [0, 1, 2]
    # A longer match narrows to the one document that has it, and the depth grows with it.
    hit = store.lookup([9, 2, 3, 4], max_depth=8)
    assert hit.length == 4 and hit.docs == (1,) and hit.trie.top(0) == [7]
    node, depth = 0, 0
    while hit.trie.top(node):
        node, depth = hit.trie.child(node, hit.trie.top(node)[0]), depth + 1
    assert depth == 3  # the document's whole continuation [7, 7, 7]: ceil(1.0 * 4) = 4 > 3 left
    # No occurrence of the context's last key_len tokens: nothing.
    assert store.lookup([5, 5], max_depth=8) is None
    assert store.lookup([4], max_depth=8) is None  # shorter than key_len


def test_depth_adapts_to_the_match_length():
    store = SuffixStore(max_tokens=1000, key_len=2, depth_factor=1.5)
    assert [store.depth_for(n, max_depth=6) for n in (2, 3, 4, 5)] == [3, 5, 6, 6]
    store.add(list(range(40)))
    hit = store.lookup([0, 1], max_depth=30)  # matched 2 tokens: 3 continuation tokens
    node, path = 0, []
    while hit.trie.top(node):
        tok = hit.trie.top(node)[0]
        path.append(tok)
        node = hit.trie.child(node, tok)
    assert path == [2, 3, 4]
    hit = store.lookup([0, 1, 2, 3, 4, 5, 6, 7], max_depth=30)  # 8 matched: 12 tokens
    assert hit.length == 8 and hit.trie.total[0] == 1 and len(hit.trie) == 13


def test_memory_stays_bounded_and_frequent_documents_outlive_newer_ones():
    rng = np.random.default_rng(0)
    store = SuffixStore(max_tokens=2_000, key_len=3)
    useful = store.add(list(range(100, 150)))
    for i in range(200):
        doc = rng.integers(0, 30_000, size=int(rng.integers(20, 120))).tolist()
        store.add(doc)
        assert len(store) <= 2_000
        if i % 5 == 0:  # the useful document keeps supplying accepted drafts
            hit = store.lookup([100, 101, 102], max_depth=4)
            assert hit is not None and useful in hit.docs
            store.credit(hit.docs)
    stats = store.stats()
    assert stats["evicted_docs"] > 150 and stats["tokens"] <= 2_000
    assert store.lookup([100, 101, 102], max_depth=4) is not None  # survived 150+ evictions
    # The index holds exactly the live documents' entries once swept (no leak of evicted positions).
    store._sweep()
    live = sum(max(0, len(d.tokens) - store.key_len) for d in store._docs.values())
    assert store.stats()["entries"] == live == sum(len(a) for a in store._keys.values())
    # An uncredited document fades: after enough newer documents it is gone.
    stale = store.add([7, 7, 1, 2, 3, 9, 9, 9])
    for _ in range(300):
        store.add(rng.integers(0, 30_000, size=60).tolist())
    assert stale not in store._docs


def test_store_is_safe_under_concurrent_updates_and_lookups():
    store = SuffixStore(max_tokens=5_000, key_len=2)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                store.add(rng.integers(0, 50, size=30).tolist())
        except BaseException as exc:  # reported below: a thread's exception would be lost
            errors.append(exc)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2_000):
                hit = store.lookup(rng.integers(0, 50, size=6).tolist(), max_depth=4)
                if hit is not None:
                    store.credit(hit.docs)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = store.stats()
    assert stats["tokens"] <= 5_000 and stats["docs"] + stats["evicted_docs"] == 600


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, r"suffix_store\.max_tokens must be an integer in \[1, 1000000000\], got 0"),
        ({"max_tokens": 10, "key_len": 0}, r"suffix_store\.key_len must be an integer in \[1, 16\]"),
        ({"max_tokens": 10, "key_len": 4, "max_match_len": 3}, r"suffix_store\.max_match_len .* \[4, 256\]"),
        ({"max_tokens": 10, "depth_factor": 0}, r"suffix_store\.depth_factor must be in \(0, 64\]"),
    ],
)
def test_store_rejects_bad_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SuffixStore(**kwargs)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("store_tokens", -1, r"retrieval\.store_tokens"),
        ("store_key_len", 17, r"retrieval\.store_key_len"),
        ("store_depth_factor", 0.0, r"retrieval\.store_depth_factor must be in \(0.0, 64.0\]"),
    ],
)
def test_retrieval_config_validates_the_store_fields(field, value, message):
    with pytest.raises(ConfigError, match=message):
        RetrievalConfig(**{field: value})


def _cfg(n: int) -> EngineConfig:
    return EngineConfig(max_new_tokens=n, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0))


def test_solo_loop_feeds_the_store_and_stays_lossless():
    """The second time a prompt arrives, the store holds the first answer: the drafts come from it
    (more tokens per step than the first time) and the output is still vanilla's."""
    target = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))
    drafter = RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False, store_tokens=10_000,
                                               transition_topk=0), VOCAB)
    assert isinstance(drafter, FinishingDrafter) and drafter.store is not None
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50], [3, 1, 4, 1, 5, 9, 2, 6]]
    runs = []
    for p in prompts:
        ref = generate_vanilla(target, p, _cfg(40)).tokens
        res = generate_speculative(target, drafter, p, _cfg(40))
        assert res.tokens == ref
        runs.append(res)
    assert drafter.store.stats()["docs"] == 3
    tau = [len(r.tokens) / len(r.steps) for r in runs]
    assert tau[2] > 2.0 * tau[0], tau
    assert sum(s.stats.get("store_nodes", 0) for s in runs[2].steps) > 0
    assert drafter.report()["suffix_store"]["hits"] > 0


def test_batched_engine_shares_one_store_and_every_output_is_vanilla():
    target = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))
    spec = resolve_methods(["r"], {"r": {"type": "retrieval", "budget": 8, "cost_aware": False,
                                         "store_tokens": 10_000}})[0]
    factory = drafter_factory(spec, target)
    a, b = factory(), factory()
    assert a.store is b.store is not None  # one store per factory (engine)
    assert factory is not drafter_factory(spec, target)
    assert drafter_factory(spec, target)().store is not a.store  # ...and a new factory gets its own
    base = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 12, [10, 20, 10, 20, 10], [63, 0, 17, 42, 42, 9]]
    prompts = base + base  # repeats arrive while their first copies may still run
    engine = BatchEngine(target, factory, BatchConfig(max_sequences=3, max_tokens_per_sequence=64))
    requests = [Request(f"r{i}", p, 30, SamplingConfig(temperature=0.0)) for i, p in enumerate(prompts)]
    out = engine.run(requests)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].tokens == generate_vanilla(target, p, _cfg(30)).tokens, i
    stats = a.store.stats()
    assert stats["docs"] == len(prompts)  # every finished request was stored once
    assert stats["hits"] > 0  # ...and the repeats drafted from their first copies


def test_retrieval_store_builtin_and_no_store_by_default():
    spec = resolve_methods(["retrieval_store"])[0]
    assert spec.config.store_tokens == 1_000_000
    assert new_store(RetrievalConfig()) is None
    assert RetrievalDrafter(RetrievalConfig(cost_aware=False), VOCAB).report() == {}
