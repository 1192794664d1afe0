"""Prompt KV reuse across requests (speculation/model/prefix_cache.py): a reused prefill is the
same bits as a fresh one, only whole chunks are reused, the cache stays bounded, and bad settings
are refused by name."""

from __future__ import annotations

import pytest
import torch

from speculation.config import ConfigError, EngineConfig, SamplingConfig
from speculation.drafters.retrieval import RetrievalConfig, RetrievalDrafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCachedTarget
from tests.helpers import shared_tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
C = 16  # the chunk grid of these tests


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _cached(max_tokens: int = 4096):
    target = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=7))
    return target, PrefixCachedTarget(target, PrefixCache(PrefixCacheConfig(chunk_tokens=C, max_tokens=max_tokens)))


def _rows(state) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = state.cache
    n = cache.get_seq_length()
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]


@pytest.mark.parametrize("need_aux", [False, True])
def test_a_reused_prefill_is_the_same_bits_as_a_fresh_one(need_aux):
    target, cached = _cached()
    turn1 = _ids(45, seed=1)
    prompt = turn1 + _ids(60, seed=2)  # the next request re-sends the first and extends it
    cached.prefill(turn1, need_aux=need_aux, chunk_tokens=C)
    state_c, logits_c, aux_c = cached.prefill(prompt, need_aux=need_aux, chunk_tokens=C)
    assert cached.cache.stats.reused_tokens == 32  # two whole chunks of the 45-token turn
    state_f, logits_f, aux_f = target.prefill(prompt, need_aux=need_aux, chunk_tokens=C)
    assert torch.equal(logits_c, logits_f)
    assert state_c.cache.get_seq_length() == state_f.cache.get_seq_length() == len(prompt)
    for (kc, vc), (kf, vf) in zip(_rows(state_c), _rows(state_f), strict=True):
        assert torch.equal(kc, kf) and torch.equal(vc, vf)
    if need_aux:
        assert aux_c.shape == aux_f.shape == (len(prompt), aux_f.shape[1]) and torch.equal(aux_c, aux_f)
    else:
        assert aux_c is None and aux_f is None
    for tok in (5, 9, 11):  # and the decodes after it too
        assert torch.equal(cached.decode(state_c, tok), target.decode(state_f, tok))


def test_generation_through_the_cache_is_vanilla_token_for_token():
    """A conversation served through the cache (vanilla and speculative) gives the uncached output."""
    target, cached = _cached()
    greedy = EngineConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0),
                          prefill_chunk_tokens=C)
    history: list[int] = []
    for turn in range(3):
        history = history + _ids(30, seed=10 + turn)
        ref = generate_vanilla(target, history, greedy).tokens
        assert generate_vanilla(cached, history, greedy).tokens == ref
        drafter = RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB)
        assert generate_speculative(cached, drafter, history, greedy).tokens == ref
        history = history + ref
    stats = cached.cache.stats.as_dict()
    assert stats["lookups"] == 6 and stats["hits"] == 5  # every turn after the first vanilla one
    assert 0.0 < stats["reused_share"] < 1.0


def test_only_whole_chunks_are_reused_and_the_last_token_is_always_computed():
    _, cached = _cached()
    cache = cached.cache
    two = _ids(2 * C, seed=3)
    cached.prefill(two, chunk_tokens=C)
    assert cache.rows == 2 * C
    assert cache.lookup(two).rows == C  # the same prompt again: its last token must run for its logits
    assert cache.lookup(two + [1]).rows == 2 * C
    edited = two[: C + 3] + [(two[C + 3] + 1) % VOCAB] + two[C + 4:] + [1]
    assert cache.lookup(edited).rows == C  # an edit inside chunk 1 keeps chunk 0 only
    assert cache.lookup([(two[0] + 1) % VOCAB] + two[1:] + [1]) is None  # a different first token
    assert cache.lookup(two[: C - 1]) is None  # shorter than a chunk
    assert cache.lookup(two + [1], need_aux=True) is None  # stored without the drafters' features
    cached.prefill(two[:10], chunk_tokens=C)  # under one chunk: nothing to store
    assert cache.rows == 2 * C


def test_superseded_entries_are_dropped_and_lru_eviction_keeps_the_bound():
    _, cached = _cached(max_tokens=5 * C)
    cache = cached.cache
    a = _ids(2 * C + 5, seed=4)
    cached.prefill(a, chunk_tokens=C)
    cached.prefill(a + _ids(C, seed=5), chunk_tokens=C)  # extends a: its entry replaces a's
    assert cache.rows == 3 * C and len(cache._entries) == 1
    b = _ids(2 * C + 1, seed=6)
    cached.prefill(b, chunk_tokens=C)
    assert cache.rows == 5 * C and cache.stats.evictions == 0
    assert cache.lookup(a + [1]).rows == 2 * C  # touches a: b is now the least recently used
    cached.prefill(_ids(C + 1, seed=8), chunk_tokens=C)
    assert cache.stats.evictions == 1 and cache.rows == 4 * C
    assert cache.lookup(b + [1]) is None and cache.lookup(a + [1]) is not None
    per_row = cache.nbytes() / cache.rows
    layers = cached.target.model.config.num_hidden_layers
    kv = cached.target.model.config.num_key_value_heads * (32 // 4)  # H_kv * head_dim
    assert per_row == 2 * layers * kv * 4  # keys + values, fp32, nothing more
    cache.clear()
    assert cache.rows == 0 and cache.nbytes() == 0
    cached.prefill(_ids(20 * C, seed=9), chunk_tokens=C)  # longer than the whole cache: not stored
    assert cache.rows == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_tokens": 0}, r"prefix_cache\.chunk_tokens must be in \[1, 1048576\], got 0"),
        ({"max_tokens": 0}, r"prefix_cache\.max_tokens must be in \[1, 16777216\], got 0"),
        ({"max_tokens": 2.5}, r"prefix_cache\.max_tokens must be an integer, got 2\.5"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PrefixCacheConfig(**kwargs)


def test_a_prefill_off_the_grid_is_refused():
    target, cached = _cached()
    with pytest.raises(ConfigError, match="16-token prefill grid: prefill_chunk_tokens must be 16, got 32"):
        cached.prefill(_ids(40, seed=1), chunk_tokens=32)
    with pytest.raises(ConfigError, match="must be 16, got None"):
        cached.prefill(_ids(40, seed=1))
    assert cached.cache.stats.lookups == 0  # refused before it touched the cache
    ids = _ids(40, seed=1)
    cached.prefill(ids, chunk_tokens=C)
    hit = cached.cache.lookup(ids + [1])
    with pytest.raises(ValueError, match="needs a chunk grid that divides it"):
        target.prefill(ids + [1], chunk_tokens=24, reuse=hit)
    with pytest.raises(ValueError, match="without auxiliary features"):
        target.prefill(ids + [1], need_aux=True, chunk_tokens=C, reuse=hit)


def test_the_ray_backend_refuses_a_reuse_it_cannot_load():
    """RayTargetBackend takes the protocol's ``reuse`` but its shards keep no rows across
    sequences: a hit is refused by name before any shard is called (the placeholder shard here
    would fail on any call)."""
    from cluster.backend import RayTargetBackend
    from workers.shard import TargetInfo

    target, cached = _cached()
    ids = _ids(40, seed=3)
    cached.prefill(ids, chunk_tokens=C)
    hit = cached.cache.lookup(ids + [1])
    assert hit is not None and hit.rows == 32
    info = TargetInfo(num_layers=4, hidden_size=32, vocab_size=VOCAB, max_context=256, sliding_window=None,
                      eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="prefix reuse runs on the in-process target only"):
        RayTargetBackend([object()], info).prefill(ids + [1], chunk_tokens=C, reuse=hit)


def test_sliding_window_models_are_refused():
    """Gemma 3's sliding-window layers drop rows a reused prefix needs: refused, naming the model."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from speculation.model.target import TargetModel

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    target = TargetModel(Gemma3ForCausalLM(config).eval(), None)
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM has .*Sliding.*turn the prefix cache off"):
        PrefixCachedTarget(target, PrefixCache())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefix-cache"], "--prefix-cache needs --prefill-chunk-tokens"),
        (["--prefix-cache", "--prefill-chunk-tokens", "64", "--ray"],
         "--prefix-cache runs on the in-process target only"),
        (["--prefix-cache", "--prefill-chunk-tokens", "64", "--prefix-cache-tokens", "0"],
         "--prefix-cache-tokens must be in [1, 16777216], got 0"),
    ],
)
def test_cli_refuses_a_prefix_cache_it_cannot_run(tmp_path, monkeypatch, capsys, argv, message):
    from graftblock import cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load_target", no_load)
    rc = cli.main(["bench", "--no-mlflow", "--json", str(tmp_path / "x.json"), "--dataset", "mixed", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and message in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_bench_with_the_prefix_cache_is_lossless_and_reuses_the_earlier_turn(smol_fp32):
    from speculation import assets
    from speculation.bench.runner import run_bench
    from speculation.config import BenchConfig

    questions = assets.load_questions("code_edit", limit_per_category=2)  # two turns: the edit re-sends the code
    cfg = BenchConfig(methods=("vanilla", "retrieval"), dtype="float32", dataset="code_edit",
                      limit_per_category=2, max_new_tokens=24, warmup=1)
    cache = PrefixCacheConfig(chunk_tokens=64)
    with pytest.raises(ConfigError, match="prefill_chunk_tokens must be 64, got 128"):
        run_bench(cfg, smol_fp32, questions, {}, prefill_chunk_tokens=128, prefix_cache=cache)
    result = run_bench(cfg, smol_fp32, questions, {"retrieval": {"budget": 16, "cost_aware": False}},
                       prefill_chunk_tokens=64, prefix_cache=cache)
    assert result["prefix_cache"] == {"chunk_tokens": 64, "max_tokens": 32768}
    for name in ("vanilla", "retrieval"):
        stats = result["methods"][name]["prefix_cache"]
        assert stats["lookups"] == 4  # 2 questions x 2 turns, the warm-up's cleared
        assert stats["hits"] == 2 and stats["reused_tokens"] >= 2 * 64, stats  # each second turn
    assert result["methods"]["retrieval"]["lossless"] is True


def _eagle3_factory(target):
    from speculation.config import Eagle3Config
    from speculation.drafters.eagle3 import build_eagle3_drafter

    return lambda: build_eagle3_drafter(
        Eagle3Config(checkpoint="random", draft_vocab_size=VOCAB, top_k=3, depth=3, total_tokens=12), target)


@pytest.mark.parametrize("drafter", ["vanilla", "retrieval", "eagle3"])
def test_the_batched_engine_shares_one_cache_and_every_output_is_vanilla(drafter):
    """Two waves of requests through one engine: the second re-sends the first's prompts extended
    (an agent's next call), so its prefills start from the cached rows, drafter features included
    (EAGLE-3), and every output equals the solo vanilla run with the same chunked prefill."""
    from speculation.config import BatchConfig
    from speculation.engine.batch import BatchEngine, Request

    target = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42, lean=True))
    factories = {"vanilla": None,
                 "retrieval": lambda: RetrievalDrafter(RetrievalConfig(budget=8, cost_aware=False), VOCAB),
                 "eagle3": _eagle3_factory(target)}
    cache = PrefixCache(PrefixCacheConfig(chunk_tokens=4, max_tokens=4096))
    engine = BatchEngine(target, factories[drafter],
                         BatchConfig(max_sequences=3, max_tokens_per_sequence=128, prefill_chunk_tokens=4),
                         prefix_cache=cache)
    greedy = EngineConfig(max_new_tokens=16, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0),
                          prefill_chunk_tokens=4)
    first = [_ids(18 + 3 * i, seed=20 + i) for i in range(4)]
    second = [p + _ids(9, seed=40 + i) for i, p in enumerate(first)]
    for wave, prompts in enumerate((first, second)):
        reqs = [Request(f"w{wave}r{i}", p, 16, SamplingConfig(temperature=0.0), stop_at_eos=False)
                for i, p in enumerate(prompts)]
        out = engine.run(reqs)
        for r, p in zip(reqs, prompts):
            assert out[r.request_id].tokens == generate_vanilla(target, p, greedy).tokens, r.request_id
    stats = cache.stats.as_dict()
    assert stats["lookups"] == 8 and stats["hits"] >= 4, stats  # at least every second-wave request
    assert stats["reused_tokens"] >= sum(len(p) // 4 * 4 for p in first), stats
    assert engine.pool.free == 3 and engine.num_prefilling == 0


def test_the_batched_engine_refuses_a_prefix_cache_it_cannot_apply():
    from speculation.config import BatchConfig
    from speculation.engine.batch import BatchEngine

    flat = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42, lean=True))
    padded = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))
    cache = PrefixCache(PrefixCacheConfig(chunk_tokens=4))
    with pytest.raises(ConfigError, match="needs chunked prefills folded into the step"):
        BatchEngine(flat, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64), prefix_cache=cache)
    with pytest.raises(ConfigError, match="needs chunked prefills folded into the step"):
        BatchEngine(padded, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64, prefill_chunk_tokens=4),
                    prefix_cache=cache)  # a PADDED target cannot fold prompts into its step
    with pytest.raises(ConfigError, match="batch.prefill_chunk_tokens must be 4, got 8"):
        BatchEngine(flat, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=64, prefill_chunk_tokens=8),
                    prefix_cache=cache)


@pytest.mark.slow
def test_bench_concurrency_with_the_prefix_cache_reuses_an_episode_and_stays_lossless(smol_fp32):
    """bench --concurrency --prefix-cache on real weights: one agent episode's requests re-send
    its growing transcript, so later ones hit the engine's cache, and every first-turn output
    still equals the solo vanilla decode with the same chunked prefill."""
    from speculation import assets
    from speculation.bench.runner import run_concurrency
    from speculation.config import BenchConfig

    questions = assets.load_questions("agentic", limit_per_category=4)
    cfg = BenchConfig(methods=("vanilla", "retrieval"), dtype="float32", dataset="agentic",
                      limit_per_category=4, max_new_tokens=16, warmup=0)
    cache = PrefixCacheConfig(chunk_tokens=64)
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        run_concurrency(cfg, smol_fp32, questions, [2], prefill_chunk_tokens=32, prefix_cache=cache)
    result = run_concurrency(cfg, smol_fp32, questions, [2], {"retrieval": {"budget": 16, "cost_aware": False}},
                             prefill_chunk_tokens=64, prefix_cache=cache)
    level = result["2"]
    assert level["prefix_cache"] == {"chunk_tokens": 64, "max_tokens": 32768}
    for name in ("vanilla", "retrieval"):
        m = level["methods"][name]
        stats = m["prefix_cache"]
        assert stats["lookups"] == len(questions), stats
        assert stats["hits"] >= 1 and stats["reused_tokens"] >= 64, stats
        assert m["lossless"] is True
