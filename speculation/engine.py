"""The decode loop: draft -> verify -> accept -> commit -> observe, and the vanilla loop.

Both loops run on the same :class:`TargetBackend` (the in-process :class:`TargetModel`, or a
proxy over Ray actors), so speedups compare like with like and the distributed path reuses this
exact loop. Every speculative step is recorded as a :class:`StepRecord`; all metrics are
computed from those records.

Output rule (both loops): generation stops after ``max_new_tokens`` tokens or at the first EOS
token (kept in the output), so a step that accepts past either point is truncated there.
Both loops release the target's sequence (its KV cache, or the shards' caches) when generation
ends, normally or by an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import torch

from speculation import verify as V
from speculation.config import EngineConfig, SamplingConfig
from speculation.drafters.base import DraftContext, Drafter, Proposal, StepOutcome
from speculation.target import TreeForward
from speculation.tree import DraftTree, NodeSource

StateT = TypeVar("StateT")
"""A backend's per-sequence state (``TargetState`` in process, a sequence handle over Ray)."""


@runtime_checkable
class TargetBackend(Protocol[StateT]):
    """What the decode loop needs from a target (in-process or distributed), over its state type.

    :class:`~speculation.target.TargetModel` (state ``TargetState``) and
    ``cluster.backend.RayTargetBackend`` (state ``RayTargetState``) satisfy it structurally.
    A sequence lives from ``prefill`` to ``release``; the loops release it when generation ends.
    """

    vocab_size: int
    eos_token_ids: frozenset[int]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``ContextLengthError`` if prompt + new tokens do not fit the context window."""
        ...

    def prefill(self, ids: list[int], need_aux: bool = False) -> tuple[StateT, torch.Tensor, torch.Tensor | None]:
        """Start a sequence: (state, next-token logits ``[V]``, aux ``[n, 3H]`` or None)."""
        ...

    def decode(self, state: StateT, token: int) -> torch.Tensor:
        """Append ``token``; next-token logits ``[V]``."""
        ...

    def verify(self, state: StateT, tree: DraftTree, need_aux: bool = False) -> TreeForward:
        """One forward over every node of ``tree`` (provisional KV rows until ``commit``)."""
        ...

    def commit(self, state: StateT, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's KV rows of the last verified tree."""
        ...

    def truncate(self, state: StateT, length: int) -> None:
        """Forget everything after the first ``length`` cached tokens."""
        ...

    def release(self, state: StateT) -> None:
        """Free the sequence's KV cache(s); the state is unusable afterwards."""
        ...


@dataclass(frozen=True)
class StepRecord:
    """One verify step.

    Attributes:
        drafted: draft nodes proposed (tree size minus the root).
        tree_size: tokens the target verified (root included).
        accepted: draft tokens accepted (bonus excluded).
        tokens_gained: tokens this step appended to the output (accepted + bonus, after truncation).
        drafting_s: seconds in ``propose`` + ``observe``.
        verify_s: seconds in the target forward, acceptance and KV commit.
        drafter_forwards: neural drafter forwards spent on the proposal.
        tree_depth: depth of the verified tree.
        accepted_by_source: accepted draft tokens per :class:`NodeSource` name.
        drafted_by_source: drafted nodes per :class:`NodeSource` name.
        stats: the drafter's per-step numbers (:attr:`Proposal.stats`).
    """

    drafted: int
    tree_size: int
    accepted: int
    tokens_gained: int
    drafting_s: float
    verify_s: float
    drafter_forwards: int
    tree_depth: int
    accepted_by_source: dict[str, int]
    drafted_by_source: dict[str, int]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class GenerationResult:
    """Tokens generated for one prompt and how.

    Attributes:
        tokens: generated token ids (prompt excluded).
        wall_s: wall-clock seconds from prefill start to the last token.
        prefill_s: seconds of the prefill forward (and drafter ``begin``).
        steps: per-step records (empty for vanilla).
    """

    tokens: list[int]
    wall_s: float
    prefill_s: float
    steps: list[StepRecord] = field(default_factory=list)


def _choose(logits: torch.Tensor, sampling: SamplingConfig, procs, gen: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return V.sample_token(logits, procs, gen)


def _finish(out: list[int], new: list[int], max_new: int, eos: frozenset[int], stop_at_eos: bool) -> bool:
    """Append ``new`` to ``out`` up to the limits; True when generation is over."""
    for t in new:
        out.append(t)
        if len(out) >= max_new or (stop_at_eos and t in eos):
            return True
    return False


def _validate_prompt(target: TargetBackend[StateT], prompt_ids: list[int], cfg: EngineConfig) -> None:
    if not prompt_ids:
        raise ValueError("prompt is empty: at least one token is required")
    target.check_fits(len(prompt_ids), cfg.max_new_tokens)


def generate_vanilla(target: TargetBackend[StateT], prompt_ids: list[int], cfg: EngineConfig) -> GenerationResult:
    """Plain autoregressive decoding on ``target`` (one forward per token)."""
    _validate_prompt(target, prompt_ids, cfg)
    sampling = cfg.sampling
    procs = V.build_processors(sampling)
    gen = torch.Generator().manual_seed(sampling.seed)
    t0 = time.perf_counter()
    state, logits, _ = target.prefill(prompt_ids)
    try:
        tok = _choose(logits, sampling, procs, gen)
        prefill_s = time.perf_counter() - t0
        out: list[int] = []
        done = _finish(out, [tok], cfg.max_new_tokens, target.eos_token_ids, cfg.stop_at_eos)
        while not done:
            logits = target.decode(state, tok)
            tok = _choose(logits, sampling, procs, gen)
            done = _finish(out, [tok], cfg.max_new_tokens, target.eos_token_ids, cfg.stop_at_eos)
    finally:
        target.release(state)
    return GenerationResult(tokens=out, wall_s=time.perf_counter() - t0, prefill_s=prefill_s)


FeedbackSink = Callable[[DraftContext, StepOutcome], None]


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
    _validate_prompt(target, prompt_ids, cfg)
    sampling = cfg.sampling
    procs = V.build_processors(sampling)
    gen = torch.Generator().manual_seed(sampling.seed)
    eos = target.eos_token_ids
    t0 = time.perf_counter()
    state, logits, prompt_aux = target.prefill(prompt_ids, need_aux=drafter.needs_aux)
    try:
        tok = _choose(logits, sampling, procs, gen)
        ctx = DraftContext(tokens=[*prompt_ids, tok], prompt_len=len(prompt_ids))
        drafter.begin(ctx, prompt_aux)
        prefill_s = time.perf_counter() - t0
        out: list[int] = []
        steps: list[StepRecord] = []
        done = _finish(out, [tok], cfg.max_new_tokens, eos, cfg.stop_at_eos)
        while not done:
            ta = time.perf_counter()
            proposal = drafter.propose(ctx)
            tree = proposal.tree
            tb = time.perf_counter()
            fwd = target.verify(state, tree, need_aux=drafter.needs_aux)
            if sampling.greedy:
                res = V.greedy(tree, fwd.logits)
            else:
                res = V.sample(tree, fwd.logits, procs, gen)
            target.commit(state, tree, res.accepted)
            new = [tree.tokens[a] for a in res.accepted[1:]] + [res.bonus_token]
            before = len(out)
            done = _finish(out, new, cfg.max_new_tokens, eos, cfg.stop_at_eos)
            ctx.tokens.extend(new)
            tc = time.perf_counter()
            outcome = StepOutcome(
                tree=tree,
                accepted=res.accepted,
                accepted_tokens=[tree.tokens[a] for a in res.accepted],
                bonus_token=res.bonus_token,
                aux_hidden=fwd.aux_hidden[res.accepted] if fwd.aux_hidden is not None else None,
                target_topk=(
                    torch.topk(fwd.logits, drafter.target_topk, dim=-1).indices if drafter.target_topk else None
                ),
            )
            if not done:
                drafter.observe(ctx, outcome)
            td = time.perf_counter()
            if feedback is not None:
                feedback(ctx, outcome)
            steps.append(_record(tree, res, proposal, len(out) - before, (tb - ta) + (td - tc), tc - tb))
    finally:
        target.release(state)
    return GenerationResult(tokens=out, wall_s=time.perf_counter() - t0, prefill_s=prefill_s, steps=steps)


def _record(tree: DraftTree, res: V.VerifyResult, proposal: Proposal, gained: int, draft_s: float,
            verify_s: float) -> StepRecord:
    acc_src: dict[str, int] = {}
    for a in res.accepted[1:]:
        name = NodeSource(tree.sources[a]).name.lower()
        acc_src[name] = acc_src.get(name, 0) + 1
    dr_src: dict[str, int] = {}
    for s in tree.sources[1:]:
        name = NodeSource(s).name.lower()
        dr_src[name] = dr_src.get(name, 0) + 1
    return StepRecord(
        drafted=len(tree) - 1,
        tree_size=len(tree),
        accepted=res.accept_length,
        tokens_gained=gained,
        drafting_s=draft_s,
        verify_s=verify_s,
        drafter_forwards=proposal.drafter_forwards,
        tree_depth=tree.max_depth(),
        accepted_by_source=acc_src,
        drafted_by_source=dr_src,
        stats=dict(proposal.stats),
    )
