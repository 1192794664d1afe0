"""Online adaptation (docs/algorithms.md §8) on a tiny random Llama: feedback, updates, gate, rollback,
the Ray learner.

Every drafter here is a real EAGLE-3 / SpecBlock head over a real (tiny) target; feedback comes from
the real decode loop's hook, updates run the families' real losses, the learner is a real Ray actor.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import threading
import time

import pytest
import torch

from adaptation.bandit import BanditConfig, CostAwareBandit, gate
from adaptation.controller import AdaptationController, ControllerConfig, Outcome, Policy
from adaptation.cost_model import CostConfig
from adaptation.feedback import BufferConfig, FeedbackRecord, FeedbackSink, ReplayBuffer, SinkConfig
from adaptation.gain import (
    ReplayConfig,
    UnitReplay,
    break_even_horizon_s,
    estimate_gain,
    replay_units,
    replica,
    tau_of,
)
from adaptation.online import OnlineConfig, OnlineUpdater
from adaptation.rollback import HEAD_KEY, GuardConfig, GuardMode, shuffled_head
from speculation.config import ConfigError, EngineConfig, Eagle3Config, SamplingConfig, SpecBlockConfig
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.specblock import build_specblock_drafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from tests.helpers import shared_tiny_llama, tiny_target
from tests.ray_fixtures import ray_local, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
NEW_TOKENS = 48
N_REQUESTS = 16
GREEDY = EngineConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0))


def _target():
    return tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=42))


def _drafter(family: str, target=None):
    target = target or _target()
    if family == "eagle3":
        cfg = Eagle3Config(checkpoint="random", draft_vocab_size=VOCAB, total_tokens=20, depth=3, top_k=4)
        return build_eagle3_drafter(cfg, target)
    cfg = SpecBlockConfig(checkpoint="random", draft_vocab_size=VOCAB, block_size=4, max_blocks=2, beam=4,
                          total_tokens=24)
    return build_specblock_drafter(cfg, target)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))] for _ in range(n)]


def _serve(target, drafter, prompts, sink: FeedbackSink, first_id: int = 0) -> list[list[int]]:
    outs = []
    for i, p in enumerate(prompts):
        outs.append(generate_speculative(target, drafter, p, GREEDY, feedback=sink.hook(first_id + i)).tokens)
        sink.end_request(first_id + i)
        sink.drain()
    return outs


@functools.lru_cache(maxsize=2)
def _feedback(family: str) -> tuple[list[FeedbackRecord], list[list[int]]]:
    """Records of N_REQUESTS greedy requests served with an untrained head, and the outputs."""
    target = _target()
    records: list[FeedbackRecord] = []
    sink = FeedbackSink(records.extend)
    outs = _serve(target, _drafter(family, target), _prompts(N_REQUESTS), sink)
    return records, outs


@functools.lru_cache(maxsize=2)
def _candidate(family: str):
    """An update of the untrained head: 32 optimizer steps on the buffer's train part."""
    drafter = _drafter(family)
    return OnlineUpdater(drafter, OnlineConfig(lr=1e-3)).train(drafter.state_dict(), _buffer(family).train_sequences(), 32)


def _buffer(family: str, heldout: int = 4) -> ReplayBuffer:
    buf = ReplayBuffer(BufferConfig(heldout_sequences=heldout))
    buf.add(_feedback(family)[0])
    return buf


# ---------------------------------------------------------------------- feedback
def test_sink_drops_under_backpressure_without_blocking():
    records = _feedback("eagle3")[0][:60]
    release = threading.Event()
    got: list[FeedbackRecord] = []

    def slow_consumer(batch):
        release.wait(10)
        got.extend(batch)

    sink = FeedbackSink(slow_consumer, SinkConfig(max_queue=4, batch_records=1)).start()
    worst = 0.0
    for r in records:
        t0 = time.perf_counter()
        sink.offer(r)
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.05, f"offer blocked for {worst:.3f} s"
    assert sink.stats.emitted == 60 and sink.stats.dropped >= 60 - 4 - 1
    release.set()
    sink.close(flush=True)
    assert sink.stats.delivered == len(got) and sink.stats.delivered + sink.stats.dropped == 60
    assert got == records[: len(got)]  # kept in order, the newest dropped


def test_failing_consumer_never_raises_into_decode():
    def broken(batch):
        raise RuntimeError("learner is gone")

    target = _target()
    drafter = _drafter("eagle3", target)
    sink = FeedbackSink(broken)
    prompt = _prompts(1, seed=5)[0]
    out = _serve(target, drafter, [prompt], sink)[0]
    assert out == generate_vanilla(target, prompt, GREEDY).tokens
    assert sink.stats.consumer_errors >= 1 and "learner is gone" in sink.stats.last_error


def test_records_join_into_the_served_text_and_split_train_heldout():
    records, outs = _feedback("eagle3")
    buf = ReplayBuffer(BufferConfig(heldout_sequences=3))
    buf.add(records)
    train, held = buf.train_sequences(), buf.heldout_sequences()
    assert len(train) == N_REQUESTS - 3 and len(held) == 3
    for seq, out in zip(train + held, outs):  # oldest first: request order
        # accepted paths + the last bonus = the generated text (the last step may verify past the limit)
        assert seq.tokens.tolist()[: len(out)] == out and len(seq.tokens) <= NEW_TOKENS + 4
        assert seq.aux.shape == (len(seq.tokens) - 1, 3 * 32)
        assert not bool(seq.mistakes[0]) and int(seq.mistakes.sum()) == len(seq.step_tokens)
    # bounded: the oldest requests are evicted whole, the held-out part is the freshest
    small = ReplayBuffer(BufferConfig(max_records=100, heldout_sequences=2))
    small.add(records)
    assert len(small) <= 100
    kept_ids = sorted({r.request_id for g in small._requests.values() for r in g})
    assert kept_ids == list(range(N_REQUESTS - len(kept_ids), N_REQUESTS))
    assert [s.tokens.tolist()[:NEW_TOKENS] for s in small.heldout_sequences()] == outs[-2:]
    with pytest.raises(ConfigError, match="heldout_sequences"):
        BufferConfig(heldout_sequences=0)


def test_the_sink_itself_is_a_hook_that_tells_sequences_apart():
    target = _target()
    drafter = _drafter("eagle3", target)
    records: list[FeedbackRecord] = []
    sink = FeedbackSink(records.extend)
    prompts = _prompts(2)
    outs = [generate_speculative(target, drafter, p, GREEDY, feedback=sink).tokens for p in prompts]
    sink.drain()
    buf = ReplayBuffer(BufferConfig(heldout_sequences=1))
    buf.add(records)
    seqs = buf.train_sequences() + buf.heldout_sequences()
    assert len(seqs) == 2 and [s.tokens.tolist()[:NEW_TOKENS] for s in seqs] == outs == _feedback("eagle3")[1][:2]


# ---------------------------------------------------------------------- updates and gain
@pytest.mark.parametrize("family", ["eagle3", pytest.param("specblock", marks=pytest.mark.slow)])  # specblock: ~10 s
def test_online_update_raises_heldout_replay_tau(family):
    buf = _buffer(family)
    drafter = _drafter(family)
    held = buf.heldout_sequences()
    live_tau = sum(sum(s.step_tokens) for s in held) / sum(len(s.step_tokens) for s in held)
    rep = replica(drafter)
    tau_old = tau_of(replay_units(rep, held, 16))
    assert abs(tau_old - live_tau) < 0.15  # replay reproduces what serving saw (bf16 features)
    result = _candidate(family)
    assert result.steps == 32 and result.trained_rows > 0 and len(result.step_seconds) == 32
    rep.load_state_dict(result.state)
    tau_new = tau_of(replay_units(rep, held, 16))
    assert tau_new > tau_old + 0.4, (tau_old, tau_new)
    # the live drafter's weights were not touched by training a candidate
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in _drafter(family).state_dict().items())


def _controller(drafter, publish, **kw) -> AdaptationController:
    base = dict(policy=Policy.COST_AWARE, decide_every_steps=10**9, bandit=BanditConfig(budgets=(0, 16)),
                online=OnlineConfig(lr=1e-3), replay=ReplayConfig(chunk=16, bootstrap=200),
                buffer=BufferConfig(heldout_sequences=4), guard=GuardConfig(window_steps=12, margin=0.1))
    base.update(kw)
    return AdaptationController(drafter, publish, ControllerConfig(**base))


def test_gate_applies_when_gain_beats_cost_and_skips_otherwise():
    assert gate(2.0, 1.0) and not gate(1.0, 2.0) and not gate(float("-inf"), 0.0)
    drafter = _drafter("eagle3")
    published = []
    for horizon, expect in ((1e7, Outcome.APPLIED), (1e-3, Outcome.GATED)):
        ctl = _controller(drafter, published.append, cost=CostConfig(default_sync_s=0.5))
        ctl.add(_feedback("eagle3")[0])
        ctl.horizon_tokens_override = horizon
        d = ctl.round()
        assert d.arm == 16 and d.outcome is expect, d
        assert d.gain is not None and d.gain.tau_new > d.gain.tau_old
        assert d.cost.total_s == pytest.approx(16 * ctl.cost.step_s * 1.0 + 0.5)  # kappa = 1 (blocking twin)
        assert (d.gain.gain_lo_s > d.cost.total_s) == (expect is Outcome.APPLIED)
        # the gate fires exactly for horizons past the break-even one
        assert (d.break_even_horizon_s < ctl.config.horizon_s) == (expect is Outcome.APPLIED)
        assert d.metrics()["break_even_horizon_s"] == pytest.approx(d.break_even_horizon_s)
        # the held-out replay was timed: not in the gate's C (sunk when it decides), in the arm's price
        assert d.cost.replay_s > 0 and d.cost.tried_s == pytest.approx(d.cost.total_s + d.cost.replay_s)
    assert len(published) == 1  # only the applied round swapped weights
    # a gated round costs its training and its replay: the bandit learns it, skip (0) stays at 0
    assert ctl.bandit.stats[16].mean == pytest.approx(-(d.cost.train_s + d.cost.replay_s))  # kappa = 1
    assert ctl.bandit.stats[0].mean == 0 and ctl.summary()["cost_s"] == pytest.approx(d.spent_s)
    assert d.spent_s == pytest.approx(d.cost.train_s + d.cost.replay_s)  # never synced


def test_break_even_horizon_is_where_the_lower_bound_gain_meets_the_cost():
    """G_lo is linear in the horizon's tokens, so replaying at H* = H * C / G_lo gives G_lo == C;
    a candidate whose G_lo <= 0 never pays, whatever the horizon."""
    cfg = ReplayConfig(bootstrap=200)
    rng = random.Random(0)
    old = [UnitReplay(gained=rng.randint(30, 40), steps=25) for _ in range(12)]
    better = [UnitReplay(gained=u.gained + rng.randint(3, 9), steps=u.steps) for u in old]
    rate, horizon, step_s, cost = 20.0, 60.0, 0.05, 9.0  # tokens/s, s, s per verify step, s
    est = estimate_gain(old, better, rate * horizon, step_s, cfg)
    assert 0 < est.gain_lo_s < est.gain_s
    h = break_even_horizon_s(est.gain_lo_s, cost, horizon)
    assert h == pytest.approx(horizon * cost / est.gain_lo_s)
    at_h = estimate_gain(old, better, rate * h, step_s, cfg)
    assert at_h.gain_lo_s == pytest.approx(cost)
    assert gate(estimate_gain(old, better, rate * h * 1.01, step_s, cfg).gain_lo_s, cost)
    assert not gate(estimate_gain(old, better, rate * h * 0.99, step_s, cfg).gain_lo_s, cost)
    worse = estimate_gain(better, old, rate * horizon, step_s, cfg)
    assert break_even_horizon_s(worse.gain_lo_s, cost, horizon) == math.inf
    assert break_even_horizon_s(0.0, cost, horizon) == math.inf
    assert break_even_horizon_s(float("-inf"), cost, horizon) == math.inf


def test_the_live_weights_held_out_replay_is_reused_until_the_weights_change():
    """Rounds overlap in held-out requests: the live side of the gain replay is computed once per
    request and weights, and gives the same tau as replaying afresh."""
    drafter = _drafter("eagle3")
    ctl = _controller(drafter, lambda state: None)
    ctl.add(_feedback("eagle3")[0])
    candidate = _candidate("eagle3").state
    first = ctl.estimate(candidate)
    assert ctl.live_replay_hits == 0
    second = ctl.estimate(candidate)
    held = ctl.buffer.heldout_sequences()
    assert ctl.live_replay_hits == len(held) == 4
    assert second.tau_old == first.tau_old and second.tau_new == first.tau_new
    fresh = replica(drafter)
    fresh.load_state_dict(ctl.weights)
    assert tau_of(replay_units(fresh, held, ctl.config.replay.chunk)) == first.tau_old
    ctl._publish(candidate)  # new live weights: the cached side is stale
    third = ctl.estimate(candidate)
    assert ctl.live_replay_hits == 4 and third.tau_old == pytest.approx(first.tau_new)


def test_cost_prices_contention_from_serving_steps_measured_idle_and_busy():
    from adaptation.cost_model import UpdateCostModel

    cm = UpdateCostModel(CostConfig(alpha=1.0, default_step_s=2.0, default_sync_s=0.3))
    assert cm.cost(0).total_s == 0 and cm.cost(10).total_s == pytest.approx(10 * 2.0 * 1.0 + 0.3)  # unmeasured: kappa 1
    cm.observe_serving_step(0.10, learner_busy=False)
    cm.observe_serving_step(0.25, learner_busy=True)  # serving 2.5x slower while the learner trains
    cm.observe_opt_steps([0.5, 0.5])
    cm.observe_sync(0.02)
    assert cm.contention == pytest.approx(0.6) and cm.serving_step_s == pytest.approx(0.10)
    assert cm.cost(32).total_s == pytest.approx(32 * 0.5 * 0.6 + 0.02)


def test_bandit_prefers_the_arm_with_the_best_net_reward():
    bandit = CostAwareBandit(BanditConfig(budgets=(0, 32, 128), ucb_scale=0.1))
    true_reward = {0: 0.0, 32: 1.0, 128: -2.0}
    for _ in range(60):
        arm = bandit.choose()
        bandit.record(arm, true_reward[arm])
    assert bandit.stats[32].pulls > 45
    reg = bandit.regret()
    assert reg["best_fixed_arm"] == 32 and 0 <= reg["regret_s"] < 6
    with pytest.raises(ConfigError, match="budgets"):
        BanditConfig(budgets=(32, 128))


def test_bandit_explores_cheapest_first_and_not_past_a_harmful_arm():
    """A candidate whose whole gain interval is below zero blocks exploring dearer budgets (they
    would train longer in the same direction); a later non-harmful estimate lifts the block."""
    bandit = CostAwareBandit(BanditConfig(budgets=(0, 32, 128, 512)))
    assert bandit.choose() == 32
    bandit.record(32, -17.0, harmful=True)  # gated: tau_new CI below tau_old
    assert [bandit.choose() for _ in range(5)] == [0] * 5  # neither 128 nor 512 is explored
    for _ in range(5):
        bandit.record(0, 0.0)
    bandit.record(32, -3.0, harmful=False)  # the same budget, now with an interval reaching above 0
    assert bandit.choose() == 128
    bandit.record(128, -60.0, harmful=None)  # no estimate: 128 keeps its flag (clear)
    assert bandit.choose() == 512
    # The previous behaviour: every untried arm is explored whatever the cheaper ones showed.
    plain = CostAwareBandit(BanditConfig(budgets=(0, 32, 128, 512), explore_after_harm=True))
    chosen = []
    for _ in range(3):
        arm = plain.choose()
        chosen.append(arm)
        plain.record(arm, -10.0, harmful=True)
    assert chosen == [32, 128, 512]
    with pytest.raises(ConfigError, match="explore_after_harm must be true or false"):
        BanditConfig(explore_after_harm="yes")


def test_bandit_retries_an_arm_once_the_train_part_has_grown():
    """An arm's reward is conditional on the data it was trained on: its statistics go stale once
    the train part holds ``retry_growth`` times the positions of its latest estimate."""
    bandit = CostAwareBandit(BanditConfig(budgets=(0, 32, 128), retry_growth=2.0))
    assert bandit.choose(300) == 32
    bandit.record(32, -17.0, harmful=True, positions=300)
    assert [bandit.choose(p) for p in (300, 450, 599)] == [0, 0, 0]  # not stale yet; 128 blocked by harm
    for _ in range(3):
        bandit.record(0, 0.0)
    assert bandit.choose(600) == 32  # 2x the positions: re-tried as untried
    bandit.record(32, 5.0, harmful=False, positions=600)
    s = bandit.stats[32]
    assert (s.pulls, s.reward_sum, s.harmful, s.positions) == (1, 5.0, False, 600)  # old -17 s dropped
    assert bandit.choose(600) == 128  # the block is lifted
    # a stale arm above a harmful cheaper arm is not re-tried, but still competes on its old mean
    up = CostAwareBandit(BanditConfig(budgets=(0, 32, 128), retry_growth=2.0, ucb_scale=0.0))
    up.choose(300)
    up.record(32, -1.0, harmful=False, positions=300)
    up.choose(300)
    up.record(128, 50.0, harmful=False, positions=300)
    assert up.choose(600) == 32  # stale: re-tried first
    up.record(32, -20.0, harmful=True, positions=600)
    assert up.choose(600) == 128  # stale and blocked by the harmful 32, yet its +50 s beats skipping
    # statistics recorded without positions (0 = unknown) never go stale
    unknown = CostAwareBandit(BanditConfig(budgets=(0, 32)))
    unknown.choose(0)
    unknown.record(32, 3.0, positions=0)
    assert not unknown.stats[32].stale(10**9, 2.0) and unknown.choose(10**9) == 32  # by UCB, not as untried
    assert unknown.stats[32].pulls == 1
    never = CostAwareBandit(BanditConfig(budgets=(0, 32), retry_growth=float("inf")))
    never.choose(100)
    never.record(32, -17.0, harmful=True, positions=100)
    assert never.choose(10**9) == 0
    for bad in (1.0, "2", True):
        with pytest.raises(ConfigError, match="adapt.bandit.retry_growth must be > 1"):
            BanditConfig(retry_growth=bad)


def test_no_candidate_is_trained_before_min_train_positions():
    buf = _buffer("eagle3")
    positions = sum(s.length for s in buf.train_sequences())
    for need, trained in ((positions + 1, False), (positions, True)):
        ctl = _controller(_drafter("eagle3"), lambda state: None, min_train_positions=need,
                          bandit=BanditConfig(budgets=(0, 4)))
        ctl.buffer = buf
        d = ctl.round()
        assert (d.outcome is not Outcome.SKIPPED) == trained and d.arm == 4, (need, d)
        assert ctl.bandit.rounds == int(trained)  # a round below the floor is not a bandit round
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="adapt.min_train_positions must be an integer >= 0"):
            ControllerConfig(min_train_positions=bad)


@pytest.mark.slow  # ~4 s; the fast tier keeps the gate and rollback tests
def test_explore_budget_bounds_what_refused_candidates_may_cost():
    """cost_aware trains a candidate only while the candidates the gate refused, plus this one's
    expected training, stay within explore_budget of the serving wall time. Before the first
    candidate the step cost is measured (a probe of PROBE_STEPS steps, counted as exploration)
    rather than taken from the prior (1 s per step)."""
    from adaptation.controller import PROBE_STEPS

    buf = _buffer("eagle3")
    for budget, elapsed, trained in ((None, 0.0, True), (0.0, 1e6, False), (0.5, 1e6, True), (0.5, 1e-3, False),
                                     (0.5, 8.0, True)):  # the prior would price 4 steps at 4 s > 0.5 * 8 s - probe
        ctl = _controller(_drafter("eagle3"), lambda state: None, explore_budget=budget,
                          bandit=BanditConfig(budgets=(0, 4)))
        ctl.buffer = buf
        ctl._first_wall = time.time() - elapsed  # as if the first record arrived `elapsed` s ago
        d = ctl.round()
        assert (d.outcome is not Outcome.SKIPPED) == trained and d.arm == 4, (budget, elapsed, d)
        probed = bool(budget)  # a zero budget never explores, so it never probes either
        assert ctl.cost.opt_step.count == (PROBE_STEPS if probed else 0) + (4 if trained else 0)
        if probed:
            assert 0 < ctl.cost.step_s < 1.0 and ctl.refused_s > 0  # measured; the probe is exploration
        if d.outcome is Outcome.GATED:
            assert ctl.refused_s > 0 and ctl.summary()["refused_s"] == ctl.refused_s
    ctl = _controller(_drafter("eagle3"), lambda state: None, explore_budget=0.5, bandit=BanditConfig(budgets=(0, 4)))
    ctl.buffer, ctl._first_wall, ctl.refused_s = buf, time.time() - 100.0, 50.0  # 50 + probe + 4 steps > 50
    assert ctl.round().outcome is Outcome.SKIPPED and ctl.bandit.rounds == 0
    for bad in (-0.1, 1.5, "0.1", True):
        with pytest.raises(ConfigError, match="adapt.explore_budget must be a number in"):
            ControllerConfig(explore_budget=bad)


@pytest.mark.parametrize("injected", [False, True])
def test_rollback_restores_previous_weights_when_live_tau_collapses(injected):
    """An update that collapses tau is rolled back at the close of the guard's window. The bandit's
    arm is credited with the loss, unless the update was injected (no arm chose it)."""
    target = _target()
    live = _drafter("eagle3", target)
    live.load_state_dict(_candidate("eagle3").state)
    ctl = _controller(live, live.load_state_dict, guard=GuardConfig(window_steps=30, margin=0.1))
    ctl.weights = live.state_dict()
    before = ctl.weights
    sink = FeedbackSink(ctl.add)
    prompts = _prompts(4)  # served before and after the swap: same text, so tau_pre vs tau_post is fair
    _serve(target, live, prompts, sink, first_id=100)
    # a deliberately harmful update: the draft LM head's rows shuffled (labels permuted)
    harmful = shuffled_head(before)
    applied = ctl.apply(harmful, 16, ctl.cost.cost(16), positions=777, injected=injected)
    assert applied.outcome is Outcome.APPLIED and applied.tau_pre > 1.25 and applied.injected is injected
    outs = _serve(target, live, prompts, sink, first_id=200)
    closing = [d for d in ctl.decisions if d.outcome in (Outcome.KEPT, Outcome.ROLLED_BACK)]
    assert [d.outcome for d in closing] == [Outcome.ROLLED_BACK] and closing[0].injected is injected
    assert closing[0].tau_post < closing[0].tau_pre * 0.9 and closing[0].reward_s < 0
    assert ("injected" in closing[0].metrics()) is injected
    # the deferred reward reached the bandit with the positions the update was trained on (not
    # when injected: the bandit never chose it)
    arm16 = ctl.bandit.stats[16]
    expect = (0, 0, 0.0) if injected else (1, 777, closing[0].reward_s)
    assert (arm16.pulls, arm16.positions, arm16.reward_sum) == expect
    restored = live.state_dict()
    assert restored.keys() == before.keys() and all(torch.equal(restored[k], before[k]) for k in before)
    assert outs == _feedback("eagle3")[1][:4]  # lossless throughout
    # paired (default) mode: the verdict replayed both weights on the post-swap text
    assert closing[0].tau_replay_new < closing[0].tau_replay_prev * 0.9


def test_shuffled_head_permutes_only_the_head_rows_and_names_a_missing_head():
    head = torch.arange(12.0).reshape(6, 2)  # [V_draft, H]
    other = torch.ones(3)
    state = {HEAD_KEY: head, "fc.weight": other}
    out = shuffled_head(state, seed=3)
    assert out["fc.weight"] is other and state[HEAD_KEY] is head  # the rest shared, the input untouched
    assert not torch.equal(out[HEAD_KEY], head)
    assert sorted(out[HEAD_KEY][:, 0].tolist()) == head[:, 0].tolist()  # the same rows, in another order
    assert torch.equal(out[HEAD_KEY], shuffled_head(state, seed=3)[HEAD_KEY])  # seeded
    two = {HEAD_KEY: torch.tensor([[1.0], [2.0]])}
    assert shuffled_head(two)[HEAD_KEY].flatten().tolist() == [2.0, 1.0]  # never the identity permutation
    with pytest.raises(ConfigError, match="shuffled_head: the drafter's state dict has no 'lm_head.weight'"):
        shuffled_head({"fc.weight": other})
    with pytest.raises(ConfigError, match=r"lm_head.weight must be \[draft_vocab >= 2, hidden\], got \(1, 2\)"):
        shuffled_head({HEAD_KEY: torch.ones(1, 2)})


@pytest.mark.parametrize("mode, expect", [(GuardMode.LIVE, Outcome.ROLLED_BACK), (GuardMode.PAIRED, Outcome.KEPT)])
def test_paired_guard_keeps_a_harmless_swap_that_meets_harder_text(mode, expect):
    """The window after a swap covers other text than the window before it. Here the update is
    harmless (the very same weights) but the text after the swap drafts worse (records served by
    an untrained head): the live guard reads the text's difficulty as harm and rolls back, the
    paired guard replays previous and new weights on the same window and keeps it."""
    target = _target()
    live = _drafter("eagle3", target)
    live.load_state_dict(_candidate("eagle3").state)
    ctl = _controller(live, live.load_state_dict, guard=GuardConfig(window_steps=30, margin=0.1, mode=mode))
    ctl.weights = live.state_dict()
    ctl.horizon_tokens_override = 1e4
    _serve(target, live, _prompts(4), FeedbackSink(ctl.add), first_id=100)
    ctl.apply(dict(ctl.weights), 16, ctl.cost.cost(16), positions=5)
    ctl.add(_feedback("eagle3")[0][:40])
    closing = ctl.decisions[-1]
    assert closing.outcome is expect
    assert closing.tau_post < closing.tau_pre * 0.9  # live windows: the text got harder
    if mode is GuardMode.PAIRED:
        assert closing.tau_replay_new == closing.tau_replay_prev > 1.0 and closing.realised_gain_s == 0.0
    else:
        assert math.isnan(closing.tau_replay_prev) and closing.realised_gain_s < 0


@pytest.mark.slow  # ~5 s; the fast tier keeps the gate and rollback tests
def test_audit_reverts_a_kept_update_when_live_tau_drops_because_of_it_and_not_when_the_text_got_harder():
    """After a kept update, live tau is read over consecutive windows; a drop triggers a replay of
    the start and the live weights on the window's text. Harder text (records served by an
    untrained head) drops live tau for both weights: the update stays. An update gone bad (the
    draft LM head's rows permuted) drops it for the live weights only: the start weights come
    back, and decoding stays lossless across that swap."""
    target = _target()
    live = _drafter("eagle3", target)
    start = _candidate("eagle3").state
    live.load_state_dict(start)
    published = []

    def publish(state):
        published.append(state)
        live.load_state_dict(state)

    ctl = AdaptationController(live, publish, ControllerConfig(
        policy=Policy.COST_AWARE, decide_every_steps=10**9, bandit=BanditConfig(budgets=(0, 16)),
        replay=ReplayConfig(chunk=16, bootstrap=200), buffer=BufferConfig(heldout_sequences=4),
        guard=GuardConfig(window_steps=12, margin=0.1), audit_window_steps=12), weights=start)
    sink = FeedbackSink(ctl.add)
    _serve(target, live, _prompts(4), sink, first_id=100)
    assert not ctl.decisions  # the live weights are the start weights: nothing to audit
    kept = dict(start)  # a kept update (live, no longer watched); here the same values
    publish(kept)
    ctl.weights = kept
    _serve(target, live, _prompts(4), sink, first_id=200)
    early = len(ctl.decisions)
    assert all(d.outcome is Outcome.AUDITED for d in ctl.decisions)  # noise may trigger one: kept
    ctl.add(_feedback("eagle3")[0][:48])  # harder text: both weights draft it worse
    harder = ctl.decisions[early:]
    assert harder and all(d.outcome is Outcome.AUDITED for d in harder)
    assert all(d.tau_replay_new == d.tau_replay_prev and d.cost.replay_s > 0 for d in harder)
    assert ctl.weights is kept and published[-1] is kept
    # the update goes bad on the text that follows
    bad = dict(start)
    perm = torch.randperm(bad["lm_head.weight"].shape[0], generator=torch.Generator().manual_seed(0))
    bad["lm_head.weight"] = start["lm_head.weight"][perm]
    publish(bad)
    ctl.weights = bad
    _serve(target, live, _prompts(4), sink, first_id=300)  # the first window is served well above
    reverted = [d for d in ctl.decisions if d.outcome is Outcome.REVERTED]
    assert len(reverted) == 1 and reverted[0].tau_replay_new < reverted[0].tau_replay_prev * 0.9
    assert published[-1] is start and ctl.weights is start
    summary = ctl.summary()
    assert summary["reverts"] == 1 and summary["audits"] == len(ctl.decisions)
    assert summary["cost_s"] >= ctl.audit_cost_s > 0
    outs = _serve(target, live, _prompts(4, seed=1), sink, first_id=400)
    assert len(ctl.decisions) == summary["audits"]  # back at the start weights: no more audits
    assert outs == [generate_vanilla(target, p, GREEDY).tokens for p in _prompts(4, seed=1)]
    with pytest.raises(ConfigError, match="adapt.audit_window_steps must be an integer >= 2 or null"):
        ControllerConfig(audit_window_steps=1)


def test_recency_half_life_draws_training_windows_mostly_from_the_newest_requests():
    cfg = OnlineConfig(recency_half_life=2.0)
    w = cfg.draw_weights(5)  # oldest first
    assert float(w.sum()) == pytest.approx(1.0) and w[-1] == pytest.approx(2 * w[-3])
    assert OnlineConfig().draw_weights(5) is None  # uniform: the old draws, unchanged
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ConfigError, match="adapt.online.recency_half_life must be a number > 0 or null"):
            OnlineConfig(recency_half_life=bad)
    drafter = _drafter("eagle3")
    seqs = _buffer("eagle3").train_sequences()  # 12 requests, oldest first
    newest = set(seqs[-1].tokens.tolist())
    gen = torch.Generator().manual_seed(0)
    up = OnlineUpdater(drafter, OnlineConfig(recency_half_life=0.25, batch_sequences=8))
    batch = up._batch(seqs, up.config.draw_weights(len(seqs)), gen)  # weight of the 2nd newest: 1/16
    rows_from_newest = sum(set(r.tolist()) <= newest for r in batch.input_ids[:, :4])
    assert rows_from_newest >= 6, rows_from_newest


def test_guard_config_names_the_field_and_the_allowed_modes():
    assert GuardConfig(mode="live").mode is GuardMode.LIVE and GuardConfig().mode is GuardMode.PAIRED
    with pytest.raises(ConfigError, match=r"adapt.guard.mode must be one of live, paired, got 'pairs'"):
        GuardConfig(mode="pairs")


def test_greedy_output_stays_lossless_across_mid_generation_swaps():
    target = _target()
    live = _drafter("eagle3", target)
    swaps_at: list[int] = []
    ctx_len = [0]

    def publish(state):
        live.load_state_dict(state)
        swaps_at.append(ctx_len[0])

    ctl = _controller(live, publish, policy=Policy.ALWAYS, decide_every_steps=3, fixed_budget=2)
    ctl.add(_feedback("eagle3")[0])
    sink = FeedbackSink(ctl.add)
    for i, prompt in enumerate(_prompts(3, seed=21)):
        hook = sink.hook(("live", i))

        def feedback(ctx, outcome, _hook=hook):
            ctx_len[0] = len(ctx.tokens)
            _hook(ctx, outcome)
            sink.drain()  # the controller trains and swaps right here, between two decode steps

        out = generate_speculative(target, live, prompt, GREEDY, feedback=feedback).tokens
        assert out == generate_vanilla(target, prompt, GREEDY).tokens
    assert len(swaps_at) >= 6 and ctl.version == len(swaps_at)
    assert any(n < len(p) + NEW_TOKENS - 1 for n, p in zip(swaps_at, _prompts(3, seed=21)))  # mid-generation


# ---------------------------------------------------------------------- the Ray learner
def test_learner_actor_pushes_weights_restarts_from_them_and_decode_survives(ray_local, tmp_path):  # noqa: F811
    ray = ray_local
    from speculation.drafters.base import DraftContext
    from workers.drafter_worker import make_actor_class, pack_drafter
    from workers.learner import RemoteFeed, SwapTarget, spawn_learner, wait_until_ready

    target = _target()
    live = _drafter("eagle3", target)
    worker = make_actor_class(num_cpus=0).remote(VOCAB)
    ray.get(worker.host.remote("s", pack_drafter(live)))
    cfg = ControllerConfig(policy=Policy.ALWAYS, decide_every_steps=40, fixed_budget=4,
                           buffer=BufferConfig(heldout_sequences=1), online=OnlineConfig(lr=1e-3))
    learner = spawn_learner(live, cfg, tmp_path / "learner", targets=[SwapTarget(worker, "s")], max_restarts=2)
    records = _feedback("eagle3")[0]
    ray.get(learner.feed.remote(records[:200], wait=True))
    version, weights = ray.get(learner.weights.remote())
    assert version >= 1
    assert any(not torch.equal(weights[k], v) for k, v in live.state_dict().items())
    pid = ray.get(learner.pid.remote())

    # the drafter worker swapped in the learner's weights: it drafts what a local twin with them drafts
    prompt = _prompts(1, seed=41)[0]
    state, _, aux = target.prefill(prompt, need_aux=True)
    target.release(state)
    ray.get(worker.begin.remote("s", [*prompt, 7], len(prompt), aux))
    remote_tree = ray.get(worker.propose.remote("s", [])).tree
    twin = replica(live, weights)
    ctx = DraftContext(tokens=[*prompt, 7], prompt_len=len(prompt))
    twin.begin(ctx, aux)
    assert remote_tree.tokens == twin.propose(ctx).tree.tokens
    assert remote_tree.parents == twin.propose(ctx).tree.parents
    before = replica(live)  # the starting weights draft another tree here: the check can fail
    before.begin(ctx, aux)
    assert before.propose(ctx).tree.tokens != remote_tree.tokens

    ray.kill(learner, no_restart=False)
    # decode keeps going while the learner is down or restarting: feedback is dropped, never awaited
    feed = RemoteFeed(learner, max_inflight=2)
    sink = FeedbackSink(feed).start()
    prompt = _prompts(1, seed=31)[0]
    out = generate_speculative(target, live, prompt, GREEDY, feedback=sink.hook("during-kill")).tokens
    sink.close(flush=True)
    assert out == generate_vanilla(target, prompt, GREEDY).tokens

    wait_until_ready(learner, timeout_s=300)  # a restart imports torch: slow on a loaded machine
    v2, w2 = ray.get(learner.weights.remote())
    assert ray.get(learner.pid.remote()) != pid
    assert ray.get(learner.summary.remote())["restored"] == 1.0
    assert v2 == version and all(torch.equal(w2[k], weights[k]) for k in weights)


def test_learner_actor_answers_and_takes_feedback_while_a_round_trains(ray_local, tmp_path):  # noqa: F811
    """A round trains in the actor's background thread: feed returns at once and the actor answers
    mid-round (run inside feed, a round held the actor and the replicas dropped its feedback)."""
    ray = ray_local
    from workers.learner import spawn_learner

    live = _drafter("eagle3")
    cfg = ControllerConfig(policy=Policy.ALWAYS, decide_every_steps=40, fixed_budget=100_000,  # never finishes
                           buffer=BufferConfig(heldout_sequences=1), online=OnlineConfig(lr=1e-3))
    learner = spawn_learner(live, cfg, tmp_path / "learner", max_restarts=0)
    try:
        records = _feedback("eagle3")[0]
        assert ray.get(learner.feed.remote(records[:200]), timeout=120) == 0  # queued, not processed here
        deadline = time.monotonic() + 120
        while ray.get(learner.summary.remote(), timeout=30)["rounds"] < 1:  # the round has started
            assert time.monotonic() < deadline, "no round started"
            time.sleep(0.2)
        assert ray.get(learner.feed.remote(records[200:240]), timeout=30) == 0  # mid-round: returns
        summary = ray.get(learner.summary.remote(), timeout=30)
        assert summary["weights_version"] == 0 and summary["inbox_records"] == 40 and summary["inbox_dropped"] == 0
    finally:
        ray.kill(learner)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="adapt.online.lr"):
        OnlineConfig(lr=0)
    with pytest.raises(ConfigError, match="adapt.guard.margin"):
        GuardConfig(margin=1.5)
    with pytest.raises(ConfigError, match="adapt.decide_every_steps"):
        ControllerConfig(decide_every_steps=0)
    with pytest.raises(ValueError):
        Policy("sometimes")
    with pytest.raises(ConfigError, match="adapt.replay.alpha"):
        dataclasses.replace(ReplayConfig(), alpha=0.7)
    with pytest.raises(ConfigError, match="adapt.sink.max_queue"):
        SinkConfig(max_queue=0)


# ---------------------------------------------------------------------- the CLI
def test_adapt_bench_cli_runs_the_policies_and_logs_decisions(tiny_model_dir, tmp_path):  # noqa: F811
    import json

    import mlflow
    import yaml

    from graftblock.cli import main

    cfg = tmp_path / "drafter.yaml"
    cfg.write_text(yaml.safe_dump({"eagle3": {"checkpoint": "random", "draft_vocab_size": VOCAB,
                                              "total_tokens": 12, "depth": 3, "top_k": 3}}))
    questions = tmp_path / "questions.jsonl"  # Spec-Bench's format; two categories per phase used
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": cat, "turns": [f"t{3 * i} t{3 * i + 1} t{3 * i + 2} t{i}"]}) + "\n"
        for i, cat in enumerate(["writing", "roleplay", "coding", "coding"])))
    out = tmp_path / "adapt.json"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rc = main(["adapt-bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--drafter", "eagle3",
               "--dataset", str(questions),
               "--config", str(cfg), "--policies", "static,always,cost_aware", "--phases", "chat,code",
               "--requests-per-phase", "2", "--max-new-tokens", "24", "--max-prompt-tokens", "32",
               "--decide-every-steps", "6", "--budgets", "0,4", "--fixed-budget", "4", "--guard-window", "4",
               "--heldout", "1", "--json", str(out), "--tracking-uri", uri, "--experiment", "adapt-test"])
    assert rc == 0
    res = json.loads(out.read_text())
    pol = res["policies"]
    assert set(pol) == {"static", "always", "cost_aware"} and res["phases"] == ["chat", "code"]
    assert all(p["lossless"] for p in pol.values())  # same greedy text whatever the updates did
    assert pol["static"]["updates"] == 0 and pol["always"]["updates"] >= 1
    assert pol["cost_aware"]["regret"] is not None and len(pol["always"]["tau_series"]) == 4
    assert {"chat", "code"} == set(pol["always"]["per_phase"])
    # every policy's controller ran on its own serving clock: the others' requests are foreign time
    for name, p in pol.items():
        others = sum(q["serving_s"] for n, q in pol.items() if n != name)
        assert p["foreign_s"] == pytest.approx(others, rel=1e-9) and p["foreign_s"] > 0
    # A benchmark result: its command, environment and controller settings, and the tau plot beside it.
    assert res["kind"] == "adapt_bench" and res["command"].startswith("graftblock adapt-bench --model ")
    assert res["env"]["torch"] and res["controller"]["budgets"] == [0, 4]
    assert (tmp_path / "adapt_tau.png").stat().st_size > 5000
    run = mlflow.MlflowClient(tracking_uri=uri).search_runs(
        [mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name("adapt-test").experiment_id])[0]
    assert run.data.metrics["always.updates"] == pol["always"]["updates"]
    assert any(k.startswith("adapt.always.outcome.applied") for k in run.data.metrics)


def test_adapt_bench_harmful_policy_swaps_once_and_stays_lossless(tiny_model_dir, tmp_path):  # noqa: F811
    """The harmful policy publishes shuffled_head before request --harmful-at; the guard closes the
    watch within the run, static's text is kept token for token, and the result's harmful block
    compares the swap's phase against static's."""
    import json

    import yaml

    from graftblock.cli import main

    cfg = tmp_path / "drafter.yaml"
    cfg.write_text(yaml.safe_dump({"eagle3": {"checkpoint": "random", "draft_vocab_size": VOCAB,
                                              "total_tokens": 12, "depth": 3, "top_k": 3}}))
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": "writing", "turns": [f"t{3 * i} t{3 * i + 1} t{i}"]}) + "\n"
        for i in range(4)))
    out = tmp_path / "harm.json"
    rc = main(["adapt-bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--drafter", "eagle3",
               "--dataset", str(questions), "--config", str(cfg), "--policies", "static,harmful", "--phases", "chat",
               "--requests-per-phase", "4", "--max-new-tokens", "24", "--max-prompt-tokens", "32",
               "--guard-window", "4", "--heldout", "1", "--json", str(out), "--no-mlflow"])
    assert rc == 0
    res = json.loads(out.read_text())
    harm, pol = res["harmful"], res["policies"]
    assert pol["harmful"]["lossless"] is True and pol["static"]["updates"] == 0
    assert pol["harmful"]["updates"] == 1  # the injected swap, and no policy update: static otherwise
    assert harm["at_request"] == 2 and harm["phase"] == "chat"  # default: the middle of the first phase
    assert "--harmful-at 2" in res["command"]
    applied = [d for d in pol["harmful"]["decisions"] if d["injected"]]
    assert [d["outcome"] for d in applied][0] == "applied"
    assert harm["closed_as"] in ("kept", "rolled_back") and harm["rolled_back"] is (harm["closed_as"] == "rolled_back")
    assert 2 <= harm["rollback_request"] <= 3 and harm["requests_to_rollback"] == harm["rollback_request"] - 1
    assert harm["affected_requests"] == harm["requests_to_rollback"]
    walls, static_walls = pol["harmful"]["wall_series"], pol["static"]["wall_series"]
    # Both policies emit the same tokens (lossless), so each speed ratio is the inverse ratio of their walls:
    # over the whole (single) phase, and over the requests before the swap.
    assert harm["phase_tokens_per_s"] == pytest.approx(sum(static_walls) / sum(walls))
    assert harm["before_swap_requests"] == 2
    assert harm["before_swap_tokens_per_s"] == pytest.approx(sum(static_walls[:2]) / sum(walls[:2]))
    assert harm["phase_serving_s"] == pytest.approx(sum(walls)) and len(walls) == 4
    assert harm["cost_share_of_phase"] == pytest.approx(harm["affected_extra_s"] / sum(walls))


@pytest.mark.parametrize("argv, message", [
    (["--policies", "harmful"], "measured against static: add static to --policies"),
    (["--policies", "static,harmful", "--harmful-at", "0"], r"--harmful-at must be in \[1, 7\]"),
    (["--policies", "static,harmful", "--harmful-at", "8"], r"--harmful-at must be in \[1, 7\]"),
    (["--policies", "static,cost_aware", "--harmful-at", "3"], "--harmful-at needs the harmful policy"),
    (["--policies", "static,static"], "--policies names a policy twice"),
])
def test_adapt_bench_harmful_options_are_validated(argv, message):
    import argparse

    from graftblock.adapt import _parse_args, add_adapt_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_adapt_parser(sub)
    args = sub.choices["adapt-bench"].parse_args(["--json", "-", "--phases", "chat,code", "--requests-per-phase", "4",
                                                  *argv])
    with pytest.raises(ConfigError, match=message):
        _parse_args(args)


def test_recovery_counts_requests_until_tau_is_back_within_ten_percent_of_the_phase_end():
    from graftblock.adapt import recovery_requests

    phases = ["chat"] * 3 + ["code"] * 8 + ["math"] * 4
    taus = [1.6, 1.6, 1.6,
            1.0, 1.0, 1.2, 1.5, 1.6, 1.6, 1.6, 1.6,  # code: a dip, then the learner catches up
            1.7, 1.7, 1.6, 1.7]  # math: no dip
    rec = recovery_requests(taus, phases)
    assert set(rec) == {"code", "math"}  # the first phase has no shift before it
    # code's end: mean of its last max(3, 2) = 3 requests, 1.6; the bar 1.44; trailing means of 3:
    # r = 4 -> (1.0 + 1.2 + 1.5) / 3 = 1.23, r = 5 -> 1.43, r = 6 -> 1.57
    assert rec["code"] == 6 and rec["math"] == 1
    # a longer phase's end is the mean of its last quarter: a late rise moves the bar
    late = [1.0] * 12 + [2.0] * 4
    assert recovery_requests([1.0, *late], ["a"] + ["b"] * 16)["b"] == 15  # bar 1.8: (1 + 2 + 2) / 3 is not
