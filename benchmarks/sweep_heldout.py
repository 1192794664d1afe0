"""Record a finished sweep that has a held-out run (``holdout_categories``) as a benchmark result.

The sweep job writes its comparison (``runs.json``: one row per trial) and ``holdout.json`` (the
best trial's sweep score beside its held-out score) under ``<output_dir>/compare``, and every
trial's bench JSON under ``<output_dir>/artifacts``. This script gathers them into one JSON for
``benchmarks/results/`` (rendered by ``benchmarks/render/``): the searched knobs and metrics of
every trial, and the held-out bench's per-category figures and environment. It measures nothing.

    .venv/bin/python benchmarks/sweep_heldout.py --config ray_configs/sweep_graft.yaml \\
        --json benchmarks/results/sweep_graft_heldout_fp32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tracking
from speculation.bench.runner import emit_json  # noqa: E402
from sweeps.config import load_sweep_config  # noqa: E402

SUBMIT = ("ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m sweeps.run "
          "--config {config} --root $PWD --git-commit $(git rev-parse HEAD)")


def _per_category(bench: dict, method: str) -> dict[str, dict[str, float]]:
    per = bench["methods"][method].get("per_category") or {}
    return {c: {k: per[c][k] for k in ("speedup", "tau", "tokens_per_s") if k in per[c]} for c in sorted(per)}


def _recorded_commit(paths, study: str, number: int) -> str | None:
    """The git commit the sweep's held-out run recorded (``--git-commit`` of the submission)."""
    exp_id = tracking.experiment_id(paths.experiment, paths.tracking_uri)
    runs = tracking.holdout_runs(paths.tracking_uri, exp_id, study, number)
    sha = runs[0].tags.get(tracking.COMMIT_TAG) if runs else None
    return sha[:7] if sha else None


def build(config: Path, root: Path) -> dict:
    cfg = load_sweep_config(config)
    paths = cfg.resolved(root)
    compare_dir = paths.output_dir / "compare"
    held_path = compare_dir / "holdout.json"
    if not held_path.is_file():
        raise SystemExit(f"{held_path} not found: run the sweep (with holdout_categories) first")
    held = json.loads(held_path.read_text())
    rows = json.loads((compare_dir / "runs.json").read_text())
    knobs = [k.name for k in cfg.search_space().knobs]
    trials = []
    for row in sorted((r for r in rows if r.get("trial_number") is not None), key=lambda r: r["trial_number"]):
        config_row = row["config"]
        searched = {}
        for name in knobs:
            head, _, key = name.partition(".")
            searched[name] = config_row.get(head, {}).get(key) if key else config_row.get(head)
        trials.append({"trial_number": row["trial_number"], "status": row["status"], "params": searched,
                       "metrics": row["metrics"]})
    number = held["trial_number"]
    art = paths.artifacts_dir
    trial_bench = json.loads((art / f"trial-{number:04d}.json").read_text())
    held_bench = json.loads((art / f"holdout-trial-{number:04d}.json").read_text())
    method = cfg.method
    env = dict(held_bench["env"])
    if not env.get("git_commit"):  # a Ray job's copy has no .git: the commit is the one the runs record
        env["git_commit"] = _recorded_commit(paths, cfg.study, number)
    return {
        "kind": "sweep_heldout",
        "command": SUBMIT.format(config=config.as_posix()),
        "env": env,
        "study": cfg.study,
        "method": method,
        "objective": cfg.objective.value,
        "bench_config": held_bench["bench_config"],
        "model": held_bench["model"],
        "dtype": held_bench["dtype"],
        "fixed": dict(cfg.fixed),
        "knobs": knobs,
        "sweep_categories": held["sweep_categories"],
        "holdout_categories": held["holdout_categories"],
        "trials": trials,
        "best": {
            "trial_number": number,
            "config": held["config"],
            "sweep": held["sweep"],
            "holdout": held["holdout"],
            "sweep_per_category": _per_category(trial_bench, method),
            "holdout_per_category": _per_category(held_bench, method),
            "sweep_lossless": trial_bench["methods"][method].get("lossless"),
            "holdout_lossless": held_bench["methods"][method].get("lossless"),
            "holdout_vanilla_tokens_per_s": held_bench["baseline_tokens_per_s"],
            "sweep_vanilla_tokens_per_s": trial_bench["baseline_tokens_per_s"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True, help="the sweep YAML the job ran")
    p.add_argument("--root", type=Path, default=ROOT, help="the --root the job was given (default: this checkout)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    emit_json(build(args.config, args.root.resolve()), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
