"""Where a vanilla decode step's time goes: wall time per step, and torch.profiler's operator
self-times per step grouped into the linear layers, attention, the rest of the operators, and
what no operator accounts for (Python and the Hugging Face forward's glue).

    .venv/bin/python benchmarks/decode_profile.py --dtype float32 --baseline --json benchmarks/results/decode_profile_fp32.json

    .venv/bin/python benchmarks/decode_profile.py --dtype float32 --baseline transformers-forward --json benchmarks/results/decode_profile_lean_fp32.json

Loads the target as every command does (``assets.load_model``: grouped projections, fused RMS
norms, oneDNN-packed linear layers; ``TargetModel``'s lean decoder loop where the model
qualifies), prefills one Spec-Bench prompt, then times ``--steps`` greedy ``TargetModel.decode``
steps without the profiler (the wall figure) and again under ``torch.profiler`` (the breakdown;
the profiler adds its own overhead, reported as the difference of the two walls).
``--baseline`` also times a baseline interleaved with the target, run by run, on the same prompt
(wall ratio and whether the greedy tokens are identical): ``unfused`` loads the target without
the grouped projections and fused norms (so transformers' own forward), ``transformers-forward``
runs the very same model through transformers' forward instead of the lean loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from speculation import assets
from speculation.bench.runner import emit_json, environment
from speculation.model.target import TargetModel, load_target

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::matmul")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::baddbmm")


BASELINES = {
    "unfused": "transformers' separate projections and norms and its own forward, linear layers packed",
    "transformers-forward": "the same fused, packed model through transformers' forward (no lean loop)",
}


def _group(name: str) -> str:
    if name in LINEAR_OPS:
        return "linear"
    if name in ATTENTION_OPS:
        return "attention"
    return "other operators"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
    ap.add_argument("--top", type=int, default=12, help="operators listed by self time")
    ap.add_argument("--baseline", nargs="?", const="unfused", choices=sorted(BASELINES),
                    help="also time a baseline side by side: 'unfused' (transformers' separate projections "
                         "and norms and its own forward; the default) or 'transformers-forward' (the same "
                         "fused weights through transformers' forward instead of the lean loop)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    target = load_target(args.model, args.dtype)
    prompt = assets.encode_turn(target.tokenizer, [], assets.load_questions("spec_bench", 1)[0].turns[0])

    baseline = None
    if args.baseline is not None:
        if args.baseline == "unfused":
            baseline = TargetModel(assets.load_model(args.model, target.dtype, fuse=False), target.tokenizer)
        else:
            baseline = TargetModel(target.model, target.tokenizer, aux_layers=target.aux_layers, lean=False)

    def decode(state, logits, steps: int, model=target) -> tuple[float, list[int]]:
        tokens = []
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = model.decode(state, tokens[-1])
        return (time.perf_counter() - t0) / steps, tokens

    def run(steps: int, model=target) -> tuple[float, list[int]]:
        state, logits, _ = model.prefill(prompt)
        return decode(state, logits, steps, model)

    run(8)  # warm-up: oneDNN primitives, allocator
    if baseline is not None:
        run(8, baseline)
    walls, base_walls, same = [], [], True
    for _ in range(args.repeats):  # interleaved, so both see the same host
        wall_i, tokens = run(args.steps)
        walls.append(wall_i)
        if baseline is not None:
            base_i, base_tokens = run(args.steps, baseline)
            base_walls.append(base_i)
            same = same and base_tokens == tokens
    wall = sorted(walls)[len(walls) // 2]
    state, logits, _ = target.prefill(prompt)  # outside the profile: only decode steps are profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_wall, _ = decode(state, logits, args.steps)
    events = prof.key_averages()
    per_op = sorted(((e.key, e.self_cpu_time_total / 1e3 / args.steps, e.count / args.steps) for e in events),
                    key=lambda x: -x[1])
    groups: dict[str, float] = {}
    for name, ms, _ in per_op:
        groups[_group(name)] = groups.get(_group(name), 0.0) + ms
    op_total = sum(groups.values())
    out = {
        "kind": "decode_profile",
        "command": " ".join(["benchmarks/decode_profile.py", *(argv if argv is not None else sys.argv[1:])]),
        "env": environment(), "model": args.model, "dtype": args.dtype, "steps": args.steps,
        "prompt_tokens": len(prompt), "lean_forward": target.lean is not None, "wall_ms_per_step": wall * 1e3, "walls_ms": [w * 1e3 for w in walls],
        "profiled_wall_ms_per_step": profiled_wall * 1e3,
        "groups_ms_per_step": groups, "operators_ms_per_step": op_total,
        "unaccounted_ms_per_step": profiled_wall * 1e3 - op_total,
        "top_operators": [{"op": n, "self_ms_per_step": ms, "calls_per_step": c} for n, ms, c in per_op[: args.top]],
    }
    if baseline is not None:
        base = sorted(base_walls)[len(base_walls) // 2]
        paired = sorted(b / w for b, w in zip(base_walls, walls))  # each run against its neighbour
        out["baseline"] = {"name": args.baseline, "what": BASELINES[args.baseline],
                           "wall_ms_per_step": base * 1e3, "walls_ms": [w * 1e3 for w in base_walls],
                           "speedup": base / wall, "paired_speedup_median": paired[len(paired) // 2],
                           "pairs_faster": sum(r > 1.0 for r in paired), "pairs": len(paired),
                           "identical_tokens": same}
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
