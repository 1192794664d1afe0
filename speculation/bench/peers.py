"""Peer baselines run inside the same bench run: Hugging Face's own decoding loops.

* ``hf_generate``: ``model.generate(do_sample=False)``, the reference greedy loop.
* ``hf_prompt_lookup``: ``model.generate(prompt_lookup_num_tokens=N)``, HF's n-gram lookup
  speculation (PLD), the closest off-the-shelf analogue of the retrieval drafter.

Both use the very same model object and weights as our target, so the comparison is direct.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from speculation.bench import vllm_peers
from speculation.config import ConfigError, SamplingConfig
from speculation.engine.sequence import GenerationResult
from speculation.model.target import TargetModel


class Peer(str, enum.Enum):
    HF_GENERATE = "hf_generate"
    HF_PROMPT_LOOKUP = "hf_prompt_lookup"
    VLLM = "vllm"  # the vLLM peers run in .venv-vllm: speculation/bench/vllm_peers.py
    VLLM_NGRAM = "vllm_ngram"
    VLLM_EAGLE3 = "vllm_eagle3"
    VLLM_RETRIEVAL = "vllm_retrieval"
    VLLM_SUFFIX = "vllm_suffix"


PROMPT_LOOKUP_TOKENS = 10


def available_peers(peers: list[Peer]) -> tuple[list[Peer], dict[str, str]]:
    """``peers`` split into those that can run here and ``{name: reason}`` for those that cannot
    (a vLLM peer whose optional module is not installed: :func:`vllm_peers.unavailable`)."""
    missing = {p.value: why for p in peers if p.value in vllm_peers.PEER_METHODS
               and (why := vllm_peers.unavailable(p.value)) is not None}
    return [p for p in peers if p.value not in missing], missing


def parse_peers(value: str | None) -> list[Peer]:
    if not value:
        return []
    out = []
    for name in value.split(","):
        name = name.strip()
        try:
            out.append(Peer(name))
        except ValueError:
            raise ConfigError(f"--peers: unknown peer {name!r}; allowed: {', '.join(p.value for p in Peer)}") from None
    if any(p.value in vllm_peers.PEER_METHODS for p in out):
        vllm_peers.require_environment()
    return out


@torch.inference_mode()
def run_peer(
    peer: Peer, target: TargetModel, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig
) -> GenerationResult:
    """Generate with a Hugging Face loop or a vLLM peer; timing covers the whole ``generate`` call."""
    if peer.value in vllm_peers.PEER_METHODS:
        return vllm_peers.generate(peer.value, target, prompt_ids, max_new_tokens, sampling)
    model = target.model
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(target.eos_token_ids) or None,
        pad_token_id=min(target.eos_token_ids) if target.eos_token_ids else 0,
        attention_mask=torch.ones_like(input_ids),
    )
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        torch.manual_seed(sampling.seed)
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    if peer == Peer.HF_PROMPT_LOOKUP:
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    t0 = time.perf_counter()
    out = model.generate(input_ids, **kwargs)
    wall = time.perf_counter() - t0
    return GenerationResult(tokens=out[0, len(prompt_ids):].tolist(), wall_s=wall, prefill_s=0.0)


@dataclass(frozen=True)
class BatchedPeerRun:
    """One static batch of Hugging Face ``generate``: per-prompt tokens and the batch's wall time."""

    tokens: list[list[int]]
    wall_s: float


def _trim_at_eos(row: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut a padded output row after its first EOS (HF pads finished rows with ``pad_token_id``)."""
    for i, t in enumerate(row[:max_new_tokens]):
        if t in eos:
            return row[: i + 1]
    return row[:max_new_tokens]


@torch.inference_mode()
def run_hf_batched(
    target: TargetModel, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig
) -> BatchedPeerRun:
    """HF ``generate`` on a left-padded batch (static batching: the batch ends with its longest row).

    This is the padded-batch peer of the concurrency bench: the whole batch is one call, so no
    request returns before the slowest one ends and no new request joins mid-batch.
    """
    model = target.model
    width = max(len(p) for p in prompts)
    pad = min(target.eos_token_ids) if target.eos_token_ids else 0
    # input_ids/attention_mask: [B, width], left-padded so every row's last prompt token aligns.
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=target.device)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device=target.device)
        mask[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(target.eos_token_ids) or None,
                  pad_token_id=pad, attention_mask=mask)
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        torch.manual_seed(sampling.seed)
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None)
    t0 = time.perf_counter()
    out = model.generate(input_ids, **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows = [_trim_at_eos(r, target.eos_token_ids, max_new_tokens) for r in out[:, width:].tolist()]
    return BatchedPeerRun(tokens=rows, wall_s=wall)


def peer_stats(peer: Peer) -> dict:
    """Per-peer figures beyond tokens/s: vLLM's mean acceptance length (none for HF's loops)."""
    return vllm_peers.peer_stats(peer.value) if peer.value in vllm_peers.PEER_METHODS else {}


def reset_peer_stats() -> None:
    """Forget the warm-up's counters."""
    vllm_peers.reset_stats()
