"""``RayTargetBackend``: the :class:`~speculation.engine.sequence.TargetBackend` protocol over shard actors.

It satisfies the protocol structurally with ``RayTargetState`` as its state type, like
:class:`~speculation.model.target.TargetModel` does with ``TargetState``. The decode loops call
``release`` when a sequence ends, which frees its KV caches on every shard (an LRU bound of
``topology.max_sequences`` live sequences per shard remains as a backstop).

The decode loop in ``speculation/engine/`` runs unchanged on this backend. Each call becomes
one pipeline pass: the coordinator submits ``forward`` to every shard in order, handing shard k's
output *reference* to shard k+1 (Ray moves the hidden states between the actors directly, not
through the coordinator), and waits only for the last shard's logits and the aux parts.
``commit`` and ``truncate`` are submitted without waiting (calls from one caller to one actor run
in order); their results are checked together with the next forward, so an error still surfaces.
Every wait has a timeout (``call_timeout_s``); a shard that does not answer becomes a
:class:`ShardTimeoutError` naming it (:func:`wait_pipeline`).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from speculation.model.prefix_cache import PrefixHit
from speculation.model.target import TargetModel, TreeForward, default_aux_layers
from speculation.model.tree_attention import prompt_chunks
from speculation.spec.tree import DraftTree, NodeSource
from workers.shard import StepInput, StepKind, TargetInfo
from workers.wire import WireTensor


class ShardTimeoutError(TimeoutError):
    """A shard actor did not answer within the call timeout (hung, overloaded, or restarting)."""


def wait_pipeline(refs_by_shard: Sequence[Sequence], timeout_s: float, what: str) -> None:
    """Wait until every ref of every shard is ready (values or errors), at most ``timeout_s``.

    ``refs_by_shard[k]``: the refs of shard k's calls, pipeline order. Raises
    :class:`ShardTimeoutError` naming the first shard (pipeline order) with a ref not ready: a
    later shard waits on an earlier one's output, so that shard is the one that hangs.
    """
    flat = [r for refs in refs_by_shard for r in refs]
    if not flat:
        return
    _, not_ready = ray.wait(flat, num_returns=len(flat), timeout=timeout_s, fetch_local=False)
    if not not_ready:
        return
    late = set(not_ready)
    k = next(k for k, refs in enumerate(refs_by_shard) if any(r in late for r in refs))
    raise ShardTimeoutError(
        f"target shard {k} did not answer {what} within call_timeout_s={timeout_s:g}s "
        "(the actor is hung, overloaded, or restarting)"
    )


@dataclass
class RayTargetState:
    """Per-sequence handle: the KV caches live in the shards under ``seq_id``.

    Attributes mirror :class:`~speculation.model.target.TargetState` (``length``, ``tokens``), so code
    that reads them works on either backend.
    """

    seq_id: str
    length: int = 0
    tokens: list[int] = field(default_factory=list)


class RayTargetBackend:
    """A target cut into pipeline shards (Ray actor handles), behind the TargetBackend protocol.

    Args:
        shards: actor handles of :class:`~workers.shard.TargetShard`, in pipeline order.
        info: the target's facts (from the last shard).
        aux_layers: HF hidden-state indices of the drafters' features (default ``[2, L/2, L-3]``).
        call_timeout_s: the longest wait for any shard call; beyond it a :class:`ShardTimeoutError`.
    """

    def __init__(
        self,
        shards: Sequence,
        info: TargetInfo,
        aux_layers: tuple[int, int, int] | None = None,
        call_timeout_s: float = 300.0,
    ) -> None:
        if not shards:
            raise ValueError("RayTargetBackend needs at least one shard")
        if isinstance(call_timeout_s, bool) or not isinstance(call_timeout_s, (int, float)) or not (
            0 < call_timeout_s <= 86400
        ):
            raise ValueError(f"call_timeout_s must be in (0, 86400] seconds, got {call_timeout_s!r}")
        self.call_timeout_s = float(call_timeout_s)
        self.shards = list(shards)
        self.info = info
        self.num_layers = info.num_layers
        self.hidden_size = info.hidden_size
        self.vocab_size: int = info.vocab_size
        self.max_context = info.max_context
        self.sliding_window = info.sliding_window
        self.eos_token_ids: frozenset[int] = info.eos_token_ids
        self.aux_layers = tuple(aux_layers or default_aux_layers(self.num_layers))
        if not all(0 <= i <= self.num_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers {self.aux_layers} out of range [0, {self.num_layers}]")
        self._pending: list = []  # refs of commit/truncate calls not yet checked
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]

    # The same rule as the in-process target (context window, sliding window).
    check_fits = TargetModel.check_fits

    # ------------------------------------------------------------------ pipeline
    def _run(self, seq_id: str, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = None
        aux_refs = []
        for shard in self.shards:
            hidden, aux = shard.forward.options(num_returns=2).remote(seq_id, step, hidden)
            aux_refs.append(aux)
        wait = [hidden, *aux_refs] if step.aux_layers else [hidden]
        pending, self._pending = self._pending, []  # checked once: an error surfaces once
        # A shard runs one caller's calls in order: its forward ready means its pending calls are done.
        wait_pipeline([[a] for a in aux_refs[:-1]] + [[aux_refs[-1], hidden]],
                      self.call_timeout_s, f"{step.kind.value} of sequence {seq_id}")
        got = ray.get(pending + wait)
        got = got[len(got) - len(wait) :]
        logits: WireTensor = got[0]
        aux_parts: dict[int, WireTensor] = {}
        for part in got[1:]:
            aux_parts.update(part)
        aux = None
        if step.aux_layers:
            aux = torch.cat([aux_parts[i].to_torch() for i in self.aux_layers], dim=-1)  # [T, 3H]
        return logits.to_torch(), aux

    def _new_seq(self) -> str:
        return f"{self._tag}-{next(self._ids)}"

    # ------------------------------------------------------------------ TargetBackend
    def prefill(
        self, ids: list[int], need_aux: bool = False, chunk_tokens: int | None = None,
        reuse: PrefixHit | None = None,
    ) -> tuple[RayTargetState, torch.Tensor, torch.Tensor | None]:
        """Run the prompt on a new sequence. Returns (state, logits ``[V]``, aux ``[n, 3H]`` or None).

        ``chunk_tokens``: chunked prefill, as ``TargetModel.prefill``: the first chunk a prefill,
        each later one a chain-shaped tree pass over the cached chunks (the chunk mask and
        positions), committed whole. ``reuse`` is refused: the shards keep no prompt rows across
        sequences, so a prefix cache runs on the in-process target only."""
        if reuse is not None:
            raise ValueError("prefix reuse runs on the in-process target only: the Ray shards keep no "
                             "rows across sequences (drop --prefix-cache or --ray)")
        if not ids:
            raise ValueError("prompt is empty: at least one token is required")
        chunks = prompt_chunks(ids, chunk_tokens)
        if len(chunks) > 1:
            state, logits, aux = self.prefill(chunks[0][1], need_aux=need_aux)
            auxes = [aux]
            for _, chunk in chunks[1:]:
                chain = DraftTree(chunk[0])
                chain.add_chain(0, chunk[1:], [0.0] * (len(chunk) - 1), NodeSource.DRAFTER)
                fwd = self.verify(state, chain, need_aux=need_aux)
                self.commit(state, chain, list(range(len(chain))))
                logits = fwd.logits[-1]
                auxes.append(fwd.aux_hidden)
            return state, logits, (torch.cat(auxes) if need_aux else None)
        state = RayTargetState(seq_id=self._new_seq())
        step = StepInput(
            kind=StepKind.PREFILL,
            tokens=np.asarray(ids, dtype=np.int64),
            aux_layers=self.aux_layers if need_aux else (),
        )
        logits, aux = self._run(state.seq_id, step)
        state.length = len(ids)
        state.tokens = list(ids)
        return state, logits, aux

    def decode(self, state: RayTargetState, token: int) -> torch.Tensor:
        """Vanilla step: append ``token`` and return the next-token logits ``[V]``."""
        step = StepInput(kind=StepKind.DECODE, tokens=np.asarray([token], dtype=np.int64))
        logits, _ = self._run(state.seq_id, step)
        state.length += 1
        state.tokens.append(int(token))
        return logits

    def verify(self, state: RayTargetState, tree: DraftTree, need_aux: bool = False) -> TreeForward:
        """One pipeline pass over every node of ``tree`` (ancestor-or-self attention)."""
        tt = tree.to_tensors()
        step = StepInput(
            kind=StepKind.TREE,
            tokens=tt.tokens.numpy(),
            depths=tt.depths.numpy(),
            ancestor_mask=tt.ancestor_mask.numpy(),
            aux_layers=self.aux_layers if need_aux else (),
        )
        logits, aux = self._run(state.seq_id, step)
        state.length += len(tree)
        return TreeForward(logits=logits, aux_hidden=aux)

    def commit(self, state: RayTargetState, tree: DraftTree, accepted: list[int]) -> None:
        """Keep only the accepted path's KV rows on every shard (not waited for; see module doc)."""
        if not accepted or accepted[0] != 0:
            raise ValueError("accepted path must start at the root (node 0)")
        acc = [int(a) for a in accepted]
        self._pending += [s.commit.remote(state.seq_id, len(tree), acc) for s in self.shards]
        state.length = state.length - len(tree) + len(acc)
        state.tokens.extend(tree.tokens[a] for a in acc)

    def truncate(self, state: RayTargetState, length: int) -> None:
        """Forget everything after the first ``length`` cached tokens."""
        if not 0 <= length <= state.length:
            raise ValueError(f"length must be in [0, {state.length}], got {length}")
        self._pending += [s.truncate.remote(state.seq_id, length) for s in self.shards]
        del state.tokens[length:]
        state.length = length

    def release(self, state: RayTargetState) -> None:
        """Free the sequence's KV caches on every shard (not waited for; checked with the next call)."""
        self._pending += [s.release.remote(state.seq_id) for s in self.shards]

    def sync(self) -> None:
        """Wait for (and check) every call submitted without waiting."""
        if self._pending:
            pending, self._pending = self._pending, []
            n = len(self.shards)  # every commit/truncate/release appends one ref per shard, in order
            wait_pipeline([pending[k::n] for k in range(n)], self.call_timeout_s, "its KV bookkeeping calls")
            ray.get(pending)
