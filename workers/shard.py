"""``TargetShard``: a contiguous range of the target's layers and their KV cache, as a Ray actor.

A sharded forward is the HF model's own forward cut into pieces, built from its own modules
(``model.model.embed_tokens``, ``model.model.layers[i]``, ``model.model.rotary_emb``,
``model.model.norm``, ``model.lm_head``) with the same inputs the single-process
:class:`~speculation.target.TargetModel` passes:

* prefill / decode: no mask (HF's causal mask), positions ``n + arange(T)``;
* tree verify with T > 1: the 4D boolean mask ``[1, 1, T, n + T]`` = ones over the committed
  prefix, the ancestor-or-self mask over the tree block; positions ``n + depth`` (both from
  :func:`~speculation.target.tree_attention_inputs`, the function the in-process target uses);
* the causal mask is made by ``transformers.masking_utils.create_causal_mask`` sized on the
  shard's first layer (a shard's full-size ``DynamicCache`` holds only its own layers).

Hidden states flow shard to shard as :class:`~workers.wire.WireTensor` (``[1, T, H]``); the last
shard returns logits (``[V]`` for prefill/decode, ``[T, V]`` for a tree). Aux hidden states
(HF ``hidden_states`` index i = the input of layer i; index L = the final-norm output) are
returned by whichever shard owns them.

The class is plain Python (usable, and tested, in one process); :func:`make_actor_class` gives the
Ray actor. Each shard loads the weights itself (through :func:`speculation.assets.load_model`, the
one model loader) and keeps only its modules. EOS ids follow
:func:`speculation.target.eos_token_ids`, the in-process target's rule.
"""

from __future__ import annotations

import enum
import functools
import gc
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from speculation import assets
from speculation.config import DType
from speculation.target import causal_positions, compact_kv, eos_token_ids, tree_attention_inputs
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
        self._seqs: OrderedDict[str, _Sequence] = OrderedDict()

    @staticmethod
    def _pick_device() -> torch.device:
        try:
            import ray

            if ray.is_initialized() and ray.get_gpu_ids():
                return torch.device("cuda")
        except ImportError:  # pragma: no cover - ray is a dependency of workers/
            pass
        return torch.device("cpu")

    # ------------------------------------------------------------------ small queries
    def target_info(self) -> TargetInfo:
        return self.info

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

    # ------------------------------------------------------------------ sequence state
    def _open(self, seq_id: str) -> _Sequence:
        from transformers import DynamicCache

        self._seqs.pop(seq_id, None)
        seq = _Sequence(DynamicCache(config=self.config))
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
        from transformers.masking_utils import create_causal_mask

        seq = self._open(seq_id) if step.kind == StepKind.PREFILL else self._get(seq_id)
        n, T = seq.length, len(step)
        if self.spec.is_first:
            ids = torch.tensor(np.asarray(step.tokens, dtype=np.int64)).view(1, T).to(self.device)
            hidden = self.embed_tokens(ids)  # [1, T, H]
        else:
            if hidden_in is None:
                raise ValueError(f"shard {self.spec.index} needs the previous shard's hidden states")
            hidden = hidden_in.to_torch(self.device)
        mask = None
        if step.kind == StepKind.TREE and T > 1:
            mask, positions = tree_attention_inputs(  # [1, 1, T, n+T], [1, T]
                torch.from_numpy(np.asarray(step.ancestor_mask, dtype=bool)),
                torch.from_numpy(np.asarray(step.depths, dtype=np.int64)),
                n,
                self.device,
            )
        else:
            positions = causal_positions(n, T, self.device)  # [1, T]
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask,
            past_key_values=seq.cache,
            position_ids=positions,
            layer_idx=self.spec.start,
        )
        pos_emb = self.rotary_emb(hidden, position_ids=positions)
        aux: dict[int, WireTensor] = {}
        wanted = set(step.aux_layers)
        for i in range(self.spec.start, self.spec.end):
            if i in wanted:
                aux[i] = to_wire(hidden[0])
            hidden = self.layers[str(i)](
                hidden,
                attention_mask=causal_mask,
                position_embeddings=pos_emb,
                position_ids=positions,
                past_key_values=seq.cache,
                use_cache=True,
            )
        seq.length = n + T  # a tree is provisional: commit() cuts it back to the accepted path
        if not self.spec.is_last:
            return to_wire(hidden), aux
        hidden = self.norm(hidden)
        if self.num_layers in wanted:
            aux[self.num_layers] = to_wire(hidden[0])
        if step.kind == StepKind.TREE:
            logits = self.lm_head(hidden)[0]  # [T, V]
        else:
            logits = self.lm_head(hidden[:, -1:, :])[0, -1]  # [V]
        return to_wire(logits), aux

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


def make_actor_class(**options):
    """The ``TargetShard`` Ray actor class with ``options`` (Ray is imported lazily)."""
    return _remote_class().options(**options) if options else _remote_class()


@functools.cache
def _remote_class():
    import ray

    return ray.remote(TargetShard)
