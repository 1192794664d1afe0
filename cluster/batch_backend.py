"""``RayBatchTarget``: continuous batching over pipeline-sharded target actors, with shard-fault recovery.

It implements the slot API of :class:`~speculation.model.target.TargetModel` that
:class:`~speculation.engine.batch.BatchEngine` drives (``new_slot_pool``, ``prefill_slot``,
``verify_batch``, ``commit_slot``, ``release_slot``, ``check_fits``, ``tokenizer``, ``device``), so
``BatchEngine(RayBatchTarget(...), ...)`` runs unchanged; it also keeps the batch-1
:class:`~speculation.engine.sequence.TargetBackend` methods of :class:`~cluster.backend.RayTargetBackend`
(solo references, ``measure_cost_model``).

Per engine step the coordinator sends ONE call per shard
(:meth:`~workers.shard.TargetShard.verify_batch`) for all live sequences: slots with their own KV
lengths, per-row positions and ancestor masks (built on the shard by the in-process helpers:
``speculation.model.tree_attention.ragged_tree_inputs`` for a flat pass, ``batch_tree_attention_inputs`` for a
padded one). Hidden states flow shard to shard as object refs (the batch's flat rows); the coordinator fetches only the last shard's logits of the valid
rows (``[sum T_b, V]``) and the aux parts. ``commit_slot`` sends nothing: the step's KV
compactions ride in the next call on that pool (:class:`~workers.shard.Compaction`, idempotent).
Where every shard runs flat rows (``folds_prefills``), arriving prompts ride in the same call
(``empty_slot`` + ``step_batch``: one causal row each, written into its empty slot, logits at its
last token), so a step is one call per shard whatever arrives; a prompt that arrives in a
padded deployment takes its own pipeline pass (``prefill_slot``). A sequence prefilled inside a
step becomes live (replayable after a fault) only once that step succeeded; a fault during it
recovers the live sequences and resubmits the step, prompts included.

Memory: each shard holds per pool ``max_sequences x max_tokens`` KV rows of its own layers,
allocated once; live sequences are never evicted (the pool is dropped on the shards when the
coordinator's :class:`RaySlotPool` is garbage-collected).

Faults. Every wait has a timeout (:class:`ShardCallConfig`; a :class:`~cluster.backend.ShardTimeoutError`
names the shard). When a shard actor dies (``RayActorError``, or a restarted actor that no longer
knows the pool), the step is recovered and retried, up to ``max_recoveries`` times:

1. wait (``restart_timeout_s``) until every shard answers; a shard whose
   :meth:`~workers.shard.TargetShard.incarnation` changed was restarted by Ray (``max_restarts``);
2. on the restarted shards, recreate every live pool and re-prefill every live sequence from its
   committed tokens (the shards before them run the same prefill without storing, to hand on the
   hidden states);
3. resubmit the step (compactions already applied on a surviving shard are skipped there).

The output is the same as without the fault up to the floating-point order of one prefill forward
over the committed tokens versus the incremental forwards that wrote them (fp32 greedy: identical
in the tests). A shard that Ray does not restart is a :class:`ShardLostError` naming it.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import ray
import torch

from cluster.backend import RayTargetBackend, ShardTimeoutError, wait_pipeline
from speculation.config import BatchLayout
from speculation.model.batch_target import SlotState
from speculation.model.kv_slots import SlotLedger
from speculation.model.target import PrefillForward, TreeForward, check_step_rows, split_step_outputs
from speculation.spec.tree import DraftTree
from workers.shard import (
    BatchStepInput,
    Compaction,
    ShardStateError,
    StepInput,
    StepKind,
    TargetInfo,
    UnknownPoolError,
)
from workers.wire import WireTensor


_RESTART_POLL_S = 0.2
"""Seconds between asks to a shard that Ray is restarting."""


class ShardLostError(RuntimeError):
    """A shard actor died and was not restarted, or kept failing past ``max_recoveries``."""


class _ShardFault(Exception):
    """Internal: shard ``shard``'s call failed with an actor death or a lost pool (recoverable)."""

    def __init__(self, shard: int, cause: BaseException) -> None:
        super().__init__(f"shard {shard}: {cause}")
        self.shard = shard
        self.cause = cause


@dataclass(frozen=True)
class ShardCallConfig:
    """Timeouts and retries of the batched Ray target (validated on construction).

    Attributes:
        call_timeout_s: the longest wait for one step's (or prefill's) shard calls. Range (0, 86400].
        restart_timeout_s: the longest wait for a dead shard to come back (Ray restarts it and it
            reloads its weights). Range (0, 86400].
        max_recoveries: fault recoveries (re-prefill + retry) per call before giving up. Range [0, 100].
    """

    call_timeout_s: float = 300.0
    restart_timeout_s: float = 300.0
    max_recoveries: int = 3

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "restart_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise ValueError(f"shard_calls.{name} must be in (0, 86400] seconds, got {v!r}")
        m = self.max_recoveries
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 100:
            raise ValueError(f"shard_calls.max_recoveries must be an integer in [0, 100], got {m!r}")


class RaySlotPool(SlotLedger):
    """The coordinator's ledger of one KV pool held by every shard: free slots (fixed size, the
    shards' :class:`~speculation.model.kv_slots.KVSlotPool` layout), live sequences, and the KV
    compactions not yet sent."""

    def __init__(self, pool_id: str, max_sequences: int, max_tokens: int) -> None:
        super().__init__(max_sequences, max_tokens)
        self.pool_id = pool_id
        self.live: dict[int, RaySlotState] = {}
        self.compactions: list[Compaction] = []

    def release(self, slot: int) -> None:
        super().release(slot)
        self.live.pop(slot, None)
        self.compactions = [c for c in self.compactions if c.slot != slot]


RaySlotState = SlotState[RaySlotPool]
"""A sequence in a :class:`RaySlotPool` slot: the one :class:`~speculation.model.batch_target.SlotState`
of the in-process target too (same fields, same :class:`ReleasedSequenceError` after release)."""


def _drop_pool(shards: tuple, pool_id: str) -> None:
    """Free ``pool_id`` on every shard (fire and forget: the pool's ledger is gone)."""
    if ray.is_initialized():
        for s in shards:
            s.drop_pool.remote(pool_id)


class RayBatchTarget(RayTargetBackend):
    """The batched slot API over pipeline shard actors (see the module doc).

    Args:
        shards: :class:`~workers.shard.TargetShard` actor handles, pipeline order (create them
            with ``max_restarts`` > 0 for fault recovery).
        info: the target's facts (from the last shard).
        tokenizer: the model's tokenizer (the bench encodes prompts with it), or None.
        aux_layers: HF hidden-state indices of the drafters' features (default ``[2, L/2, L-3]``).
        calls: timeouts and recoveries.
    """

    def __init__(
        self,
        shards: Sequence,
        info: TargetInfo,
        tokenizer=None,
        aux_layers: tuple[int, int, int] | None = None,
        calls: ShardCallConfig | None = None,
    ) -> None:
        self.calls = calls or ShardCallConfig()
        super().__init__(shards, info, aux_layers=aux_layers, call_timeout_s=self.calls.call_timeout_s)
        self.tokenizer = tokenizer
        self.device = torch.device("cpu")  # where logits land (the coordinator)
        self._pools: weakref.WeakValueDictionary[str, RaySlotPool] = weakref.WeakValueDictionary()
        self._pool_ids = itertools.count()
        refs = [s.incarnation.remote() for s in self.shards]
        layouts = [s.batch_layout.remote() for s in self.shards]
        wait_pipeline([[r] for r in (*refs, *layouts)], self.calls.call_timeout_s, "incarnation")
        self._incarnations: list[str] = ray.get(refs)
        flat = all(layout is BatchLayout.FLAT for layout in ray.get(layouts))
        self.batch_layout = BatchLayout.FLAT if flat else BatchLayout.PADDED
        """How the shards lay a batched step out (what the goodput rule's cost model assumes)."""
        self._stale: set[int] = set()  # restarted shards whose pools are not re-prefilled yet
        self.recoveries = 0
        """Shard restarts recovered so far (pools recreated and live sequences re-prefilled)."""
        self.batch_calls = 0
        """Batched verify steps sent (each one call per shard)."""

    @property
    def folds_prefills(self) -> bool:
        """Whether :meth:`step_batch` can prefill arriving prompts inside the step's one call per
        shard (every shard runs the lean loop's flat rows); else each prompt takes its own
        pipeline pass (:meth:`prefill_slot`)."""
        return self.batch_layout is BatchLayout.FLAT

    # ------------------------------------------------------------------ slot API
    def new_slot_pool(self, max_sequences: int, max_tokens: int, token_budget: int | None = None) -> RaySlotPool:
        """A pool of ``max_sequences`` slots of ``max_tokens`` rows on every shard. The shards keep
        fixed slots, so ``token_budget`` (slots sized per request) is refused."""
        if token_budget is not None:
            raise ValueError("batch.kv_token_budget sizes KV slots per request in process only; the shards of "
                             "a RayBatchTarget hold fixed slots of batch.max_tokens_per_sequence rows: leave it unset")
        pool = RaySlotPool(f"{self._tag}-pool-{next(self._pool_ids)}", max_sequences, max_tokens)
        self._with_recovery(lambda: [[s.new_pool.remote(pool.pool_id, max_sequences, max_tokens)]
                                     for s in self.shards], "new_pool")
        self._pools[pool.pool_id] = pool
        fin = weakref.finalize(pool, _drop_pool, tuple(self.shards), pool.pool_id)
        fin.atexit = False
        return pool

    def prefill_slot(
        self, pool: RaySlotPool, ids: list[int], need_aux: bool = False, rows: int | None = None
    ) -> tuple[RaySlotState, torch.Tensor, torch.Tensor | None]:
        """The prompt's prefill (the solo forward), its rows stored in a free slot on every shard
        (``rows``: checked against the fixed slot size). Returns (state, next-token logits ``[V]``,
        aux ``[n, 3H]`` or None)."""
        if not ids:
            raise ValueError("prompt is empty: at least one token is required")
        slot = pool.acquire(rows)
        step = StepInput(kind=StepKind.PREFILL, tokens=np.asarray(ids, dtype=np.int64),
                         aux_layers=self.aux_layers if need_aux else ())

        def submit() -> list[list]:
            comps = tuple(pool.compactions)
            return self._pipeline(lambda s, h: s.prefill_slot.options(num_returns=2).remote(
                pool.pool_id, slot, step, h, True, comps))

        try:
            logits, aux_parts = self._split(self._with_recovery(submit, f"prefill of slot {slot}"))
        except BaseException:
            pool.release(slot)
            raise
        pool.compactions = []
        state = SlotState(pool=pool, slot=slot, length=len(ids), tokens=list(ids))
        pool.live[slot] = state
        return state, logits.to_torch(), self._aux(aux_parts) if need_aux else None

    def verify_batch(
        self, states: list[RaySlotState], trees: list[DraftTree], need_aux: bool = False
    ) -> list[TreeForward]:
        """ONE call per shard over every tree of every sequence (per-row masks and positions);
        the tree rows are provisional until :meth:`commit_slot`."""
        if len(states) != len(trees) or not states:
            raise ValueError("verify_batch needs one tree per state, at least one")
        return self.step_batch(states, trees, [], need_aux=need_aux)[0]

    def empty_slot(self, pool: RaySlotPool, rows: int | None = None) -> RaySlotState:
        """A free slot of ``pool`` holding nothing yet, for a prompt that :meth:`step_batch` prefills."""
        if not self.folds_prefills:
            raise RuntimeError("prefills fold into the batched step only when every shard runs flat rows "
                               "(use prefill_slot)")
        return SlotState(pool=pool, slot=pool.acquire(rows), length=0, tokens=[])

    def step_batch(
        self,
        states: list[RaySlotState],
        trees: list[DraftTree],
        prefills: list[tuple[RaySlotState, list[int]]],
        need_aux: bool = False,
    ) -> tuple[list[TreeForward], list[PrefillForward]]:
        """ONE call per shard: every tree of ``states`` verified (as :meth:`verify_batch`) and each
        ``(state, prompt)`` of ``prefills`` prefilled into its empty slot (:meth:`empty_slot`; the
        flat layout only), or after the earlier chunks its slot holds (chunked prefill), as
        :meth:`speculation.model.target.TargetModel.step_batch` does in one process. A prefilled sequence
        joins the pool's live sequences (what a re-prefill after a fault replays, chunks so far
        included) once the step succeeded."""
        if prefills and not self.folds_prefills:
            raise RuntimeError("prefills fold into the batched step only when every shard runs flat rows")
        pool = check_step_rows(states, trees, prefills, chunked=True)
        every = [*states, *(p[0] for p in prefills)]
        sizes = [len(t) for t in trees]
        prompt_sizes = [len(ids) for _, ids in prefills]
        if any(s.length + t > pool.max_tokens for s, t in zip(every, sizes + prompt_sizes)):
            raise ValueError(f"a row would write past the slot size {pool.max_tokens}")
        tts = [t.to_tensors() for t in trees]
        batch = BatchStepInput(
            slots=tuple(s.held_slot() for s in states),
            bases=tuple(s.length for s in states),
            trees=tuple((tt.tokens.numpy(), tt.depths.numpy(), tt.ancestor_mask.numpy()) for tt in tts),
            aux_layers=self.aux_layers if need_aux else (),
            compactions=tuple(pool.compactions),
            prompt_slots=tuple(s.held_slot() for s, _ in prefills),
            prompts=tuple(np.asarray(ids, dtype=np.int64) for _, ids in prefills),
            prompt_bases=tuple(s.length for s, _ in prefills),
        )
        batch_ref = ray.put(batch)  # one copy in the object store, read by every shard

        def submit() -> list[list]:
            return self._pipeline(lambda s, h: s.verify_batch.options(num_returns=2).remote(
                pool.pool_id, batch_ref, h))

        what = f"verify step of {len(states)} sequences" + (f" and {len(prefills)} prefills" if prefills else "")
        logits_w, aux_parts = self._split(self._with_recovery(submit, what))
        self.batch_calls += 1
        pool.compactions = []
        aux = self._aux(aux_parts) if need_aux else None  # [sum T_b + sum n_p, 3H]
        fwds, starts = split_step_outputs(states, trees, prefills, logits_w.to_torch(), aux)
        for state, _ in prefills:
            pool.live[state.held_slot()] = state
        return fwds, starts

    def commit_slot(self, state: RaySlotState, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's rows (root first); sent with the pool's next call."""
        if not accepted or accepted[0] != 0:
            raise ValueError("accepted path must start at the root (node 0)")
        base = state.length - len(tree)
        state.pool.compactions.append(Compaction(state.held_slot(), base, tuple(int(a) for a in accepted)))
        state.length = base + len(accepted)
        state.tokens.extend(tree.tokens[a] for a in accepted)

    def release_slot(self, state: RaySlotState) -> None:
        """Give the sequence's slot back (idempotent); the shards overwrite it on the next prefill."""
        if state.slot is not None:
            state.pool.release(state.slot)
            state.slot = None

    # ------------------------------------------------------------------ pipeline calls
    def _pipeline(self, call: Callable, shards: Sequence | None = None) -> list[list]:
        """Submit ``call(shard, hidden_ref)`` to every shard in order, shard k's hidden ref feeding
        shard k+1; returns per shard its ``[hidden_or_logits_ref, aux_ref]``."""
        hidden = None
        refs = []
        for shard in self.shards if shards is None else shards:
            hidden, aux = call(shard, hidden)
            refs.append([hidden, aux])
        return refs

    def _gather(self, refs_by_shard: list[list], what: str) -> list:
        """Wait (with the call timeout) and fetch: every shard's last ref (the aux parts, small) and
        the last shard's first ref. Raises :class:`_ShardFault` naming the first failed shard."""
        wait_pipeline(refs_by_shard, self.calls.call_timeout_s, what)
        out = []
        for k, refs in enumerate(refs_by_shard):
            want = refs if k == len(refs_by_shard) - 1 else refs[-1:]
            try:
                out.append(ray.get(want))
            except (ray.exceptions.RayActorError, UnknownPoolError) as e:
                raise _ShardFault(k, e) from e
        return out

    def _with_recovery(self, submit: Callable[[], list[list]], what: str) -> list:
        """``submit`` then gather; on a shard fault recover (re-prefill on restarted shards) and retry."""
        fault: _ShardFault | None = None
        for _ in range(self.calls.max_recoveries + 1):
            try:
                if fault is not None:
                    self._recover()
                return self._gather(submit(), what)
            except _ShardFault as e:
                fault = e
        assert fault is not None
        raise ShardLostError(
            f"target shard {fault.shard} kept failing during {what} after "
            f"max_recoveries={self.calls.max_recoveries} recoveries: {fault.cause}"
        ) from fault.cause

    @staticmethod
    def _split(got: list) -> tuple[WireTensor, dict[int, WireTensor]]:
        """(the last shard's output, every shard's aux parts merged) from :meth:`_gather`."""
        aux: dict[int, WireTensor] = {}
        for parts in got:
            aux.update(parts[-1])
        return got[-1][0], aux

    def _aux(self, parts: dict[int, WireTensor]) -> torch.Tensor:
        return torch.cat([parts[i].to_torch() for i in self.aux_layers], dim=-1)  # [N, 3H]

    # ------------------------------------------------------------------ fault recovery
    def _restarted(self) -> list[int]:
        """Wait for every shard to answer; the indices of those Ray restarted since last seen."""
        restarted = []
        deadline = time.monotonic() + self.calls.restart_timeout_s
        for k, shard in enumerate(self.shards):
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise ray.exceptions.GetTimeoutError()
                    inc = ray.get(shard.incarnation.remote(), timeout=left)
                    break
                except ray.exceptions.GetTimeoutError:
                    raise ShardTimeoutError(
                        f"target shard {k} did not come back within restart_timeout_s="
                        f"{self.calls.restart_timeout_s:g}s after a fault"
                    ) from None
                except ray.exceptions.ActorUnavailableError:
                    time.sleep(min(_RESTART_POLL_S, max(left, 0.0)))  # restarting: ask again
                except ray.exceptions.RayActorError as e:
                    raise ShardLostError(
                        f"target shard {k} died and Ray did not restart it (create the shard actors with "
                        f"max_restarts > 0): {e}"
                    ) from e
            if inc != self._incarnations[k]:
                restarted.append(k)
                self._incarnations[k] = inc
        return restarted

    def _recover(self) -> None:
        """Recreate the live pools and re-prefill their live sequences on the restarted shards."""
        # A shard restarted during an earlier, unfinished recovery still needs its re-prefill.
        self._stale.update(self._restarted())
        restarted = sorted(self._stale)
        if not restarted:
            return  # a transient failure: the retry resubmits as is
        upto = self.shards[: max(restarted) + 1]  # later shards keep their KV and are not needed
        for pool in list(self._pools.values()):
            self._gather([[self.shards[k].new_pool.remote(pool.pool_id, pool.max_sequences, pool.max_tokens)]
                          for k in restarted], f"new_pool {pool.pool_id} after a restart")
            for slot, state in sorted(pool.live.items()):
                if state.length != len(state.tokens):
                    raise ShardStateError(f"slot {slot}: {state.length} KV rows but {len(state.tokens)} tokens")
                step = StepInput(kind=StepKind.PREFILL, tokens=np.asarray(state.tokens, dtype=np.int64))
                store = [k in restarted for k in range(len(upto))]
                it = iter(store)
                refs = self._pipeline(lambda s, h: s.prefill_slot.options(num_returns=2).remote(
                    pool.pool_id, slot, step, h, next(it), ()), upto)
                self._gather(refs, f"re-prefill of slot {slot} after a restart")
        self._stale.clear()
        self.recoveries += 1
