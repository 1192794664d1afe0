"""Compare MLflow runs: a table, a Pareto plot and the best config as a bench-ready YAML.

    graftblock compare --experiment graftblock-sweep-smoke [--tracking-uri URI] [--out-dir DIR]
    python -m sweeps.compare --experiment NAME

Rows are (run, method) pairs: a sweep trial contributes its swept method, a ``graftblock bench``
run every non-vanilla method it measured. Metrics follow the bench JSON names
(``<method>.speedup`` …). The Pareto plot shows speedup against tree size and against
drafting share (front: higher speedup at lower cost); ``pareto_front.yaml`` lists the configs on the
speedup-vs-tree-size front as arms of ``graftblock adapt-bench --config-arms``. ``best_config.yaml`` holds the finished
row best by ``--metric`` (highest speedup by default; cost metrics such as drafting share are
minimised, :data:`METRICS`) as ``<method>: {knob: value, …}``, the format of
``graftblock bench --config``.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console
from rich.table import Table

import tracking
from adaptation.config_bandit import ConfigArm, PARETO_FILE, write_arms
from speculation.config import ConfigError
from speculation.drafters import resolve_methods

if TYPE_CHECKING:
    from adaptation.config_bandit import ConfigArm

class Direction(str, enum.Enum):
    """Whether more of a metric is better (MAX) or less (MIN)."""

    MAX = "max"
    MIN = "min"


#: The metrics a row carries, and which way each is better. Drafting share, tree size (verified
#: tokens per step) and the per-step seconds are costs: minimised.
METRICS: dict[str, Direction] = {
    "speedup": Direction.MAX,
    "tau": Direction.MAX,
    "tokens_per_s": Direction.MAX,
    "mean_tree_size": Direction.MIN,
    "drafting_share": Direction.MIN,
    "drafting_s_per_step": Direction.MIN,
    "verify_s_per_step": Direction.MIN,
}
COLUMNS = tuple(METRICS)


def check_metric(metric: str) -> Direction:
    """The direction of ``metric``; a ConfigError listing the allowed metrics if it is unknown."""
    if metric not in METRICS:
        allowed = ", ".join(f"{m} ({d.value})" for m, d in METRICS.items())
        raise ConfigError(f"--metric must be one of {allowed}; got {metric!r}")
    return METRICS[metric]


@dataclass
class Row:
    """One method measured in one MLflow run."""

    run_id: str
    run_name: str
    status: str
    kind: str
    method: str
    trial_number: int | None
    config: dict[str, Any]
    metrics: dict[str, float | None]


@dataclass
class CompareReport:
    """What :func:`compare` found and wrote."""

    rows: list[Row]
    best: dict[str, Any] | None
    files: list[Path] = field(default_factory=list)


def _parse_param(value: str) -> Any:
    if value == "None":
        return None
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _methods_in(metrics: dict[str, float]) -> list[str]:
    names = set()
    for key in metrics:
        parts = key.split(".")
        if len(parts) == 2 and parts[1] == "speedup" and parts[0] != "vanilla":
            names.add(parts[0])
    return sorted(names)


def _config_for(run: tracking.RunRecord, method: str) -> dict[str, Any]:
    raw = run.tags.get(tracking.CONFIG_TAG)
    if raw and run.tags.get(tracking.METHOD_TAG) == method:
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError:
            cfg = None
        if isinstance(cfg, dict):
            return cfg
    prefix = f"method.{method}."
    return {k[len(prefix) :]: _parse_param(v) for k, v in run.params.items() if k.startswith(prefix)}


def collect_rows(experiment: str, uri: str | None = None, study: str | None = None) -> list[Row]:
    """Rows of every run in ``experiment`` (optionally only one sweep's trials)."""
    _, runs = tracking.experiment_runs(experiment, uri)
    rows: list[Row] = []
    for run in runs:
        tags = run.tags
        kind = tags.get(tracking.KIND_TAG, "")
        if kind in (tracking.SWEEP_KIND, tracking.HOLDOUT_KIND):
            continue
        if study is not None and tags.get(tracking.STUDY_TAG) != study:
            continue
        number = tags.get(tracking.TRIAL_TAG)
        methods = (
            [tags[tracking.METHOD_TAG]] if tracking.METHOD_TAG in tags else _methods_in(run.metrics)
        )
        for method in methods:
            metrics = {
                c: run.metrics.get(f"{method}.{c}", run.metrics.get(c) if number else None)
                for c in COLUMNS
            }
            rows.append(
                Row(
                    run_id=run.run_id,
                    run_name=run.run_name,
                    status=run.status,
                    kind=kind,
                    method=method,
                    trial_number=int(number) if number is not None else None,
                    config=_config_for(run, method),
                    metrics=metrics,
                )
            )
    return rows


def pareto_front(
    points: Sequence[tuple[float, float]], directions: tuple[Direction, Direction] = (Direction.MIN, Direction.MAX)
) -> list[int]:
    """Indices of the points no other point dominates, ``directions`` saying which way x and y are
    better. Point b dominates a when b is at least as good on both axes and better on one."""

    def better_eq(b: float, a: float, d: Direction) -> bool:
        return b >= a if d == Direction.MAX else b <= a

    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            better_eq(x2, x, directions[0]) and better_eq(y2, y, directions[1]) and (x2 != x or y2 != y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _label(r: Row) -> str:
    return f"#{r.trial_number}" if r.trial_number is not None else r.method


def pareto_axes(metric: str) -> list[str]:
    """The x metrics ``metric`` is plotted against: two of tree size, drafting share and speedup."""
    return [m for m in ("mean_tree_size", "drafting_share", "speedup") if m != metric][:2]


def plot_pareto(rows: list[Row], path: Path, metric: str = "speedup") -> Path:
    """``metric`` against two cost/benefit axes (:func:`pareto_axes`), the Pareto front (by each
    metric's direction, :data:`METRICS`) highlighted; matplotlib Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ydir = check_metric(metric)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, xkey in zip(axes, pareto_axes(metric)):
        pts = [
            (r, r.metrics[xkey], r.metrics[metric])
            for r in rows
            if r.metrics.get(xkey) is not None and r.metrics.get(metric) is not None
        ]
        if not pts:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            xy = [(x, y) for _, x, y in pts]
            front = set(pareto_front(xy, (METRICS[xkey], ydir)))
            ax.scatter([x for x, _ in xy], [y for _, y in xy], c="tab:grey", label="runs")
            fr = sorted(xy[i] for i in front)
            ax.plot([x for x, _ in fr], [y for _, y in fr], "o-", c="tab:red", label="Pareto front")
            for i, (r, x, y) in enumerate(pts):
                if i in front:
                    ax.annotate(_label(r), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if metric == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(f"{xkey} ({METRICS[xkey].value} is better)")
        ax.set_ylabel(f"{metric} ({ydir.value} is better)")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def best_row(rows: list[Row], metric: str = "speedup") -> Row | None:
    """The finished row best by ``metric`` (highest, or lowest for a minimised metric)."""
    direction = check_metric(metric)
    done = [r for r in rows if r.status == "FINISHED" and r.metrics.get(metric) is not None]
    if not done:
        return None
    pick = max if direction == Direction.MAX else min
    return pick(done, key=lambda r: r.metrics[metric])


def best_config(row: Row) -> dict[str, dict[str, Any]]:
    """``{method: options}`` for ``graftblock bench --config`` (checked by resolving it)."""
    opts = {k: v for k, v in row.config.items() if k != "type"}
    if "type" in row.config and row.config["type"] != row.method:
        opts = {"type": row.config["type"], **opts}
    out = {row.method: opts}
    resolve_methods([row.method], out)  # the file must load in `graftblock bench --config`
    return out


def pareto_arms(rows: list[Row], metric: str = "speedup") -> list[ConfigArm]:
    """The finished rows on the Pareto front of ``metric`` against the first of
    :func:`pareto_axes` (tree size for speedup), as config-bandit arms
    (:mod:`adaptation.config_bandit`), best ``metric`` first."""
    xkey = pareto_axes(metric)[0]
    done = [r for r in rows if r.status == "FINISHED" and r.metrics.get(metric) is not None
            and r.metrics.get(xkey) is not None]
    front = pareto_front([(r.metrics[xkey], r.metrics[metric]) for r in done], (METRICS[xkey], METRICS[metric]))
    picked = sorted((done[i] for i in front), key=lambda r: r.metrics[metric], reverse=METRICS[metric] == Direction.MAX)
    arms, seen = [], set()
    for r in picked:
        name = f"{r.method}{_label(r)}" if r.trial_number is not None else f"{r.method}@{r.run_name}"
        while name in seen:
            name += "'"
        seen.add(name)
        try:
            opts = best_config(r)[r.method]
        except ConfigError:  # a row whose options no longer resolve cannot be served as an arm
            continue
        arms.append(ConfigArm(name, r.method, opts, {k: v for k, v in r.metrics.items() if v is not None}))
    return arms


def render_table(rows: list[Row], title: str, console=None) -> None:
    console = console or Console(width=160)  # job logs are not a terminal: do not squeeze to 80
    knobs = sorted({k for r in rows for k in r.config if k != "type"})
    varying = [k for k in knobs if len({json.dumps(r.config.get(k), default=str) for r in rows}) > 1]
    t = Table(title=title)
    for col in ("run", "method", "status", *varying, *COLUMNS):
        t.add_column(col, justify="left" if col in ("run", "method", "status") else "right")
    for r in sorted(rows, key=lambda r: -(r.metrics.get("speedup") or 0.0)):
        cells = [_label(r) if r.trial_number is not None else r.run_name, r.method, r.status]
        cells += [str(r.config.get(k)) for k in varying]
        cells += ["-" if r.metrics.get(c) is None else f"{r.metrics[c]:.3f}" for c in COLUMNS]
        t.add_row(*cells)
    console.print(t)


def compare(
    experiment: str,
    uri: str | None,
    out_dir: str | Path,
    study: str | None = None,
    metric: str = "speedup",
    console=None,
) -> CompareReport:
    """Collect rows, print the table, write ``pareto.png``, ``runs.json``, ``pareto_front.yaml``
    (the front's configs: config-bandit arms) and ``best_config.yaml`` (best by ``metric`` in its direction)."""
    check_metric(metric)
    rows = collect_rows(experiment, uri, study)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    render_table(rows, f"{experiment}: {len(rows)} row(s)", console)
    files = [plot_pareto(rows, out / "pareto.png", metric)]
    runs_json = out / "runs.json"
    runs_json.write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    files.append(runs_json)

    arms = pareto_arms(rows, metric)
    if arms:  # the arm set of `graftblock adapt-bench --config-arms` (config adaptation)
        files.append(write_arms(out / PARETO_FILE, arms, f"# Pareto front ({metric} vs {pareto_axes(metric)[0]}) "
                                f"of MLflow experiment {experiment!r}\n"))
    best = best_row(rows, metric)
    best_info = None
    if best is not None:
        cfg = best_config(best)
        path = out / "best_config.yaml"
        header = (
            f"# best by {metric} in MLflow experiment {experiment!r}: run {best.run_id}"
            + (f", trial {best.trial_number}" if best.trial_number is not None else "")
            + "\n"
            + f"# use: graftblock bench --methods vanilla,{best.method} --config {path.name}\n"
        )
        path.write_text(header + yaml.safe_dump(cfg, sort_keys=True))
        files.append(path)
        best_info = {
            "run_id": best.run_id,
            "trial_number": best.trial_number,
            "method": best.method,
            "config": cfg[best.method],
            "metrics": best.metrics,
        }
    return CompareReport(rows=rows, best=best_info, files=files)


def build_parser(prog: str = "python -m sweeps.compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Compare MLflow runs (table, Pareto plot, best config)."
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", required=True, help="MLflow experiment name")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--study", default=None, help="only the trials of this sweep study")
    p.add_argument(
        "--metric",
        default="speedup",
        choices=list(METRICS),
        help="what 'best' and the Pareto plot optimise (default speedup); "
        + ", ".join(f"{m}: {d.value}" for m, d in METRICS.items()),
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where to write pareto.png, runs.json, best_config.yaml (default runs/compare/<experiment>)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    console = Console(width=160)
    out = Path(args.out_dir) if args.out_dir else Path("runs") / "compare" / args.experiment
    report = compare(
        args.experiment, args.tracking_uri, out, study=args.study, metric=args.metric, console=console
    )
    if report.best is None:
        console.print(f"no finished run with a {args.metric} yet")
    else:
        b = report.best
        console.print(
            f"best: {b['method']} run {b['run_id']}"
            + (f" (trial {b['trial_number']})" if b["trial_number"] is not None else "")
            + f", {args.metric} {b['metrics'][args.metric]:.3f}"
        )
    for f in report.files:
        console.print(f"wrote {f.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_from_args(args)
    except (ConfigError, tracking.TrackingError) as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
