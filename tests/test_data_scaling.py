"""benchmarks/data_scaling.py on manifests shaped like the trainer's (``graftblock train``):
the log-linear fit and its extrapolation, tau at equal training tokens, clear errors on bad
``--run`` arguments, and a JSON the report renders."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import data_scaling
from benchmarks.render import RENDERERS


def _manifest(tokens: list[int], a: float, b: float, wall_s: float, source: str) -> dict:
    """A trainer manifest whose held-out tau follows ``a + b * log2(tokens)`` exactly."""
    curve = [{"tokens": t, "tau": (1.0 if t == 0 else a + b * math.log2(t)), "acc_0": 0.4,
              "accept_ge": [0.4, 0.1, 0.02, 0.0, 0.0, 0.0], "elapsed_s": wall_s * t / tokens[-1]} for t in tokens]
    return {"target": {"name": "smollm2-135m"}, "data": {"source": source},
            "training": {"tokens": tokens[-1], "wall_s": wall_s, "steps": 10,
                         "config": {"eval_prompts": 16, "eval_max_new_tokens": 64,
                                    "eval_tree": {"total_tokens": 48, "depth": 5, "top_k": 8}}},
            "tau_curve": curve, "command": "graftblock train eagle3 --dtype bfloat16 --threads 1"}


def test_fit_recovers_the_law_and_solves_for_the_target_tokens():
    m = _manifest([0, 1000, 2000, 4000, 8000], a=0.2, b=0.1, wall_s=80.0, source="sharegpt")
    c = data_scaling.curve_of("raw", m)
    assert c["fit"]["b_per_doubling"] == pytest.approx(0.1) and c["fit"]["a"] == pytest.approx(0.2)
    assert c["fit"]["points"] == 4 and c["fit"]["fitted_tokens"] == [1000, 8000]  # tokens = 0 is not fitted
    assert c["fit"]["rmse"] == pytest.approx(0.0, abs=1e-9)
    reach = c["reach"]["2.5"]
    assert reach["tokens"] == pytest.approx(2 ** 23)  # 0.2 + 0.1 * 23 = 2.5
    assert reach["cpu_hours"] == pytest.approx(2 ** 23 / (8000 / 80.0) / 3600)
    assert c["threads"] == "1" and c["dtype"] == "bfloat16"


def test_cpu_hours_leave_out_the_tau_evaluations_when_their_seconds_are_known(tmp_path):
    m = _manifest([0, 1000, 2000, 4000, 8000], a=0.2, b=0.1, wall_s=80.0, source="sharegpt")
    for p in m["tau_curve"]:
        p["eval_s"] = 4.0  # five evaluations: 20 of the 80 wall seconds
    c = data_scaling.curve_of("raw", m)
    assert c["rate_basis"] == "training" and c["eval_s"] == 20.0
    assert c["tokens_per_s"] == pytest.approx(8000 / 60.0) and c["tokens_per_s_end_to_end"] == pytest.approx(100.0)
    assert c["reach"]["2.5"]["cpu_hours"] == pytest.approx(2 ** 23 / (8000 / 60.0) / 3600)
    # a run that predates the field: its checkpoints hold each evaluation's seconds
    del m["tau_curve"][2]["eval_s"]
    assert data_scaling.curve_of("raw", m)["rate_basis"] == "end_to_end"
    ck = tmp_path / "checkpoints" / "tokens_0000002000"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text(json.dumps({"heldout": {"heldout.tau_eval_s": 4.0}}))
    assert data_scaling.curve_of("raw", m, tmp_path)["eval_s"] == 20.0


def test_a_curve_that_does_not_rise_never_reaches_a_target():
    m = _manifest([0, 1000, 2000], a=1.5, b=0.0, wall_s=10.0, source="sharegpt")
    assert data_scaling.curve_of("flat", m)["reach"] == {"2.5": None, "3.0": None}


def test_equal_tokens_pairs_common_points_and_nearest_pairs_tolerates_batch_ends():
    raw = data_scaling.curve_of("raw", _manifest([0, 1000, 2000], 1.0, 0.01, 10.0, "sharegpt"))
    dist = data_scaling.curve_of("distilled", _manifest([0, 1000, 2000], 1.0, 0.02, 10.0, "distilled"))
    eq = data_scaling.equal_tokens([raw, dist])
    assert [e["tokens"] for e in eq] == [1000, 2000]  # tokens = 0 (both untrained) is not a comparison
    assert eq[-1]["ratio"] == pytest.approx((1.0 + 0.02 * math.log2(2000)) / (1.0 + 0.01 * math.log2(2000)))
    assert eq[-1]["of"] == "distilled / raw"
    shifted = data_scaling.curve_of("distilled", _manifest([0, 1030, 2500], 1.0, 0.02, 10.0, "distilled"))
    assert data_scaling.equal_tokens([raw, shifted]) == []
    near = data_scaling.nearest_pairs([raw, shifted])
    assert [(e["tokens"], e["tokens_other"]) for e in near] == [(1000, 1030)]  # 2500 is more than 5% from 2000


def test_bad_run_arguments_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="--run must be LABEL=DIR"):
        data_scaling.main(["--run", "raw", "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match=r"no manifest at .*missing"):
        data_scaling.main(["--run", f"raw={tmp_path / 'missing'}", "--json", str(tmp_path / "x.json")])


def test_main_writes_json_and_plot_that_the_report_renders(tmp_path):
    for label, b in (("raw", 0.05), ("distilled", 0.08)):
        (tmp_path / label / "final").mkdir(parents=True)
        (tmp_path / label / "final" / "manifest.json").write_text(
            json.dumps(_manifest([0, 1000, 2000, 4000], 1.0, b, 40.0, label)))
    feats = tmp_path / "raw" / "features"
    feats.mkdir()
    (feats / "meta.json").write_text("{}")
    save_file({"input_ids": torch.zeros(100, dtype=torch.int32), "aux": torch.zeros(100, 12, dtype=torch.bfloat16)},
              str(feats / "shard_00000.safetensors"))
    out = tmp_path / "res" / "data_scaling_eagle3_bf16.json"
    assert data_scaling.main(["--run", f"raw={tmp_path / 'raw'}", "--run", f"distilled={tmp_path / 'distilled'}",
                              "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "data_scaling" and res["dtype"] == "bfloat16" and res["model"] == "smollm2-135m"
    assert [c["label"] for c in res["curves"]] == ["raw", "distilled"]
    assert (tmp_path / "res" / "data_scaling_eagle3_bf16_tau.png").stat().st_size > 1000
    cache = res["curves"][0]["feature_cache"]
    size = (feats / "shard_00000.safetensors").stat().st_size
    assert cache["tokens"] == 100 and cache["bytes"] == size and cache["bytes_per_million_tokens"] == size * 1e4
    assert res["curves"][1]["feature_cache"] is None  # the distilled run's cache is gone
    lines = RENDERERS["data_scaling"](res)
    table = "\n".join(lines)
    assert "| raw | `raw` | 4.0K |" in table and "| distilled | `distilled` | 4.0K |" in table
    assert f"**{res['equal_tokens'][-1]['ratio']:.2f}×**" in table
