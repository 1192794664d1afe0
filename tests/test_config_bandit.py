"""Config adaptation (adaptation/config_bandit.py) and the adapt-bench stream spec (graftblock/adapt.py).

UCB on constructed rewards; full-information replay checked against live runs of the same arms on
the tiny Llama (greedy, fp32); stream-spec errors; one tiny adapt-bench run over a 2-phase stream.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from adaptation.config_bandit import (
    ConfigArm,
    ConfigBandit,
    ConfigBanditConfig,
    Scorability,
    TrajectoryRecorder,
    arm_scorability,
    VerifyCostTable,
    load_arms,
    replay_arm,
    write_arms,
)
from graftblock.adapt import StreamSpec, stream_questions
from speculation.config import ConfigError, EngineConfig, SamplingConfig
from speculation.drafters import build_drafter
from speculation.engine.solo import generate_speculative
from tests.helpers import shared_tiny_llama, tiny_target
from tests.ray_fixtures import tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
EAGLE = {"checkpoint": "random", "draft_vocab_size": VOCAB, "total_tokens": 12, "depth": 3, "top_k": 3}
ARMS = [
    ConfigArm("retrieval_small", "retrieval", {"budget": 4, "max_depth": 3, "cost_aware": False, "transition_topk": 0}),
    ConfigArm("retrieval_big", "retrieval", {"budget": 16, "max_depth": 8, "cost_aware": False, "transition_topk": 0}),
    ConfigArm("eagle3_k3", "eagle3", EAGLE),
]


# ---------------------------------------------------------------------- UCB on constructed rewards
MEANS = {"slow": 5.0, "best": 15.0, "mid": 9.0}


def _play(rounds: int, seed: int = 0) -> tuple[ConfigBandit, list[float]]:
    """UCB with bandit feedback only; returns the bandit and its cumulative pseudo-regret per round."""
    rng = random.Random(seed)
    bandit = ConfigBandit(tuple(MEANS), ConfigBanditConfig(ucb_scale=1.0, full_information=False))
    best, cum, total = max(MEANS.values()), [], 0.0
    for _ in range(rounds):
        arm = bandit.choose()
        bandit.record(arm, MEANS[arm] + rng.gauss(0.0, 1.0))
        total += best - MEANS[arm]
        cum.append(total)
    return bandit, cum


def test_ucb_finds_the_best_arm_with_sublinear_regret():
    bandit, cum = _play(2000)
    late = bandit.chosen[-500:]
    assert late.count("best") / len(late) > 0.9
    # Sublinear: quadrupling the rounds far less than quadruples the regret (linear would be 4x).
    assert cum[1999] / cum[499] < 2.0
    # A fixed bad arm's regret is linear: (15 - 5) per round.
    assert cum[1999] < 0.05 * 10.0 * 2000
    report = bandit.regret()
    assert report["best_fixed_arm"] == "best" and report["pulls"]["best"] > 1500
    assert 0 <= report["regret"] < 0.05 * 10.0 * 2000 and report["exact"] is False  # other arms imputed


def test_full_information_updates_every_scored_arm_and_exact_regret():
    bandit = ConfigBandit(("a", "b", "c"))
    assert bandit.choose() == "a"  # unobserved arms first, in order
    bandit.record("a", 10.0, {"b": 20.0, "c": 5.0})
    assert {k: s.observations for k, s in bandit.stats.items()} == {"a": 1, "b": 1, "c": 1}
    assert bandit.choose() == "b"  # no exploration pull needed for b: it was scored
    bandit.record("b", 18.0, {"a": 11.0, "c": 4.0})
    rep = bandit.regret()
    assert rep["exact"] is True and rep["best_fixed_arm"] == "b"
    assert rep["regret"] == pytest.approx((20.0 + 18.0) - (10.0 + 18.0))
    with pytest.raises(ConfigError, match="ucb_scale"):
        ConfigBanditConfig(ucb_scale=-1)
    with pytest.raises(ConfigError, match="cost_ema"):
        ConfigBanditConfig(cost_ema=0)


# ---------------------------------------------------------------------- replay == live (greedy fp32)
def test_replay_scores_other_arms_exactly_as_a_live_run_would():
    target = tiny_target(shared_tiny_llama(vocab_size=VOCAB, seed=3))
    engine = EngineConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig(temperature=0.0))
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(8)] * 2 for _ in range(2)]  # repeats: retrieval accepts
    for prompt in prompts:
        live = {}
        for arm in ARMS:  # every arm served live, each with a fresh drafter
            rec = TrajectoryRecorder(build_drafter(arm.spec(), target), record_features=True)
            res = generate_speculative(target, rec, prompt, engine, feedback=rec.feedback)
            live[arm.name] = (res, rec.trajectory(res))
        ref = live[ARMS[0].name][0].tokens
        assert all(r.tokens == ref for r, _ in live.values())  # lossless whatever the arm
        for served, (res, traj) in live.items():
            assert traj.has_features and traj.generated == len(res.tokens)
            cost = VerifyCostTable(0.3)
            for s in res.steps:
                cost.observe(s.tree_size, s.verify_s)
            for arm in ARMS:
                if arm.name == served:
                    continue
                score = replay_arm(build_drafter(arm.spec(), target), traj, cost)
                truth = live[arm.name][0].steps
                assert score.tree_sizes == tuple(s.tree_size for s in truth), (served, arm.name)
                assert score.gained == sum(s.tokens_gained for s in truth)
                assert score.tokens_per_s == pytest.approx(
                    traj.generated / (traj.prefill_s + score.draft_s + score.verify_s))
    accepted = sum(s.accepted for res, _ in live.values() for s in res.steps)
    assert accepted > 0  # the check covered accepted drafts, not only empty trees
    kinds = [arm_scorability(build_drafter(a.spec(), target)) for a in ARMS]
    assert kinds == [Scorability.TOKENS, Scorability.TOKENS, Scorability.FEATURES]
    # A transition table reads the target's top-k at its own tree's nodes: not replayable.
    table = build_drafter(ConfigArm("t", "retrieval", {"cost_aware": False}).spec(), target)
    assert arm_scorability(table) is Scorability.NONE
    with pytest.raises(ValueError, match="not replayable"):
        replay_arm(table, live[ARMS[0].name][1], VerifyCostTable(0.3))


def test_arm_file_round_trip_from_compare_rows(tmp_path):
    from sweeps.compare import Row, pareto_arms

    def row(n, budget, speedup, size, status="FINISHED"):
        return Row(f"r{n}", f"t{n}", status, "trial", "retrieval", n, {"budget": budget, "cost_aware": False},
                   {"speedup": speedup, "mean_tree_size": size})

    rows = [row(0, 4, 1.1, 5.0), row(1, 16, 1.4, 9.0), row(2, 32, 1.2, 12.0), row(3, 64, 9.9, 1.0, "RUNNING")]
    arms = pareto_arms(rows)
    assert [a.name for a in arms] == ["retrieval#1", "retrieval#0"]  # #2 is dominated, #3 unfinished
    path = write_arms(tmp_path / "pareto_front.yaml", arms)
    loaded = load_arms(path)
    assert [a.spec().config.budget for a in loaded] == [16, 4]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"arms": [{"name": "x", "method": "retrieval", "options": {"budget": 0}}]}))
    with pytest.raises(ConfigError, match="config arm 'x'.*budget"):
        load_arms(bad)
    bad.write_text(yaml.safe_dump({"arms": [{"name": "x", "method": ""}]}))
    with pytest.raises(ConfigError, match=r"arms\[0\]\.method"):
        load_arms(bad)


# ---------------------------------------------------------------------- stream spec
def _questions(tmp_path, categories):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(
        json.dumps({"question_id": i, "category": cat, "turns": [f"t{3 * i} t{3 * i + 1} t{3 * i + 2} t{i}"]}) + "\n"
        for i, cat in enumerate(categories)))
    return path


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(phases=[]), r"stream\.phases must be a non-empty list"),
    (lambda d: d["phases"][1].update(requests=0), r"stream\.phases\[1\]\.requests must be an integer >= 1"),
    (lambda d: d["phases"][0].update(source="nope.jsonl"), r"stream\.phases\[0\]\.source 'nope\.jsonl'"),
    (lambda d: d["phases"][1].update(order="random"), r"stream\.phases\[1\]\.order must be one of"),
    (lambda d: d["phases"][1].update(name="chat"), r"stream\.phases\[1\]\.name 'chat' repeats"),
    (lambda d: d["phases"][0].update(categories="writing"), r"stream\.phases\[0\]\.categories"),
    (lambda d: d["phases"][0].update(budget=3), r"stream\.phases\[0\]: unknown field\(s\) \['budget'\]"),
    (lambda d: d.update(requests_per_phase=-2), r"stream\.requests_per_phase"),
])
def test_stream_spec_errors_name_the_field(tmp_path, edit, field):
    q = _questions(tmp_path, ["writing", "coding"])
    doc = {"requests_per_phase": 1, "phases": [{"name": "chat", "source": q.name, "categories": ["writing"]},
                                               {"name": "code", "source": str(q), "categories": ["coding"]}]}
    assert len(StreamSpec.from_dict(json.loads(json.dumps(doc)), tmp_path).phases) == 2
    edit(doc)
    with pytest.raises(ConfigError, match=field):
        StreamSpec.from_dict(doc, tmp_path)


def test_stream_questions_order_and_short_phase(tmp_path):
    q = _questions(tmp_path, ["writing", "writing", "roleplay", "coding"])
    rr = StreamSpec.from_dict({"phases": [{"name": "chat", "source": str(q), "categories": ["writing", "roleplay"],
                                           "requests": 3}]})
    assert [t for _, t in stream_questions(rr)] == ["t0 t1 t2 t0", "t6 t7 t8 t2", "t3 t4 t5 t1"]
    short = StreamSpec.from_dict({"phases": [{"name": "code", "source": str(q), "categories": ["coding"],
                                              "requests": 2}]})
    with pytest.raises(ConfigError, match=r"stream\.phases\[0\]\.requests 2: phase 'code' has only 1"):
        stream_questions(short)
    shipped = StreamSpec.from_yaml(Path(__file__).resolve().parent.parent / "ray_configs" / "stream_domain_shift.yaml")
    assert [p.name for p in shipped.phases] == ["chat", "code", "math", "translation"]
    assert all(p.requests >= 40 for p in shipped.phases)


# ---------------------------------------------------------------------- the CLI, smallest size
def test_adapt_bench_config_policy_over_a_two_phase_stream(tiny_model_dir, tmp_path):  # noqa: F811
    import mlflow

    from graftblock.cli import main

    q = _questions(tmp_path, ["writing", "roleplay", "coding", "coding"])
    stream = tmp_path / "stream.yaml"
    stream.write_text(yaml.safe_dump({"name": "tiny", "requests_per_phase": 2, "phases": [
        {"name": "chat", "source": q.name, "categories": ["writing", "roleplay"]},
        {"name": "code", "source": q.name, "categories": ["coding"], "order": "file"}]}))
    arms = write_arms(tmp_path / "pareto_front.yaml", ARMS)
    cfg = tmp_path / "drafter.yaml"
    cfg.write_text(yaml.safe_dump({"eagle3": EAGLE}))
    out = tmp_path / "adapt.json"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rc = main(["adapt-bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--drafter", "eagle3",
               "--config", str(cfg), "--stream", str(stream), "--policies", "static,config_ucb",
               "--config-arms", str(arms), "--max-new-tokens", "16", "--max-prompt-tokens", "32",
               "--decide-every-steps", "6", "--json", str(out), "--tracking-uri", uri, "--experiment", "cfg-test"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["phases"] == ["chat", "code"] and res["requests_per_phase"] == {"chat": 2, "code": 2}
    for name, p in res["policies"].items():
        assert {"tokens_per_s", "tau", "updates", "rollbacks", "cost_s", "regret"} <= set(p), name
        assert set(p["per_phase"]) == {"chat", "code"} and len(p["tau_series"]) == 4
        assert all(len(p["per_phase"][ph]["tokens_per_s_series"]) == 2 for ph in ("chat", "code"))
        assert p["lossless"] is True
    cfg_pol = res["policies"]["config_ucb"]
    assert len(cfg_pol["arm_series"]) == 4 and set(cfg_pol["arm_series"]) <= {a.name for a in ARMS}
    assert cfg_pol["arm_series"][0] == ARMS[0].name  # UCB tries unobserved arms in order...
    # ...but under greedy every other arm was scored on the first trajectory (full information).
    first = cfg_pol["decisions"][0]
    assert set(first["counterfactual"]) == {a.name for a in ARMS[1:]}
    assert cfg_pol["config_bandit"]["exact"] is True and math.isfinite(cfg_pol["regret"])
    assert cfg_pol["cost_s"] > 0 and res["policies"]["static"]["regret"] is None
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("cfg-test").experiment_id])[0]
    assert run.data.metrics["config_ucb.tokens_per_s"] == pytest.approx(cfg_pol["tokens_per_s"])
    assert "adapt.config_ucb.arm.retrieval_small" in run.data.metrics
    assert "adapt.config_ucb.reward_tokens_per_s" in run.data.metrics
