"""The sweep job: an Optuna study run by Ray Tune, every trial a bench run logged to MLflow.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m sweeps.run --config ray_configs/sweep_smoke.yaml --root $PWD \\
            --git-commit $(git rev-parse HEAD)

Steps:

1. load and validate the config (knobs against the method's config dataclass), resolve every
   path against ``--root``, check the tracking URI answers and, on a Ray cluster of more than
   one node, that the tracking store and Tune's storage are reachable from every node;
2. open the study in the RDB storage, take its lease (:mod:`sweeps.lease`: a second live job on
   the same study refuses to start) and settle trials a killed run left RUNNING
   (:mod:`sweeps.resume`); run only the trials still missing;
3. open (or reuse) the MLflow parent run; Tune runs :class:`~sweeps.objective.BenchTrainable`
   with ``OptunaSearch(storage=…)``, ``reuse_actors=True`` and the concurrency limit, printing
   progress lines;
4. write the comparison (table, Pareto plot, best config YAML) and attach it to the parent run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import optuna
import ray
from optuna.samplers import TPESampler
from optuna.trial import TrialState
from ray import tune
from ray.tune.search.optuna import OptunaSearch

import tracking
from cluster.deploy import ensure_ray
from speculation.config import ConfigError
from sweeps import compare, resume
from sweeps.config import ResolvedPaths, SweepConfig, check_cluster, load_sweep_config, tune_storage_is_uri
from sweeps.lease import StudyBusy, StudyLease
from sweeps.objective import BenchTrainable, TRIAL_METRICS, TrialContext, run_holdout
from sweeps.progress import SweepProgress
from sweeps.settle import SettleDeadTrials


def _storage(url: str):
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        # Several Tune callbacks touch the study; give SQLite a generous lock timeout.
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(url)


def _bench_for(cfg: SweepConfig, root: Path):
    """The bench config with a relative dataset path resolved against ``root``.

    A Ray job runs in a temporary copy of the checkout, so a relative question file is taken from
    the checkout the sweep was submitted from. Named datasets (``spec_bench`` included: it ships
    as package data) need no resolution.
    """
    bench = cfg.bench_config()
    ds = bench.dataset
    if ds.endswith(".jsonl") and not Path(ds).is_absolute():
        return dataclasses.replace(bench, dataset=str((root / ds).resolve()), dtype=bench.dtype.value)
    return bench


def _best_before(study, objective) -> tuple[float, int] | None:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    if not done:
        return None
    best = max(done, key=lambda t: t.values[0])
    return float(best.values[0]), best.number


def alive_nodes() -> int:
    """Alive nodes of the connected Ray cluster."""
    return sum(1 for n in ray.nodes() if n["Alive"])


@contextlib.contextmanager
def _released_on_sigterm(lease: StudyLease) -> Iterator[None]:
    """While inside, SIGTERM (``ray job stop``) drops the study's lease, then terminates the process.

    Ray stops a job with SIGTERM and, a few seconds later, SIGKILL; releasing first lets the
    next submission of the study start at once instead of waiting for the lease to expire.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame) -> None:
        lease.release()
        # Then die at once, as without this handler (an exception here could be caught by Tune,
        # which would keep running trials until the SIGKILL).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_sweep(cfg: SweepConfig, paths: ResolvedPaths, source: tracking.RunSource,
              trials_override: int | None = None, force: bool = False) -> dict:
    """Run (or resume) the sweep; returns a summary dict.

    Refuses (ConfigError) a one-machine store on a multi-node cluster and (StudyBusy) a study
    another live job holds; ``force`` takes the study's lease over.
    """
    tracking.check_reachable(paths.tracking_uri)
    exp_id = tracking.experiment_id(
        paths.experiment, paths.tracking_uri, artifact_location=paths.artifact_location
    )
    ensure_ray()
    check_cluster(alive_nodes(), paths)
    storage = _storage(paths.storage)
    study = resume.create_or_load(storage, cfg.study, cfg.objective.directions)
    lease = StudyLease(storage, cfg.study)
    lease.acquire(force=force)
    lease.start_heartbeat()
    try:
        with _released_on_sigterm(lease):
            return _run_leased(cfg, paths, source, trials_override, study, storage, exp_id)
    finally:
        lease.release()


def _run_leased(cfg: SweepConfig, paths: ResolvedPaths, source: tracking.RunSource,
                trials_override: int | None, study, storage, exp_id: str) -> dict:
    """Steps 2-4 of the module doc, with the study's lease held."""
    total = trials_override or cfg.trials
    objective = cfg.objective
    space = cfg.search_space()
    status = resume.settle_interrupted(study, storage, paths.tracking_uri, exp_id, objective.metrics)
    remaining = status.remaining(total)
    print(
        f"[sweep {cfg.study}] study in {paths.storage}: {status.complete} complete, {status.failed} failed, "
        f"{status.recovered} recovered and {status.requeued} re-queued from an interrupted run; "
        f"{remaining} of {total} trials to run",
        flush=True,
    )
    parent = tracking.open_sweep_parent(paths.tracking_uri, exp_id, cfg.study, cfg.to_dict(), source)
    summary = {
        "study": cfg.study,
        "experiment": paths.experiment,
        "experiment_id": exp_id,
        "parent_run_id": parent,
        "ran": remaining,
        "resumed_from": status.finished,
    }
    ctx = TrialContext(
        study=cfg.study,
        method=cfg.method,
        space=space,
        bench=_bench_for(cfg, paths.root),
        categories=cfg.categories,
        tracking_uri=paths.tracking_uri,
        experiment_id=exp_id,
        parent_run_id=parent,
        artifacts_dir=str(paths.artifacts_dir),
        source=source,
    )
    resources = {k.lower() if k in ("CPU", "GPU") else k: v for k, v in cfg.trial_resources.items()}
    if remaining > 0:
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
        trainable = tune.with_resources(tune.with_parameters(BenchTrainable, context=ctx), resources)
        local_storage = not tune_storage_is_uri(paths.tune_storage)
        attempt = 0
        if local_storage:
            tune_dir = Path(paths.tune_storage)
            attempt = len(list(tune_dir.glob("tune-*"))) if tune_dir.exists() else 0
            tune_dir.mkdir(parents=True, exist_ok=True)
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
                name=f"tune-{attempt}" if local_storage else f"tune-{cfg.study}-{len(study.trials)}",
                storage_path=paths.tune_storage,
                callbacks=[
                    SweepProgress(
                        cfg.study, total, status.finished, objective, _best_before(study, objective)
                    ),
                    SettleDeadTrials(paths.tracking_uri, exp_id, cfg.study),
                ],
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=cfg.retries),
            ),
        )
        grid = tuner.fit()
        summary["errors"] = len(grid.errors)
    report = compare.compare(
        paths.experiment, paths.tracking_uri, paths.output_dir / "compare", study=cfg.study
    )
    holdout = None
    if cfg.holdout_categories and report.best is not None:
        try:
            holdout = _holdout(cfg, ctx, report.best, resources, paths.output_dir / "compare")
        except BaseException:  # the trials stand; the parent run records that the sweep did not finish
            tracking.set_status(paths.tracking_uri, parent, tracking.RunStatus.FAILED)
            raise
        report.files.append(paths.output_dir / "compare" / "holdout.json")
    _finish_parent(paths.tracking_uri, parent, report, study, total, holdout)
    summary.update({"best": report.best, "holdout": holdout, "compare_dir": str(paths.output_dir / "compare")})
    return summary


def _holdout(cfg: SweepConfig, ctx, best: dict, resources: dict, out_dir: Path) -> dict:
    """Bench the best trial's configuration on ``cfg.holdout_categories`` (a Ray task with the
    trials' resources), unless a finished held-out run of that trial exists (a resumed sweep);
    write ``holdout.json`` (sweep score beside held-out score) into ``out_dir``."""
    number = best["trial_number"]
    done = [r for r in tracking.holdout_runs(ctx.tracking_uri, ctx.experiment_id, cfg.study, number)
            if r.status == tracking.RunStatus.FINISHED.value]
    if done:
        metrics = {k: done[0].metrics[k] for k in TRIAL_METRICS if k in done[0].metrics}
        print(f"[sweep {cfg.study}] held-out run of trial {number} already finished; reusing it", flush=True)
    else:
        print(f"[sweep {cfg.study}] benching trial {number}'s configuration on the held-out categories "
              f"{list(cfg.holdout_categories)}", flush=True)
        held_ctx = dataclasses.replace(ctx, categories=cfg.holdout_categories)
        opts = {"num_cpus": resources.get("cpu", 1), "num_gpus": resources.get("gpu", 0),
                "resources": {k: v for k, v in resources.items() if k not in ("cpu", "gpu")}}
        task = ray.remote(run_holdout).options(**opts)
        metrics = ray.get(task.remote(held_ctx, number, dict(best["config"])))
    out = {
        "study": cfg.study,
        "trial_number": number,
        "method": best["method"],
        "config": best["config"],
        "sweep_categories": list(cfg.categories or ()),
        "holdout_categories": list(cfg.holdout_categories or ()),
        "sweep": {k: v for k, v in best["metrics"].items() if v is not None},
        "holdout": metrics,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "holdout.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def _finish_parent(uri: str, parent: str, report, study, total: int, holdout: dict | None = None) -> None:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    metrics = {"trials_complete": float(len(complete))}
    if report.best is not None:
        metrics.update({f"best.{k}": float(v) for k, v in report.best["metrics"].items() if v is not None})
    if holdout is not None:
        metrics.update({f"holdout.{k}": float(v) for k, v in holdout["holdout"].items()})
    # Fewer complete trials than asked means some failed (a killed sweep never gets here).
    tracking.finish_sweep_parent(uri, parent, metrics, report.files, complete=len(complete) >= total)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options (shared by ``python -m sweeps.run`` and ``graftblock sweep``)."""
    p.add_argument("--config", required=True, help="sweep YAML, e.g. ray_configs/sweep_smoke.yaml")
    p.add_argument(
        "--root",
        default=None,
        help="directory relative paths resolve against (default: the current directory; "
        "under `ray job submit` pass --root $PWD, the job runs in a temporary copy)",
    )
    p.add_argument("--trials", type=int, default=None, help="override the config's trial count")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow URI (default: the config's tracking_uri, else MLFLOW_TRACKING_URI, "
        "else sqlite:///<root>/mlflow.db); a multi-node cluster needs a server, e.g. http://HEAD:5000",
    )
    p.add_argument(
        "--git-commit",
        default=None,
        help="commit the runs record (default: git rev-parse HEAD of this checkout; a Ray job's copy "
        "has no .git, so submit with --git-commit $(git rev-parse HEAD))",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="take the study over even if another sweep job's lease on it looks live",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sweeps.run", description="Run (or resume) an Optuna sweep on Ray."
    )
    add_arguments(p)
    return p


def _source(git_commit: str | None) -> tracking.RunSource:
    commit = tracking.check_commit(git_commit) if git_commit else tracking.git_commit()
    if commit is None:
        print(
            "[sweep] warning: no git commit known (a Ray job's copy of the checkout has no .git); "
            "runs will not record one: submit with --git-commit $(git rev-parse HEAD)",
            file=sys.stderr,
        )
    return tracking.RunSource(name="graftblock sweep", type=tracking.SourceType.JOB, commit=commit)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the sweep the parsed arguments describe; prints the summary line."""
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
    paths = cfg.resolved(root, tracking_uri=args.tracking_uri)
    summary = run_sweep(cfg, paths, _source(args.git_commit), args.trials, force=args.force)
    best = summary.get("best")
    line = (
        "no finished trial yet"
        if not best
        else (
            f"best trial {best['trial_number']}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in best["metrics"].items() if v is not None)
        )
    )
    held = summary.get("holdout")
    if held:
        line += (f"; held-out ({', '.join(held['holdout_categories'])}): speedup "
                 f"{held['holdout'].get('speedup', float('nan')):.3f} against {held['sweep'].get('speedup', float('nan')):.3f} "
                 "on the sweep's categories")
    print(
        f"[sweep {summary['study']}] done: ran {summary['ran']} trial(s); {line}; "
        f"comparison in {summary['compare_dir']}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_from_args(args)
    except (ConfigError, ValueError, tracking.TrackingError, StudyBusy) as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
