"""Training-free retrieval drafter: suffix matching + a token-transition table.

Three candidate sources feed one best-first tree builder:

1. **Suffix index** over prompt + generated text (SuffixDecoding style). A trie holds every
   substring of length <= ``D = max_match_len + max_depth`` with its occurrence count. Appending
   a token costs O(D): the nodes of all suffixes ending at the previous token are extended by it.
   Those same nodes are the current context's matches, so lookup is free; the cost per step never
   grows with the context length.
2. **Datastore** (optional, REST style): a corpus suffix array (:class:`SuffixArrayDatastore`);
   the continuations of the longest matched context suffix form a small count trie.
   **Cross-request store** (optional, SuffixDecoding style, ``store_tokens > 0``): earlier
   requests' outputs (:class:`~speculation.drafters.suffix_store.SuffixStore`), shared by the
   drafters of one engine; its longest match's continuations form a count trie the same way,
   cut at a depth that grows with the match length.
3. **Transition table** ``A[u] = top-k successors of token u`` (Token Recycling): after every
   verification, ``A[token_i]`` is overwritten with the target's top-k at tree node i (rejected
   nodes included), and prompts seed it with their bigrams. Graft reuses this table.

Tree building: best-first over estimated path probabilities ``P(child) = P(parent) * p`` with

* trie children:   ``p = (count(child) / sum of sibling counts) * conf[l]``, where ``l`` is the
  effective match length (context match + depth below it) and ``conf[l]`` is the measured rate at
  which such candidates were accepted when tested (one ``conf`` per source: the request's own
  index and datastore share one, the cross-request store has its own);
* table children:  ``p = conf_rank[j]`` for the j-th successor, measured the same way.

A candidate is *tested* when its parent was accepted; the per-bucket rates are exponential
moving averages over tested candidates, so the scores stay calibrated to this model and data.
The builder stops at ``budget`` nodes or ``max_depth``.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from speculation.config import ConfigError, RetrievalConfig
from speculation.policy.cost import OnlineCostModel, VerifyCost, online
from speculation.drafters.base import DraftContext, Proposal, StepOutcome
from speculation.drafters.suffix_store import StoreMatch, SuffixStore
from speculation.spec.tree import DraftTree, NodeSource
from speculation.drafters.count_trie import TRIE_ROOT as _TRIE_ROOT, CountTrie


class SuffixIndex:
    """Counts of every substring of length <= ``depth`` of a growing token sequence.

    ``active[k]`` is the node (of :attr:`trie`) of the suffix of length ``k + 1`` ending at the
    last token, so ``active`` doubles as the list of context matches, shortest first.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.trie = CountTrie()
        self.active: list[int] = []
        self.length = 0

    def append(self, token: int) -> None:
        """Extend every live suffix by ``token`` (O(depth))."""
        trie = self.trie
        trie.count[_TRIE_ROOT] += 1
        self.active = [trie.bump(node, token) for node in (_TRIE_ROOT, *self.active[: self.depth - 1])]
        self.length += 1

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def matches(self, min_len: int, max_len: int, path: Sequence[int] = ()) -> list[tuple[int, int]]:
        """(match length, node of :attr:`trie`) for suffixes of ``context + path`` with a recorded
        continuation, longest first (``path``: draft tokens after the last indexed token; nothing
        is inserted).

        Advancing along ``path`` costs O(depth) per token: the suffix of length k+2 ending at the
        new token is the child of the suffix of length k+1, and if a suffix never occurred no
        longer one did either, so the live list stays contiguous from length 1.
        """
        trie = self.trie
        active = self.active
        for tok in path:
            moved: list[int] = []
            for node in (_TRIE_ROOT, *active[: self.depth - 1]):
                nxt = trie.child(node, tok)
                if nxt is None:
                    break
                moved.append(nxt)
            active = moved
        out = []
        for k in range(min(max_len, len(active)) - 1, min_len - 2, -1):
            node = active[k]
            if trie.total[node]:
                out.append((k + 1, node))
        return out


class SuffixArrayDatastore:
    """A static corpus indexed by a suffix array over fixed-width windows (REST style).

    Args:
        tokens: ``[N]`` int32 corpus token ids (documents separated by any token, e.g. EOS).
        match_len: window width W; the longest context suffix looked up.
        max_continuations: matched positions sampled per lookup.
    """

    def __init__(self, tokens: np.ndarray, match_len: int, max_continuations: int = 64) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.match_len = match_len
        self.max_continuations = max_continuations
        n = len(self.tokens)
        pad = np.full(match_len, -1, dtype=np.int32)
        padded = np.concatenate([self.tokens, pad])
        windows = np.lib.stride_tricks.sliding_window_view(padded, match_len)[:n]  # [N, W]
        # lexsort sorts by the last key first: feed columns W-1..0 so column 0 is primary.
        self.order = np.lexsort(windows.T[::-1]).astype(np.int64)  # [N]
        self._windows = windows

    @classmethod
    def load(cls, path: str | Path, match_len: int) -> "SuffixArrayDatastore":
        return cls(np.load(path), match_len)

    def _bound(self, query: list[int], upper: bool) -> int:
        lo, hi = 0, len(self.order)
        q = tuple(query)
        k = len(query)
        while lo < hi:
            mid = (lo + hi) // 2
            w = tuple(self._windows[self.order[mid], :k].tolist())
            if w < q or (upper and w == q):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def lookup(self, context: list[int], min_len: int, max_depth: int) -> tuple[int, CountTrie] | None:
        """Longest suffix of ``context`` (>= min_len) found in the corpus -> (length, count trie of
        its continuations, rooted at node 0)."""
        for k in range(min(self.match_len, len(context)), min_len - 1, -1):
            query = context[-k:]
            lo = self._bound(query, upper=False)
            hi = self._bound(query, upper=True)
            if hi <= lo:
                continue
            starts = self.order[lo:hi]
            if len(starts) > self.max_continuations:
                starts = starts[:: max(1, len(starts) // self.max_continuations)][: self.max_continuations]
            trie = CountTrie()
            for s in starts.tolist():
                node = _TRIE_ROOT
                trie.count[_TRIE_ROOT] += 1
                for t in self.tokens[s + k : s + k + max_depth].tolist():
                    node = trie.bump(node, t)
            if trie.total[_TRIE_ROOT]:
                return k, trie
        return None


class TransitionTable:
    """Likely successors per token, updated online (Token Recycling, plus a second order).

    * ``table[u]``: dense ``[V, k]`` int32 rows, -1 = empty; the target's top-k after token u.
    * ``pairs[(t, u)]``: the target's top-k after the two tokens (t, u), kept for the most
      recent ``max_pairs`` pairs. A pair row is more specific, so it is preferred when present.
    """

    def __init__(self, vocab_size: int, topk: int, max_pairs: int = 200_000) -> None:
        self.topk = topk
        self.table = np.full((vocab_size, topk), -1, dtype=np.int32)
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.max_pairs = max_pairs

    def successors(self, prev: int | None, token: int, width: int) -> tuple[list[int], bool]:
        """(successors of ``token`` after ``prev``, whether the second-order row was used)."""
        row = self.pairs.get((prev, token)) if prev is not None else None
        if row is not None:
            return row[:width], True
        return [t for t in self.table[token, :width].tolist() if t >= 0], False

    def recycle(self, tokens: list[int], prev_tokens: list[int | None], topk_ids: torch.Tensor) -> None:
        """``A[tokens[i]] = topk_ids[i]`` and ``pairs[(prev_tokens[i], tokens[i])] = topk_ids[i]``."""
        ids = topk_ids[:, : self.topk].to(torch.int32).cpu().numpy()
        self.table[np.asarray(tokens, dtype=np.int64)] = ids
        rows = ids.tolist()
        for prev, tok, row in zip(prev_tokens, tokens, rows):
            if prev is None:
                continue
            key = (prev, tok)
            self.pairs.pop(key, None)  # re-insert: dict order is recency order
            self.pairs[key] = row
        while len(self.pairs) > self.max_pairs:
            del self.pairs[next(iter(self.pairs))]

    def seed_bigrams(self, tokens: list[int]) -> None:
        """Put each observed successor first in its predecessor's row (the rest shift right)."""
        for u, v in zip(tokens[:-1], tokens[1:]):
            row = self.table[u]
            if row[0] == v:
                continue
            keep = [t for t in row.tolist() if t != v][: self.topk - 1]
            row[:] = [v, *keep, *([-1] * (self.topk - 1 - len(keep)))]


class _Kind(enum.IntEnum):
    """Candidate source inside the retrieval drafter (for calibration)."""

    SUFFIX = 0
    TABLE = 1
    STORE = 2  # the cross-request suffix store


@dataclass
class _Rate:
    """Exponential moving average of a success rate, started from a prior."""

    value: float
    decay: float = 0.995

    def update(self, success: bool) -> None:
        self.value = self.decay * self.value + (1.0 - self.decay) * float(success)


_MAX_BUCKET = 8  # effective match lengths >= this share one calibration bucket


class RetrievalDrafter:
    """Suffix-index + datastore + store + transition-table drafter behind the :class:`Drafter` protocol.

    Args:
        config: the drafter's knobs.
        vocab_size: the target's vocabulary size (rows of the transition table).
        cost_model: the target's measured verify curve c(T); required when ``config.cost_aware``
            (each tree is then cut to the size c(T) favours), ignored otherwise.
        store: the cross-request suffix store to share (:func:`new_store` builds one per engine);
            None with ``config.store_tokens > 0`` gives this drafter its own, which still spans
            every request it drafts for (a solo loop reuses one drafter).
    """

    name = "retrieval"
    needs_aux = False

    def __init__(self, config: RetrievalConfig, vocab_size: int, cost_model: VerifyCost | None = None,
                 store: SuffixStore | None = None) -> None:
        if config.cost_aware and cost_model is None:
            raise ConfigError(
                "retrieval.cost_aware is true but no verify-cost model c(T) was given: build the drafter with "
                "speculation.drafters.build_drafter (it measures c(T) on the target), or set cost_aware: false"
            )
        self.config = config
        self.cost_model: VerifyCost | None = online(cost_model) if config.cost_aware else None
        """The c(T) each tree is cut by (a measured one corrected by the solo loop's live verify times,
        :meth:`observe_verify`); None when ``cost_aware`` is false."""
        self.target_topk = config.transition_topk
        self.table = TransitionTable(vocab_size, config.transition_topk) if config.transition_topk else None
        self.datastore = (
            SuffixArrayDatastore.load(config.datastore, config.datastore_match_len) if config.datastore else None
        )
        # Priors: longer matches are more reliable; lower-ranked successors less so.
        self.suffix_conf = [_Rate(min(0.9, 0.3 + 0.1 * b)) for b in range(_MAX_BUCKET + 1)]
        # Table ranks: buckets 0..k-1 for first-order rows, k..2k-1 for second-order rows.
        k = max(1, config.transition_topk)
        self.rank_conf = [_Rate(0.35 / (1 + j)) for j in range(k)] + [_Rate(0.5 / (1 + j)) for j in range(k)]
        self.store = store if store is not None else new_store(config)
        self.store_conf = [_Rate(min(0.9, 0.3 + 0.1 * b)) for b in range(_MAX_BUCKET + 1)]
        self._store_docs: tuple[int, ...] = ()  # documents the last propose drafted from
        self._store_match = 0
        self._last_hit: StoreMatch | None = None  # the last build_tree's store match
        self.index = SuffixIndex(config.max_match_len + config.max_depth)
        self._full: tuple[DraftTree, list[tuple[_Kind, int] | None]] = (DraftTree(0), [None])
        self._skipped = False  # the last step was sat out (skip): observe leaves the index behind

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None = None) -> None:
        self.index = SuffixIndex(self.config.max_match_len + self.config.max_depth)
        self.index.extend(ctx.tokens)
        if self.table is not None:
            self.table.seed_bigrams(ctx.tokens[: ctx.prompt_len])

    def propose(self, ctx: DraftContext) -> Proposal:
        self._skipped = False
        self._sync(ctx.tokens)
        tree, meta = self.build_tree(ctx.tokens, self.config.budget)
        hit = self._last_hit  # this tree's store match (Graft's anchored lookups come later)
        self._store_docs, self._store_match = (hit.docs, hit.length) if hit is not None else ((), 0)
        self._full = (tree, meta)
        if self.cost_model is not None and len(tree) > 1:
            # Nodes were added best-first (decreasing path probability, parents first), so
            # nodes 1..n form the best tree of n drafts; keep the n the verify curve favours.
            n = self.cost_model.best_prefix([math.exp(s) for s in tree.scores[1:]], context=len(ctx.tokens))
            if n < len(tree) - 1:
                tree = tree.subtree(range(n + 1))
        if self.store is None:
            return Proposal(tree=tree, drafter_forwards=0)
        from_store = sum(1 for m in meta[1 : len(tree)] if m is not None and m[0] == _Kind.STORE)
        return Proposal(tree=tree, drafter_forwards=0,
                        stats={"store_match_len": float(self._store_match), "store_nodes": float(from_store)})

    def finish(self, ctx: DraftContext, output: list[int]) -> None:
        """Put the finished request into the store (:class:`~speculation.drafters.base.FinishingDrafter`):
        its output, or prompt + output with ``store_prompts``."""
        if self.store is None:
            return
        prompt = ctx.tokens[: ctx.prompt_len] if self.config.store_prompts else []
        self.store.add([*prompt, *output])

    def report(self) -> dict:
        """The cross-request store's counters (:class:`~speculation.drafters.base.Reportable`); {} without one."""
        return {"suffix_store": self.store.stats()} if self.store is not None else {}

    def observe_verify(self, size: int, context: int, seconds: float) -> None:
        """Correct c(T) by one live verify (:class:`~speculation.drafters.base.VerifyTimed`)."""
        if isinstance(self.cost_model, OnlineCostModel):
            self.cost_model.observe(size, context, seconds)

    def skip(self, ctx: DraftContext) -> None:
        """Sit out a step (:class:`~speculation.drafters.base.SkippableDrafter`): nothing was
        proposed, so ``observe`` calibrates nothing and does not index the new tokens either; the
        index catches up at the next ``propose`` (about 0.4 ms per token at depth 28 on this host,
        so a sequence that sits out its remaining steps never pays it)."""
        self._full = (DraftTree(ctx.root_token), [None])
        self._skipped = True

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        # Calibrate on the full (uncut) tree: the target's emitted tokens (accepted + bonus) are
        # the true continuation, so every candidate whose parent lies on it was effectively
        # tested, whether or not the cost model let it be verified.
        full, meta = self._full
        truth = [*outcome.accepted_tokens[1:], outcome.bonus_token]
        rates_of = {_Kind.SUFFIX: self.suffix_conf, _Kind.TABLE: self.rank_conf, _Kind.STORE: self.store_conf}
        cur = 0
        store_hit = False
        for tok in truth:
            for c in full.children(cur):
                if meta[c] is not None:
                    kind, bucket = meta[c]
                    rates_of[kind][bucket].update(full.tokens[c] == tok)
            nxt = full.child(cur, tok)
            if nxt is None:
                break
            store_hit |= meta[nxt] is not None and meta[nxt][0] == _Kind.STORE
            cur = nxt
        if store_hit and self.store is not None:
            self.store.credit(self._store_docs)
        if self.table is not None and outcome.target_topk is not None:
            tree = outcome.tree
            root_prev = ctx.tokens[-len(outcome.accepted) - 2] if len(ctx.tokens) > len(outcome.accepted) + 1 else None
            prev = [root_prev] + [tree.tokens[p] for p in tree.parents[1:]]
            self.table.recycle(tree.tokens, prev, outcome.target_topk)
        if not self._skipped:
            self._sync(ctx.tokens)

    # ------------------------------------------------------------------ tree building
    def _sync(self, tokens: list[int]) -> None:
        if self.index.length < len(tokens):
            self.index.extend(tokens[self.index.length :])

    def continuations(self, tokens: list[int], path: list[int], budget: int) -> DraftTree:
        """Retrieved continuations of ``tokens + path`` (an *anchored* retrieval for Graft).

        ``tokens`` is the committed context (already indexed: ``propose`` ran this step), ``path``
        the draft tokens of an anchor node below the root (empty = the root itself). The suffix
        index is matched on ``tokens + path`` without inserting the path, the datastore is looked up
        on it, and the transition table continues from the path's last two tokens. The result is
        rooted at the anchor's token; node scores are calibrated log path probabilities *given the
        anchor* (add the anchor's own log probability to put them on the root's scale).
        """
        self._sync(tokens)
        context = [*tokens, *path]
        matches = self.index.matches(self.config.min_match_len, self.config.max_match_len, path)
        tree, _ = self.build_tree(context, budget, matches=matches)
        return tree

    def build_tree(
        self,
        tokens: list[int],
        budget: int,
        root_node: int = 0,
        tree: DraftTree | None = None,
        matches: list[tuple[int, int]] | None = None,
    ) -> tuple[DraftTree, list[tuple[_Kind, int] | None]]:
        """Best-first tree of at most ``budget`` new nodes under ``root_node`` of ``tree``.

        ``tokens`` is the context whose last token is the root's token; ``matches`` its suffix
        matches as (length, node of ``self.index.trie``) (default: the index's matches of the
        committed context). Returns the tree and, per node index, the (source kind, calibration
        bucket) of retrieval nodes.
        """
        cfg = self.config
        if matches is None:
            matches = self.index.matches(cfg.min_match_len, cfg.max_match_len)
        if tree is None:
            tree = DraftTree(tokens[-1])
        meta: list[tuple[_Kind, int] | None] = [None] * len(tree)
        # entries: (-log p, tie-break, parent, token, kind, bucket, (trie, trie node) or None)
        heap: list[tuple[float, int, int, int, _Kind, int, tuple[CountTrie, int] | None]] = []
        counter = 0

        def push_trie(parent: int, logp: float, trie: CountTrie, node: int, eff_len: int,
                      kind: _Kind = _Kind.SUFFIX) -> None:
            """Queue ``node``'s top children: p(child) = count(child) / total(node) * conf(bucket)."""
            nonlocal counter
            bucket = min(eff_len, _MAX_BUCKET)
            conf = (self.store_conf if kind == _Kind.STORE else self.suffix_conf)[bucket].value
            total = trie.total[node]
            for tok in trie.top(node):
                child = cast(int, trie.child(node, tok))
                p = trie.count[child] / total * conf
                if p < cfg.min_token_prob:
                    continue
                counter += 1
                heapq.heappush(heap, (-(logp + math.log(p)), counter, parent, tok, kind, bucket, (trie, child)))

        def push_table(parent: int, logp: float, prev: int | None, token: int) -> None:
            nonlocal counter
            if self.table is None or not cfg.transition_fill:
                return
            succ, second_order = self.table.successors(prev, token, cfg.transition_width)
            offset = self.table.topk if second_order else 0
            for j, tok in enumerate(succ):
                j += offset
                p = self.rank_conf[j].value
                if p < cfg.min_token_prob:
                    continue
                counter += 1
                heapq.heappush(heap, (-(logp + math.log(p)), counter, parent, tok, _Kind.TABLE, j, None))

        base_logp = tree.scores[root_node]
        for match_len, node in matches[:3]:
            push_trie(root_node, base_logp, self.index.trie, node, match_len)
        if self.datastore is not None:
            found = self.datastore.lookup(tokens, cfg.min_match_len, cfg.max_depth)
            if found is not None:
                push_trie(root_node, base_logp, found[1], _TRIE_ROOT, found[0])
        self._last_hit = None
        if self.store is not None:
            hit = self._last_hit = self.store.lookup(tokens, cfg.max_depth)
            if hit is not None:
                push_trie(root_node, base_logp, hit.trie, _TRIE_ROOT, hit.length, _Kind.STORE)
        root_prev = (
            tree.tokens[tree.parents[root_node]] if root_node > 0 else (tokens[-2] if len(tokens) > 1 else None)
        )
        push_table(root_node, base_logp, root_prev, tree.tokens[root_node])

        root_depth = tree.depths[root_node]
        added = 0
        while heap and added < budget:
            neg_logp, _, parent, tok, kind, bucket, trie_child = heapq.heappop(heap)
            if tree.child(parent, tok) is not None:
                continue  # a better-scored candidate already took this slot
            idx = tree.add(parent, tok, -neg_logp, NodeSource.RETRIEVAL)
            meta.append((kind, bucket))
            added += 1
            if tree.depths[idx] - root_depth >= cfg.max_depth:
                continue
            if trie_child is not None and trie_child[0].total[trie_child[1]]:
                push_trie(idx, -neg_logp, trie_child[0], trie_child[1], bucket + 1, kind)
            push_table(idx, -neg_logp, tree.tokens[parent], tok)
        return tree, meta


def new_store(config: RetrievalConfig) -> SuffixStore | None:
    """The cross-request store ``config`` asks for (None when ``store_tokens`` is 0): build one per
    engine or replica and pass it to every drafter it builds."""
    if not config.store_tokens:
        return None
    return SuffixStore(config.store_tokens, key_len=config.store_key_len,
                       max_match_len=max(config.store_key_len, 32), depth_factor=config.store_depth_factor)
