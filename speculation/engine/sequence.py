"""One sequence's decode step, shared by the solo loops and :class:`~speculation.engine.batch.BatchEngine`.

:class:`DecodingSequence` chooses the first token, drafts, accepts (greedy or lossless
sampling), commits the accepted KV rows, truncates the output, lets the drafter observe and
hands the outcome to feedback; every step becomes a :class:`StepRecord`. The
:class:`TargetBackend` protocol is what the loops need from a target.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast, runtime_checkable

import torch

from speculation.spec import verify as V
from speculation.config import SamplingConfig
from speculation.drafters.base import DraftContext, Drafter, FinishingDrafter, Proposal, StepOutcome
from speculation.model.prefix_cache import PrefixHit
from speculation.model.target import TreeForward
from speculation.spec.tree import DraftTree, NodeSource


StateT = TypeVar("StateT")
"""A backend's per-sequence state (``TargetState`` in process, a sequence handle over Ray)."""


@runtime_checkable
class TargetBackend(Protocol[StateT]):
    """What the decode loop needs from a target (in-process or distributed), over its state type.

    :class:`~speculation.model.target.TargetModel` (state ``TargetState``) and
    ``cluster.backend.RayTargetBackend`` (state ``RayTargetState``) satisfy it structurally.
    A sequence lives from ``prefill`` to ``release``; the loops release it when generation ends.
    """

    vocab_size: int
    eos_token_ids: frozenset[int]

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``ContextLengthError`` if prompt + new tokens do not fit the context window."""
        ...

    def prefill(
        self, ids: list[int], need_aux: bool = False, chunk_tokens: int | None = None,
        reuse: PrefixHit | None = None,
    ) -> tuple[StateT, torch.Tensor, torch.Tensor | None]:
        """Start a sequence: (state, next-token logits ``[V]``, aux ``[n, 3H]`` or None);
        ``chunk_tokens``: in forwards of at most that many tokens (chunked prefill), or a clear
        error where the backend does not chunk; ``reuse``: an earlier prompt's rows to load
        instead of recomputing (:class:`~speculation.model.prefix_cache.PrefixCache`), or a
        clear error where the backend does not reuse."""
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
        return int(V.first_argmax(logits.reshape(-1)))
    return V.sample_token(logits.cpu(), procs, gen)  # the generator is a CPU one (seeded per request)


class FinishReason(str, enum.Enum):
    """Why a sequence ended (OpenAI's ``finish_reason`` values)."""

    LENGTH = "length"
    """``max_new_tokens`` tokens were generated."""
    STOP = "stop"
    """A stop token (EOS or one of the request's ``stop_token_ids``) was generated (kept in the output)."""
    ABORT = "abort"
    """The caller aborted the request."""


FeedbackSink = Callable[[DraftContext, StepOutcome], None]


@dataclass(frozen=True)
class NodePicks:
    """What acceptance and the drafter's ``observe`` read off one tree's logits, taken for every
    sequence of a step in one call: ``argmax`` per node (greedy sequences) and the ``[T, k]`` top-k
    ids (drafters with ``target_topk``, k the batch's largest); None where not wanted."""

    argmax: list[int] | None = None
    topk: torch.Tensor | None = None


def batch_picks(seqs: list[DecodingSequence], fwds: list[TreeForward]) -> list[NodePicks]:
    """One argmax over the greedy sequences' tree rows and one top-k over the rows of sequences
    whose drafter wants the target's top-k (:func:`~speculation.spec.verify.batch_argmax`), instead of
    one call per sequence; each row's result is the one a call of its own gives."""
    greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
    wants = [i for i, s in enumerate(seqs) if s.drafter is not None and s.drafter.target_topk]
    argmax: dict[int, list[int]] = dict(zip(greedy, V.batch_argmax([fwds[i].logits for i in greedy])))
    topk: dict[int, torch.Tensor] = {}
    if wants:
        k = max(cast(Drafter, seqs[i].drafter).target_topk for i in wants)
        topk = dict(zip(wants, V.batch_topk([fwds[i].logits for i in wants], k)))
    return [NodePicks(argmax.get(i), topk.get(i)) for i in range(len(seqs))]


class DecodingSequence:
    """One sequence's decode state and the per-step logic every loop shares.

    The solo loops (:func:`generate_vanilla`, :func:`generate_speculative`) and
    :class:`BatchEngine` differ only in how the target forward runs (one tree, or all trees of
    the batch in one forward); choosing the first token, drafting, acceptance, KV commit,
    output truncation, drafter observation, feedback and the step record all happen here.
    ``drafter`` None is vanilla decoding: every tree is the root alone.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        stop_ids: frozenset[int],
        drafter: Drafter | None,
        feedback: FeedbackSink | None = None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.drafter = drafter
        self.feedback = feedback
        self.procs = V.build_processors(sampling)
        self.gen = torch.Generator().manual_seed(sampling.seed)
        self.out: list[int] = []
        self.steps: list[StepRecord] = []
        self.finished: FinishReason | None = None
        self.ctx = DraftContext(tokens=list(prompt_ids), prompt_len=len(prompt_ids))
        self.t0 = time.perf_counter()
        self.prefill_s = 0.0
        self.t_end: float | None = None
        self.last_accepted: list[int] = []

    @property
    def needs_aux(self) -> bool:
        return self.drafter is not None and self.drafter.needs_aux

    def result(self) -> GenerationResult:
        end = self.t_end if self.t_end is not None else time.perf_counter()
        return GenerationResult(tokens=list(self.out), wall_s=end - self.t0, prefill_s=self.prefill_s,
                                steps=list(self.steps))

    def _append(self, new: list[int]) -> list[int]:
        """Append ``new`` up to the limits (stop token kept); sets :attr:`finished`; returns what was kept."""
        kept: list[int] = []
        for t in new:
            self.out.append(t)
            kept.append(t)
            if t in self.stop_ids:
                self.finished = FinishReason.STOP
            elif len(self.out) >= self.max_new_tokens:
                self.finished = FinishReason.LENGTH
            if self.finished is not None:
                self.t_end = time.perf_counter()
                break
        return kept

    def start(self, logits: torch.Tensor, prompt_aux: torch.Tensor | None) -> list[int]:
        """After prefill (next-token logits ``[V]``): choose the first token, begin the drafter."""
        tok = _choose(logits, self.sampling, self.procs, self.gen)
        self.ctx.tokens.append(tok)
        if self.drafter is not None:
            self.drafter.begin(self.ctx, prompt_aux)
        self.prefill_s = time.perf_counter() - self.t0
        kept = self._append([tok])
        if self.finished is not None:
            self._finish_drafter()
        return kept

    def _finish_drafter(self) -> None:
        """Hand a finished sequence's output to a :class:`FinishingDrafter`."""
        if isinstance(self.drafter, FinishingDrafter):
            self.drafter.finish(self.ctx, list(self.out))

    def propose(self, max_tree: int | None = None) -> tuple[DraftTree, Proposal | None, float]:
        """The tree to verify (cut to its best ``max_tree`` nodes, root included), the proposal, seconds."""
        if self.drafter is None:
            return DraftTree(self.ctx.root_token), None, 0.0
        ta = time.perf_counter()
        proposal = self.drafter.propose(self.ctx)
        return self.take(proposal, max_tree, time.perf_counter() - ta)

    @staticmethod
    def take(proposal: Proposal, max_tree: int | None, seconds: float) -> tuple[DraftTree, Proposal, float]:
        """``proposal``'s tree cut to its best ``max_tree`` nodes (root included), the proposal, seconds."""
        tree = proposal.tree
        if max_tree is not None and len(tree) > max_tree:
            tree = tree.pruned_to(max_tree - 1)
        return tree, proposal, seconds

    def settle(
        self,
        tree: DraftTree,
        fwd: TreeForward,
        picks: NodePicks,
        commit: Callable[[DraftTree, list[int]], None],
        proposal: Proposal | None,
        draft_s: float,
        forward_s: float,
        stats: dict[str, float] | None = None,
    ) -> tuple[list[int], StepRecord]:
        """Accept over ``fwd`` (greedy or lossless sampling), ``commit`` the accepted KV rows, append
        the new tokens, let the drafter observe and feedback see the outcome; returns (tokens kept,
        the step's record). ``picks``: the argmax and top-k of ``fwd``'s nodes (:func:`batch_picks`,
        one call for the whole batch)."""
        tb = time.perf_counter()
        if self.sampling.greedy:
            res = V.greedy(tree, fwd.logits, picks.argmax)
        else:
            res = V.sample(tree, fwd.logits.cpu(), self.procs, self.gen)  # CPU generator: CPU logits
        commit(tree, res.accepted)
        self.last_accepted = res.accepted
        new = [tree.tokens[a] for a in res.accepted[1:]] + [res.bonus_token]
        kept = self._append(new)
        self.ctx.tokens.extend(new)
        tc = time.perf_counter()
        if self.drafter is not None:
            drafter = self.drafter
            aux = fwd.aux_hidden[res.accepted] if (fwd.aux_hidden is not None and drafter.needs_aux) else None
            outcome = StepOutcome(
                tree=tree,
                accepted=res.accepted,
                accepted_tokens=[tree.tokens[a] for a in res.accepted],
                bonus_token=res.bonus_token,
                aux_hidden=aux,
                target_topk=picks.topk[:, : drafter.target_topk] if picks.topk is not None else None,
            )
            if self.finished is None:
                drafter.observe(self.ctx, outcome)
            else:
                self._finish_drafter()
            if self.feedback is not None:
                self.feedback(self.ctx, outcome)
        td = time.perf_counter()
        rec = _record(tree, res, proposal, len(kept), draft_s + (td - tc), forward_s + (tc - tb), stats)
        self.steps.append(rec)
        return kept, rec


def _record(tree: DraftTree, res: V.VerifyResult, proposal: Proposal | None, gained: int, draft_s: float,
            verify_s: float, extra_stats: dict[str, float] | None = None) -> StepRecord:
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
        drafter_forwards=proposal.drafter_forwards if proposal is not None else 0,
        tree_depth=tree.max_depth(),
        accepted_by_source=acc_src,
        drafted_by_source=dr_src,
        stats={**(dict(proposal.stats) if proposal is not None else {}), **(extra_stats or {})},
    )
