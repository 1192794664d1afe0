"""``TargetShard``: a contiguous range of the target's layers and their KV cache, as a Ray actor.

A sharded forward is the HF model's own forward cut into pieces, built from its own modules
(``model.model.embed_tokens``, ``model.model.layers[i]``, ``model.model.rotary_emb``,
``model.model.norm``, ``model.lm_head``) with the same inputs the single-process
:class:`~speculation.model.target.TargetModel` passes:

* prefill / decode: no mask (HF's causal mask), positions ``n + arange(T)``;
* tree verify with T > 1: the 4D boolean mask ``[1, 1, T, n + T]`` = ones over the committed
  prefix, the ancestor-or-self mask over the tree block; positions ``n + depth`` (both from
  :func:`~speculation.model.tree_attention.tree_attention_inputs`, the function the in-process target uses);
* the causal mask is made by ``transformers.masking_utils.create_causal_mask`` sized on the
  shard's first layer (a shard's full-size ``DynamicCache`` holds only its own layers).

Hidden states flow shard to shard as :class:`~workers.wire.WireTensor` (``[1, T, H]``); the last
shard returns logits (``[V]`` for prefill/decode, ``[T, V]`` for a tree). Aux hidden states
(HF ``hidden_states`` index i = the input of layer i; index L = the final-norm output) are
returned by whichever shard owns them.

Continuous batching (:meth:`TargetShard.verify_batch`): the shard holds KV slot pools
(:class:`~speculation.model.kv_slots.KVSlotPool` over its own layers, one per engine) and runs ONE
forward per step over the trees of all live sequences. Between shards the batch travels as its
flat rows (``[1, sum T_b, H]``, row b's tokens after row b-1's, no padding). A shard whose layers
run the lean loop runs them flat, as the in-process target does
(:func:`~speculation.model.tree_attention.ragged_tree_inputs`: one pass over the real tokens, attention per row
over the row's own slot); otherwise it pads the rows for transformers' layers with the 4D mask
``[B, 1, T, L]`` and positions ``[B, T]`` of :func:`~speculation.model.tree_attention.batch_tree_attention_inputs`
and drops the padding again. The previous step's KV compactions ride in
the same call (:class:`Compaction`, applied first, idempotent), so the coordinator sends one call
per shard per step. A slot's prefill is :meth:`forward`'s prefill on a scratch cache, its rows
copied into the slot (as ``TargetModel.prefill_slot`` does). Every call is counted
(:meth:`TargetShard.call_counts`); :meth:`TargetShard.incarnation` changes when Ray restarts the
actor (its pools are then gone; the coordinator re-prefills them).

The class is plain Python (usable, and tested, in one process); :func:`make_actor_class` gives the
Ray actor. Each shard loads the weights itself (through :func:`speculation.assets.load_model`, the
one model loader) and keeps only its modules. EOS ids follow
:func:`speculation.model.target.eos_token_ids`, the in-process target's rule.
"""

from __future__ import annotations

import collections
import enum
import functools
import gc
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from speculation import assets
from speculation.config import BatchLayout, DType
from speculation.model.kv_reserve import reserve_rows
from speculation.model.kv_slots import KVSlotPool
from speculation.model.lean_forward import LeanLayers, PackedGemm
from speculation.model.output_head import PackedLinear, packed_path_applies
from speculation.model.target import compact_kv, eos_token_ids, step_kept_rows
from speculation.model.tree_attention import (
    batch_tree_attention_inputs,
    causal_positions,
    ragged_tree_inputs,
    tree_attention_inputs,
)
from speculation.spec.tree import TreeTensors
from workers.wire import WireTensor, to_wire


class StepKind(str, enum.Enum):
    """Which target call a forward serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    TREE = "tree"


@dataclass(frozen=True)
class StepInput:
    """One forward's inputs, identical for every shard of the pipeline.

    Attributes:
        kind: prefill, decode or tree verify.
        tokens: ``[T]`` int64 token ids (read by the first shard only).
        depths: ``[T]`` int64 node depths (tree only).
        ancestor_mask: ``[T, T]`` bool ancestor-or-self mask (tree only).
        aux_layers: HF hidden-state indices to return (empty: none).
    """

    kind: StepKind
    tokens: np.ndarray
    depths: np.ndarray | None = None
    ancestor_mask: np.ndarray | None = None
    aux_layers: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class ShardSpec:
    """What one shard loads and holds.

    Attributes:
        model: packaged alias, absolute local directory, or Hugging Face id.
        dtype: ``float32`` or ``bfloat16``.
        index: this shard's position in the pipeline (0 = holds the embeddings).
        num_shards: pipeline length (the last shard holds the norm and LM head).
        start, end: the layer range ``[start, end)``.
        torch_threads: torch intra-op threads in this process (None = leave torch's default).
        max_sequences: live KV caches kept; the least recently used is dropped beyond it.
        device: ``auto`` (CUDA when Ray gave this actor a GPU, else CPU), or a torch device.
    """

    model: str
    dtype: str
    index: int
    num_shards: int
    start: int
    end: int
    torch_threads: int | None = 1
    max_sequences: int = 4
    device: str = "auto"

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_shards - 1


@dataclass(frozen=True)
class TargetInfo:
    """Facts about the target the coordinator needs (read from the last shard)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    sliding_window: int | None
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class Compaction:
    """Keep the accepted rows of one verified tree: rows ``base + accepted`` of ``slot`` move to
    ``base .. base + m`` (``accepted[0] == 0``); the slot then holds ``base + m + 1`` valid rows.

    Idempotent on a shard: applied only while the slot holds exactly ``base`` committed rows, so a
    step retried after a fault never moves rows twice.
    """

    slot: int
    base: int
    accepted: tuple[int, ...]


@dataclass(frozen=True)
class BatchStepInput:
    """One batched verify step, identical for every shard of the pipeline.

    Attributes:
        slots: ``[B]`` the rows' KV slots.
        bases: ``[B]`` committed KV rows of each slot (the tree is written after them).
        trees: per row ``(tokens [T_b] int64, depths [T_b] int64, ancestor_mask [T_b, T_b] bool)``.
        aux_layers: HF hidden-state indices to return (empty: none).
        compactions: the previous step's :class:`Compaction` s, applied before the forward.
        prompt_slots: ``[P]`` slots whose prompts this step prefills (flat layout only).
        prompts: per prompt slot its token ids ``[n_p]`` int64: rows after the trees' rows,
            positions ``s_p..s_p+n_p-1``, causal over the slot's own rows (the solo prefill's
            attention), after the ``s_p`` rows of its earlier chunks (chunked prefill).
        prompt_bases: ``[P]`` the ``s_p``: rows each prompt slot already holds (empty: all 0).
    """

    slots: tuple[int, ...]
    bases: tuple[int, ...]
    trees: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    aux_layers: tuple[int, ...] = ()
    compactions: tuple[Compaction, ...] = field(default_factory=tuple)
    prompt_slots: tuple[int, ...] = ()
    prompts: tuple[np.ndarray, ...] = ()
    prompt_bases: tuple[int, ...] = ()

    def prompt_past(self) -> list[int]:
        """Rows each prompt slot holds before this step (its earlier chunks; 0 for a new prompt)."""
        return list(self.prompt_bases) if self.prompt_bases else [0] * len(self.prompts)

    def sizes(self) -> list[int]:
        """Tokens per row: the trees', then the prompts'."""
        return [int(t[0].shape[0]) for t in self.trees] + [int(p.shape[0]) for p in self.prompts]

    def kept_rows(self) -> list[int] | None:
        """Flat indices whose logits the step returns (:func:`~speculation.model.target.step_kept_rows`):
        every tree node, then each prompt's last token; None when there are no prompts."""
        sizes = self.sizes()
        return step_kept_rows(sizes[: len(self.trees)], sizes[len(self.trees):])


class UnknownPoolError(KeyError):
    """A KV pool id this shard does not hold (never created, dropped, or lost when Ray restarted
    the actor)."""


class ShardStateError(RuntimeError):
    """The coordinator's view of a slot disagrees with the shard's (a bug, never silently run)."""


class UnknownSequenceError(KeyError):
    """A sequence id this shard does not hold (never prefilled, released or evicted)."""


class UnsupportedModelError(ValueError):
    """The model cannot be sharded (e.g. sliding-window layers); run it in one process."""


def _check_supported(config) -> None:
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        kinds = sorted(set(types))
        raise UnsupportedModelError(
            f"the sharded target supports full-attention decoders only; this model has layer types {kinds} "
            "(run it in one process)"
        )


class _Sequence:
    __slots__ = ("cache", "length")

    def __init__(self, cache) -> None:
        self.cache = cache
        self.length = 0


class TargetShard:
    """Layers ``[start, end)`` of a causal LM and their KV cache, per sequence id.

    Args:
        spec: what to load and hold.
        model, tokenizer: an already loaded model and its tokenizer (in-process use); by default
            both are loaded from ``spec.model`` (the model with only this shard's layers).
    """

    def __init__(self, spec: ShardSpec, model=None, tokenizer=None) -> None:
        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        if model is None:
            layers = range(spec.start, spec.end)
            model, tokenizer = assets.load_model_and_tokenizer(spec.model, DType.parse(spec.dtype).torch, layers)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        _check_supported(cfg)
        self.config = model.config
        self.num_layers: int = cfg.num_hidden_layers
        if not 0 <= spec.start < spec.end <= self.num_layers:
            raise ValueError(
                f"shard {spec.index}: layer range [{spec.start}, {spec.end}) not in [0, {self.num_layers}]"
            )
        self.info = TargetInfo(
            num_layers=self.num_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            max_context=int(getattr(cfg, "max_position_embeddings", 1 << 30)),
            sliding_window=getattr(cfg, "sliding_window", None),
            eos_token_ids=eos_token_ids(model, tokenizer),
        )
        self.device = self._pick_device() if spec.device == "auto" else torch.device(spec.device)
        inner = model.model
        # Keep only this shard's modules; drop references to the rest so their memory is freed.
        self.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in range(spec.start, spec.end)})
        self.rotary_emb = inner.rotary_emb
        self.embed_tokens = inner.embed_tokens if spec.is_first else None
        self.norm = inner.norm if spec.is_last else None
        self.lm_head = model.lm_head if spec.is_last else None
        del inner, model
        gc.collect()
        for mod in (self.layers, self.rotary_emb, self.embed_tokens, self.norm, self.lm_head):
            if mod is not None:
                mod.to(self.device).eval()
        # The same layers as one loop without transformers' module glue, where they qualify (a
        # fused, packed Llama-family model on the CPU); bit for bit the modules' result.
        self._lean = LeanLayers.from_modules(
            self.config, {i: self.layers[str(i)] for i in range(spec.start, spec.end)}, self.rotary_emb
        )
        lean_head = self._lean is not None and isinstance(self.lm_head, PackedLinear)
        self._lean_head = PackedGemm(self.lm_head.packed, self.lm_head.bias) if lean_head else None
        self._seqs: OrderedDict[str, _Sequence] = OrderedDict()
        self._pools: dict[str, KVSlotPool] = {}
        self._valid: dict[str, dict[int, int]] = {}  # pool -> slot -> committed rows
        self._calls: collections.Counter[str] = collections.Counter()
        self._incarnation = uuid.uuid4().hex

    @staticmethod
    def _pick_device() -> torch.device:
        if ray.is_initialized() and ray.get_gpu_ids():
            return torch.device("cuda")
        return torch.device("cpu")

    # ------------------------------------------------------------------ small queries
    def target_info(self) -> TargetInfo:
        return self.info

    def batch_layout(self) -> BatchLayout:
        """How :meth:`verify_batch` runs this shard's layers: FLAT through the lean loop, else PADDED."""
        return BatchLayout.FLAT if self._lean is not None and self._lean.placed() else BatchLayout.PADDED

    def parameter_count(self) -> int:
        """Parameters this shard holds (the memory check in tests)."""
        mods = [m for m in (self.layers, self.embed_tokens, self.norm, self.lm_head) if m is not None]
        seen: set[int] = set()
        total = 0
        for m in mods:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    def sequences(self) -> list[str]:
        return list(self._seqs)

    def incarnation(self) -> str:
        """A random id drawn at construction: it changes when Ray restarts the actor."""
        return self._incarnation

    def call_counts(self) -> dict[str, int]:
        """Calls served since construction, by method (pool / slot / batch methods)."""
        return dict(self._calls)

    # ------------------------------------------------------------------ sequence state
    def _open(self, seq_id: str) -> _Sequence:
        self._seqs.pop(seq_id, None)
        seq = _Sequence(reserve_rows(DynamicCache(config=self.config)))
        self._seqs[seq_id] = seq
        while len(self._seqs) > self.spec.max_sequences:
            self._seqs.popitem(last=False)
        return seq

    def _get(self, seq_id: str) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(
                f"shard {self.spec.index}: unknown sequence {seq_id!r} (never prefilled, released, or "
                "evicted "
                f"because more than topology.max_sequences={self.spec.max_sequences} were live)"
            )
        self._seqs.move_to_end(seq_id)
        return seq

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def length(self, seq_id: str) -> int:
        return self._get(seq_id).length

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self, seq_id: str, step: StepInput, hidden_in: WireTensor | None = None
    ) -> tuple[WireTensor, dict[int, WireTensor]]:
        """Run this shard's layers. Returns (hidden ``[1,T,H]`` or logits, {aux index: ``[T,H]``})."""
        seq = self._open(seq_id) if step.kind == StepKind.PREFILL else self._get(seq_id)
        return self._forward_cache(seq, step, hidden_in)

    def _input_hidden(self, ids: torch.Tensor, hidden_in: WireTensor | None) -> torch.Tensor:
        """``[B, T, H]``: the embeddings of ``ids`` ``[B, T]`` (first shard), else the previous shard's."""
        if self.spec.is_first:
            return self.embed_tokens(ids.to(self.device))
        if hidden_in is None:
            raise ValueError(f"shard {self.spec.index} needs the previous shard's hidden states")
        return hidden_in.to_torch(self.device)

    def _forward_cache(
        self, seq: _Sequence, step: StepInput, hidden_in: WireTensor | None
    ) -> tuple[WireTensor, dict[int, WireTensor]]:
        """:meth:`forward` on ``seq``'s cache (a live sequence, or a scratch one for a slot prefill)."""
        n, T = seq.length, len(step)
        hidden = self._input_hidden(torch.tensor(np.asarray(step.tokens, dtype=np.int64)).view(1, T), hidden_in)
        mask = None
        if step.kind == StepKind.TREE and T > 1:
            mask, positions = tree_attention_inputs(  # [1, 1, T, n+T], [1, T]
                torch.tensor(np.asarray(step.ancestor_mask, dtype=bool)),  # copies: Ray's arrays are read-only
                torch.tensor(np.asarray(step.depths, dtype=np.int64)),
                n,
                self.device,
            )
        else:
            positions = causal_positions(n, T, self.device)  # [1, T]
        hidden, aux_t = self._layers(hidden, mask, positions, seq.cache, step.aux_layers)
        aux = {i: to_wire(h[0]) for i, h in aux_t.items()}
        seq.length = n + T  # a tree is provisional: commit() cuts it back to the accepted path
        if not self.spec.is_last:
            return to_wire(hidden), aux
        hidden = self.norm(hidden)
        if self.num_layers in step.aux_layers:
            aux[self.num_layers] = to_wire(hidden[0])
        if step.kind == StepKind.TREE:
            logits = self._head(hidden[0])  # [T, V]
        else:
            logits = self._head(hidden[0, -1:])[0]  # [V]
        return to_wire(logits), aux

    def _layers(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache, aux_layers
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This shard's decoder layers over ``hidden`` ``[B, T, H]`` with the model's own mask
        preparation (``create_causal_mask``: HF's causal mask when ``mask`` is None, a 4D mask
        passes through), or as :class:`~speculation.model.lean_forward.LeanLayers` where that applies.
        Returns (hidden ``[B, T, H]``, {aux index: its input ``[B, T, H]``})."""
        if self._lean is not None and self._lean.applies(hidden):
            return self._lean.run(hidden, positions, cache, mask, tuple(aux_layers))

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask,
            past_key_values=cache,
            position_ids=positions,
            layer_idx=self.spec.start,
        )
        pos_emb = self.rotary_emb(hidden, position_ids=positions)
        aux: dict[int, torch.Tensor] = {}
        wanted = set(aux_layers)
        for i in range(self.spec.start, self.spec.end):
            if i in wanted:
                aux[i] = hidden
            hidden = self.layers[str(i)](
                hidden,
                attention_mask=causal_mask,
                position_embeddings=pos_emb,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        return hidden, aux

    # ------------------------------------------------------------------ KV slot pools (batching)
    def new_pool(self, pool_id: str, max_sequences: int, max_tokens: int) -> None:
        """Create pool ``pool_id``: ``max_sequences`` slots of ``max_tokens`` rows for this shard's
        layers (memory fixed: nothing grows, nothing is evicted)."""
        self._calls["new_pool"] += 1
        self._pools[pool_id] = KVSlotPool(self.spec.end - self.spec.start, max_sequences, max_tokens,
                                          first_layer=self.spec.start)
        self._valid[pool_id] = {}

    def drop_pool(self, pool_id: str) -> None:
        """Free pool ``pool_id`` (idempotent)."""
        self._calls["drop_pool"] += 1
        self._pools.pop(pool_id, None)
        self._valid.pop(pool_id, None)

    def pool_ids(self) -> list[str]:
        return list(self._pools)

    def _pool(self, pool_id: str) -> KVSlotPool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownPoolError(
                f"shard {self.spec.index}: unknown KV pool {pool_id!r} (never created, dropped, or lost "
                "when the actor restarted)"
            )
        return pool

    @torch.inference_mode()
    def prefill_slot(
        self,
        pool_id: str,
        slot: int,
        step: StepInput,
        hidden_in: WireTensor | None = None,
        store: bool = True,
        compactions: tuple[Compaction, ...] = (),
    ) -> tuple[WireTensor, dict[int, WireTensor]]:
        """:meth:`forward`'s prefill on a scratch cache; with ``store`` its rows are copied into
        rows ``0..n`` of ``slot`` (``store=False``: only pass the hidden states on, for a re-prefill
        whose KV only a later, restarted shard needs). ``compactions`` are applied first."""
        self._calls["prefill_slot"] += 1
        if step.kind != StepKind.PREFILL:
            raise ValueError(f"prefill_slot needs a prefill step, got {step.kind.value}")
        pool = self._pool(pool_id)
        self._compact(pool_id, compactions)
        scratch = _Sequence(DynamicCache(config=self.config))
        out = self._forward_cache(scratch, step, hidden_in)
        if store:
            self._valid[pool_id][slot] = pool.load_prefix(slot, scratch.cache.layers[self.spec.start : self.spec.end])
        return out

    def _compact(self, pool_id: str, compactions: tuple[Compaction, ...]) -> None:
        pool, valid = self._pools[pool_id], self._valid[pool_id]
        for c in compactions:
            if valid.get(c.slot) != c.base:
                continue  # already applied (a retried step), or superseded by a re-prefill
            pool.compact(c.slot, c.base, list(c.accepted))
            valid[c.slot] = c.base + len(c.accepted)

    @torch.inference_mode()
    def verify_batch(
        self, pool_id: str, batch: BatchStepInput, hidden_in: WireTensor | None = None
    ) -> tuple[WireTensor, dict[int, WireTensor]]:
        """ONE forward over the trees of all rows (after applying ``batch.compactions``), and the
        prefills of ``batch.prompts`` into their slots (flat layout only), empty or holding the
        prompt's earlier chunks.

        Row b writes its ``T_b`` tree rows at ``bases[b]..`` of its slot (flat or padded, module
        docstring); prompt p writes its ``n_p`` rows at ``s_p..`` of its slot
        (:meth:`BatchStepInput.prompt_past`). Returns hidden
        ``[1, N, H]`` (or, on the last shard, the logits of :meth:`BatchStepInput.kept_rows`:
        every tree node, then each prompt's last token), row-major, and {aux index: ``[N, H]``},
        ``N = sum T_b + sum n_p``.
        """
        self._calls["verify_batch"] += 1
        pool = self._pool(pool_id)
        self._compact(pool_id, batch.compactions)
        valid = self._valid[pool_id]
        past = batch.prompt_past()
        # a continued prompt's slot must hold its earlier chunks (a new prompt's slot may hold anything)
        checked = [*zip(batch.slots, batch.bases), *((s, b) for s, b in zip(batch.prompt_slots, past) if b)]
        for slot, base in checked:
            if valid.get(slot) != base:
                raise ShardStateError(
                    f"shard {self.spec.index}: slot {slot} holds {valid.get(slot)} committed rows, the "
                    f"coordinator expects {base}"
                )
        sizes = batch.sizes()
        bases = list(batch.bases) + past
        slots = list(batch.slots) + list(batch.prompt_slots)
        tts = [
            TreeTensors(tokens=torch.tensor(np.asarray(t, dtype=np.int64)),  # copies: Ray's arrays are read-only
                        depths=torch.tensor(np.asarray(d, dtype=np.int64)),
                        ancestor_mask=torch.tensor(np.asarray(a, dtype=bool)))
            for t, d, a in batch.trees
        ]
        prompts = [np.asarray(p, dtype=np.int64).tolist() for p in batch.prompts]
        ids = torch.cat([*(tt.tokens for tt in tts), *(torch.tensor(p, dtype=torch.long) for p in prompts)])
        hidden = self._input_hidden(ids.view(1, -1), hidden_in)  # [1, N, H]: the wire is always the flat rows
        lean = self._lean is not None and self._lean.applies(hidden)
        if prompts and not lean:
            raise ShardStateError(f"shard {self.spec.index}: prompt rows fold into a step only in the flat "
                                  "layout (this shard runs transformers' layers); prefill them with prefill_slot")
        if lean:  # FLAT: the in-process target's pass
            if prompts:  # the first rows a fresh pool gets may be a folded prompt's
                ll = self._lean
                pool.allocate(ll.num_kv_heads, ll.head_dim, ll.dtype, ll.device)
            _, positions, rows = ragged_tree_inputs(tts, bases[: len(tts)], self.device, prompts=prompts,
                                                    prompt_past=past)
            cache = pool.batch_cache(slots, bases, sizes, flat=True)
            hidden, aux_t = self._lean.run(hidden, positions, cache, None, tuple(batch.aux_layers), rows)
            for slot, p, s0 in zip(batch.prompt_slots, prompts, past):
                valid[slot] = s0 + len(p)
        else:  # PADDED: transformers' layers over [B, T_max] rows, then back to the flat rows
            cache = pool.batch_cache(list(batch.slots), bases, sizes)
            _, mask, positions = batch_tree_attention_inputs(tts, bases, cache.plan.kv_len, self.device)
            hidden, aux_t = self._layers(_padded_rows(hidden, sizes), mask, positions, cache, batch.aux_layers)
            hidden = _valid_rows(hidden, sizes)
            aux_t = {i: _valid_rows(h, sizes) for i, h in aux_t.items()}
        if self.spec.is_last:
            hidden = self.norm(hidden)
            if self.num_layers in batch.aux_layers:
                aux_t[self.num_layers] = hidden
        aux = {i: to_wire(h[0]) for i, h in aux_t.items()}  # [N, H] each
        if not self.spec.is_last:
            return to_wire(hidden), aux
        kept = batch.kept_rows()
        rows_out = hidden[0] if kept is None else hidden[0].index_select(0, torch.tensor(kept, device=hidden.device))
        return to_wire(self._head(rows_out)), aux  # [K, V], row-major

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, V]`` of final-normed ``rows`` ``[M, H]``: the lean loop's GEMM (the in-process
        target's head call) where that applies, else the head module."""
        head = self._lean_head
        if head is not None and packed_path_applies(rows, self.lm_head.weight, head.packed):
            return head(rows)
        return self.lm_head(rows)

    # ------------------------------------------------------------------ KV bookkeeping
    @torch.inference_mode()
    def commit(self, seq_id: str, tree_len: int, accepted: list[int]) -> None:
        """Keep only the accepted path's KV rows of the last tree (see ``compact_kv``)."""
        seq = self._get(seq_id)
        compact_kv(seq.cache.layers, tree_len, accepted)
        seq.length = seq.length - tree_len + len(accepted)

    @torch.inference_mode()
    def truncate(self, seq_id: str, length: int) -> None:
        """Forget everything after the first ``length`` cached tokens."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"length must be in [0, {seq.length}], got {length}")
        if length < seq.length:
            for i in range(self.spec.start, self.spec.end):  # only this shard's cache layers
                seq.cache.layers[i].crop(length - seq.length)  # transformers 5 takes a negative count
        seq.length = length


def _valid_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``[B, T, D]`` -> ``[1, sum T_b, D]``: the first ``T_b`` rows of each batch row (padding dropped)."""
    return torch.cat([x[b, :t] for b, t in enumerate(sizes)], dim=0).unsqueeze(0)


def _padded_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``[1, sum T_b, D]`` -> ``[B, max T_b, D]``: row b's tokens first, zeros after (the padding
    positions read only their slot's row 0, see ``batch_tree_attention_inputs``)."""
    out = x.new_zeros(len(sizes), max(sizes), x.shape[-1])
    o = 0
    for b, t in enumerate(sizes):
        out[b, :t] = x[0, o : o + t]
        o += t
    return out


def make_actor_class(**options):
    """The ``TargetShard`` Ray actor class with ``options`` (Ray is imported lazily)."""
    return _remote_class().options(**options) if options else _remote_class()


@functools.cache
def _remote_class():
    return ray.remote(TargetShard)
