"""The closed-loop A/B frame (``speculation.bench.ab``): flags checked before any weights load, arms
alternating with the first arm alternating too, and paired ratios per repeat."""

from __future__ import annotations

import argparse

import pytest

from speculation.bench import ab


def _parser(**kw) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ab_script", exit_on_error=False)
    ab.add_args(ap, dtypes=("bfloat16", "float32"), concurrency="8,16", questions=3, repeats=2, **kw)
    return ap


@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "0"], "--concurrency values must be in [1, 1024], got '0'"),
    (["--concurrency", "a,b"], "--concurrency must be comma-separated integers"),
    (["--concurrency", ""], "--concurrency needs at least one level"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--kernel-calls", "0"], "--kernel-calls must be >= 1, got 0"),
])
def test_bad_flags_exit_with_the_flag_named(argv, message, capsys):
    ap = _parser(kernel_calls=40)
    with pytest.raises(SystemExit) as exc:
        ab.levels(ap, ap.parse_args(argv))
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_defaults_and_the_optional_kernel_flag():
    args = _parser().parse_args([])
    assert ab.levels(_parser(), args) == [8, 16] and args.dtype == "bfloat16" and not hasattr(args, "kernel_calls")
    assert _parser(kernel_calls=40).parse_args([]).kernel_calls == 40


def test_arms_alternate_and_the_paired_ratio_is_first_over_second():
    calls = []
    speed = {"a": 20.0, "b": 10.0}

    def run(n: int, arm: str) -> dict:
        calls.append((n, arm))
        k = sum(1 for c in calls if c[1] == arm)  # the arm's k-th run: a drifting host
        return {"tokens_per_s": speed[arm] * n / k, "itl_p50_s": 0.01 * k, "lossless": arm == "a" or 0.5}

    rows = ab.alternate(("a", "b"), [1, 4], 3, run)
    assert calls == [(1, "a"), (1, "b"), (4, "a"), (4, "b"),  # repeat 1: a first
                     (1, "b"), (1, "a"), (4, "b"), (4, "a"),  # repeat 2: b first
                     (1, "a"), (1, "b"), (4, "a"), (4, "b")]
    out = ab.paired(rows[4], ("tokens_per_s", "itl_p50_s"))
    assert list(out["arms"]) == ["a", "b"]
    assert out["ratio_tokens_per_s_paired"] == pytest.approx([2.0, 2.0, 2.0])  # each repeat against its pair
    assert out["ratio_median"] == pytest.approx(2.0) and out["repeats_faster"] == 3
    assert out["arms"]["a"]["lossless"] == [True, True, True] and out["arms"]["b"]["lossless"] == [0.5] * 3
    assert out["arms"]["b"]["tokens_per_s"] == pytest.approx(40 / 4)  # b ran N = 4 as its 2nd, 4th, 6th run
