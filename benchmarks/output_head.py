"""Vanilla decoding with the output head as ``nn.Linear`` against :class:`TransposedHead`, side by side.

    .venv/bin/python benchmarks/output_head.py --dtype float32 --json benchmarks/results/output_head_fp32.json

Loads the target once (``assets.load_model`` stores the head transposed), then decodes the first
turn of ``--questions`` Spec-Bench questions per category greedily with each head in turn, prompt
by prompt, ``--repeats`` times, on the same model object: ``linear`` puts the original
``nn.Linear`` (the same tied weight) back for its turn. Reports tokens/s per head (tokens /
seconds over all prompts and repeats), the ratio, whether the tokens are identical, and the
median seconds of the head's product alone at M = 1.
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
from speculation.engine.solo import generate_vanilla
from speculation.model.output_head import TransposedHead
from speculation.model.target import TargetModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    model, tok = assets.load_model_and_tokenizer(args.model, getattr(torch, args.dtype))
    loaded = model.get_output_embeddings()  # packed for oneDNN where torch has it (the other
    # layers stay as load_model leaves them; benchmarks/linear_kernels.py compares all layers)
    linear = nn.Linear(loaded.in_features, loaded.out_features, bias=loaded.bias is not None)
    linear.weight, linear.bias = loaded.weight, loaded.bias  # the same tied parameters
    fast = loaded if isinstance(loaded, TransposedHead) else TransposedHead(linear)
    heads = {"linear": linear, "transposed": fast}
    target = TargetModel(model, tok)
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in assets.load_questions("spec_bench", args.questions)]
    cfg = EngineConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True, sampling=SamplingConfig(temperature=0.0))
    generate_vanilla(target, prompts[0], cfg)  # warm-up
    totals = {h: {"tokens": 0, "seconds": 0.0} for h in heads}
    outputs: dict[str, list[list[int]]] = {h: [] for h in heads}
    for _ in range(args.repeats):
        for p in prompts:
            for name, head in heads.items():
                model.set_output_embeddings(head)
                t0 = time.perf_counter()
                toks = generate_vanilla(target, p, cfg).tokens
                totals[name]["seconds"] += time.perf_counter() - t0
                totals[name]["tokens"] += len(toks)
                outputs[name].append(toks)
    model.set_output_embeddings(loaded)
    x = torch.randn(1, 1, fast.in_features, dtype=fast.weight.dtype)
    with torch.inference_mode():
        product_s = {name: median_call_s(lambda h=head: h(x)) for name, head in heads.items()}
    rates = {h: t["tokens"] / t["seconds"] for h, t in totals.items()}
    out = {
        "kind": "output_head", "command": " ".join(["benchmarks/output_head.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "prompts": len(prompts),
        "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
        "head_shape": [fast.out_features, fast.in_features],
        "tokens_per_s": rates, "ratio": rates["transposed"] / rates["linear"],
        "identical_tokens": outputs["linear"] == outputs["transposed"],
        "head_product_s": product_s, "totals": totals,
    }
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
