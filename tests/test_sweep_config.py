"""Sweep configs and search spaces: validation against the method's config dataclass (< 2 s)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from speculation.config import ConfigError, RetrievalConfig
from sweeps.config import Objective, SweepConfig, load_sweep_config
from sweeps.space import build_space

REPO = Path(__file__).resolve().parent.parent
SPACE = {"budget": {"type": "int", "low": 4, "high": 32, "log": True}}


def _write(tmp_path, data) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("name", ["sweep_smoke.yaml", "sweep_retrieval.yaml", "sweep_graft.yaml", "sweep_specblock.yaml"])
def test_shipped_sweep_configs_load(name):
    cfg = load_sweep_config(REPO / "ray_configs" / name)
    assert cfg.search_space().knobs
    assert cfg.bench_config().methods == (cfg.method,)


def test_unknown_knob_is_named_with_the_valid_ones():
    with pytest.raises(ConfigError) as exc:
        build_space("retrieval", {"budgett": {"type": "int", "low": 1, "high": 4}})
    msg = str(exc.value)
    assert "unknown knob(s) ['budgett']" in msg and "RetrievalConfig" in msg
    assert "valid knobs: ['budget', 'cost_aware'" in msg


def test_valid_knobs_are_the_config_fields():
    import dataclasses

    space = build_space("retrieval", SPACE)
    assert space.valid_knobs() == sorted(f.name for f in dataclasses.fields(RetrievalConfig))


@pytest.mark.parametrize(
    "space,match",
    [
        ({"budget": 8}, r"sweep.space.budget: expected a mapping"),
        (
            {"budget": {"low": 1, "high": 4}},
            r"sweep.space.budget.type must be one of int, float, categorical",
        ),
        ({"budget": {"type": "int", "low": 8, "high": 4}}, r"low \(8\) must be <= high \(4\)"),
        ({"budget": {"type": "int", "low": 1.5, "high": 4}}, r"budget.low must be an integer"),
        (
            {"min_token_prob": {"type": "float", "low": 0.0, "high": 0.2, "log": True}},
            r"log: true needs low > 0",
        ),
        ({"transition_topk": {"type": "categorical"}}, r"needs a non-empty 'choices' list"),
        ({"budget": {"type": "int", "low": 1, "high": 4, "tries": 3}}, r"unknown key\(s\) \['tries'\]"),
        (
            {"budget": {"type": "int", "low": 1, "high": 1000}},
            r"sweep.space.budget: value 1000 is invalid: .*\[1, 512\]",
        ),
        ({"transition_topk": {"type": "categorical", "choices": [4, 99]}}, r"value 99 is invalid"),
    ],
)
def test_malformed_spaces(space, match):
    with pytest.raises(ConfigError, match=match):
        build_space("retrieval", space)


def test_fixed_knobs_are_checked():
    with pytest.raises(ConfigError, match=r"sweep.fixed: unknown knob\(s\) \['nope'\]"):
        build_space("retrieval", SPACE, {"nope": 1})
    with pytest.raises(ConfigError, match=r"both searched \(space\) and fixed"):
        build_space("retrieval", SPACE, {"budget": 8})
    with pytest.raises(ConfigError, match=r"retrieval.max_depth must be in"):
        build_space("retrieval", SPACE, {"max_depth": 0})


def test_method_must_have_knobs():
    with pytest.raises(ConfigError, match=r"sweep.method 'vanilla' has no knobs"):
        build_space("vanilla", SPACE)
    with pytest.raises(ConfigError, match=r"unknown type 'medusa'"):
        build_space("medusa", SPACE)


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"trials": 0}, r"sweep.trials must be an integer in \[1, 100000\]"),
        ({"objective": "tau"}, r"sweep.objective must be one of speedup, speedup_vs_drafting"),
        ({"bench": {"methods": ["vanilla"]}}, r"sweep.bench.methods is set by the sweep"),
        ({"bench": {"max_new_tokens": 0}}, r"bench.max_new_tokens must be in"),
        ({"study": "a b"}, r"sweep.study must be"),
        ({"categories": "humaneval"}, r"sweep.categories must be a non-empty list"),
        ({"budget": 3}, r"unknown key\(s\) \['budget'\]"),
    ],
)
def test_bad_sweep_configs(tmp_path, patch, match):
    data = {"study": "s", "method": "retrieval", "space": SPACE, **patch}
    with pytest.raises(ConfigError, match=match):
        load_sweep_config(_write(tmp_path, data))


def test_missing_required_key_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required key 'space'"):
        load_sweep_config(_write(tmp_path, {"study": "s", "method": "retrieval"}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("study: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sweep_config(bad)


def test_paths_resolve_against_root(tmp_path):
    cfg = SweepConfig(
        study="s", method="retrieval", space=SPACE, storage="sqlite:///db/optuna.db", output_dir="out"
    )
    paths = cfg.resolved(tmp_path)
    assert paths.storage == f"sqlite:///{tmp_path.resolve() / 'db' / 'optuna.db'}"
    assert paths.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert paths.output_dir == tmp_path.resolve() / "out" and paths.experiment == "graftblock-sweep-s"
    server = SweepConfig(
        study="s",
        method="retrieval",
        space=SPACE,
        tracking_uri="http://mlflow:5000",
        storage="postgresql://u@h/db",
    ).resolved(tmp_path)
    assert server.tracking_uri == "http://mlflow:5000" and server.storage == "postgresql://u@h/db"


def test_define_by_run_samples_inside_the_space():
    cfg = load_sweep_config(REPO / "ray_configs" / "sweep_smoke.yaml")
    space = cfg.search_space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        out = space.define_by_run(trial)
        assert out == {"_trial_number": trial.number}
        resolved = space.resolve(trial.params)
        assert 4 <= resolved["budget"] <= 32 and resolved["transition_topk"] in (2, 4)
        assert resolved["cost_aware"] is False
        study.tell(trial, 1.0)


def test_list_valued_choices_round_trip_through_optuna():
    """Graft's prune stages are lists: Optuna stores their labels, resolve() maps them back."""
    space = build_space("graft", {"stages": {"type": "categorical", "choices": [[0, 1, 5], [1, 5], [0]]},
                                  "threshold": {"type": "float", "low": 0.1, "high": 0.9}})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(15):
        trial = study.ask()
        space.define_by_run(trial)
        assert trial.params["stages"] in ("[0, 1, 5]", "[1, 5]", "[0]")
        stages = space.resolve(trial.params)["stages"]
        assert stages in ((0, 1, 5), (1, 5), (0,))
        seen.add(stages)
        study.tell(trial, 1.0)
    assert len(seen) > 1
    with pytest.raises(ConfigError, match="graft.stages must be strictly ascending"):
        build_space("graft", {"stages": {"type": "categorical", "choices": [[0, 1], [5, 1]]}})
    with pytest.raises(ConfigError, match="lists of scalars"):
        build_space("graft", {"stages": {"type": "categorical", "choices": [[[0]]]}})


def test_trial_options_map_labels_back_as_the_trial_runs_them():
    """The trainable builds the method from Optuna's stored params: list labels become lists again
    (the bench would refuse the string "[0, 1, 5]")."""
    from speculation.drafters import resolve_methods

    space = build_space("graft", {"stages": {"type": "categorical", "choices": [[0, 1, 5], [1, 5]]}},
                        {"threshold": 0.2})
    opts = space.options({"stages": "[1, 5]"})
    assert opts == {"threshold": 0.2, "stages": (1, 5)}
    assert resolve_methods(["graft"], {"graft": opts})[0].config.stages == (1, 5)


def test_dotted_knobs_search_the_graft_tree_drafter_with_stages_in_forwards():
    """Graft over SpecBlock: block size and stages searched together; stages counted in drafter
    forwards stay valid for every block size ([0, 1, 2] forwards = [0, K, 2K] levels)."""
    space = build_space(
        "graft",
        {"tree_drafter.block_size": {"type": "int", "low": 2, "high": 4},
         "stages": {"type": "categorical", "choices": [[0, 1], [0, 1, 2], [1, 2]]}},
        {"tree_drafter": {"type": "specblock"}, "stage_unit": "forwards"},
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(20):
        trial = study.ask()
        space.define_by_run(trial)
        k = trial.params["tree_drafter.block_size"]
        cfg = space.resolve(trial.params)
        assert cfg["tree_drafter"]["type"] == "specblock" and cfg["tree_drafter"]["block_size"] == k
        forwards = {"[0, 1]": (0, 1), "[0, 1, 2]": (0, 1, 2), "[1, 2]": (1, 2)}[trial.params["stages"]]
        assert cfg["stages"] == tuple(s * k for s in forwards)
        assert cfg["stage_unit"].value == "levels"  # stored resolved
        seen.add(k)
        study.tell(trial, 1.0)
    assert seen == {2, 3, 4}
    # Without a nested section fixed, the default (EAGLE-3) section is the base of a dotted knob.
    eagle = build_space("graft", {"tree_drafter.top_k": {"type": "int", "low": 2, "high": 6}})
    assert eagle.resolve({"tree_drafter.top_k": 3})["tree_drafter"]["type"] == "eagle3"
    with pytest.raises(ConfigError, match=r"sweep.space.threshold.x: 'threshold' is not a nested section"):
        build_space("graft", {"threshold.x": {"type": "int", "low": 1, "high": 2}})
    with pytest.raises(ConfigError, match=r"unknown knob\(s\) \['nope.block_size'\]"):
        build_space("graft", {"nope.block_size": {"type": "int", "low": 1, "high": 2}})
    with pytest.raises(ConfigError, match=r"tree_drafter.block_size: value 17 is invalid"):
        build_space("graft", {"tree_drafter.block_size": {"type": "int", "low": 2, "high": 17}},
                    {"tree_drafter": {"type": "specblock"}})


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"holdout_categories": ["xsum"]}, r"sweep.holdout_categories needs sweep.categories"),
        ({"categories": ["xsum"], "holdout_categories": "asdiv"}, r"non-empty list of category names"),
        ({"categories": ["xsum"], "holdout_categories": []}, r"non-empty list of category names"),
        ({"categories": ["xsum", "asdiv"], "holdout_categories": ["asdiv", "nq_open"]},
         r"sweep.holdout_categories \['asdiv'\] are also in sweep.categories"),
    ],
)
def test_holdout_categories_are_validated(tmp_path, extra, match):
    data = {"study": "s", "method": "retrieval", "space": SPACE, **extra}
    with pytest.raises(ConfigError, match=match):
        load_sweep_config(_write(tmp_path, data))


def test_holdout_categories_load():
    cfg = SweepConfig(study="s", method="retrieval", space=SPACE, categories=["xsum"], holdout_categories=["asdiv"])
    assert cfg.holdout_categories == ("asdiv",) and cfg.to_dict()["holdout_categories"] == ["asdiv"]


def test_objectives():
    assert Objective.SPEEDUP.metrics == ["speedup"] and Objective.SPEEDUP.directions == ["maximize"]
    assert Objective.SPEEDUP_VS_DRAFTING.modes == ["max", "min"]
