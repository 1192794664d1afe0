"""KV slots sized to their requests (:class:`speculation.model.kv_slots.SizedKVSlotPool`, ``batch.kv_token_budget``).

* fp32 greedy, both layouts, vanilla and three drafters: with a token budget that admits only
  some of the requests at a time (the slot count never binds), every output equals its solo
  vanilla run, the live slots' rows never exceed the budget, and each slot holds exactly
  ``min(L, prompt + new + max_tree_tokens)`` rows;
* memory is the live slots' rows, not ``S * L``: bytes = rows x per-row bytes, zero when idle;
* a waiting request is admitted the step after rows free up (FIFO: a long head waits, the queue
  behind it too);
* chunked prefill and the prefix cache run on sized slots with the same tokens;
* bad input: a request larger than the budget is refused at ``add`` naming the field; a budget out
  of range is a ConfigError; ``acquire`` past the budget raises; the Ray target refuses a budget.
"""

from __future__ import annotations

import pytest
import torch

from speculation.config import BatchConfig, ConfigError, EngineConfig
from speculation.engine.batch import AdmissionError, BatchEngine, Request
from speculation.engine.solo import generate_vanilla
from speculation.model.kv_slots import KVSlotPool, SizedKVSlotPool, SlotsExhaustedError
from speculation.model.prefix_cache import PrefixCache, PrefixCacheConfig
from tests.helpers import tiny_target
from tests.test_batching import GREEDY, LAYOUTS, NEW, PROMPTS, _factory, _margin_report, _model, _solo_vanilla

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TREE = 16
LIMIT = 64
BUDGET = 120
"""Rows for all live slots: 2-3 of this module's requests at a time (each asks 17-49 rows), while
6 slots would allow all six; so the budget, not the slot count, schedules them."""


def _rows(prompt: list[int], new: int) -> int:
    return min(LIMIT, len(prompt) + new + TREE)


def _run_sized(engine: BatchEngine, requests: list[Request]):
    """Add every request at once and step to the end, checking the pool after every step."""
    pool = engine.pool
    assert isinstance(pool, SizedKVSlotPool)
    want = {r.request_id: _rows(r.prompt_ids, r.max_new_tokens) for r in requests}
    for r in requests:
        engine.add(r)
    results, peak_live, steps = {}, 0, 0
    while engine.has_work():
        engine.step()
        results.update(engine.finished_results())
        assert pool.reserved_tokens <= BUDGET
        held = [lv for lv in engine._live.values()] + list(engine._prefilling.values())
        for lv in held:
            assert pool.capacity(lv.state.held_slot()) == want[lv.request.request_id]
        assert pool.reserved_tokens == sum(want[lv.request.request_id] for lv in held)
        peak_live = max(peak_live, len(held))
        steps += 1
        assert steps < 1000, "the engine made no progress"
    return results, peak_live


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["vanilla", "retrieval", "eagle3", "graft"])
def test_sized_slots_under_a_token_budget_equal_solo_vanilla(name, layout):
    model = _model(layout)
    target = tiny_target(model)
    refs = [_solo_vanilla(target, p, n) for p, n in zip(PROMPTS, NEW)]
    engine = BatchEngine(target, _factory(name, target),
                         BatchConfig(max_sequences=6, max_tokens_per_sequence=LIMIT, max_tree_tokens=TREE,
                                     kv_token_budget=BUDGET))
    reqs = [Request(f"r{i}", p, n, GREEDY, stop_at_eos=False) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    results, peak = _run_sized(engine, reqs)
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        assert results[f"r{i}"].tokens == ref, f"{name}, request {i}: {_margin_report(model, p, ref, results[f'r{i}'].tokens)}"
    assert 2 <= peak < len(PROMPTS)  # the budget held some back although slots were free
    assert engine.pool.reserved_tokens == 0 and engine.pool.nbytes() == 0 and engine.pool.free == 6


def test_memory_is_the_live_rows_not_slots_times_slot_size():
    target = tiny_target(_model("flat"))
    cfg = target.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, fp32
    fixed = target.new_slot_pool(4, 512)
    sized = target.new_slot_pool(4, 512, token_budget=4 * 512)
    assert type(fixed) is KVSlotPool and type(sized) is SizedKVSlotPool
    with torch.inference_mode():
        for pool in (fixed, sized):
            for n, rows in ((5, 40), (3, 24)):
                state = target.empty_slot(pool, rows)
                target.step_batch([], [], [(state, list(range(1, n + 1)))])
    assert fixed.nbytes() == 4 * 512 * per_row
    assert sized.nbytes() == (40 + 24) * per_row and sized.reserved_tokens == 64
    assert [sized.capacity(s) for s in (0, 1)] == [40, 24] and fixed.capacity(1) == 512
    # the same prompt rows in both
    for i in range(cfg.num_hidden_layers):
        for a, b in zip(fixed.slot_kv(i, 1), sized.slot_kv(i, 1)):
            assert torch.equal(a[:, :, :3], b[:, :, :3])
    sized.release(0)
    assert sized.nbytes() == 24 * per_row and sized.reserved_tokens == 24


def test_a_waiting_request_is_admitted_once_rows_free_up_in_order():
    """Budget 64: a 40-row request runs; a 49-row one waits (it would need 89), and so does a
    19-row one behind it although it would fit beside the first (FIFO: no overtaking, so a long
    request is never starved); each starts the step after the rows it needs are freed."""
    target = tiny_target(_model("flat"))
    engine = BatchEngine(target, None, BatchConfig(max_sequences=4, max_tokens_per_sequence=LIMIT,
                                                   max_tree_tokens=TREE, kv_token_budget=64))
    a = Request("a", [1, 2, 3, 4], 20, GREEDY, stop_at_eos=False)   # 40 rows
    b = Request("b", [5] * 13, 20, GREEDY, stop_at_eos=False)       # 49 rows
    c = Request("c", [9], 2, GREEDY, stop_at_eos=False)             # 19 rows
    for r in (a, b, c):
        engine.add(r)
    started, done, results, step = {}, {}, {}, 0
    while engine.has_work():
        for u in engine.step():
            if u.new_tokens:
                started.setdefault(u.request_id, step)
            if u.finished is not None:
                done[u.request_id] = step
        results.update(engine.finished_results())
        step += 1
        assert step < 500
    assert started["a"] == 0 and started["b"] == done["a"] + 1 and started["c"] == done["b"] + 1
    for r in (a, b, c):
        assert results[r.request_id].tokens == _solo_vanilla(target, r.prompt_ids, r.max_new_tokens)


def test_chunked_prefill_and_prefix_cache_on_sized_slots():
    """Chunks of 4 with a prefix cache on sized slots: a repeated prompt reuses its cached rows and
    every output equals the solo chunked run."""
    C = 4
    target = tiny_target(_model("flat"))
    prompts = [PROMPTS[3], PROMPTS[3] + [2, 2], PROMPTS[5]]
    refs = [generate_vanilla(target, p, EngineConfig(max_new_tokens=12, stop_at_eos=False, sampling=GREEDY,
                                                     prefill_chunk_tokens=C)).tokens for p in prompts]
    cache = PrefixCache(PrefixCacheConfig(chunk_tokens=C, max_tokens=256))
    engine = BatchEngine(target, None, BatchConfig(max_sequences=3, max_tokens_per_sequence=LIMIT,
                                                   max_tree_tokens=TREE, kv_token_budget=BUDGET,
                                                   prefill_chunk_tokens=C), prefix_cache=cache)
    out = {}
    for i, p in enumerate(prompts):  # one after another, so the later ones can hit
        out.update(engine.run([Request(f"r{i}", p, 12, GREEDY, stop_at_eos=False)]))
    assert [out[f"r{i}"].tokens for i in range(3)] == refs
    assert cache.stats.as_dict()["reused_tokens"] >= 12  # the second prompt started from the first's rows


def test_bad_budgets_and_oversize_requests_are_refused_with_the_field():
    target = tiny_target(_model("flat"))
    with pytest.raises(ConfigError, match=r"batch\.kv_token_budget"):
        BatchConfig(kv_token_budget=1)
    engine = BatchEngine(target, None, BatchConfig(max_sequences=2, max_tokens_per_sequence=LIMIT,
                                                   kv_token_budget=30))
    with pytest.raises(AdmissionError, match=r"= 35 KV rows, but all slots together hold batch\.kv_token_budget=30"):
        engine.add(Request("big", [1] * 5, 30, GREEDY))
    assert engine.num_waiting == 0  # nothing queued, nothing lost
    engine.add(Request("ok", [1] * 5, 10, GREEDY))  # 15 request rows; its slot is cut to the budget
    pool = SizedKVSlotPool(2, 4, 64, token_budget=50)
    pool.acquire(40)
    assert pool.can_hold(10) and not pool.can_hold(11)
    with pytest.raises(SlotsExhaustedError, match=r"a slot of 11 KV rows does not fit: 40 of the token_budget of 50"):
        pool.acquire(11)
    with pytest.raises(ValueError, match=r"rows must be in \[1, 64\]"):
        pool.acquire(65)


def test_the_ray_target_refuses_a_token_budget_before_touching_its_shards():
    """The shards hold fixed slots: ``new_slot_pool`` with a budget raises before any shard call
    (so an unconstructed target suffices), naming the field."""
    from cluster.batch_backend import RayBatchTarget

    target = RayBatchTarget.__new__(RayBatchTarget)
    with pytest.raises(ValueError, match=r"batch\.kv_token_budget sizes KV slots per request in process only"):
        target.new_slot_pool(4, 64, token_budget=128)
