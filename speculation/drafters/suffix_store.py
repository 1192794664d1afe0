"""SuffixDecoding's cross-request store (arXiv 2411.04975): earlier requests' outputs as drafts.

The per-request :class:`~speculation.drafters.retrieval.SuffixIndex` sees only the current
prompt and output. Agents, code assistants and templated traffic repeat whole spans *across*
requests (the same tool-call JSON, the same test boilerplate), so the store keeps the outputs
(optionally also the prompts) of finished requests, shared by every sequence of a batched engine
or a serving replica.

Index. Each stored document ``d`` is an int32 array; for every position ``i >= n - 1`` the
``n``-gram ``d[i-n+1 .. i]`` (``n = key_len``; keyed by its hash, one int per distinct n-gram)
maps to the *continuation position* ``(d, i+1)``.
A lookup for a context ``x`` takes the positions under its last ``n``-gram, most recent first (at
most ``max_positions``), extends each match backwards to its true length (a hash collision measures below ``n`` and is
dropped)

    L(p) = max{ l <= max_match_len : d[p-l .. p-1] == x[-l ..] },

keeps the positions with the longest ``L* = max_p L(p)`` (the node of the longest matched suffix,
as in a suffix tree), and counts their continuations into a :class:`CountTrie`, so candidate
``c`` after the match scores ``count(c) / count(match)``: SuffixDecoding's frequency statistics.

Adaptive depth. A longer match is more likely to continue: the continuations are cut at
``depth(L*) = min(max_depth, ceil(depth_factor * L*))`` tokens (SuffixDecoding's
``alpha * p`` speculation length).

Memory bound and eviction. When the stored tokens exceed ``max_tokens`` whole documents are
evicted, lowest score first, until the store holds at most ``max_tokens``:

    score(d) = (1 + hits(d)) * exp(-age(d) / D)

``hits(d)``: steps in which a drafted token from ``d`` was accepted; ``age(d)``: documents added
since ``d`` was added or last hit; ``D``: documents stored. A new document scores 1; a frequently
useful one outlives many newer ones; an unused one fades with the traffic that followed it
(recency and frequency, LRFU-style). Evicted positions are dropped lazily at lookup and swept
when they outnumber the live ones.

Safety. The store only proposes draft tokens; the target verifies every one, so what it holds
never changes any verified output. All methods take one lock, so sequences of a batched engine
or the threads of a serving replica may share it; an update is visible to later lookups only.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speculation.config import ConfigError
from speculation.drafters.count_trie import TRIE_ROOT, CountTrie

_DOC_SHIFT = 32  # a position is doc_id << 32 | offset


@dataclass(frozen=True)
class StoreMatch:
    """A store lookup: the longest matched length L*, its continuations' count trie (rooted at
    node 0, cut at ``depth(L*)`` tokens), and the documents they came from (for :meth:`credit`)."""

    length: int
    trie: CountTrie
    docs: tuple[int, ...]


@dataclass
class _Doc:
    tokens: np.ndarray  # [len] int32
    hits: int
    last_seen: int  # the store's document clock at insertion or last hit


class SuffixStore:
    """Cross-request suffix store with a token budget (see the module docstring for the formulas).

    Args:
        max_tokens: stored tokens kept at most (the memory bound). Range [1, 10**9].
        key_len: n of the n-gram index; the shortest match the store proposes from. Range [1, 16].
        max_match_len: longest match measured (backwards). Range [key_len, 256].
        depth_factor: alpha of ``depth(L) = ceil(alpha * L)``. Range (0, 64].
        max_positions: positions examined per lookup, most recent first. Range [1, 4096].
    """

    def __init__(self, max_tokens: int, key_len: int = 3, max_match_len: int = 32,
                 depth_factor: float = 2.0, max_positions: int = 64) -> None:
        _check("max_tokens", max_tokens, 1, 10**9)
        _check("key_len", key_len, 1, 16)
        _check("max_match_len", max_match_len, key_len, 256)
        if not (isinstance(depth_factor, (int, float)) and 0 < depth_factor <= 64):
            raise ConfigError(f"suffix_store.depth_factor must be in (0, 64], got {depth_factor!r}")
        _check("max_positions", max_positions, 1, 4096)
        self.max_tokens = max_tokens
        self.key_len = key_len
        self.max_match_len = max_match_len
        self.depth_factor = float(depth_factor)
        self.max_positions = max_positions
        self._docs: dict[int, _Doc] = {}
        self._keys: dict[int, array] = {}  # hash(n-gram) -> continuation positions ('q'), oldest first
        self._next_id = 0
        self._tokens = 0  # live stored tokens
        self._dead = 0  # index entries that point into evicted documents
        self._entries = 0  # index entries, live and dead
        self.evicted_docs = 0
        self.lookups = 0
        self.matched = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- updates
    def add(self, tokens: Sequence[int]) -> int | None:
        """Store one finished request's tokens; returns its document id (None if shorter than
        ``key_len + 1``: nothing to continue). Evicts to stay within ``max_tokens``."""
        n = self.key_len
        if len(tokens) <= n:
            return None
        arr = np.asarray(tokens, dtype=np.int32)[-self.max_tokens:]  # [len]
        with self._lock:
            doc = self._next_id
            self._next_id += 1
            self._docs[doc] = _Doc(arr, hits=0, last_seen=doc)
            self._tokens += len(arr)
            seq = arr.tolist()
            base = doc << _DOC_SHIFT
            keys = self._keys
            for i in range(n - 1, len(seq) - 1):
                key = hash(tuple(seq[i - n + 1 : i + 1]))
                slot = keys.get(key)
                if slot is None:
                    slot = keys[key] = array("q")
                slot.append(base | (i + 1))
            self._entries += len(seq) - n
            self._evict()
            return doc if doc in self._docs else None

    def credit(self, docs: Sequence[int]) -> None:
        """A drafted token from these documents was accepted: count a hit, reset their age."""
        with self._lock:
            now = self._next_id
            for d in docs:
                entry = self._docs.get(d)
                if entry is not None:
                    entry.hits += 1
                    entry.last_seen = now

    def _score(self, entry: _Doc) -> float:
        age = self._next_id - entry.last_seen
        return (1 + entry.hits) * math.exp(-age / max(1, len(self._docs)))

    def _evict(self) -> None:
        if self._tokens <= self.max_tokens:
            return
        for doc in sorted(self._docs, key=lambda d: (self._score(self._docs[d]), d)):
            entry = self._docs.pop(doc)
            self._tokens -= len(entry.tokens)
            self._dead += max(0, len(entry.tokens) - self.key_len)
            self.evicted_docs += 1
            if self._tokens <= self.max_tokens:
                break
        if self._dead > self._entries - self._dead:
            self._sweep()

    def _sweep(self) -> None:
        """Drop every index entry into an evicted document (amortised: runs when dead > live)."""
        live = self._docs
        for key in list(self._keys):
            kept = array("q", (p for p in self._keys[key] if (p >> _DOC_SHIFT) in live))
            if kept:
                self._keys[key] = kept
            else:
                del self._keys[key]
        self._entries -= self._dead
        self._dead = 0

    # ---------------------------------------------------------------- lookup
    def depth_for(self, match_len: int, max_depth: int) -> int:
        """``min(max_depth, ceil(depth_factor * match_len))``."""
        return max(1, min(max_depth, math.ceil(self.depth_factor * match_len)))

    def lookup(self, context: Sequence[int], max_depth: int) -> StoreMatch | None:
        """Continuations of the longest stored match of ``context``'s suffix (None: no match of
        ``key_len`` tokens)."""
        n = self.key_len
        if len(context) < n:
            return None
        with self._lock:
            self.lookups += 1
            slot = self._keys.get(hash(tuple(context[-n:])))
            if not slot:
                return None
            tail = list(context[-self.max_match_len:])[::-1]  # [<= M] the context, newest first
            best, found = 0, []
            examined = 0
            for pos in reversed(slot):  # newest first: recency breaks ties in the cap
                entry = self._docs.get(pos >> _DOC_SHIFT)
                if entry is None:
                    continue
                off = pos & ((1 << _DOC_SHIFT) - 1)
                length = _match_back(entry.tokens, off, tail)
                if length < n:  # a hash collision: not an occurrence of the n-gram
                    continue
                if length > best:
                    best, found = length, [(entry, pos >> _DOC_SHIFT, off)]
                elif length == best:
                    found.append((entry, pos >> _DOC_SHIFT, off))
                examined += 1
                if examined >= self.max_positions:
                    break
            if not found:
                return None
            depth = self.depth_for(best, max_depth)
            trie = CountTrie()
            docs: dict[int, None] = {}
            for entry, doc, off in found:
                cont = entry.tokens[off : off + depth].tolist()
                if not cont:
                    continue
                trie.count[TRIE_ROOT] += 1
                node = TRIE_ROOT
                for t in cont:
                    node = trie.bump(node, t)
                docs[doc] = None
            if not trie.total[TRIE_ROOT]:
                return None
            self.matched += 1
            return StoreMatch(best, trie, tuple(docs))

    # ---------------------------------------------------------------- reporting
    def stats(self) -> dict[str, float]:
        """Documents, tokens, index entries and keys held; evictions; lookups and the share that matched;
        ``bytes``: the token arrays plus the index's position arrays (payload, no interpreter overhead)."""
        with self._lock:
            payload = sum(e.tokens.nbytes for e in self._docs.values())
            payload += sum(a.itemsize * len(a) for a in self._keys.values())
            return {
                "docs": len(self._docs),
                "tokens": self._tokens,
                "keys": len(self._keys),
                "entries": self._entries - self._dead,
                "evicted_docs": self.evicted_docs,
                "lookups": self.lookups,
                "match_rate": self.matched / self.lookups if self.lookups else 0.0,
                "hits": sum(e.hits for e in self._docs.values()),
                "payload_bytes": payload,
            }

    def __len__(self) -> int:
        return self._tokens


def _match_back(doc: np.ndarray, off: int, tail_rev: list[int]) -> int:
    """Length of the common suffix of ``doc[:off]`` and the context (``tail_rev``: newest first)."""
    k = min(off, len(tail_rev))
    if k == 0:
        return 0
    window = doc[off - k : off][::-1]  # [k] newest first
    diff = np.flatnonzero(window != np.asarray(tail_rev[:k], dtype=np.int32))
    return int(diff[0]) if len(diff) else k


def _check(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"suffix_store.{name} must be an integer in [{lo}, {hi}], got {value!r}")
