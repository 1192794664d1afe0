"""The target's linear kernels side by side: ``F.linear`` everywhere, the transposed output head
(the default before oneDNN packing) and oneDNN-packed layers (``assets.load_model``'s default).

    .venv/bin/python benchmarks/linear_kernels.py --dtype float32 --json benchmarks/results/linear_kernels_fp32.json

Loads the target once, then decodes the first turn of ``--questions`` Spec-Bench questions per
category greedily with vanilla and with the retrieval drafter, under each kernel arm in turn,
prompt by prompt, on the same model object: an arm swaps the modules of every linear layer
(same parameters, tied head included) before its turn. Reports tokens/s per (arm, method),
speedups against the ``linear`` arm's vanilla, whether every arm's tokens equal the ``linear``
arm's vanilla tokens, and the median seconds of the output head's product at M = 1 and at M = 8
(a verify pass's rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from speculation import assets
from speculation.bench.runner import emit_json, environment, median_call_s
from speculation.config import EngineConfig, SamplingConfig
from speculation.drafters import build_drafter, resolve_methods
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.output_head import PackedLinear, TransposedHead, onednn_available
from speculation.model.target import TargetModel

ARMS = ("linear", "transposed_head", "packed")


def _arms(model: nn.Module) -> dict[str, dict[tuple[nn.Module, str], nn.Module]]:
    """Per arm, the module to put at each (parent, child name) holding a linear layer."""
    head = model.get_output_embeddings()
    out: dict[str, dict[tuple[nn.Module, str], nn.Module]] = {a: {} for a in ARMS}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (nn.Linear, PackedLinear, TransposedHead)):
                continue
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            plain.weight, plain.bias = child.weight, child.bias  # the same (tied) parameters
            out["linear"][(parent, name)] = plain
            out["transposed_head"][(parent, name)] = TransposedHead(plain) if child is head else plain
            out["packed"][(parent, name)] = child if isinstance(child, PackedLinear) else PackedLinear(plain)
    return out


def _use(arm: dict[tuple[nn.Module, str], nn.Module]) -> None:
    for (parent, name), module in arm.items():
        setattr(parent, name, module)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--prompts", type=int, default=0, help="keep only the first N prompts (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    if not onednn_available():
        raise SystemExit("torch has no oneDNN here: nothing to compare")
    model, tok = assets.load_model_and_tokenizer(args.model, getattr(torch, args.dtype))
    arms = _arms(model)
    # One TargetModel per arm over the same model: c(T) is cached per target object, so each arm's
    # cost-aware retrieval drafter is priced by its own kernels' measured c(T).
    targets = {a: TargetModel(model, tok) for a in ARMS}
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in assets.load_questions("spec_bench", args.questions)]
    prompts = prompts[: args.prompts] if args.prompts else prompts
    cfg = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    spec = resolve_methods(["retrieval"], {})[0]
    methods = ("vanilla", "retrieval")
    totals = {a: {m: {"tokens": 0, "seconds": 0.0} for m in methods} for a in ARMS}
    outputs = {a: {m: [] for m in methods} for a in ARMS}
    for arm in ARMS:  # warm-up, and each arm's own c(T) (measured by its first drafter build)
        _use(arms[arm])
        generate_vanilla(targets[arm], prompts[0], cfg)
        build_drafter(spec, targets[arm])
    for p in prompts:
        for arm in ARMS:
            _use(arms[arm])
            t = targets[arm]
            for m in methods:
                t0 = time.perf_counter()
                res = generate_vanilla(t, p, cfg) if m == "vanilla" else generate_speculative(
                    t, build_drafter(spec, t), p, cfg)
                totals[arm][m]["seconds"] += time.perf_counter() - t0
                totals[arm][m]["tokens"] += len(res.tokens)
                outputs[arm][m].append(res.tokens)
    head_s: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for arm in ARMS:
            _use(arms[arm])
            head = model.get_output_embeddings()
            head_s[arm] = {}
            for rows in (1, 8):
                x = torch.randn(1, rows, head.in_features, dtype=head.weight.dtype)
                head_s[arm][f"M={rows}"] = median_call_s(lambda: head(x))
    _use(arms["packed"])
    rates = {a: {m: t["tokens"] / t["seconds"] for m, t in per.items()} for a, per in totals.items()}
    ref = outputs["linear"]["vanilla"]
    out = {
        "kind": "linear_kernels",
        "command": " ".join(["benchmarks/linear_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "tokens_per_s": rates,
        "speedup_vs_linear_vanilla": {a: {m: r / rates["linear"]["vanilla"] for m, r in per.items()}
                                      for a, per in rates.items()},
        "identical_to_linear_vanilla": {a: {m: outputs[a][m] == ref for m in methods} for a in ARMS},
        "head_product_s": head_s, "totals": totals,
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
