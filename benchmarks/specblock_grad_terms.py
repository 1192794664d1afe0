"""Why the valid-prefix mask slowed SpecBlock's slot 0 here: per-slot gradient norms.

    .venv/bin/python benchmarks/specblock_grad_terms.py --checkpoint checkpoints/specblock-smollm2-135m \
        --features runs/eagle3-smollm2-135m/features --batches 4 --json benchmarks/results/specblock_grad_terms.json

For a few cached training batches it computes, with and without the mask, the gradient norm of
every weighted slot term ``w^k L_{1,k}`` of block 1, the rows each term averages over, and the
global norm of their sum. Training clips the global norm to 0.5, so a term with few rows and a
large gradient shrinks every other term's update, slot 0's included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import sys
from pathlib import Path

import torch
import transformers

from adaptation.batches import make_batch, plan_batches
from adaptation.features import FeatureCache
from adaptation.specblock_loss import block_forward
from speculation import assets
from speculation.drafters.checkpoint import SPECBLOCK, TargetFingerprint, load_checkpoint
from speculation.model.target import TargetModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--features", required=True, help="a feature cache (graftblock train ... --features)")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model_hf, tok = assets.load_model_and_tokenizer("smollm2-135m", torch.bfloat16)
    target = TargetModel(model_hf, tok)
    head = load_checkpoint(args.checkpoint, TargetFingerprint.from_target(target), kind=SPECBLOCK).float().train()
    params = [p for n, p in head.named_parameters() if not n.startswith("rank_head")]
    embed = model_hf.get_input_embeddings().weight.detach()
    t2d = head.target_to_draft()
    shard = FeatureCache(args.features).load(args.shard)
    plan = plan_batches(shard.lengths(), args.batch_tokens, seed=0)[: args.batches]

    out: dict = {
        "kind": "specblock_grad_terms",
        "command": ".venv/bin/python benchmarks/specblock_grad_terms.py " + " ".join(shlex.quote(a) for a in
                                                                                 (argv or sys.argv[1:])),
        "env": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "cpu": platform.processor() or platform.machine(), "cpu_count": __import__("os").cpu_count(),
                "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                "transformers": transformers.__version__,
                "git_commit": __import__("subprocess").run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                           text=True).stdout.strip()},
        "model": "smollm2-135m", "dtype": "bfloat16 autocast",
        "checkpoint": args.checkpoint, "batches": len(plan), "modes": {},
    }
    for mode, masked in (("valid_prefix_mask", True), ("no_mask", False)):
        per_slot = [[] for _ in range(head.arch.block_size)]
        rows = [[] for _ in range(head.arch.block_size)]
        total_norms = []
        for idx in plan:
            batch = make_batch(shard, idx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = block_forward(head, embed, batch, t2d, 1, torch.Generator().manual_seed(0),
                                    valid_prefix_mask=masked, rank_weight=0.0)
            terms = res.slot_losses[0]
            for k, term in enumerate(terms):
                if term is None:
                    continue
                grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
                per_slot[k].append(math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None)))
                rows[k].append(res.slot_count[0][k])
            present = [t for t in terms if t is not None]
            grads = torch.autograd.grad(sum(present), params, allow_unused=True)
            total_norms.append(math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None)))
        out["modes"][mode] = {
            "slot_grad_norm": [sum(v) / len(v) if v else None for v in per_slot],
            "slot_rows": [sum(v) / len(v) if v else None for v in rows],
            "total_grad_norm": sum(total_norms) / len(total_norms),
            "slot0_share_after_clip_0.5": [min(1.0, 0.5 / t) for t in total_norms],
        }
        print(mode, json.dumps(out["modes"][mode]))
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
