"""A count trie over token sequences in flat int lists (the suffix index's, the datastore's and
the cross-request store's candidate structure)."""

from __future__ import annotations

_TOP_CHILDREN = 4  # continuations kept per trie node, by count: the only ones ever proposed
TRIE_ROOT = 0  # node id of a CountTrie's root (the empty substring)


class CountTrie:
    """A count trie in flat int lists: node ids are ints (0 = the root), nothing per node is a
    Python object.

    Per node ``n``: ``count[n]`` (occurrences of the substring ending at n), ``total[n]`` (the sum
    of its children's counts) and ``top(n)`` (up to ``_TOP_CHILDREN`` child tokens, most frequent
    first, maintained incrementally so proposing never scans all children). The edge
    ``(n, token) -> child`` is one entry of an int-to-int dict keyed ``n << 32 | token``.

    Why flat: a node-object trie holds about three garbage-collected objects per node, i.e. per
    indexed token times the depth. Sixteen 300-token contexts at depth 14 added ~380k objects,
    and every full collection then walked them all (0.27-0.38 s each, a stall of two batched
    steps at N = 16). Here the collector tracks three int lists whatever the trie's size (the
    int-to-int dict is not tracked at all), and walking a list of ints is a C loop.
    """

    _SHIFT = 32

    def __init__(self) -> None:
        self.count: list[int] = [0]
        self.total: list[int] = [0]
        self._top: list[int] = [-1] * _TOP_CHILDREN  # [nodes * _TOP_CHILDREN], -1 = empty
        self._edges: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.count)

    def child(self, node: int, token: int) -> int | None:
        return self._edges.get(node << self._SHIFT | token)

    def top(self, node: int) -> list[int]:
        """The most frequent child tokens of ``node``, most frequent first."""
        base = node * _TOP_CHILDREN
        return [t for t in self._top[base : base + _TOP_CHILDREN] if t >= 0]

    def bump(self, node: int, token: int) -> int:
        """Count one more occurrence of ``token`` after ``node``; return the child (O(1))."""
        key = node << self._SHIFT | token
        child = self._edges.get(key)
        count = self.count
        if child is None:
            child = len(count)
            count.append(0)
            self.total.append(0)
            self._top.extend(_EMPTY_TOP)
            self._edges[key] = child
        count[child] += 1
        self.total[node] += 1
        top, edges, shift = self._top, self._edges, self._SHIFT
        base = node * _TOP_CHILDREN
        i = -1
        for j in range(base, base + _TOP_CHILDREN):
            t = top[j]
            if t == token:
                i = j
                break
            if t < 0:  # a free slot: the token was not listed
                top[j] = token
                i = j
                break
        if i < 0:  # listed children are full: replace the last if this one is now more frequent
            last = base + _TOP_CHILDREN - 1
            if count[child] <= count[edges[node << shift | top[last]]]:
                return child
            top[last] = token
            i = last
        while i > base and count[edges[node << shift | top[i - 1]]] < count[child]:
            top[i - 1], top[i] = top[i], top[i - 1]
            i -= 1
        return child


_EMPTY_TOP = (-1,) * _TOP_CHILDREN
