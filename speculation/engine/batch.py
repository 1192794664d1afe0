"""Continuous batching: :class:`BatchEngine` admits requests into KV slots, drafts one tree per
live sequence, verifies them all in one target forward and settles each sequence.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from speculation.config import BatchConfig, ConfigError, SamplingConfig
from speculation.drafters.base import Drafter, Proposal, SkippableDrafter, propose_many
from speculation.engine.sequence import (
    DecodingSequence,
    FeedbackSink,
    FinishReason,
    GenerationResult,
    StepRecord,
    batch_picks,
)
from speculation.model.batch_target import BatchTarget, SlotState
from speculation.model.kv_slots import KVSlotPool
from speculation.model.prefix_cache import LayerRows, PrefixCache
from speculation.model.target import ContextLengthError, PrefillForward
from speculation.policy.draft_budget import DraftBudgetConfig, DraftBudgetPolicy, SequenceBudget
from speculation.policy.goodput import DEFAULT_BATCH_CONTEXTS, BatchCostModel, measure_batch_cost
from speculation.spec.step import DraftingCheck, StepResult  # noqa: F401  (DraftingCheck: re-exported)
from speculation.spec.tree import DraftTree


class AdmissionError(ValueError):
    """The request can never fit this engine (prompt + new tokens vs the slot size or context)."""


class QueueFullError(RuntimeError):
    """``BatchConfig.max_waiting`` requests already wait for a slot; retry later."""


@dataclass(frozen=True)
class Request:
    """One generation request for :class:`BatchEngine` (validated on construction).

    Attributes:
        request_id: unique among queued and live requests.
        prompt_ids: prompt token ids (at least one).
        max_new_tokens: tokens to generate at most. Range [1, 65536].
        sampling: temperature, top-p, top-k and seed of this request (its own generator).
        stop_token_ids: stop ids on top of the target's EOS (the stop token is kept in the output).
        stop_at_eos: also stop at the target's EOS id(s).
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: frozenset[int] = frozenset()
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request.request_id must be a non-empty string, got {self.request_id!r}")
        ids = list(self.prompt_ids) if isinstance(self.prompt_ids, (list, tuple)) else None
        if not ids:
            raise ValueError("request.prompt_ids is empty: at least one token is required")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"request.prompt_ids must be non-negative ints, got {bad[0]!r}")
        object.__setattr__(self, "prompt_ids", ids)
        mnt = self.max_new_tokens
        if isinstance(mnt, bool) or not isinstance(mnt, int) or not 1 <= mnt <= 65536:
            raise ValueError(f"request.max_new_tokens must be an integer in [1, 65536], got {mnt!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"request.sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        stops = frozenset(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"request.stop_token_ids must be non-negative ints, got {sorted(stops, key=str)}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.stop_at_eos, bool):
            raise ValueError(f"request.stop_at_eos must be true or false, got {self.stop_at_eos!r}")


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step did to one sequence.

    Attributes:
        request_id: the request.
        new_tokens: tokens appended by this step (may be empty: e.g. an abort).
        finished: why the sequence ended in this step, or None while it goes on.
        step: this sequence's verify-step record, None when the step only prefilled or aborted it.
    """

    request_id: str
    new_tokens: list[int]
    finished: FinishReason | None
    step: StepRecord | None


@dataclass
class _Live:
    request: Request
    seq: DecodingSequence
    state: SlotState
    budget: SequenceBudget
    """What the draft budget policy knows of this sequence (acceptance by rank, recent tree size)."""
    prompt_aux: list[torch.Tensor] = field(default_factory=list)
    """A chunked prefill's aux features of the chunks run so far (each ``[c, 3H]``), when its drafter reads them."""


class BatchEngine:
    """Continuous batching: N live sequences, each with its own drafter, sampling and limits,
    verified together in ONE target forward per step.

    A step (1) admits waiting requests into free KV slots, (2) drafts one tree per live sequence
    (the root alone for vanilla; drafters sharing a network run one forward per drafting stage for
    all of them, :func:`_propose_batch`), cut to the sequence's share of the step's tree-token
    budget and to the rows left in its slot, (3) verifies every tree in one
    :meth:`~speculation.model.target.TargetModel.verify_batch` forward, (4) accepts, commits and
    observes per sequence (the same :class:`DecodingSequence` logic as the solo loops), and (5) frees
    the slots of sequences that ended. Requests join and leave only between steps.

    Admitted prompts are prefilled inside the step's forward (one more causal row of the flat
    pass, :meth:`~speculation.model.target.TargetModel.step_batch`; their first token comes from it, and
    they verify from the next step on) where the target ``folds_prefills`` and
    ``config.fold_prefills`` is on; otherwise each in its own forward before the step, verifying
    in that same step. Either way a sequence's tokens are the same bits (tested).

    Synchronous and single-threaded: call ``add``/``abort``/``step`` from one thread.

    Args:
        target: any :class:`~speculation.model.batch_target.BatchTarget` (slot KV pool + batched
            verify): the in-process :class:`~speculation.model.target.TargetModel` or the Ray
            :class:`~cluster.batch_backend.RayBatchTarget`.
        drafter_factory: builds one drafter per request (its own state); None = vanilla.
        config: slots, slot size and step budget.
        feedback: optional sink for every sequence's :class:`StepOutcome` (online adaptation).
        cost_model: c(B, t, L) for the goodput rule (``config.goodput``); measured on ``target`` at
            construction when None (:func:`speculation.policy.goodput.measure_batch_cost`), then rescaled
            every step by the policy's cost correction (measured / predicted forward seconds).

    The engine schedules only: whether to draft and how many draft nodes each tree verifies is
    :attr:`budget`'s (:class:`~speculation.policy.draft_budget.DraftBudgetPolicy`, the goodput
    rule with ``config.goodput``; each sequence's share may be zero drafts), handed over as a
    :class:`~speculation.spec.step.StepPlan`, and the policy learns from the step's
    :class:`~speculation.spec.step.StepResult`. :attr:`last_split` and every step record's
    ``stats["tree_budget"]`` (tree tokens granted, root included) report the split.
    """

    def __init__(
        self,
        target: BatchTarget,
        drafter_factory: Callable[[], Drafter] | None,
        config: BatchConfig,
        feedback: FeedbackSink | None = None,
        cost_model: BatchCostModel | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target = target
        self.drafter_factory = drafter_factory
        self.config = config
        self.feedback = feedback
        self.pool = target.new_slot_pool(config.max_sequences, config.max_tokens_per_sequence,
                                         token_budget=config.kv_token_budget)
        self.prefix_cache = prefix_cache
        """Prompt rows of earlier requests, shared by every sequence (None: every prompt is prefilled whole)."""
        if prefix_cache is not None:
            self._check_prefix_cache(prefix_cache)
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._aborted: list[SequenceUpdate] = []
        self._retired: dict[str, DecodingSequence] = {}  # sequences whose final update the last step returned
        self._aborted_seqs: dict[str, DecodingSequence] = {}  # aborted since then (reported by the next step)
        self.steps_run = 0
        self.last_split: dict[str, int] = {}
        """Tree tokens (root included) each live sequence verified in the last step."""
        if config.goodput and drafter_factory is not None and cost_model is None:
            sizes = sorted({1, *(b for b in (2, 4, 8, 16, 32) if b < config.max_sequences), config.max_sequences})
            room = config.max_tokens_per_sequence
            # every default context, capped at the slot: a slot shorter than the longest default is
            # still measured at its own length (at L = 64 alone, rows of 2 tokens over 266 committed
            # ones were priced 0.20 s against 0.30 s measured)
            contexts = sorted({min(c, room) for c in DEFAULT_BATCH_CONTEXTS})
            cost_model = measure_batch_cost(target, sizes, contexts=contexts)
        self.budget = DraftBudgetPolicy(
            DraftBudgetConfig(config.max_tree_tokens, config.step_token_budget, config.payoff_veto),
            cost_model if config.goodput else None)
        """The draft budget policy: whether to draft and how many draft nodes each tree verifies
        (the goodput rule with ``config.goodput`` and a cost model; every estimator lives there)."""
        if config.prefill_chunk_tokens is not None and not target.folds_prefills:
            raise ValueError("batch.prefill_chunk_tokens needs a target that continues a prompt in its slot "
                             "(folds_prefills: the lean FLAT forward, in process or on every shard); this one "
                             "does not, so leave it unset")
        self._prefilling: dict[str, _Live] = {}
        """Chunked prefills under way (``config.prefill_chunk_tokens``): their slots hold the chunks so far."""

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue ``request``; it joins the batch at a step when a slot is free.

        Raises:
            ValueError: its id is already queued or live, or a prompt id is outside the vocabulary.
            AdmissionError: it can never fit (slot size or the model's context).
            QueueFullError: every slot is taken or promised and ``max_waiting`` more requests wait.
        """
        rid = request.request_id
        if rid in self._live or any(r.request_id == rid for r in self._waiting):
            raise ValueError(f"request_id {rid!r} is already queued or running")
        vocab = self.target.vocab_size
        bad = next((t for t in request.prompt_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"request {rid!r}: prompt token id {bad} is outside the vocabulary [0, {vocab})")
        need = len(request.prompt_ids) + request.max_new_tokens
        limit = self.config.max_tokens_per_sequence
        if need > limit:
            raise AdmissionError(
                f"request {rid!r} can never fit: prompt of {len(request.prompt_ids)} tokens + max_new_tokens "
                f"{request.max_new_tokens} = {need} KV rows, but each slot holds "
                f"batch.max_tokens_per_sequence={limit}"
            )
        budget = self.config.kv_token_budget
        if budget is not None and need > budget:
            raise AdmissionError(
                f"request {rid!r} can never fit: prompt of {len(request.prompt_ids)} tokens + max_new_tokens "
                f"{request.max_new_tokens} = {need} KV rows, but all slots together hold "
                f"batch.kv_token_budget={budget}"
            )
        try:
            self.target.check_fits(len(request.prompt_ids), request.max_new_tokens)
        except ContextLengthError as e:
            raise AdmissionError(f"request {rid!r} can never fit: {e}") from e
        # a request bound for a free slot does not wait: the queue holds max_waiting beyond the free slots
        free = max(0, self.config.max_sequences - len(self._live) - len(self._prefilling))
        if len(self._waiting) >= self.config.max_waiting + free:
            raise QueueFullError(
                f"request {rid!r} refused: batch.max_waiting={self.config.max_waiting} requests already wait "
                f"for one of batch.max_sequences={self.config.max_sequences} slots"
            )
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        """End ``request_id`` now: a waiting request leaves the queue, a live one frees its slot at
        once; the next :meth:`step` reports it with :attr:`FinishReason.ABORT`. Unknown or already
        finished ids are ignored (a client may abort after its last token)."""
        for r in self._waiting:
            if r.request_id == request_id:
                self._waiting.remove(r)
                self._aborted.append(SequenceUpdate(request_id, [], FinishReason.ABORT, None))
                return
        live = self._live.pop(request_id, None) or self._prefilling.pop(request_id, None)
        if live is None:
            return
        self.target.release_slot(live.state)
        live.seq.finished = FinishReason.ABORT
        live.seq.t_end = time.perf_counter()
        self._aborted_seqs[request_id] = live.seq
        self._aborted.append(SequenceUpdate(request_id, [], FinishReason.ABORT, None))

    def has_work(self) -> bool:
        return bool(self._waiting or self._live or self._prefilling or self._aborted)

    def finished_results(self) -> dict[str, GenerationResult]:
        """Full results (tokens, seconds, step records) of the sequences whose final update the
        last :meth:`step` returned (aborted ones included)."""
        return {rid: seq.result() for rid, seq in self._retired.items()}

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_prefilling(self) -> int:
        """Sequences whose chunked prefill is under way (they hold a slot, not yet a token)."""
        return len(self._prefilling)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[SequenceUpdate]:
        """Admit waiting requests (prefill), then one batched draft + verify step over all live
        sequences. Returns one update per sequence that changed."""
        updates: list[SequenceUpdate] = list(self._aborted)
        self._aborted = []
        self._retired, self._aborted_seqs = self._aborted_seqs, {}
        prefill_tokens: dict[str, list[int]] = {}
        arriving, used = self._continuing()  # chunked prompts go on first
        budget, chunk = self.config.prefill_step_tokens, self.config.prefill_chunk_tokens
        while self._waiting and self.pool.can_hold(self._slot_rows(self._waiting[0])):
            if budget is not None and chunk is not None:  # a budget is set only with chunking (prompts fold)
                first = min(len(self._waiting[0].prompt_ids), chunk)
                if arriving and used + first > budget:  # admitted at a later step, when its first chunk fits
                    break
                used += first
            request = self._waiting.popleft()
            if self._folds:
                arriving.append(self._arrive(request))
                continue
            kept = self._admit(request)
            if request.request_id in self._live:
                prefill_tokens[request.request_id] = kept
            else:  # ended on its first token
                updates.append(SequenceUpdate(request.request_id, kept, self._retired[request.request_id].finished,
                                              None))
        if self._live or arriving:
            updates.extend(self._verify_step(prefill_tokens, arriving))
        self.steps_run += 1
        return updates

    def _slot_rows(self, request: Request) -> int:
        """KV rows ``request``'s slot asks for: prompt + new tokens + one full tree, within the slot
        size and the token budget (a tree is cut to the rows left, as at the slot's end)."""
        cfg = self.config
        rows = len(request.prompt_ids) + request.max_new_tokens + cfg.max_tree_tokens
        return min(rows, cfg.max_tokens_per_sequence, cfg.kv_token_budget or rows)

    @property
    def _folds(self) -> bool:
        """Whether arriving prompts are prefilled inside the step's forward (``config.fold_prefills``
        and a target whose ``folds_prefills`` says it can)."""
        return self.config.fold_prefills and self.target.folds_prefills

    def _new_sequence(self, request: Request) -> DecodingSequence:
        drafter = self.drafter_factory() if self.drafter_factory is not None else None
        stop = request.stop_token_ids | (self.target.eos_token_ids if request.stop_at_eos else frozenset())
        return DecodingSequence(list(request.prompt_ids), request.max_new_tokens, request.sampling, stop, drafter,
                         self.feedback)

    def _check_prefix_cache(self, cache: PrefixCache) -> None:
        """Refuse a prefix cache this engine cannot apply, naming the setting to change."""
        if not self._folds or self.config.prefill_chunk_tokens is None:
            raise ConfigError("prefix_cache needs chunked prefills folded into the step (batch.fold_prefills on a "
                              "FLAT-layout target and batch.prefill_chunk_tokens set): drop the prefix cache or "
                              "enable them")
        if cache.chunk_tokens != self.config.prefill_chunk_tokens:
            raise ConfigError(f"prefix_cache reuses rows on a {cache.chunk_tokens}-token prefill grid: "
                              f"batch.prefill_chunk_tokens must be {cache.chunk_tokens}, "
                              f"got {self.config.prefill_chunk_tokens}")
        if not isinstance(self.pool, KVSlotPool):
            raise ConfigError("prefix_cache runs on the in-process target only (its KV slots live here): "
                              f"drop it with {type(self.target).__name__}")

    def _arrive(self, request: Request) -> _Live:
        """A request whose prompt this step's forward prefills (into an empty slot), after the rows
        of its longest cached prefix when a prefix cache is on."""
        seq = self._new_sequence(request)
        arrived = _Live(request, seq, self.target.empty_slot(self.pool, self._slot_rows(request)),
                        self.budget.new_sequence())
        if self.prefix_cache is not None:
            hit = self.prefix_cache.lookup(seq.prompt_ids, need_aux=seq.needs_aux)
            if hit is not None:
                state = arrived.state
                self.pool.load_prefix(state.held_slot(), hit.layers())
                state.length, state.tokens = hit.rows, list(seq.prompt_ids[: hit.rows])
                if seq.needs_aux and hit.aux is not None:
                    arrived.prompt_aux.append(hit.aux)
        return arrived

    def _remember_prompt(self, arrived: _Live, prompt_aux: torch.Tensor | None) -> None:
        """Keep a prompt just prefilled in the prefix cache (its full chunks), before its slot can go."""
        if self.prefix_cache is None:
            return
        pool = cast(KVSlotPool, self.pool)
        s = arrived.state.held_slot()
        layers = [LayerRows(k, v) for k, v in pool.slot_layers(s)]
        self.prefix_cache.store(arrived.seq.prompt_ids, layers, prompt_aux if arrived.seq.needs_aux else None)

    def _admit(self, request: Request) -> list[int]:
        """Prefill ``request`` in its own forward (the unfolded path), choose its first token."""
        seq = self._new_sequence(request)
        state, logits, prompt_aux = self.target.prefill_slot(self.pool, seq.prompt_ids, need_aux=seq.needs_aux,
                                                             rows=self._slot_rows(request))
        try:
            kept = seq.start(logits, prompt_aux)
        except BaseException:
            self.target.release_slot(state)
            raise
        if seq.finished is not None:
            self.target.release_slot(state)
            self._retired[request.request_id] = seq
        else:
            self._live[request.request_id] = _Live(request, seq, state, self.budget.new_sequence())
        return kept

    def _tree_caps(self, lives: list[_Live]) -> list[int]:
        """Per sequence: the most tree nodes (root included) it may verify this step (without the
        goodput rule, a step budget is split equally)."""
        cfg = self.config
        caps = [min(cfg.max_tree_tokens, self.pool.capacity(lv.state.held_slot()) - lv.state.length) for lv in lives]
        if cfg.step_token_budget is not None and not self.budget.active:
            share = max(1, cfg.step_token_budget // len(lives))
            caps = [min(c, share) for c in caps]
        return caps

    def _verify_step(self, prefill_tokens: dict[str, list[int]], arriving: list[_Live]) -> list[SequenceUpdate]:
        """Ask the policy whether to draft, draft, ask it how many draft nodes each tree keeps (a
        :class:`~speculation.spec.step.StepPlan`), ONE forward (every live tree, and the
        ``arriving`` prompts' prefills when they fold in), accept and commit per sequence, report
        the :class:`~speculation.spec.step.StepResult` to the policy, then start the arrived sequences."""
        t_step = time.perf_counter()
        lives = list(self._live.values())
        seqs = [lv.budget for lv in lives]
        contexts = [lv.state.length for lv in lives]
        caps = self._tree_caps(lives)
        check = self.budget.check(seqs, contexts, caps)
        proposed = _propose_batch([lv.seq for lv in lives], caps, skip=check.skips)
        trees = [p[0] for p in proposed]
        drafting_s = sum(p[2] for p in proposed)
        plan = self.budget.plan(check, seqs, contexts, [len(t) - 1 for t in trees],
                                [p[1] is not None for p in proposed], drafting_s)
        if plan.drafts is not None:
            trees = [t.pruned_to(n) for t, n in zip(trees, plan.drafts)]
            caps = [n + 1 for n in plan.drafts]
        self.last_split = {lv.request.request_id: len(t) for lv, t in zip(lives, trees)}
        need_aux = any(lv.seq.needs_aux for lv in (*lives, *arriving))
        tb = time.perf_counter()
        starts = []
        prompts = [(a.state, self._next_chunk(a)) for a in arriving]
        try:
            if arriving:
                fwds, starts = self.target.step_batch([lv.state for lv in lives], trees, prompts, need_aux=need_aux)
            else:
                fwds = self.target.verify_batch([lv.state for lv in lives], trees, need_aux=need_aux)
        except BaseException:  # the arriving requests wait again, first in line; nothing is lost
            for a in reversed(arriving):  # (a chunked prefill starts over)
                self._prefilling.pop(a.request.request_id, None)
                self.target.release_slot(a.state)
                self._waiting.appendleft(a.request)
            raise
        forward_s = time.perf_counter() - tb
        prompt_tokens = sum(len(chunk) for _, chunk in prompts)
        stats = {"batch_size": float(len(lives)), "batch_tree_tokens": float(sum(len(t) for t in trees)),
                 "batch_prefill_tokens": float(prompt_tokens), **plan.stats}
        updates = []
        picks = batch_picks([lv.seq for lv in lives], fwds)
        for lv, cap, tree, (_, proposal, draft_s), fwd, pick in zip(lives, caps, trees, proposed, fwds, picks):
            commit = functools.partial(self.target.commit_slot, lv.state)
            kept, rec = lv.seq.settle(tree, fwd, pick, commit, proposal, draft_s, forward_s,
                                      {**stats, "tree_budget": float(cap)})
            rid = lv.request.request_id
            if lv.seq.finished is not None:
                self.target.release_slot(lv.state)
                del self._live[rid]
                self._retired[rid] = lv.seq
            updates.append(SequenceUpdate(rid, prefill_tokens.get(rid, []) + kept, lv.seq.finished, rec))
        self.budget.observe(plan, StepResult(
            trees=tuple(trees), paths=tuple(lv.seq.last_accepted for lv in lives),
            accepted=tuple(lv.seq.steps[-1].accepted for lv in lives), forward_s=forward_s,
            drafting_s=drafting_s, started=t_step, folded_prefills=bool(arriving)), seqs)

        for a, start in zip(arriving, starts):
            rid = a.request.request_id
            if a.state.length < len(a.seq.prompt_ids):  # a chunk: the prompt goes on next step
                self._prefilling[rid] = a
                if start.aux_hidden is not None and a.seq.needs_aux:
                    a.prompt_aux.append(start.aux_hidden)
                continue
            self._prefilling.pop(rid, None)
            if a.prompt_aux and start.aux_hidden is not None:
                start = PrefillForward(logits=start.logits, aux_hidden=torch.cat([*a.prompt_aux, start.aux_hidden]))
                a.prompt_aux = []
            self._remember_prompt(a, start.aux_hidden)
            updates.append(self._start(a, start))
        return updates

    def _continuing(self) -> tuple[list[_Live], int]:
        """The chunked prefills under way that advance this step, and their prompt tokens: all of
        them, or with ``config.prefill_step_tokens`` those whose next chunk fits the budget in
        arrival order (the first always does); the others keep their slots and wait a step."""
        budget = self.config.prefill_step_tokens
        out, used = [], 0
        for a in self._prefilling.values():
            n = len(self._next_chunk(a))
            if budget is None or not out or used + n <= budget:
                out.append(a)
                used += n
        return out, used

    def _next_chunk(self, arriving: _Live) -> list[int]:
        """The prompt tokens this step prefills for ``arriving``: the rest of its prompt, or with
        ``config.prefill_chunk_tokens`` C the next C of them (its slot holds the earlier chunks)."""
        prompt, done = arriving.seq.prompt_ids, arriving.state.length
        c = self.config.prefill_chunk_tokens
        return prompt[done:] if c is None else prompt[done: done + c]

    def _start(self, arrived: _Live, start: PrefillForward) -> SequenceUpdate:
        """After its prompt was prefilled in the step's forward: the first token, the drafter's
        ``begin``; the sequence goes live, or retires at once (its first token ended it)."""
        seq, rid = arrived.seq, arrived.request.request_id
        try:
            kept = seq.start(start.logits, start.aux_hidden if seq.needs_aux else None)
        except BaseException:
            self.target.release_slot(arrived.state)
            raise
        if seq.finished is not None:
            self.target.release_slot(arrived.state)
            self._retired[rid] = seq
        else:
            self._live[rid] = arrived
        return SequenceUpdate(rid, kept, seq.finished, None)

    # ------------------------------------------------------------------ convenience
    def run(self, requests: list[Request]) -> dict[str, GenerationResult]:
        """Add every request, step until all are done; results by request id (aborted ones too)."""
        for r in requests:
            self.add(r)
        results: dict[str, GenerationResult] = {}
        while self.has_work():
            self.step()
            results.update(self.finished_results())
        return results


def _propose_batch(seqs: list[DecodingSequence], caps: list[int],
                   skip: bool = False) -> list[tuple[DraftTree, Proposal | None, float]]:
    """Every sequence's tree for this step: drafters sharing a network propose together, one
    forward per drafting stage (:func:`~speculation.drafters.base.propose_many`; retrieval and
    other drafters per sequence); vanilla sequences verify the root alone. With ``skip``, every
    :class:`~speculation.drafters.base.SkippableDrafter` sits the step out (root alone too)."""
    out: list[tuple[DraftTree, Proposal | None, float]] = [(DraftTree(s.ctx.root_token), None, 0.0) for s in seqs]
    drafted = []
    skippable: dict[type, bool] = {}  # a runtime Protocol check costs tens of microseconds: once per class
    for i, s in enumerate(seqs):
        if s.drafter is None:
            continue
        kind = type(s.drafter)
        if skip and kind not in skippable:
            skippable[kind] = isinstance(s.drafter, SkippableDrafter)
        if skip and skippable[kind]:
            cast(SkippableDrafter, s.drafter).skip(s.ctx)
        else:
            drafted.append(i)
    proposals = propose_many([cast(Drafter, seqs[i].drafter) for i in drafted], [seqs[i].ctx for i in drafted])
    for i, (proposal, seconds) in zip(drafted, proposals):
        out[i] = DecodingSequence.take(proposal, caps[i], seconds)
    return out
