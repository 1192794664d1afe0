"""Draft trees: flat, parents-first arrays of candidate tokens.

A :class:`DraftTree` with N+1 nodes stores, for every node i,

* ``tokens[i]``  -- the candidate token id,
* ``parents[i]`` -- the parent's index, with ``parents[i] < i`` (node 0 is the root: the last
  verified token, not yet in the target's KV cache; ``parents[0] = -1``),
* ``depths[i]``  -- ``depths[parents[i]] + 1``, ``depths[0] = 0``,
* ``scores[i]``  -- the proposer's log-score of the path root..i (cumulative log-probability for
  model drafters, log of the count ratio for retrieval),
* ``sources[i]`` -- which proposer put the node there (:class:`NodeSource`).

Siblings are unique by token: adding a child whose token already hangs under the same parent
returns the existing node (and keeps the higher score). That is what makes "merge duplicate
siblings" hold by construction, and it keeps greedy acceptance single-path.

The ancestor-or-self mask is ``A[i] = A[parents[i]] | e_i`` (docs/algorithms.md §1); the RoPE
position of node i over a committed prefix of length n is ``n + depths[i]``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

ROOT = 0


class NodeSource(enum.IntEnum):
    """Who proposed a node; kept per node so acceptance can be attributed."""

    ROOT = 0
    DRAFTER = 1
    RETRIEVAL = 2


@dataclass(frozen=True)
class TreeTensors:
    """Tensors the target needs for one tree forward.

    Attributes:
        tokens: ``[T]`` int64 token ids, node order.
        depths: ``[T]`` int64 depth of each node (root = 0).
        ancestor_mask: ``[T, T]`` bool, ``[i, j]`` true iff j is an ancestor of i or j == i.
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor


class DraftTree:
    """A growable draft tree. Build it with :meth:`add` / :meth:`attach`; read it as arrays."""

    __slots__ = ("tokens", "parents", "depths", "scores", "sources", "_children")

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.scores: list[float] = [0.0]
        self.sources: list[NodeSource] = [NodeSource.ROOT]
        # children[i]: token -> node index, in insertion order (the fixed sibling order).
        self._children: list[dict[int, int]] = [{}]

    # ------------------------------------------------------------------ building
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def root_token(self) -> int:
        return self.tokens[ROOT]

    def child(self, node: int, token: int) -> int | None:
        """Index of ``node``'s child carrying ``token``, or None."""
        return self._children[node].get(token)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in insertion (sibling) order."""
        return list(self._children[node].values())

    def add(self, parent: int, token: int, score: float, source: NodeSource) -> int:
        """Add ``token`` under ``parent`` and return its index.

        A sibling with the same token is merged: the existing node is returned, its score becomes
        the max of both, and its source tag is kept (the first proposer owns the node).
        """
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} is not a node of a tree with {len(self)} nodes")
        existing = self._children[parent].get(token)
        if existing is not None:
            if score > self.scores[existing]:
                self.scores[existing] = float(score)
            return existing
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(float(score))
        self.sources.append(NodeSource(source))
        self._children.append({})
        self._children[parent][int(token)] = idx
        return idx

    def add_chain(
        self,
        parent: int,
        tokens: Sequence[int],
        scores: Sequence[float],
        source: NodeSource,
        max_new_nodes: int | None = None,
    ) -> int:
        """Hang ``tokens`` as a chain under ``parent``, descending through existing equal children.

        Returns the number of *new* nodes created. Stops once ``max_new_nodes`` new nodes exist.
        """
        created = 0
        cur = parent
        for tok, sc in zip(tokens, scores):
            nxt = self._children[cur].get(int(tok))
            if nxt is None:
                if max_new_nodes is not None and created >= max_new_nodes:
                    break
                nxt = self.add(cur, int(tok), sc, source)
                created += 1
            cur = nxt
        return created

    def attach(
        self,
        node: int,
        subtree: "DraftTree",
        max_new_nodes: int | None = None,
        score_offset: float = 0.0,
    ) -> list[int]:
        """Attach ``subtree`` (whose root stands for ``node``) under ``node``, merging duplicates.

        The subtree's root token is ignored: it *is* ``node``. Subtree nodes are visited in their
        own order (parents first), so ancestors are always placed before descendants; a node is
        skipped when its parent was not placed (budget exhausted). Sources are preserved, scores
        are shifted by ``score_offset``.

        Returns a map ``placed[j]`` = index in this tree of subtree node j (``-1`` if not placed).
        """
        placed = [-1] * len(subtree)
        placed[ROOT] = node
        created = 0
        for j in range(1, len(subtree)):
            parent_here = placed[subtree.parents[j]]
            if parent_here < 0:
                continue
            existing = self._children[parent_here].get(subtree.tokens[j])
            if existing is None:
                if max_new_nodes is not None and created >= max_new_nodes:
                    continue
                created += 1
            placed[j] = self.add(
                parent_here, subtree.tokens[j], subtree.scores[j] + score_offset, subtree.sources[j]
            )
        return placed

    # ------------------------------------------------------------------ reading
    def path(self, node: int) -> list[int]:
        """Node indices root..node inclusive."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def follow(self, tokens: Iterable[int]) -> list[int]:
        """Nodes root..n matched by walking ``tokens`` down from the root (the greedy acceptance of
        a known continuation): ``[0]`` when the first token is not a child of the root."""
        accepted = [0]
        for tok in tokens:
            child = self.child(accepted[-1], tok)
            if child is None:
                break
            accepted.append(child)
        return accepted

    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self._children[i]]

    def max_depth(self) -> int:
        return max(self.depths)

    def count_source(self, source: NodeSource) -> int:
        return sum(1 for s in self.sources if s == source)

    def ancestor_mask(self) -> torch.Tensor:
        """``[T, T]`` bool; row i = row parents[i] with bit i set (parents come first)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    def to_tensors(self) -> TreeTensors:
        return TreeTensors(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            depths=torch.tensor(self.depths, dtype=torch.long),
            ancestor_mask=self.ancestor_mask(),
        )

    def retrieve_paths(self) -> list[list[int]]:
        """Root-to-leaf node-index paths, one per leaf (EAGLE's ``retrieve`` without padding)."""
        return [self.path(leaf) for leaf in self.leaves()]

    # ------------------------------------------------------------------ reshaping
    def pruned_to(self, budget: int) -> "DraftTree":
        """The best ``budget`` non-root nodes by score, closed under ancestors, as a new tree.

        Nodes are taken in descending score; a node is added together with its missing ancestors
        if they all fit (docs/algorithms.md §4, tree growth step 5). Node order in the result keeps the
        original (parents-first) order, so sibling order is stable.
        """
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if len(self) - 1 <= budget:
            return self
        keep = [False] * len(self)
        keep[ROOT] = True
        kept = 0
        order = sorted(range(1, len(self)), key=lambda i: -self.scores[i])
        for i in order:
            if kept >= budget:
                break
            if keep[i]:
                continue
            missing = []
            j = i
            while not keep[j]:
                missing.append(j)
                j = self.parents[j]
            if kept + len(missing) <= budget:
                for m in missing:
                    keep[m] = True
                kept += len(missing)
        return self.subtree(i for i in range(len(self)) if keep[i])

    def subtree(self, nodes: Iterable[int]) -> "DraftTree":
        """A new tree with the given ancestor-closed node set (root included), original order."""
        out = DraftTree(self.tokens[ROOT])
        remap = {ROOT: ROOT}
        for i in sorted(set(nodes)):
            if i == ROOT:
                continue
            p = self.parents[i]
            if p not in remap:
                raise ValueError(f"node set is not ancestor-closed: node {i} lacks parent {p}")
            remap[i] = out.add(remap[p], self.tokens[i], self.scores[i], self.sources[i])
        return out

    def __repr__(self) -> str:
        return f"DraftTree(nodes={len(self)}, depth={self.max_depth()})"
