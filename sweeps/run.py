"""The sweep job: an Optuna study run by Ray Tune, every trial a bench run logged to MLflow.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m sweeps.run --config ray_configs/sweep_smoke.yaml --root $PWD

Steps:

1. load and validate the config (knobs against the method's config dataclass), resolve every
   path against ``--root`` and check the tracking URI answers;
2. open the study in the RDB storage and settle trials a killed run left RUNNING
   (:mod:`sweeps.resume`); run only the trials still missing;
3. open (or reuse) the MLflow parent run; Tune runs :class:`~sweeps.objective.BenchTrainable`
   with ``OptunaSearch(storage=…)``, ``reuse_actors=True`` and the concurrency limit, printing
   progress lines;
4. write the comparison (table, Pareto plot, best config YAML) and attach it to the parent run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speculation.config import ConfigError
from sweeps.config import ResolvedPaths, SweepConfig, load_sweep_config


def _storage(url: str):
    import optuna

    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        # Several Tune callbacks touch the study; give SQLite a generous lock timeout.
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(url)


def _bench_for(cfg: SweepConfig, root: Path):
    """The bench config with a relative dataset path (and ``spec_bench``) resolved against ``root``.

    A Ray job runs in a temporary copy of the checkout, where ``../shared`` does not exist.
    """
    import dataclasses

    from speculation import assets

    bench = cfg.bench_config()
    ds = bench.dataset
    if ds == assets.SPEC_BENCH and not assets.spec_bench_path().exists():
        candidate = root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
        if candidate.exists():
            return dataclasses.replace(bench, dataset=str(candidate), dtype=bench.dtype.value)
    elif ds.endswith(".jsonl") and not Path(ds).is_absolute():
        return dataclasses.replace(bench, dataset=str((root / ds).resolve()), dtype=bench.dtype.value)
    return bench


def _best_before(study, objective) -> tuple[float, int] | None:
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    if not done:
        return None
    best = max(done, key=lambda t: t.values[0])
    return float(best.values[0]), best.number


def run_sweep(cfg: SweepConfig, paths: ResolvedPaths, trials_override: int | None = None) -> dict:
    """Run (or resume) the sweep; returns a summary dict."""
    from optuna.samplers import TPESampler
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from cluster.deploy import ensure_ray
    import tracking
    from sweeps import resume
    from sweeps.objective import BenchTrainable, TrialContext
    from sweeps.progress import SweepProgress

    total = trials_override or cfg.trials
    objective = cfg.objective
    space = cfg.search_space()
    tracking.check_reachable(paths.tracking_uri)
    exp_id = tracking.experiment_id(
        paths.experiment, paths.tracking_uri, artifact_location=paths.artifact_location
    )

    storage = _storage(paths.storage)
    study = resume.create_or_load(storage, cfg.study, objective.directions)
    status = resume.settle_interrupted(study, storage, paths.tracking_uri, exp_id, objective.metrics)
    remaining = status.remaining(total)
    print(
        f"[sweep {cfg.study}] study in {paths.storage}: {status.complete} complete, {status.failed} failed, "
        f"{status.recovered} recovered and {status.requeued} re-queued from an interrupted run; "
        f"{remaining} of {total} trials to run",
        flush=True,
    )
    parent = tracking.open_sweep_parent(paths.tracking_uri, exp_id, cfg.study, cfg.to_dict())
    summary = {
        "study": cfg.study,
        "experiment": paths.experiment,
        "experiment_id": exp_id,
        "parent_run_id": parent,
        "ran": remaining,
        "resumed_from": status.finished,
    }
    if remaining > 0:
        ensure_ray()
        ctx = TrialContext(
            study=cfg.study,
            method=cfg.method,
            fixed=dict(cfg.fixed),
            bench=_bench_for(cfg, paths.root),
            categories=cfg.categories,
            tracking_uri=paths.tracking_uri,
            experiment_id=exp_id,
            parent_run_id=parent,
            artifacts_dir=str(paths.artifacts_dir),
        )
        searcher = OptunaSearch(
            space=space.define_by_run,
            metric=objective.metrics if len(objective.metrics) > 1 else objective.metrics[0],
            mode=objective.modes if len(objective.modes) > 1 else objective.modes[0],
            # Offset the seed by the trials already held so a resumed study does not replay its
            # first random points.
            sampler=TPESampler(seed=cfg.seed + len(study.trials)),
            study_name=cfg.study,
            storage=storage,
        )
        resources = {k.lower() if k in ("CPU", "GPU") else k: v for k, v in cfg.trial_resources.items()}
        trainable = tune.with_resources(tune.with_parameters(BenchTrainable, context=ctx), resources)
        attempt = len(list(paths.output_dir.glob("tune-*"))) if paths.output_dir.exists() else 0
        paths.output_dir.mkdir(parents=True, exist_ok=True)
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                num_samples=remaining,
                max_concurrent_trials=cfg.concurrency,
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=f"tune-{attempt}",
                storage_path=str(paths.output_dir),
                callbacks=[
                    SweepProgress(
                        cfg.study, total, status.finished, objective, _best_before(study, objective)
                    )
                ],
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=0),
            ),
        )
        grid = tuner.fit()
        summary["errors"] = len(grid.errors)
    from sweeps import compare

    report = compare.compare(
        paths.experiment, paths.tracking_uri, paths.output_dir / "compare", study=cfg.study
    )
    _finish_parent(paths.tracking_uri, parent, report, study, total)
    summary.update({"best": report.best, "compare_dir": str(paths.output_dir / "compare")})
    return summary


def _finish_parent(uri: str, parent: str, report, study, total: int) -> None:
    import mlflow
    from optuna.trial import TrialState

    import tracking

    client = mlflow.MlflowClient(tracking_uri=uri)
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    metrics = {"trials_complete": float(len(complete))}
    if report.best is not None:
        metrics.update({f"best.{k}": float(v) for k, v in report.best["metrics"].items() if v is not None})
    tracking.log_batch(client, parent, {}, metrics)
    for p in report.files:
        client.log_artifact(parent, str(p))
    # Fewer complete trials than asked means some failed (a killed sweep never gets here).
    client.set_terminated(parent, "FINISHED" if len(complete) >= total else "FAILED")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sweeps.run", description="Run (or resume) an Optuna sweep on Ray."
    )
    p.add_argument("--config", required=True, help="sweep YAML, e.g. ray_configs/sweep_smoke.yaml")
    p.add_argument(
        "--root",
        default=None,
        help="directory relative paths resolve against (default: the current directory; "
        "under `ray job submit` pass --root $PWD, the job runs in a temporary copy)",
    )
    p.add_argument("--trials", type=int, default=None, help="override the config's trial count")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_sweep_config(args.config)
        if args.trials is not None and args.trials < 1:
            raise ConfigError(f"--trials must be >= 1, got {args.trials}")
        root = Path(args.root) if args.root else Path.cwd()
        if args.root is None and "runtime_resources" in str(Path.cwd().resolve()):
            print(
                "[sweep] warning: running in a Ray job's temporary working directory without --root; "
                "results written under it are lost when the job ends (pass --root $PWD)",
                file=sys.stderr,
            )
        paths = cfg.resolved(root)
        summary = run_sweep(cfg, paths, args.trials)
    except ConfigError as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from tracking import TrackingError

        if isinstance(exc, TrackingError):
            print(f"sweep: error: {exc}", file=sys.stderr)
            return 2
        raise
    best = summary.get("best")
    line = (
        "no finished trial yet"
        if not best
        else (
            f"best trial {best['trial_number']}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in best["metrics"].items() if v is not None)
        )
    )
    print(
        f"[sweep {summary['study']}] done: ran {summary['ran']} trial(s); {line}; "
        f"comparison in {summary['compare_dir']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
