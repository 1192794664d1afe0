"""The feature drafters' networks with ``F.linear`` against oneDNN-packed linear layers, side by side.

    .venv/bin/python benchmarks/drafter_kernels.py --dtype float32 --json benchmarks/results/drafter_kernels_fp32.json

Loads the target once and, for each drafter (``--drafters``: the committed EAGLE-3 and SpecBlock
checkpoints), two drafters of the same checkpoint: ``packed`` as every command builds it
(:func:`~speculation.drafters.feature_pairs.shared_network` packs the network's linear layers)
and ``linear``, whose network has the same parameters in plain ``nn.Linear`` layers. Each
Spec-Bench first turn (``--questions`` per category) is decoded greedily by both arms in turn,
prompt by prompt. Reports per drafter and arm: drafting milliseconds per verify step (the
engine's ``drafting_s``: propose + observe), verify milliseconds per step, tokens/s, tau, the
per-prompt paired ratio of drafting time, and whether the two arms' tokens are identical.

The per-forward profile (``profile``, per drafter) asks whether one drafter forward costs what its
size says: ``ms_per_forward`` = drafting seconds / drafter forwards (the steps' ``drafter_forwards``,
a batched forward counting once) against ``bound_ms`` = 1.5 x (drafter parameters / target
parameters) x one vanilla target decode step (``target_step_ms``: the reference decodes' wall
seconds after prefill / tokens after the first). Drafter parameters are the network's own: the
embedding it borrows from the target is not counted; the target's count includes its tied embedding.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

from speculation import assets
from speculation.bench.runner import emit_json, environment
from speculation.config import Eagle3Config, EngineConfig, SamplingConfig, SpecBlockConfig
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.specblock import build_specblock_drafter
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.output_head import PackedLinear
from speculation.model.target import load_target

ARMS = ("linear", "packed")


def _unpacked(network: nn.Module) -> nn.Module:
    """A copy of ``network`` whose packed linear layers are plain ``nn.Linear`` (same values)."""
    plain = copy.deepcopy(network)
    for parent in list(plain.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight, lin.bias = child.weight, child.bias
                setattr(parent, name, lin)
    return plain


def _own_parameters(network: nn.Module, target: nn.Module) -> int:
    """Parameters of ``network`` not shared with ``target`` (a borrowed embedding is the target's)."""
    borrowed = {p.data_ptr() for p in target.parameters()}
    return sum(p.numel() for p in network.parameters() if p.data_ptr() not in borrowed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafters", default="eagle3,specblock", help="comma list of eagle3, specblock")
    ap.add_argument("--questions", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    builders = {"eagle3": lambda t: build_eagle3_drafter(Eagle3Config(), t),
                "specblock": lambda t: build_specblock_drafter(SpecBlockConfig(), t)}
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    unknown = sorted(set(names) - set(builders))
    if unknown or not names:
        ap.error(f"--drafters takes a comma list of {sorted(builders)}, got {args.drafters!r}")
    torch.set_num_threads(args.threads)
    target = load_target(args.model, args.dtype)
    questions = assets.load_questions("spec_bench", args.questions)
    prompts = [assets.encode_turn(target.tokenizer, [], q.turns[0]) for q in questions]
    cfg = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    generate_vanilla(target, prompts[0], cfg)  # warm-up
    vanilla = [generate_vanilla(target, p, cfg) for p in prompts]
    reference = [r.tokens for r in vanilla]
    decode_s = sum(r.wall_s - r.prefill_s for r in vanilla)
    target_step_ms = 1e3 * decode_s / max(1, sum(len(r.tokens) - 1 for r in vanilla))
    target_params = sum(p.numel() for p in target.model.parameters())

    results = {}
    for name in names:
        arms = {"packed": builders[name](target), "linear": builders[name](target)}
        arms["linear"].model = _unpacked(arms["packed"].model)  # bypasses swap_model, which would pack it
        packed_layers = sum(isinstance(m, PackedLinear) for m in arms["packed"].model.modules())
        generate_speculative(target, arms["packed"], prompts[0], cfg)  # warm-up: oneDNN primitives
        generate_speculative(target, arms["linear"], prompts[0], cfg)
        totals = {a: {"steps": 0, "tokens": 0, "accepted": 0, "forwards": 0, "drafting_s": 0.0, "verify_s": 0.0,
                      "wall_s": 0.0}
                  for a in ARMS}
        tokens = {a: [] for a in ARMS}
        paired = []
        for p in prompts:
            per_step = {}
            for arm in ARMS:
                t0 = time.perf_counter()
                res = generate_speculative(target, arms[arm], p, cfg)
                tot = totals[arm]
                tot["wall_s"] += time.perf_counter() - t0
                tot["steps"] += len(res.steps)
                tot["tokens"] += len(res.tokens)
                tot["accepted"] += sum(s.accepted for s in res.steps)
                tot["forwards"] += sum(s.drafter_forwards for s in res.steps)
                drafting = sum(s.drafting_s for s in res.steps)
                tot["drafting_s"] += drafting
                tot["verify_s"] += sum(s.verify_s for s in res.steps)
                tokens[arm].append(res.tokens)
                per_step[arm] = drafting / max(1, len(res.steps))
            paired.append(per_step["linear"] / per_step["packed"])
        paired.sort()
        drafter_params = _own_parameters(arms["packed"].model, target.model)
        share = drafter_params / target_params
        results[name] = {
            "profile": {"drafter_params": drafter_params, "target_params": target_params, "share": share,
                        "target_step_ms": target_step_ms, "bound_ms": 1.5 * share * target_step_ms,
                        "ms_per_forward": {a: 1e3 * t["drafting_s"] / max(1, t["forwards"])
                                           for a, t in totals.items()},
                        "forwards_per_step": {a: t["forwards"] / t["steps"] for a, t in totals.items()}},
            "packed_linear_layers": packed_layers,
            "arms": {a: {"drafting_ms_per_step": 1e3 * t["drafting_s"] / t["steps"],
                         "verify_ms_per_step": 1e3 * t["verify_s"] / t["steps"],
                         "tokens_per_s": t["tokens"] / t["wall_s"],
                         "tau": (t["steps"] + t["accepted"]) / t["steps"], **t} for a, t in totals.items()},
            "drafting_speedup_paired_median": paired[len(paired) // 2],
            "prompts_faster": sum(r > 1.0 for r in paired),
            "identical_tokens": tokens["linear"] == tokens["packed"],
            "lossless": tokens["packed"] == reference and tokens["linear"] == reference,
        }
    out = {
        "kind": "drafter_kernels",
        "command": " ".join(["benchmarks/drafter_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "drafters": results,
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
