"""Prompt KV reuse across requests: a prompt that extends an earlier one skips its prefill.

Multi-turn chat, code-editing sessions and agent loops re-send a growing transcript, so most of
each prompt was prefilled by the previous request. vLLM (automatic prefix caching) and SGLang
(RadixAttention) keep those KV rows; this module does the same for the solo decode loop
(:class:`PrefixCachedTarget`) and for the batched engine's chunked prefills
(``BatchEngine(prefix_cache=...)``, one cache shared by every sequence).

Exactness. Reuse happens on the chunked-prefill grid only. With chunk size ``C`` a prompt of
``n`` tokens is prefilled in forwards over tokens ``[jC, (j+1)C)`` (``TargetModel.prefill``); the
rows of chunk ``j`` depend only on tokens ``0 .. (j+1)C - 1`` and on a forward of that same shape.
So the rows of a *full* chunk are the same bits whichever prompt computed them, and

    prefill(ids, C, reusing k full chunks) == prefill(ids, C)                  (bit for bit)

for logits, KV rows and auxiliary features (tested). In the batched engine a chunk's rows come
from a packed forward with other sequences' rows, whose products may round differently with the
row count (as every batched step does); a reused prefill there equals the one the step would have
run up to that rounding, and outputs stay vanilla's token for token (tested). Storing only full chunks and reusing at
most ``floor((n - 1) / C)`` of them (the last token is always computed, for its logits) keeps a
shared cache from making any output depend on what was served before.

Memory: an entry of ``m`` rows holds ``2 * L * H_kv * D * m`` KV values (plus ``3H * m`` when it
kept the drafters' features); the cache evicts least-recently-used entries past
``PrefixCacheConfig.max_tokens`` rows in all. An entry whose tokens are a prefix of a newer
entry's is dropped (the newer one serves every lookup the older could).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from speculation.config import ConfigError, _check_int
from speculation.model.kv_reserve import ReservedLayer, reserve_rows
from speculation.spec.tree import DraftTree

if TYPE_CHECKING:
    from speculation.model.target import TargetModel, TargetState, TreeForward


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Settings of a :class:`PrefixCache`."""

    chunk_tokens: int = 256
    """The chunked-prefill grid reuse happens on (``EngineConfig.prefill_chunk_tokens`` must equal
    it). Range [1, 1048576]."""
    max_tokens: int = 32768
    """Rows kept over all entries before least-recently-used eviction. Range [1, 16777216]."""

    def __post_init__(self) -> None:
        _check_int("prefix_cache", "chunk_tokens", self.chunk_tokens, 1, 1 << 20)
        _check_int("prefix_cache", "max_tokens", self.max_tokens, 1, 1 << 24)


@dataclass
class PrefixHit:
    """Rows an earlier prompt left that a new prompt starts with.

    Attributes:
        rows: reused prompt positions ``0 .. rows - 1``; a multiple of the chunk size.
        keys, values: per layer ``[1, H_kv, rows, D]``.
        aux: ``[rows, 3H]`` auxiliary features of those positions, or None when not needed.
    """

    rows: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    aux: torch.Tensor | None

    def layers(self) -> list[LayerRows]:
        """The rows per layer, as a KV slot pool loads them."""
        return [LayerRows(k, v) for k, v in zip(self.keys, self.values, strict=True)]


@dataclass(frozen=True)
class LayerRows:
    """One layer's rows in the shape a prefill cache layer has: keys, values ``[1, H_kv, m, D]``
    (what :meth:`PrefixCache.store` reads and
    :meth:`~speculation.model.kv_slots.KVSlotPool.load_prefix` writes)."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [1, H_kv, m, D]
    values: list[torch.Tensor]
    aux: torch.Tensor | None  # [m, 3H] or None


@dataclass
class PrefixCacheStats:
    """Counters over every lookup: how much prefill the cache saved."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, float | int]:
        share = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "reused_share": share, "evictions": self.evictions}


@dataclass
class PrefixCache:
    """The prompt rows of earlier prefills, on one chunk grid, bounded and LRU-evicted."""

    config: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._rows = 0

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens

    @property
    def rows(self) -> int:
        """Rows held over all entries."""
        return self._rows

    def nbytes(self) -> int:
        """Bytes held by every entry's KV rows and features."""
        total = 0
        for e in self._entries.values():
            total += sum(t.nbytes for t in e.keys) + sum(t.nbytes for t in e.values)
            total += e.aux.nbytes if e.aux is not None else 0
        return total

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        self._entries.clear()
        self._rows = 0

    def lookup(self, ids: list[int], need_aux: bool = False) -> PrefixHit | None:
        """The longest reusable prefix of ``ids``: whole chunks, at most ``floor((n - 1) / C)`` of
        them, from an entry that kept the features when ``need_aux``. None on a miss."""
        C = self.config.chunk_tokens
        n = len(ids)
        self.stats.lookups += 1
        self.stats.prompt_tokens += n
        limit = (n - 1) // C  # chunks; the last prompt token is always computed
        best: _Entry | None = None
        best_chunks = 0
        for e in self._entries.values():
            if need_aux and e.aux is None:
                continue
            k = _common_chunks(ids, e.tokens, C, min(limit, len(e.tokens) // C))
            if k > best_chunks:
                best, best_chunks = e, k
        if best is None:
            return None
        self._entries.move_to_end(best.tokens)
        m = best_chunks * C
        self.stats.hits += 1
        self.stats.reused_tokens += m
        return PrefixHit(rows=m, keys=[k[:, :, :m] for k in best.keys], values=[v[:, :, :m] for v in best.values],
                         aux=best.aux[:m] if need_aux and best.aux is not None else None)

    def store(self, ids: list[int], layers: Sequence[LayerRows], aux: torch.Tensor | None) -> None:
        """Keep the full-chunk rows of a prompt just prefilled (``layers``: per layer keys and values
        ``[1, H_kv, >= n, D]``, e.g. a prefill cache's ``layers``; ``aux``: its ``[n, 3H]``
        features, or None). A prompt shorter than one chunk, or one already held, stores nothing."""
        C = self.config.chunk_tokens
        m = (len(ids) // C) * C
        if m == 0 or m > self.config.max_tokens:
            return
        key = tuple(ids[:m])
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        for old in [t for t in self._entries if len(t) < m and key[: len(t)] == t]:
            self._drop(old)  # superseded: every lookup it serves, the new entry serves
        entry = _Entry(tokens=key, keys=[layer.keys[:, :, :m].clone() for layer in layers],
                       values=[layer.values[:, :, :m].clone() for layer in layers],
                       aux=aux[:m].clone() if aux is not None else None)
        self._entries[key] = entry
        self._rows += m
        while self._rows > self.config.max_tokens:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1

    def _drop(self, key: tuple[int, ...]) -> None:
        self._rows -= len(self._entries.pop(key).tokens)


def _common_chunks(ids: list[int], tokens: tuple[int, ...], C: int, k: int) -> int:
    """The number of leading whole chunks (at most ``k``) on which ``ids`` and ``tokens`` agree."""
    if tuple(ids[: k * C]) == tokens[: k * C]:
        return k
    j = 0
    while j < k and tuple(ids[j * C: (j + 1) * C]) == tokens[j * C: (j + 1) * C]:
        j += 1
    return j


def check_reusable(cache: DynamicCache, model_name: str) -> None:
    """Refuse a model whose KV layers are not plain full-attention rows (sliding-window layers drop
    rows a reused prefix would need), naming the model."""
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) not in (DynamicLayer, ReservedLayer)}
    if kinds:
        raise ConfigError(
            f"prefix_cache needs full-attention KV layers; {model_name} has {', '.join(sorted(kinds))}: "
            "turn the prefix cache off for this model"
        )


def inject(cache: DynamicCache, hit: PrefixHit, chunk_tokens: int) -> None:
    """Write ``hit``'s rows into a fresh ``cache`` one chunk at a time, the appends its prefill would
    have made, so every layer's buffer grows exactly as it would have."""
    reserve_rows(cache)
    for lo in range(0, hit.rows, chunk_tokens):
        hi = lo + chunk_tokens
        for layer, k, v in zip(cache.layers, hit.keys, hit.values, strict=True):
            layer.update(k[:, :, lo:hi], v[:, :, lo:hi])


class PrefixCachedTarget:
    """A :class:`~speculation.model.target.TargetModel` whose prefills reuse ``cache`` (a
    ``TargetBackend`` for the solo loop: everything but :meth:`prefill` is the target's own).

    One per client stream in a benchmark (each method keeps its own conversation, so its cache
    sees what a server serving that conversation would); a server may share one across requests,
    since reuse never changes a bit (module docstring)."""

    def __init__(self, target: TargetModel, cache: PrefixCache) -> None:
        check_reusable(reserve_rows(DynamicCache(config=target.model.config)), type(target.model).__name__)
        self.target = target
        self.cache = cache
        self.eos_token_ids = target.eos_token_ids

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        self.target.check_fits(prompt_len, max_new_tokens)

    def prefill(
        self, ids: list[int], need_aux: bool = False, chunk_tokens: int | None = None
    ) -> tuple[TargetState, torch.Tensor, torch.Tensor | None]:
        """``TargetModel.prefill`` on the cache's grid, after the longest cached prefix of ``ids``;
        the prompt's full chunks are stored for later prompts. ``chunk_tokens`` must be the grid."""
        if chunk_tokens != self.cache.chunk_tokens:
            raise ConfigError(
                f"prefix_cache reuses rows on a {self.cache.chunk_tokens}-token prefill grid: "
                f"prefill_chunk_tokens must be {self.cache.chunk_tokens}, got {chunk_tokens}"
            )
        hit = self.cache.lookup(ids, need_aux)
        state, logits, aux = self.target.prefill(ids, need_aux=need_aux, chunk_tokens=chunk_tokens, reuse=hit)
        self.cache.store(ids, state.cache.layers, aux)
        return state, logits, aux

    def decode(self, state: TargetState, token: int) -> torch.Tensor:
        return self.target.decode(state, token)

    def verify(self, state: TargetState, tree: DraftTree, need_aux: bool = False) -> TreeForward:
        return self.target.verify(state, tree, need_aux=need_aux)

    def commit(self, state: TargetState, tree: DraftTree, accepted: list[int]) -> None:
        self.target.commit(state, tree, accepted)

    def truncate(self, state: TargetState, length: int) -> None:
        self.target.truncate(state, length)

    def release(self, state: TargetState) -> None:
        self.target.release(state)
