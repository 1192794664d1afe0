"""``graftblock train <family>``: train a drafter head for a target on ShareGPT (resumable).

    graftblock train eagle3 --model smollm2-135m --workdir runs/eagle3-smollm2-135m \\
        --export checkpoints/eagle3-smollm2-135m --max-minutes 45

One sub-command per registered family (:data:`adaptation.families.FAMILIES`): the shared flags
come from :class:`~adaptation.trainer.TrainConfig` (with the family's defaults for the unroll),
the family adds its own. Also reachable as ``python -m graftblock.train <family> ...`` (e.g. for
``ray job submit``). Re-running the same command resumes from ``<workdir>/state.pt`` and the
cached features.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from adaptation.data import sharegpt_data
from adaptation.distill import distilled_data
from adaptation.families import FAMILIES
from adaptation.family import DrafterFamily
from adaptation.trainer import TrainConfig, Trainer
from speculation import assets
from speculation.config import ConfigError, DType
from speculation.model.target import TargetModel
from graftblock import distill_data
from tracking.train import MetricsSink, MlflowSink, NullSink


def add_arguments(p: argparse.ArgumentParser, family: DrafterFamily) -> None:
    """The options of ``train <family>``: shared ones (defaults = the train config's with the
    family's unroll defaults), the family's own, then run logging."""
    d = TrainConfig(**family.unroll_defaults)
    p.set_defaults(family=family.name)
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default="bfloat16", help="target dtype for extraction/evaluation: bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--workdir", default=f"runs/{family.name}-smollm2-135m", help="features, checkpoints, resume state")
    p.add_argument("--features", default=None,
                   help="feature cache directory (default <workdir>/features); share one between drafters")
    p.add_argument("--export", default=None, help="also write the final checkpoint + manifest here")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the packaged file)")
    p.add_argument("--distilled", default=None,
                   help="train on a `graftblock distill-data` directory (the target's own answers)")
    p.add_argument("--heldout", type=int, default=24, help="first N conversations held out (not trained on)")
    p.add_argument("--regenerate", type=int, default=0,
                   help="self-distillation: replace answers by N target-generated tokens (0 = off)")
    p.add_argument("--regenerate-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size)
    p.add_argument("--vocab-items", type=int, default=d.vocab_items)
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    p.add_argument("--curriculum-steps", type=int, default=d.curriculum_steps)
    p.add_argument("--curriculum-tokens", type=int, default=d.curriculum_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--topk", type=int, default=d.topk)
    p.add_argument("--shard-size", type=int, default=d.shard_size)
    p.add_argument("--eval-every-tokens", type=int, default=d.eval_every_tokens)
    p.add_argument("--eval-every-minutes", type=float, default=d.eval_every_minutes)
    p.add_argument("--eval-at-start", action="store_true")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--eval-max-new-tokens", type=int, default=d.eval_max_new_tokens)
    family.add_arguments(p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-mlflow", action="store_true", help="do not log this run to MLflow")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default="graftblock-train", help="MLflow experiment name")
    p.add_argument("--run-name", default=None)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The shared :class:`TrainConfig` from parsed ``train <family>`` arguments."""
    return TrainConfig(
        max_len=args.max_len, draft_vocab_size=args.draft_vocab_size, vocab_items=args.vocab_items,
        ttt_steps=args.ttt_steps, curriculum_steps=min(args.curriculum_steps, args.ttt_steps),
        curriculum_tokens=args.curriculum_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
        batch_tokens=args.batch_tokens, max_tokens=args.max_tokens, max_minutes=args.max_minutes,
        epochs=args.epochs, topk=args.topk, shard_size=args.shard_size,
        eval_every_tokens=args.eval_every_tokens, eval_every_minutes=args.eval_every_minutes,
        eval_at_start=args.eval_at_start, eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, seed=args.seed,
    )


def configure(args: argparse.Namespace) -> tuple[DrafterFamily, TrainConfig]:
    """The family (with its knobs from the flags) and the shared config of a parsed command."""
    return FAMILIES[args.family].configure(vars(args)), train_config(args)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``graftblock train <family>``; ``args.argv`` is recorded as the command."""
    if args.threads:
        torch.set_num_threads(args.threads)
    family, cfg = configure(args)
    model, tokenizer = assets.load_model_and_tokenizer(args.model, DType.parse(args.dtype).torch)
    target = TargetModel(model, tokenizer)
    if args.distilled and args.regenerate:
        raise ConfigError("train: --distilled and --regenerate both replace the answers; pass one of them")
    if args.distilled:
        data = distilled_data(tokenizer, target, args.distilled, max_len=args.max_len, heldout=args.heldout,
                              sharegpt=args.sharegpt)
    else:
        data = sharegpt_data(tokenizer, target, max_len=args.max_len, heldout=args.heldout,
                             regenerate_tokens=args.regenerate, regenerate_batch=args.regenerate_batch,
                             path=args.sharegpt)
    command = f"graftblock train {family.name} " + " ".join(shlex.quote(a) for a in args.argv)
    trainer = Trainer(cfg, family, target, data, args.workdir, target_name=args.model,
                      progress=not args.no_progress, features_dir=args.features)
    sink: MetricsSink = NullSink()
    if not args.no_mlflow:
        run_name = args.run_name or f"{family.name}-{args.model}"
        mlflow_run = MlflowSink(args.experiment, args.tracking_uri, run_name, trainer.saved_run_id())
        print(f"MLflow run {mlflow_run.run_id} ({mlflow_run.uri})", file=sys.stderr)
        sink = mlflow_run
    trainer.sink = sink
    manifest = trainer.run(export=args.export, command=command)
    t = manifest["training"]
    h = manifest["heldout"]
    print(f"trained {t['steps']} steps, {t['tokens']} tokens in {t['wall_s']:.0f}s ({t['stop_reason']}); "
          f"loss {t['last_loss']:.3f}; held-out acc_0 {h.get('heldout.acc_0')}, tau {h.get('heldout.tau')}")
    if args.export:
        print(f"checkpoint written to {args.export}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    """``graftblock train <family>`` from the top-level CLI: records the flags after the family."""
    args.argv = sys.argv[3:] if sys.argv[1:3] == ["train", args.family] else []
    return run(args)


def _add_families(parser: argparse.ArgumentParser) -> None:
    """One sub-command per registered family under ``parser``."""
    sub = parser.add_subparsers(dest="drafter", required=True)
    for name, family in FAMILIES.items():
        help_text = f"train a drafter head ({family.kind.label}) on ShareGPT for a target"
        add_arguments(sub.add_parser(name, help=help_text), family)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """``train <family>`` for every registered family, under the top-level CLI's sub-commands."""
    t = sub.add_parser("train", help="train a drafter (resumable; logged to MLflow)")
    _add_families(t)
    t.set_defaults(func=_cmd_train)
    distill_data.add_subcommand(sub)


def build_parser() -> argparse.ArgumentParser:
    """``python -m graftblock.train <family> ...``: the same sub-commands without the top level."""
    p = argparse.ArgumentParser(prog="graftblock train", description=__doc__.split("\n\n")[0])
    _add_families(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
