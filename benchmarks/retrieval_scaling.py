"""Retrieval drafter proposal cost vs context length (it must not grow linearly).

    .venv/bin/python benchmarks/retrieval_scaling.py --json benchmarks/results/retrieval_scaling.json

Feeds real text (XSum documents from the packaged dataset, tokenized with SmolLM2's tokenizer)
to a fresh drafter and, at each context length, times ``propose`` + ``observe`` (including the
incremental index update) over a window of steps. No target model runs: the "verification"
accepts the true next text tokens, so the index sees exactly what decoding would feed it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from speculation import assets
from speculation.bench.runner import environment
from speculation.config import RetrievalConfig, to_dict
from speculation.drafters.base import DraftContext, StepOutcome
from speculation.drafters.retrieval import RetrievalDrafter

LENGTHS = (256, 1024, 4096, 16384)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per context length")
    args = ap.parse_args()
    _, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.bfloat16)
    docs = assets.load_questions("xsum")
    text: list[int] = []
    for q in docs:
        text += tok(q.turns[0])["input_ids"]
        if len(text) > max(LENGTHS) + args.steps * 8 + 10:
            break
    cfg = RetrievalConfig(cost_aware=False)
    drafter = RetrievalDrafter(cfg, vocab_size=len(tok))
    ctx = DraftContext(tokens=text[:2], prompt_len=2)
    drafter.begin(ctx, None)
    topk = torch.zeros(1, cfg.transition_topk, dtype=torch.long)
    results = {}
    pos = 2
    for length in LENGTHS:
        # Grow the context to `length` through the drafter's own incremental update path.
        ctx.tokens.extend(text[pos:length])
        pos = length
        drafter.propose(ctx)
        times, sizes = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            tree = drafter.propose(ctx).tree
            # Accept the true next tokens along the tree as far as they match (greedy walk).
            cur, acc = 0, [0]
            while True:
                nxt = tree.child(cur, text[pos + len(acc) - 1])
                if nxt is None:
                    break
                acc.append(nxt)
                cur = nxt
            new = text[pos : pos + len(acc)]
            ctx.tokens.extend(new)
            pos += len(new)
            out = StepOutcome(tree=tree, accepted=acc, accepted_tokens=[tree.tokens[a] for a in acc],
                              bonus_token=new[-1], target_topk=topk.expand(len(tree), -1))
            drafter.observe(ctx, out)
            times.append(time.perf_counter() - t0)
            sizes.append(len(tree))
        results[str(length)] = {
            "median_ms": 1000 * statistics.median(times),
            "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))],
            "mean_tree_size": sum(sizes) / len(sizes),
        }
        print(f"context {length:6d}: propose+observe median {results[str(length)]['median_ms']:.3f} ms "
              f"(p90 {results[str(length)]['p90_ms']:.3f}), tree {results[str(length)]['mean_tree_size']:.1f}")
    out = {"kind": "retrieval_scaling", "model": "smollm2-135m (tokenizer only)", "config": to_dict(cfg), "steps": args.steps, "results": results,
           "env": environment(), "command": "python benchmarks/retrieval_scaling.py " + " ".join(sys.argv[1:])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
