"""The load ramp's statistics and verdict (``benchmarks/load_stats.py``), without a server or locust.
The live ramp runs in ``tests/test_serve.py`` (two short stages) and ``make load`` (the full ramp)."""

from __future__ import annotations

import pytest

from benchmarks.load_stats import LoadConfig, StageStats, default_stages, verdict


def _stage(users: int, itl: list[float], errors: dict[str, int] | None = None) -> dict:
    st = StageStats(users, seconds=2.0, finished=len(itl), tokens=10 * len(itl), ttft=[0.1] * len(itl), itl=itl)
    st.errors.update(errors or {})
    return st.to_json()


def test_stage_statistics():
    s = _stage(2, [0.01, 0.02, 0.03, 0.04])
    assert s["goodput_tokens_per_s"] == pytest.approx(40 / 2.0)
    assert s["itl_p50_s"] in (0.02, 0.03) and s["itl_p99_s"] == 0.04
    assert StageStats(1).to_json()["goodput_tokens_per_s"] is None  # no time measured yet


def test_default_stages_ramp_from_one_user_to_four_times_saturation():
    assert default_stages(8) == (1, 4, 8, 16, 24, 32)
    assert default_stages(1) == (1, 2, 3, 4)


@pytest.mark.parametrize("loaded,lost,met,why", [
    (_stage(16, [0.05] * 10), 0, True, "within 3x"),
    (_stage(16, [0.05] * 9 + [0.5]), 0, False, "p99 ITL 10x"),
    (_stage(16, [0.05] * 10, {"503": 1}), 0, False, "a 5xx"),
    (_stage(16, [0.05] * 10, {"stream_error:replica_lost": 1}), 0, False, "an error event in a stream"),
    (_stage(16, [0.05] * 10, {"429": 2}), 0, True, "429 is admission control, not a server error"),
    (_stage(16, [0.05] * 10), 1, False, "a lost request"),
])
def test_verdict_at_twice_saturation(loaded, lost, met, why):
    result = {"stages": [_stage(1, [0.05] * 10), _stage(8, [0.05] * 10), loaded], "lost": lost}
    v = verdict(result, saturation=8)
    assert v["evaluated"] and v["users"] == 16
    assert v["met"] is met, why


def test_verdict_needs_the_one_user_and_twice_saturation_stages():
    assert verdict({"stages": [_stage(8, [0.05])], "lost": 0}, saturation=8)["evaluated"] is False


@pytest.mark.parametrize("kwargs,needle", [
    ({"base_url": "http://10.1.2.3:8000"}, "loopback"),
    ({"prompts": ()}, "load.prompts"),
    ({"stages": (1, 0)}, "load.stages"),
    ({"stage_seconds": 0}, "load.stage_seconds"),
    ({"max_tokens": 0}, "load.max_tokens"),
])
def test_load_config_is_validated(kwargs, needle):
    base = {"base_url": "http://127.0.0.1:8000", "prompts": ("hi",), "model": "m", "stages": (1, 2)}
    with pytest.raises(ValueError, match=needle):
        LoadConfig(**{**base, **kwargs})
