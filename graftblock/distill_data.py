"""``graftblock distill-data``: the target answers training prompts itself (resumable, sharded).

    graftblock distill-data --model smollm2-135m --out runs/distill-smollm2 --items 2048
    graftblock train eagle3 --distilled runs/distill-smollm2 ...

Prompts are ShareGPT conversations after the trainer's held-out ones, with every benchmark prompt
(Spec-Bench and every packaged dataset) excluded; each item's user turns are answered in turn by
the target, its own earlier answers in the history. The output is ``shard_NNNNN.jsonl.gz`` files
plus ``manifest.json`` (see :mod:`adaptation.distill`); re-running the same command after a kill
resumes at the first missing shard. With ``--baseline-prompts N`` the first N items are answered
again, batched and then one sequence at a time, back to back: the ratio is the batching speed-up
on this host. Everything is logged to MLflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ray
import torch

from adaptation.distill import (
    DistillConfig,
    distill,
    make_generator,
    plan_from_sharegpt,
    side_by_side_rates,
)
from cluster.distill_fanout import distill_on_ray
from speculation import assets
from speculation.config import ConfigError, DType
from speculation.model.target import TargetModel
from tracking.train import MetricsSink, MlflowSink, NullSink

RUN_ID_FILE = "mlflow_run_id"
"""Beside the shards: the MLflow run a resumed command keeps logging to."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``distill-data`` (defaults: :class:`~adaptation.distill.DistillConfig`'s)."""
    d = DistillConfig()
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default="float32", help="bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", required=True, help="output directory (shards + manifest; resumable)")
    p.add_argument("--items", type=int, default=1024, help="prompts (conversations) to answer")
    p.add_argument("--heldout", type=int, default=24,
                   help="skip the first N conversations: the trainer's --heldout (never distilled)")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the packaged file)")
    p.add_argument("--backend", choices=("engine", "hf"), default="engine",
                   help="engine: graftblock's batched engine (CPU); hf: transformers generate")
    p.add_argument("--batch-size", type=int, default=8, help="sequences generated together")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-turns", type=int, default=d.max_turns)
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--shard-size", type=int, default=d.shard_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--replicas", type=int, default=0,
                   help="fan the shards out over N Ray actors, each with its own target (0: this process)")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: the cluster to join (default: start a local Ray with N CPUs)")
    p.add_argument("--baseline-prompts", type=int, default=0,
                   help="also time this many prompts one sequence at a time (the throughput baseline)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-mlflow", action="store_true", help="do not log this run to MLflow")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default="graftblock-distill", help="MLflow experiment name")


def distill_config(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                         max_turns=args.max_turns, greedy_fraction=args.greedy_fraction,
                         temperature=args.temperature, top_p=args.top_p, shard_size=args.shard_size,
                         seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``graftblock distill-data``."""
    if args.items < 1:
        raise ConfigError(f"distill-data: --items must be >= 1, got {args.items}")
    if args.heldout < 0:
        raise ConfigError(f"distill-data: --heldout must be >= 0, got {args.heldout}")
    if args.replicas < 0:
        raise ConfigError(f"distill-data: --replicas must be >= 0, got {args.replicas}")
    if args.ray_address and not args.replicas:
        raise ConfigError("distill-data: --ray-address needs --replicas N (N >= 1)")
    if args.baseline_prompts < 0:
        raise ConfigError(f"distill-data: --baseline-prompts must be >= 0, got {args.baseline_prompts}")
    cfg = distill_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DType.parse(args.dtype)
    source = args.sharegpt or str(assets.sharegpt_path())
    plan = plan_from_sharegpt(source, args.heldout, args.items)
    if not plan:
        raise ConfigError(f"distill-data: no usable conversation after the first {args.heldout} of {source}")
    meta = {"target": args.model, "dtype": dtype.value, "generator": args.backend,
            "heldout": args.heldout, "sharegpt": args.sharegpt or "packaged"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink: MetricsSink = NullSink()
    if not args.no_mlflow:
        id_file = out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        mlflow_run = MlflowSink(args.experiment, args.tracking_uri, f"distill-{args.model}", run_id)
        id_file.write_text(mlflow_run.run_id)
        print(f"MLflow run {mlflow_run.run_id} ({mlflow_run.uri})", file=sys.stderr)
        if run_id is None:
            mlflow_run.log_params({**meta, **{f"distill.{k}": v for k, v in vars(cfg).items()},
                                   "items": len(plan), "batch_size": args.batch_size})
        sink = mlflow_run
    target = None
    if not args.replicas or args.baseline_prompts:  # with replicas, only the baseline runs here
        target = TargetModel(*assets.load_model_and_tokenizer(args.model, dtype.torch))

    def on_shard(stats) -> None:
        sink.log_metrics({"distill.items": stats.items, "distill.new_tokens": stats.new_tokens,
                          "distill.tokens_per_s": stats.new_tokens / max(stats.wall_s, 1e-9)},
                         step=stats.shards_done)

    status = "FAILED"
    try:
        if args.replicas:
            stats = _distill_on_ray(args, plan, out, cfg, meta, dtype.value)
            on_shard(stats)
        else:
            stats = distill(plan, out, cfg, target.tokenizer,
                            make_generator(args.backend, target, args.batch_size, cfg), target.eos_token_ids,
                            meta, progress=not args.no_progress, on_shard=on_shard)
        rate = stats.new_tokens / max(stats.wall_s, 1e-9)
        summary = {"items": stats.items, "turns": stats.turns, "new_tokens": stats.new_tokens,
                   "wall_s": round(stats.wall_s, 2), "tokens_per_s": round(rate, 2),
                   "by_category": stats.by_category, "batch_size": args.batch_size, "backend": args.backend}
        if args.baseline_prompts:
            batched = make_generator(args.backend, target, args.batch_size, cfg)
            single = make_generator(args.backend, target, 1, cfg)
            many, base = side_by_side_rates(target.tokenizer, batched, single, plan, cfg, target.eos_token_ids,
                                            args.baseline_prompts)
            summary |= {"baseline_prompts": args.baseline_prompts, "batched_tokens_per_s": round(many, 2),
                        "single_sequence_tokens_per_s": round(base, 2), "speedup_vs_single": round(many / base, 3)}
            sink.log_metrics({"distill.batched_tokens_per_s": many, "distill.single_sequence_tokens_per_s": base,
                              "distill.speedup_vs_single": many / base}, step=stats.shards_done)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        sink.log_artifact(out / "manifest.json")
        status = "FINISHED"
    finally:
        sink.finish(status)
    print(json.dumps(summary))
    print(f"distilled {stats.items} conversations into {out}")
    return 0


def _distill_on_ray(args: argparse.Namespace, plan, out: Path, cfg: DistillConfig, meta: dict, dtype: str):
    """The shards over ``args.replicas`` Ray actors (a local Ray started, and stopped, if no address)."""
    started = not ray.is_initialized()
    if started:
        if args.ray_address:
            ray.init(address=args.ray_address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    try:
        return distill_on_ray(plan, out, cfg, meta, args.replicas, args.model, dtype, args.backend,
                              args.batch_size, threads=args.threads)
    finally:
        if started:
            ray.shutdown()


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """``distill-data`` under the top-level CLI's sub-commands."""
    p = sub.add_parser("distill-data", help="the target answers training prompts itself (resumable)")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m graftblock.distill_data ...`` (e.g. for ``ray job submit``)."""
    p = argparse.ArgumentParser(prog="graftblock distill-data", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
