"""``graftblock export vllm``: write a trained EAGLE-3 head in vLLM's EAGLE-3 format.

    graftblock export vllm --checkpoint checkpoints/eagle3-smollm2-135m --out DIR [--model ALIAS|DIR]

vLLM then serves it as ``speculative_config={"method": "eagle3", "model": DIR,
"num_speculative_tokens": K}`` next to the target (see :mod:`speculation.drafters.vllm_format`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculation import assets
from speculation.config import DType
from speculation.drafters.checkpoint import EAGLE3, read_header
from speculation.drafters.vllm_format import export_vllm_eagle3


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export`` (with its ``vllm`` target) on the top-level sub-command parser."""
    e = sub.add_parser("export", help="write a trained drafter in another engine's format")
    esub = e.add_subparsers(dest="target_format", required=True)
    v = esub.add_parser("vllm", help="EAGLE-3 head -> vLLM's EAGLE-3 format (config.json + model.safetensors)")
    v.add_argument("--checkpoint", required=True, help="graftblock EAGLE-3 checkpoint (directory or .safetensors)")
    v.add_argument("--out", required=True, help="output directory")
    v.add_argument("--model", default=None,
                   help="target alias or directory (default: the target named in the checkpoint)")
    v.add_argument("--dtype", default="float32", help="float32 | bfloat16 (tensors as written)")
    v.set_defaults(func=cmd_export_vllm)


def cmd_export_vllm(args: argparse.Namespace) -> int:
    _, fingerprint = read_header(args.checkpoint, EAGLE3)
    model_dir = assets.resolve_model_dir(args.model or fingerprint.name)
    target_config = json.loads((model_dir / "config.json").read_text())
    out = export_vllm_eagle3(args.checkpoint, Path(args.out), target_config, DType.parse(args.dtype).torch)
    print(f"vLLM EAGLE-3 head written to {out.resolve()} (target {model_dir})")
    return 0
