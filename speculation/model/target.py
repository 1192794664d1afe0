"""The target model: prefill, one-pass tree verification, and KV compaction to the accepted path.

Tree forward (docs/algorithms.md §1). Over a KV cache holding the n committed tokens, the T
tree nodes are fed in node order with

* RoPE position ``n + depth_i``,
* a 4D boolean mask ``M[0, 0, i, :] = [1]*n ++ A[i]`` where ``A`` is the ancestor-or-self mask,

so node i sees exactly the committed text and its own path: its logits equal those of a
sequential forward along root..i. After acceptance of the path ``(0, a_1..a_m)`` the KV rows at
``n + [0, a_1..a_m]`` are moved to ``n..n+m`` and the cache is cut to ``n + m + 1``.

Auxiliary hidden states (for EAGLE-3 / SpecBlock drafters) are the HF ``hidden_states`` at
indices ``[2, L // 2, L - 3]`` (the inputs of layers 2, L/2 and L-3), concatenated to ``3H``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from speculation import assets
from speculation.config import BatchLayout, ConfigError, DType
from speculation.model.batch_target import ReleasedSequenceError, SlotState
from speculation.model.kv_reserve import reserve_rows
from speculation.model.lean_forward import LeanDecoder, RaggedRows
from speculation.model.prefix_cache import PrefixHit, inject
from speculation.model.tree_attention import (
    batch_tree_attention_inputs,
    causal_positions,
    chunk_attention_inputs,
    prompt_chunks,
    ragged_tree_inputs,
    tree_attention_inputs,
)
from speculation.spec.tree import DraftTree

if TYPE_CHECKING:
    # Imported where a pool is made: kv_slots needs transformers >= 5.23 (DummyLayer), and the
    # vLLM peer environment (transformers < 5.20) imports this module without batching.
    from speculation.model.kv_slots import KVSlotPool


class ContextLengthError(ValueError):
    """The request does not fit in the model's context window."""


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """HF ``hidden_states`` indices of the low, mid and high features: ``[2, L//2, L-3]``."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class TargetState:
    """Per-sequence target state: the KV cache (None once released) and how many tokens it holds."""

    cache: DynamicCache | None
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    """Token ids held in the KV cache (the committed text minus the pending root)."""


@dataclass(frozen=True)
class PrefillForward:
    """Target outputs of a prompt prefilled inside a batched step (:meth:`TargetModel.step_batch`).

    Attributes:
        logits: ``[V]`` next-token logits after the prompt.
        aux_hidden: ``[n, 3H]`` fused auxiliary features of the prompt, or None if not requested.
    """

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None


@dataclass(frozen=True)
class TreeForward:
    """Target outputs over one tree.

    Attributes:
        logits: ``[T, V]`` next-token logits at every node.
        aux_hidden: ``[T, 3H]`` fused auxiliary features at every node, or None if not requested.
    """

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None


class TargetModel:
    """A causal LM behind the verification interface the decode loop needs.

    Args:
        model: a Hugging Face causal LM (eval mode, any dtype).
        tokenizer: its tokenizer (for EOS ids and templates).
        aux_layers: HF hidden-state indices for the drafters' features (default ``[2, L/2, L-3]``).
        lean: run the forward passes through :class:`~speculation.model.lean_forward.LeanDecoder` where
            the model qualifies (a fused, packed Llama-family model on the CPU; the same operators
            without transformers' module glue), else through the model's own ``forward``.
        batch_invariant: every product of the lean forward runs in row groups no larger than its
            kernel's probed invariant limit (:class:`~speculation.model.lean_forward.PackedGemm`), so a
            sequence's bits do not depend on how many rows share its step, at the large kernels'
            speed. Needs the lean forward (:class:`ConfigError` otherwise).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        aux_layers: tuple[int, int, int] | None = None,
        lean: bool = True,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model.eval()
        self.lean: LeanDecoder | None = LeanDecoder.from_model(self.model) if lean else None
        self.batch_invariant_rows: dict[str, int | None] | None = None
        """Batch-invariant mode's row limit per kernel; None when the mode is off."""
        if batch_invariant:
            if self.lean is None or not self.lean.placed():
                raise ConfigError(
                    "batch_invariant needs the lean forward: a fused, packed Llama-family model on the CPU "
                    f"(got {type(model).__name__} on {self.device}); turn batch_invariant off for this model"
                )
            self.batch_invariant_rows = self.lean.set_batch_invariant(True)
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context: int = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.sliding_window: int | None = getattr(cfg, "sliding_window", None)
        self.aux_layers = tuple(aux_layers or default_aux_layers(self.num_layers))
        if not all(0 <= i <= self.num_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers {self.aux_layers} out of range [0, {self.num_layers}]")
        self.eos_token_ids: frozenset[int] = eos_token_ids(model, tokenizer)

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`ContextLengthError` if prompt + new tokens exceed the context window."""
        if prompt_len <= 0:
            raise ValueError("prompt is empty: at least one token is required")
        limit = self.max_context
        if self.sliding_window is not None:
            # Tree verification writes candidate rows into the sliding window before pruning them,
            # which would evict rows vanilla decoding still attends to. Stay inside the window.
            limit = min(limit, int(self.sliding_window) - 1)
        if prompt_len + max_new_tokens > limit:
            raise ContextLengthError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"model's usable context of {limit} tokens"
            )

    # ------------------------------------------------------------------ forward passes
    def _forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        keep_last: bool = False,
        need_aux: bool = False,
        cache_position: torch.Tensor | None = None,
        rows: RaggedRows | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None]:
        """One forward of ``input_ids`` ``[B, T]`` over ``cache``: the lean loop where it applies,
        else the model's own ``forward``; both compute the same tensors (bit for bit, tested).

        ``positions`` ``[B, T]`` (None: right after the cached rows), ``mask`` ``[B, 1, T, n + T]``
        bool (None: causal), ``keep_last``: logits of the last row only, ``rows``: a flat batch
        (lean loop only, :class:`~speculation.model.lean_forward.RaggedRows`), ``keep``: logits of these
        token indices only (lean loop only). Returns (logits ``[B, T or 1 or K, V]``, hidden states
        by transformers index when ``need_aux``, else None).
        """
        lean = self._lean()
        if lean is not None:
            if positions is None:
                positions = causal_positions(cache.get_seq_length(), input_ids.shape[1], self.device)
            out = lean.forward(input_ids, positions, cache, mask=mask, keep_last=keep_last,
                               hidden_at=self.aux_layers if need_aux else (), rows=rows, keep=keep)
            return out.logits, (out.hidden if need_aux else None)
        if rows is not None or keep is not None:
            raise RuntimeError("a flat batch needs the lean forward (see TargetModel.batch_layout)")
        kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
        if cache_position is not None:
            kwargs["cache_position"] = cache_position
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                         output_hidden_states=need_aux, logits_to_keep=1 if keep_last else 0, **kwargs)
        return out.logits, (out.hidden_states if need_aux else None)

    @torch.inference_mode()
    def prefill(
        self, ids: list[int], need_aux: bool = False, chunk_tokens: int | None = None,
        reuse: PrefixHit | None = None,
    ) -> tuple[TargetState, torch.Tensor, torch.Tensor | None]:
        """Run the prompt. Returns (state, next-token logits ``[V]``, aux ``[n, 3H]`` or None).

        ``chunk_tokens``: run it in forwards of at most that many tokens (chunked prefill), chunk
        j being tokens ``jC .. (j+1)C - 1``: the first causal over itself, each later one over the
        cached chunks before it and causally over itself (:func:`chunk_attention_inputs`), the
        calls a batched step makes for a chunked prompt row, so the batched engine's chunked
        prefill gives these bits. Equal to the one-forward prefill up to summation order.

        ``reuse``: the first ``reuse.rows`` positions' rows from an earlier prompt on the same grid
        (:class:`~speculation.model.prefix_cache.PrefixCache`, a multiple of ``chunk_tokens`` and
        shorter than ``ids``); only the chunks after them run, and the result is the same bits."""
        if not ids:
            raise ValueError("prompt is empty: at least one token is required")
        chunks = prompt_chunks(ids, chunk_tokens)
        state = TargetState(cache=reserve_rows(DynamicCache(config=self.model.config)))
        auxes = []
        if reuse is not None:
            if chunk_tokens is None or reuse.rows % chunk_tokens or not 0 < reuse.rows < len(ids):
                raise ValueError(f"reuse of {reuse.rows} rows needs a chunk grid that divides it and a longer "
                                 f"prompt (chunk_tokens={chunk_tokens}, prompt of {len(ids)} tokens)")
            if need_aux and reuse.aux is None:
                raise ValueError("reuse without auxiliary features cannot serve a prefill with need_aux")
            inject(_cache(state), reuse, chunk_tokens)
            chunks = [(lo, chunk) for lo, chunk in chunks if lo >= reuse.rows]
            if need_aux:
                auxes.append(reuse.aux)
        for lo, chunk in chunks:
            input_ids = torch.tensor([chunk], dtype=torch.long, device=self.device)  # [1, c]
            mask, positions = chunk_attention_inputs(lo, len(chunk), self.device)
            logits, hidden = self._forward(input_ids, _cache(state), positions, mask, keep_last=True,
                                           need_aux=need_aux,
                                           cache_position=None if mask is None else positions[0])
            if need_aux:
                auxes.append(self._aux(hidden))
        state.length = len(ids)
        state.tokens = list(ids)
        return state, logits[0, -1], (torch.cat(auxes) if need_aux else None)

    @torch.inference_mode()
    def decode(self, state: TargetState, token: int) -> torch.Tensor:
        """Vanilla step: append ``token`` to the cache and return the next-token logits ``[V]``."""
        input_ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        logits, _ = self._forward(input_ids, _cache(state), keep_last=True)
        state.length += 1
        state.tokens.append(int(token))
        return logits[0, -1]

    @torch.inference_mode()
    def verify(self, state: TargetState, tree: DraftTree, need_aux: bool = False) -> TreeForward:
        """One forward over every node of ``tree`` (ancestor-or-self attention, depth positions)."""
        n = state.length
        cache = _cache(state)
        tt = tree.to_tensors()
        T = len(tree)
        input_ids = tt.tokens.view(1, T).to(self.device)
        if T == 1:  # root only: the plain causal step is the same computation
            logits, hidden = self._forward(input_ids, cache, need_aux=need_aux)
        else:
            mask, positions = tree_attention_inputs(tt.ancestor_mask, tt.depths, n, self.device)
            logits, hidden = self._forward(input_ids, cache, positions, mask, need_aux=need_aux,
                                           cache_position=torch.arange(n, n + T, device=self.device))
        state.length += T  # provisional: commit() cuts back to the accepted path
        return TreeForward(logits=logits[0], aux_hidden=self._aux(hidden) if need_aux else None)

    @torch.inference_mode()
    def commit(self, state: TargetState, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's KV rows (root first) after a :meth:`verify` of ``tree``."""
        compact_kv(_cache(state).layers, len(tree), accepted)
        state.length = state.length - len(tree) + len(accepted)
        state.tokens.extend(tree.tokens[a] for a in accepted)

    @torch.inference_mode()
    def truncate(self, state: TargetState, length: int) -> None:
        """Forget everything after the first ``length`` cached tokens."""
        cache = _cache(state)
        if not 0 <= length <= state.length:
            raise ValueError(f"length must be in [0, {state.length}], got {length}")
        if length < state.length:
            cache.crop(length - state.length)  # transformers 5 takes a negative count
        del state.tokens[length:]
        state.length = length

    def release(self, state: TargetState) -> None:
        """Drop the sequence's KV cache (idempotent); any later call on ``state`` raises."""
        state.cache = None

    def _lean(self) -> LeanDecoder | None:
        """The lean forward when it applies now (see :meth:`LeanDecoder.applies`), else None."""
        return self.lean if self.lean is not None and self.lean.applies() else None

    def _aux(self, hidden_states: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], row: int = 0) -> torch.Tensor:
        """``[T, 3H]``: concat of the three auxiliary hidden states of batch row ``row`` (hidden
        states by transformers ``hidden_states`` index)."""
        return torch.cat([hidden_states[i][row] for i in self.aux_layers], dim=-1)

    # ------------------------------------------------------------------ continuous batching (slots)
    def new_slot_pool(self, max_sequences: int, max_tokens: int, token_budget: int | None = None) -> KVSlotPool:
        """A KV pool of ``max_sequences`` slots of ``max_tokens`` rows for this model; with
        ``token_budget``, slots sized per request (:class:`~speculation.model.kv_slots.SizedKVSlotPool`)."""
        # Imported here: the vLLM proposer imports this module in .venv-vllm, whose transformers
        # lacks the cache classes kv_slots builds on.
        from speculation.model.kv_slots import KVSlotPool, SizedKVSlotPool

        if token_budget is not None:
            return SizedKVSlotPool(self.num_layers, max_sequences, max_tokens, token_budget)
        return KVSlotPool(self.num_layers, max_sequences, max_tokens)

    @torch.inference_mode()
    def prefill_slot(
        self, pool: KVSlotPool, ids: list[int], need_aux: bool = False, rows: int | None = None
    ) -> tuple[SlotState, torch.Tensor, torch.Tensor | None]:
        """:meth:`prefill` (the same forward as a solo sequence), its rows copied into a free slot of
        ``pool`` (of ``rows`` KV rows). Returns (state, next-token logits ``[V]``, aux ``[n, 3H]`` or None)."""
        solo, logits, aux = self.prefill(ids, need_aux=need_aux)
        slot = pool.acquire(rows)
        try:
            n = pool.load_prefix(slot, _cache(solo).layers)
        except BaseException:
            pool.release(slot)
            raise
        self.release(solo)
        return SlotState(pool=pool, slot=slot, length=n, tokens=list(ids)), logits, aux

    @property
    def batch_layout(self) -> BatchLayout:
        """How :meth:`verify_batch` lays a batch out: FLAT where the lean loop runs, else PADDED."""
        return BatchLayout.FLAT if self.lean is not None and self.lean.placed() else BatchLayout.PADDED

    @property
    def folds_prefills(self) -> bool:
        """Whether :meth:`step_batch` can prefill new sequences inside the batched verify forward
        (the FLAT layout: a prompt is one more causal row of the packed pass)."""
        return self.batch_layout is BatchLayout.FLAT

    def empty_slot(self, pool: KVSlotPool, rows: int | None = None) -> SlotState:
        """A free slot of ``pool`` (of ``rows`` KV rows) holding nothing yet, for a prompt that
        :meth:`step_batch` prefills."""
        if not self.folds_prefills:
            raise RuntimeError("prefills fold into the batched forward only in the FLAT layout "
                               "(use prefill_slot)")
        layers = self.lean.layers  # folds_prefills: the lean loop is there
        pool.allocate(layers.num_kv_heads, layers.head_dim, layers.dtype, layers.device)
        return SlotState(pool=pool, slot=pool.acquire(rows), length=0, tokens=[])

    @torch.inference_mode()
    def verify_batch(
        self, states: list[SlotState], trees: list[DraftTree], need_aux: bool = False
    ) -> list[TreeForward]:
        """ONE forward over every tree of every sequence (per-row masks and positions).

        Row b verifies ``trees[b]`` after the ``n_b`` valid rows of its slot; node i sees exactly
        its slot's committed rows and its own path, so its logits equal a solo :meth:`verify` of
        that tree. :attr:`batch_layout` FLAT (the lean loop): the trees' tokens are packed into one
        ``[1, sum T_b]`` pass, every projection runs once over them, and each row attends over its
        own slot with the solo forward's call (:func:`ragged_tree_inputs`); the logits are then
        the solo verify's bit for bit wherever the GEMM kernels are batch-invariant (tested).
        PADDED (transformers' forward): rows padded to the largest tree, one masked attention
        (:func:`batch_tree_attention_inputs`), equal to the solo verify up to summation order.
        The tree rows are provisional until :meth:`commit_slot`.
        """
        if len(states) != len(trees) or not states:
            raise ValueError("verify_batch needs one tree per state, at least one")
        if self._lean() is not None:  # inference mode here: the lean loop runs, so FLAT
            return self.step_batch(states, trees, [], need_aux=need_aux)[0]
        pool = states[0].pool
        if any(s.pool is not pool for s in states):
            raise ValueError("all states of one batch must live in the same KV pool")
        slots = [s.held_slot() for s in states]
        bases = [s.length for s in states]
        sizes = [len(t) for t in trees]
        tts = [t.to_tensors() for t in trees]
        fwds = []
        cache = pool.batch_cache(slots, bases, sizes)
        input_ids, mask, positions = batch_tree_attention_inputs(tts, bases, cache.plan.kv_len, self.device)
        logits, hidden = self._forward(input_ids, cache, positions, mask, need_aux=need_aux)
        for b, (state, t) in enumerate(zip(states, sizes)):
            aux = self._aux(hidden, b)[:t] if need_aux else None
            fwds.append(TreeForward(logits=logits[b, :t], aux_hidden=aux))
            state.length += t  # provisional: commit_slot() cuts back to the accepted path
        return fwds

    @torch.inference_mode()
    def step_batch(
        self,
        states: list[SlotState],
        trees: list[DraftTree],
        prefills: list[tuple[SlotState, list[int]]],
        need_aux: bool = False,
    ) -> tuple[list[TreeForward], list[PrefillForward]]:
        """ONE flat forward that verifies ``trees[b]`` for ``states[b]`` (as :meth:`verify_batch`)
        and prefills each ``(state, prompt)`` of ``prefills`` into its empty slot
        (:meth:`empty_slot`), or, for a chunked prefill, after the prompt's earlier chunks that its
        slot holds, the FLAT layout only (:attr:`folds_prefills`).

        A prompt of n tokens is one more row of the packed pass: positions ``0..n-1``, causal
        attention over its own keys (the solo :meth:`prefill`'s SDPA call), and logits at its last
        token only; a later chunk of n tokens after s prefilled ones takes positions ``s..s+n-1``
        and the solo chunked :meth:`prefill`'s masked call. So its next-token logits and features equal a solo :meth:`prefill` bit for bit
        where the GEMM kernels are batch-invariant (tested), and the weights stream once for the
        whole step instead of once more per arriving request. The prompts' rows are committed
        (their states hold the prompt); the tree rows are provisional until :meth:`commit_slot`.
        Returns (one :class:`TreeForward` per tree, one :class:`PrefillForward` per prompt).
        """
        if self._lean() is None:
            raise RuntimeError("step_batch needs the lean forward (FLAT layout; see TargetModel.folds_prefills)")
        pool = check_step_rows(states, trees, prefills, chunked=True)
        every = [*states, *(s for s, _ in prefills)]
        bases = [s.length for s in every]
        sizes = [len(t) for t in trees] + [len(ids) for _, ids in prefills]
        cache = pool.batch_cache([s.held_slot() for s in every], bases, sizes, flat=True)
        input_ids, positions, rows = ragged_tree_inputs([t.to_tensors() for t in trees], bases[: len(trees)],
                                                        self.device, prompts=[ids for _, ids in prefills],
                                                        prompt_past=bases[len(trees):])
        kept = step_kept_rows(sizes[: len(trees)], sizes[len(trees):])
        keep = None if kept is None else torch.tensor(kept, dtype=torch.long, device=self.device)
        logits, hidden = self._forward(input_ids, cache, positions, need_aux=need_aux, rows=rows, keep=keep)
        return split_step_outputs(states, trees, prefills, logits[0], self._aux(hidden) if need_aux else None)

    @torch.inference_mode()
    def commit_slot(self, state: SlotState, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's rows (root first) after a :meth:`verify_batch` of ``tree``."""
        base = state.length - len(tree)
        state.pool.compact(state.held_slot(), base, accepted)
        state.length = base + len(accepted)
        state.tokens.extend(tree.tokens[a] for a in accepted)

    def release_slot(self, state: SlotState) -> None:
        """Give the sequence's slot back to its pool (idempotent)."""
        if state.slot is not None:
            state.pool.release(state.slot)
            state.slot = None


def _cache(state: TargetState) -> DynamicCache:
    if state.cache is None:
        raise ReleasedSequenceError("this sequence was released: its KV cache is gone (prefill a new one)")
    return state.cache


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids that end generation: the model's generation-config EOS id(s), plus the tokenizer's.

    The one rule for every target (in-process or sharded): the union of
    ``model.generation_config.eos_token_id`` (an id or a list) and ``tokenizer.eos_token_id``.
    """
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return frozenset(int(i) for i in ids)


def check_step_rows(states: Sequence, trees: Sequence[DraftTree], prefills: Sequence[tuple],
                    chunked: bool = False):
    """Validate one batched step's rows (``step_batch`` of the in-process and the Ray target): one
    tree per state, at least one row, every state in one pool, each prefill a non-empty prompt
    into an empty slot (``chunked``: or a slot holding that prompt's earlier chunks). Returns that
    pool."""
    if len(states) != len(trees) or not (states or prefills):
        raise ValueError("step_batch needs one tree per state and at least one row")
    every = [*states, *(s for s, _ in prefills)]
    pool = every[0].pool
    if any(s.pool is not pool for s in every):
        raise ValueError("all states of one batch must live in the same KV pool")
    for s, ids in prefills:
        if not ids or (s.length != 0 and not chunked):
            raise ValueError("a prefill row needs an empty slot (empty_slot) and a non-empty prompt")
    return pool


def step_kept_rows(tree_sizes: Sequence[int], prompt_sizes: Sequence[int]) -> list[int] | None:
    """Flat indices whose logits a batched step keeps: every tree node, then each prompt's last
    token (rows are the trees' tokens, then the prompts'); None without prompts (every row)."""
    if not prompt_sizes:
        return None
    n_tree = sum(tree_sizes)
    ends = list(itertools.accumulate(prompt_sizes, initial=n_tree))[1:]
    return [*range(n_tree), *(e - 1 for e in ends)]


def split_step_outputs(
    states: Sequence, trees: Sequence[DraftTree], prefills: Sequence[tuple],
    logits: torch.Tensor, aux: torch.Tensor | None,
) -> tuple[list[TreeForward], list[PrefillForward]]:
    """A batched step's outputs per row, and its states advanced. ``logits`` ``[K, V]``: the
    :func:`step_kept_rows` (every tree node, then each prompt's last token); ``aux`` ``[N, 3H]``
    over every row (trees' tokens, then prompts') or None. Tree rows are provisional until
    ``commit_slot``; a prefilled state now holds its prompt (or chunk, after the earlier ones)."""
    sizes = [len(t) for t in trees] + [len(ids) for _, ids in prefills]
    offsets = list(itertools.accumulate(sizes, initial=0))
    n_tree = offsets[len(trees)]
    fwds = []
    for b, state in enumerate(states):
        lo, hi = offsets[b], offsets[b + 1]
        fwds.append(TreeForward(logits=logits[lo:hi], aux_hidden=aux[lo:hi] if aux is not None else None))
        state.length += hi - lo  # provisional: commit_slot() cuts back to the accepted path
    starts = []
    for p, (state, ids) in enumerate(prefills):
        lo, hi = offsets[len(trees) + p], offsets[len(trees) + p + 1]
        starts.append(PrefillForward(logits=logits[n_tree + p], aux_hidden=aux[lo:hi] if aux is not None else None))
        state.length += len(ids)
        state.tokens.extend(ids)
    return fwds, starts


@torch.inference_mode()
def compact_kv(layers: list, tree_len: int, accepted: list[int]) -> None:
    """Move the accepted tree rows to the front of the tree block and drop the rest.

    For every initialised cache layer, the last ``tree_len`` rows hold the tree nodes; rows
    ``base + accepted`` are copied to ``base .. base + m`` and the layer is cut to ``base + m + 1``.
    Uninitialised layers (another shard's) are skipped, so a pipeline shard can call this on a
    full-size cache that holds only its own layers.
    """
    if not accepted or accepted[0] != 0:
        raise ValueError("accepted path must start at the root (node 0)")
    m1 = len(accepted)
    contiguous = accepted == list(range(m1))
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        base = layer.keys.shape[-2] - tree_len  # tree rows are the last tree_len rows
        if not contiguous:
            idx = torch.tensor([base + a for a in accepted], device=layer.keys.device)
            layer.keys[:, :, base : base + m1] = layer.keys.index_select(2, idx)
            layer.values[:, :, base : base + m1] = layer.values.index_select(2, idx)
        layer.keys = layer.keys[:, :, : base + m1]
        layer.values = layer.values[:, :, : base + m1]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= tree_len - m1


def load_target(model: str, dtype: str, device: str = "cpu", batch_invariant: bool = False) -> TargetModel:
    """The :class:`TargetModel` of ``model`` (packaged alias, HF id or local dir) in ``dtype``
    (``bfloat16 | float32``, also ``bf16 | fp32``) on ``device``; what the CLI and the benchmark
    scripts load a target with."""
    dt = DType.parse(dtype)
    model_obj, tokenizer = assets.load_model_and_tokenizer(model, dt.torch)
    return TargetModel(model_obj.to(device), tokenizer, batch_invariant=batch_invariant)
