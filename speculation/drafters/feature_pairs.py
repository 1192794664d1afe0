"""Bookkeeping shared by the drafters that read the target's features (EAGLE-3, SpecBlock).

Both condition on committed *pairs* ``(f_i, x_{i+1})``: the target's fused aux features at token
i and the token after it. ``begin`` stores the prompt's pairs (the last one carries the pending
root); ``observe`` appends the aux at the accepted nodes (root first), which pair with the
accepted tokens after them and the bonus token. A drafter encodes the pairs it has not encoded yet
(``encoded .. n_pairs``) into its own KV cache at the next ``propose``; swapping the weights
resets ``encoded`` to 0, so the whole context is re-encoded with the new weights.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from speculation.drafters.base import DraftContext, DraftResult, Proposal, StepOutcome, StopRule
from speculation.drafters.candidate_pool import CandidatePool, build_draft_tree, select_top
from speculation.model.output_head import onednn_available, pack_linears
from speculation.spec.tree import DraftTree


_NETWORKS: weakref.WeakValueDictionary[Hashable, Any] = weakref.WeakValueDictionary()


def shared_network(model: Any) -> Any:
    """``model``, or an equal network some live drafter already uses: drafters whose weights are
    equal (same class, architecture, dtype, device and parameter values) share one network object,
    so an engine's per-request drafters batch their forwards
    (:class:`~speculation.drafters.base.BatchDrafter`). Sharing is by content, never by name, so
    a retrained checkpoint is not confused with an older one. Inference never mutates a network;
    a weight swap replaces one drafter's reference (:meth:`FeaturePairsDrafter.swap_model`) and
    leaves the others untouched. The registry holds weak references only (one network per
    class, architecture, dtype and device) and keeps nothing alive.

    On the CPU the network's linear layers are packed for oneDNN first
    (:class:`~speculation.model.output_head.PackedLinear`; same parameters and state dict). The packed
    copies follow the weights (packed again after any in-place change or copy), so a network
    that is later trained or loaded into stays correct. On the AVX2 host of BENCHMARKS.md this
    halved EAGLE-3's drafting time per step (44-50 ms to 22-27 ms, identical tokens).
    """
    p = next(model.parameters())
    if p.device.type == "cpu" and onednn_available(p.dtype):
        pack_linears(model)
    key = (type(model), repr(model.arch), p.dtype, p.device)
    known = _NETWORKS.get(key)
    if known is not None and known is not model:
        a, b = known.state_dict(), model.state_dict()
        if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a):
            return known
    _NETWORKS[key] = model
    return model


def count_forward(model: Any) -> None:
    """Count one inference forward of a draft network (its ``forward_calls``; a batched forward over
    many sequences counts once)."""
    model.forward_calls += 1


class FeaturePairsDrafter(abc.ABC):
    """Committed-pair store, KV-cache reset hooks, thread-safe weight swaps (see module docstring).

    Subclasses set ``name`` and ``config`` (with ``total_tokens``), call :meth:`_init_pairs` and
    implement the abstract :meth:`_reset_cache`, :meth:`_encode_batch` and :meth:`_grow_batch`
    (batched over sequences sharing the network: :class:`~speculation.drafters.base.BatchStagedDrafter`).
    """

    name = "features"
    needs_aux = True
    target_topk = 0

    def _init_pairs(self, model, embed_weight: torch.Tensor) -> None:
        """Take the network and the target's ``[V, H]`` input embedding; empty pair store."""
        if embed_weight.shape != (model.arch.target_vocab_size, model.arch.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(embed_weight.shape)}, the drafter expects "
                f"[{model.arch.target_vocab_size}, {model.arch.hidden_size}]"
            )
        self.embed_weight = embed_weight
        self.model = model.eval()
        self._draft_ids = model.draft_ids()
        self._aux = torch.empty(0, 3 * self.model.arch.hidden_size)  # [capacity, 3H]
        self._n_pairs = 0
        self._encoded = 0
        self._lock = threading.Lock()  # a swap never lands in the middle of a propose

    def __getstate__(self) -> dict:
        """Picklable (shipped to a DrafterWorker): the lock is per process, recreated on load."""
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @abc.abstractmethod
    def _reset_cache(self, new: bool) -> None:
        """Empty the drafter's KV cache (``new``: also reallocate it, for a new sequence)."""

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        if prompt_aux is None:
            raise ValueError(f"the {self.name} drafter needs the target's aux hidden states (prefill with need_aux=True)")
        n = prompt_aux.shape[0]
        if n != ctx.prompt_len or len(ctx.tokens) != n + 1:
            raise ValueError(f"prompt aux has {n} rows for a prompt of {ctx.prompt_len} tokens + 1 root")
        self._check_aux(prompt_aux)
        self._aux = torch.empty(max(256, 2 * n), 3 * self.model.arch.hidden_size, dtype=prompt_aux.dtype)
        self._n_pairs = 0
        self._encoded = 0
        self._reset_cache(new=True)
        self._append_aux(prompt_aux)

    def skip(self, ctx: DraftContext) -> None:
        """Sit out a step (:class:`~speculation.drafters.base.SkippableDrafter`): nothing to forget;
        ``observe`` still stores the accepted rows' features, and the next ``propose`` encodes every
        pair not yet encoded."""

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if outcome.aux_hidden is None:
            raise ValueError(f"the {self.name} drafter needs aux hidden states at the accepted nodes")
        if outcome.aux_hidden.shape[0] != len(outcome.accepted):
            raise ValueError(f"aux rows {outcome.aux_hidden.shape[0]} != accepted nodes {len(outcome.accepted)}")
        self._append_aux(outcome.aux_hidden)

    def batch_key(self) -> Hashable:
        """Drafters sharing this network object and these tree knobs draft in one batched forward."""
        return (id(self.model), repr(self.config))

    @classmethod
    def propose_batch(cls, drafters: Sequence[FeaturePairsDrafter], ctxs: Sequence[DraftContext]) -> list[Proposal]:
        """:meth:`propose` for every sequence, one network forward per drafting stage for all of them."""
        results = cls.draft_batch(drafters, ctxs, [d.config.total_tokens - 1 for d in drafters], [None] * len(drafters))
        return [d._proposal(*r) for d, r in zip(drafters, results)]

    def propose(self, ctx: DraftContext) -> Proposal:
        return self.propose_batch([self], [ctx])[0]

    def draft(
        self, ctx: DraftContext, budget: int | Callable[[int], int], stop: StopRule | None = None
    ) -> DraftResult:
        """Encode the pending pairs (one forward), grow the candidate pool (asking ``stop`` before
        each further level or block), keep the ``budget`` best nodes (``budget`` may depend on the
        levels drafted: a callable ``levels -> nodes``).

        Returns ``(tree, drafter forwards, levels drafted)`` (the :class:`StagedDrafter` contract);
        the batch of one of :meth:`draft_batch`.
        """
        return self.draft_batch([self], [ctx], [budget], [stop])[0]

    @classmethod
    @torch.inference_mode()
    def draft_batch(
        cls,
        drafters: Sequence[FeaturePairsDrafter],
        ctxs: Sequence[DraftContext],
        budgets: Sequence[int | Callable[[int], int]],
        stops: Sequence[StopRule | None],
    ) -> list[DraftResult]:
        """:meth:`draft` for B sequences sharing one network: (1) one batched encode forward over
        every row with pending pairs, (2) the batched growth (one forward per level or block for
        the rows still growing; row i stops on ``stops[i]``), (3) per row, the ``budgets[i]`` best
        nodes. Per row, forwards = its encode (0 or 1) + the growth forwards it took part in."""
        if len({id(d.model) for d in drafters}) != 1 or len({repr(d.config) for d in drafters}) != 1:
            raise ValueError(f"batched {cls.name} drafting needs drafters sharing one network and one config")
        for d, ctx in zip(drafters, ctxs):
            d._check_context(ctx)
        with contextlib.ExitStack() as locks:
            for d in drafters:
                locks.enter_context(d._lock)
            encode = [i for i, d in enumerate(drafters) if d._encoded < d._n_pairs]
            if encode:
                cls._encode_batch([drafters[i] for i in encode], [ctxs[i].tokens for i in encode])
            grown = cls._grow_batch(drafters, stops)
            out: list[DraftResult] = []
            encoded = set(encode)
            for i, (d, ctx, budget, (pool, grow_forwards, levels)) in enumerate(zip(drafters, ctxs, budgets, grown)):
                keep = budget(levels) if callable(budget) else budget
                tree = build_draft_tree(ctx.root_token, pool, select_top(pool, keep), d._draft_ids)
                out.append((tree, int(i in encoded) + grow_forwards, levels))
        return out

    def _proposal(self, tree: DraftTree, forwards: int, levels: int) -> Proposal:
        """The :class:`Proposal` of one drafted tree (subclasses add their stats)."""
        return Proposal(tree=tree, drafter_forwards=forwards)

    @classmethod
    @abc.abstractmethod
    def _encode_batch(cls, drafters: Sequence[FeaturePairsDrafter], tokens: Sequence[list[int]]) -> None:
        """Encode each drafter's pairs ``[encoded, n_pairs)`` into its cache: ONE network forward."""

    @classmethod
    @abc.abstractmethod
    def _grow_batch(
        cls, drafters: Sequence[FeaturePairsDrafter], stops: Sequence[StopRule | None]
    ) -> list[tuple[CandidatePool, int, int]]:
        """Draft from each encoded context (one forward per level/block for the rows still
        growing): per row (pool, forwards it took part in, levels drafted)."""

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The network's weights (detached copies: later swaps do not change them)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights into a copy of the network, then swap it in (atomic between steps)."""
        fresh = copy.deepcopy(self.model)
        fresh.load_state_dict(state)
        self.swap_model(fresh)

    def swap_model(self, model) -> None:
        """Replace the network (same architecture, cast to the drafter's dtype). Thread-safe
        against ``propose``; the context is re-encoded with the new weights at the next propose."""
        if model.arch != self.model.arch:
            raise ValueError(f"cannot swap in a drafter of another architecture: {model.arch} != {self.model.arch}")
        model = shared_network(model.to(self.dtype).eval())  # drafters swapped to equal weights keep batching
        draft_ids = model.draft_ids()
        with self._lock:
            self.model, self._draft_ids = model, draft_ids
            self._encoded = 0
            self._reset_cache(new=False)

    def _check_context(self, ctx: DraftContext) -> None:
        if self._n_pairs != len(ctx.tokens) - 1:
            raise RuntimeError(
                f"{self.name} drafter holds {self._n_pairs} feature rows for a context of {len(ctx.tokens)} tokens "
                "(begin/observe were not called for every step)"
            )

    def _check_aux(self, aux: torch.Tensor) -> None:
        width = 3 * self.model.arch.hidden_size
        if aux.dim() != 2 or aux.shape[1] != width:
            raise ValueError(f"aux hidden states must be [n, {width}], got {tuple(aux.shape)}")

    def _append_aux(self, rows: torch.Tensor) -> None:
        self._check_aux(rows)
        end = self._n_pairs + rows.shape[0]
        if end > self._aux.shape[0]:
            grown = self._aux.new_empty(max(end, 2 * self._aux.shape[0]), self._aux.shape[1])
            grown[: self._n_pairs] = self._aux[: self._n_pairs]
            self._aux = grown
        self._aux[self._n_pairs : end] = rows.to(self._aux.dtype)
        self._n_pairs = end

    def _embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(target_ids, self.embed_weight).to(self.dtype)
