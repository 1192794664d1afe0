"""The batch-1 decode loops: :func:`generate_vanilla` and :func:`generate_speculative` on any
:class:`~speculation.engine.sequence.TargetBackend` (in process, or over Ray actors).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from speculation.config import EngineConfig
from speculation.drafters.base import Drafter, VerifyTimed
from speculation.engine.sequence import (
    DecodingSequence,
    FeedbackSink,
    GenerationResult,
    StateT,
    TargetBackend,
    batch_picks,
)
from speculation.model.target import TreeForward
from speculation.spec.tree import DraftTree


def _validate_prompt(target: TargetBackend[StateT], prompt_ids: list[int], cfg: EngineConfig) -> None:
    if not prompt_ids:
        raise ValueError("prompt is empty: at least one token is required")
    target.check_fits(len(prompt_ids), cfg.max_new_tokens)


def _run_solo(
    target: TargetBackend[StateT],
    drafter: Drafter | None,
    prompt_ids: list[int],
    cfg: EngineConfig,
    feedback: FeedbackSink | None,
) -> GenerationResult:
    """One sequence on any :class:`TargetBackend`: the batch-1 case of the shared step logic."""
    _validate_prompt(target, prompt_ids, cfg)
    stop = target.eos_token_ids if cfg.stop_at_eos else frozenset()
    seq = DecodingSequence(list(prompt_ids), cfg.max_new_tokens, cfg.sampling, stop, drafter, feedback)
    timed = drafter if isinstance(drafter, VerifyTimed) else None  # its c(T) learns from each verify
    state, logits, prompt_aux = target.prefill(prompt_ids, need_aux=seq.needs_aux, chunk_tokens=cfg.prefill_chunk_tokens)
    try:
        seq.start(logits, prompt_aux)
        while seq.finished is None:
            tree, proposal, draft_s = seq.propose()
            tb = time.perf_counter()
            if drafter is None:
                # A one-node tree's forward is the plain decode step, which already keeps its row.
                fwd = TreeForward(logits=target.decode(state, tree.root_token).view(1, -1), aux_hidden=None)
                commit: Callable[[DraftTree, list[int]], None] = _keep_decoded
            else:
                fwd = target.verify(state, tree, need_aux=seq.needs_aux)
                commit = functools.partial(target.commit, state)
            context = len(seq.ctx.tokens)
            picks = batch_picks([seq], [fwd])[0]
            _, rec = seq.settle(tree, fwd, picks, commit, proposal, draft_s, time.perf_counter() - tb)
            if timed is not None:
                timed.observe_verify(len(tree), context, rec.verify_s)
    finally:
        target.release(state)
    res = seq.result()
    if drafter is None:
        res.steps = []  # vanilla reports no step records (GenerationResult contract)
    return res


def _keep_decoded(tree: DraftTree, accepted: list[int]) -> None:
    """Commit after a decode step: the root's row is already the only one written."""
    if accepted != [0]:
        raise ValueError(f"a decode step can only accept the root, got {accepted}")


def generate_vanilla(target: TargetBackend[StateT], prompt_ids: list[int], cfg: EngineConfig) -> GenerationResult:
    """Plain autoregressive decoding on ``target`` (one forward per token): trees of one token."""
    return _run_solo(target, None, prompt_ids, cfg, None)


def generate_speculative(
    target: TargetBackend[StateT],
    drafter: Drafter,
    prompt_ids: list[int],
    cfg: EngineConfig,
    feedback: FeedbackSink | None = None,
) -> GenerationResult:
    """Speculative decoding with any drafter behind the protocol.

    Per step: propose a tree rooted at the pending token, verify it in one target forward,
    accept (greedy or lossless sampling), keep only the accepted KV rows, let the drafter
    observe, and hand the same :class:`StepOutcome` to ``feedback`` (online adaptation).
    """
    return _run_solo(target, drafter, prompt_ids, cfg, feedback)
