"""One sweep trial: a bench run (the same ``run_bench`` as ``graftblock bench``) and its MLflow run.

The objective is the swept method's measured speedup over vanilla on the configured subset
(and, multi-objective, its drafting share). Each trial is an MLflow run nested under the sweep's
parent run (tag ``mlflow.parentRunId``) with the resolved method config as params, the bench
metrics (overall and per category) and, as artifacts, the bench JSON and a per-category plot.

:class:`BenchTrainable` is the Ray Tune trainable: with ``reuse_actors=True`` one actor runs
trial after trial and keeps the target model loaded (``reset_config`` returns True).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune

import tracking
from speculation import assets
from speculation.bench.runner import run_bench
from speculation.config import BenchConfig, ConfigError
from speculation.drafters import resolve_methods
from speculation.model.target import TargetModel
from sweeps.space import SearchSpace

#: Metrics every trial reports to Tune (and logs to MLflow without a method prefix).
TRIAL_METRICS = (
    "speedup",
    "tau",
    "tokens_per_s",
    "drafting_share",
    "mean_tree_size",
    "drafting_s_per_step",
    "verify_s_per_step",
)


@dataclass(frozen=True)
class TrialContext:
    """What every trial of one sweep shares (resolved in the driver, shipped to the trainables).

    Attributes:
        study: the study name.
        method: the swept drafter type (also the bench method name).
        space: the searched space (maps Optuna's stored values back to the method's options).
        bench: the bench settings (``methods`` = the swept method).
        categories: question categories to keep (None: all).
        tracking_uri: absolute MLflow URI.
        experiment_id: MLflow experiment id.
        parent_run_id: the sweep's parent run.
        artifacts_dir: absolute directory for trial JSON and plots.
        source: the runs' source (commit passed in by the submitter: the job has no ``.git``).
    """

    study: str
    method: str
    space: SearchSpace
    bench: BenchConfig
    categories: tuple[str, ...] | None
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    artifacts_dir: str
    source: tracking.RunSource


def load_questions(bench: BenchConfig, categories: tuple[str, ...] | None) -> list:
    """The bench's questions, restricted to ``categories`` (an unknown category is an error)."""
    questions = assets.load_questions(bench.dataset, bench.limit_per_category)
    if categories:
        present = sorted({q.category for q in questions})
        missing = [c for c in categories if c not in present]
        if missing:
            raise ConfigError(
                f"sweep.categories: {missing} not in dataset {bench.dataset!r}; present: {present}"
            )
        questions = [q for q in questions if q.category in categories]
    if not questions:
        raise ConfigError(f"sweep: dataset {bench.dataset!r} gave no questions")
    return questions


def objective_metrics(result: dict, method: str) -> dict[str, float]:
    """The swept method's headline metrics from a bench result."""
    m = result["methods"][method]
    return {k: float(m[k]) for k in TRIAL_METRICS if isinstance(m.get(k), (int, float))}


def _plot_categories(result: dict, method: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result["methods"][method].get("per_category") or {}
    cats = sorted(per)
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(cats)), 3))
    ax.bar(cats, [per[c]["speedup"] for c in cats], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("speedup vs vanilla")
    ax.set_title(f"{method}: speedup per category")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bench_logged(ctx: TrialContext, run_id: str, stem: str, method_cfg: dict[str, Any], target,
                  questions: list, extra_params: dict[str, Any]) -> dict[str, float]:
    """Run the bench for ``method_cfg`` into the open MLflow run ``run_id`` and finish it.

    Artifacts are ``<stem>.json`` (the bench result) and ``<stem>-categories.png``. Whatever stops
    the bench settles the run: KILLED when the sweep was stopped, FAILED on an error.
    """
    try:
        t0 = time.perf_counter()
        result = run_bench(ctx.bench, target, questions, {ctx.method: method_cfg})
        wall = time.perf_counter() - t0
        metrics = objective_metrics(result, ctx.method)
        resolved = result["methods"][ctx.method]["config"]
        out_dir = Path(ctx.artifacts_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"{stem}.json"
        json_path.write_text(json.dumps(result, indent=1))
        plot_path = out_dir / f"{stem}-categories.png"
        _plot_categories(result, ctx.method, plot_path)
        flat_params = {f"method.{ctx.method}.{k}": v for k, v in tracking.flatten(resolved).items()}
        flat_params.update({f"bench.{k}": v for k, v in tracking.flatten(result["bench_config"]).items()})
        flat_params.update(extra_params)
        all_metrics = {**tracking.bench_metrics(result), **metrics, "trial_wall_s": wall}
    except (KeyboardInterrupt, SystemExit):  # the sweep was stopped, not a failure of this point
        tracking.set_status(ctx.tracking_uri, run_id, tracking.RunStatus.KILLED)
        raise
    except BaseException:
        tracking.set_status(ctx.tracking_uri, run_id, tracking.RunStatus.FAILED)
        raise
    tracking.finish_run(ctx.tracking_uri, run_id, flat_params, all_metrics, (json_path, plot_path))
    return metrics


def _ray_node_id() -> str:
    """The Ray node this process runs on, or ``"-"`` outside Ray (a trial run in the driver's process)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "-"


def run_trial(
    ctx: TrialContext, number: int, params: dict[str, Any], target, questions: list
) -> dict[str, float]:
    """Run the bench for one point of the space, log it as a nested MLflow run, return metrics.

    A retried trial (same number) reopens its run; a dead actor's run is settled by the driver
    (:class:`sweeps.progress.SettleDeadTrials`).
    """
    # The full resolved config (defaults included) is what the trial ran: log that, not the delta.
    method_cfg = resolve_methods([ctx.method], {ctx.method: ctx.space.options(params)})[0].config_dict()
    run_id = tracking.open_trial_run(
        ctx.tracking_uri, ctx.experiment_id, ctx.parent_run_id, ctx.study, number, ctx.method, method_cfg,
        ctx.source,
    )
    # Which Ray node ran it (the state API maps the id to the node): a multi-node sweep is traceable per trial.
    return _bench_logged(ctx, run_id, f"trial-{number:04d}", method_cfg, target, questions,
                         {"trial_number": number, "ray_node_id": _ray_node_id()})


def load_target(bench: BenchConfig):
    """The bench's target model, with the bench's torch threads."""
    if bench.threads is not None:
        torch.set_num_threads(bench.threads)
    model, tokenizer = assets.load_model_and_tokenizer(bench.model, bench.dtype.torch)
    return TargetModel(model, tokenizer)


def run_holdout(ctx: TrialContext, number: int, method_cfg: dict[str, Any]) -> dict[str, float]:
    """The best trial's resolved config (``method_cfg``, as its run logged it) benched on the
    held-out categories (``ctx.categories``), logged as a nested run of kind ``sweep_holdout``."""
    target = load_target(ctx.bench)
    questions = load_questions(ctx.bench, ctx.categories)
    run_id = tracking.open_holdout_run(
        ctx.tracking_uri, ctx.experiment_id, ctx.parent_run_id, ctx.study, number, ctx.method, method_cfg,
        ctx.source,
    )
    return _bench_logged(ctx, run_id, f"holdout-trial-{number:04d}", method_cfg, target, questions,
                         {"trial_number": number, "holdout_categories": ",".join(ctx.categories or ())})


class BenchTrainable(tune.Trainable):
    """Ray Tune trainable: one ``step`` = one bench run; the target stays loaded across trials."""

    def setup(self, config: dict, context: TrialContext | None = None) -> None:
        if context is None:
            raise ValueError("BenchTrainable needs its TrialContext (tune.with_parameters(..., context=...))")
        self.context = context
        self._target = None
        self._questions = None

    def reset_config(self, new_config: dict) -> bool:
        self.config = new_config
        return True

    def _load(self):
        if self._target is None:
            self._target = load_target(self.context.bench)
            self._questions = load_questions(self.context.bench, self.context.categories)
        return self._target, self._questions

    def save_checkpoint(self, checkpoint_dir: str) -> dict:
        """Nothing to restore: a trial is one bench run, and Optuna's storage is the record."""
        return {"trial_number": self.config.get("_trial_number")}

    def load_checkpoint(self, checkpoint: dict | str) -> None:
        return None

    def step(self) -> dict:
        target, questions = self._load()
        number = int(self.config["_trial_number"])
        params = {k: v for k, v in self.config.items() if not k.startswith("_")}
        metrics = run_trial(self.context, number, params, target, questions)
        return {**metrics, "trial_number": number, "done": True}
