"""Dynamic draft trees (EAGLE-2/3): the candidate pool, beam selection and the final rerank.

A draft with beam width k grows a *pool* level by level:

* level 1: the top-k tokens of the root's draft distribution, score ``s = log q``;
* level l+1: every beam item b of level l proposes its top-k children with
  ``s_child = s_b + log q(child | path to b)``; all k^2 children join the pool and the top-k of
  them by score become the next beam.

With ``depth`` expansions (drafter forwards after the first) the pool holds
``k + depth * k^2`` nodes over ``depth + 1`` levels. The final tree keeps the best
``budget = total_tokens - 1`` pool nodes by score. Because ``log q <= 0`` a child never
outscores its parent, and a stable sort on ``-s`` puts every parent (lower pool index) before its
children at equal scores, so the kept set is closed under ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculation.spec.tree import DraftTree, NodeSource


@dataclass
class CandidatePool:
    """Candidates of one drafting step, appended level by level (parents before children).

    Per level: ``tokens`` ``[m]`` draft ids, ``scores`` ``[m]`` cumulative log-probs, ``parents``
    ``[m]`` pool index of the parent (-1 = the root).
    """

    tokens: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    parents: list[torch.Tensor] = field(default_factory=list)
    size: int = 0

    def add_level(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> int:
        """Append one level; returns the pool index of its first node."""
        start = self.size
        self.tokens.append(tokens.reshape(-1))
        self.scores.append(scores.reshape(-1).float())
        self.parents.append(parents.reshape(-1))
        self.size += tokens.numel()
        return start


def select_top(pool: CandidatePool, budget: int) -> list[int]:
    """Pool indices of the ``budget`` best nodes by score, ancestor-closed, in ascending order."""
    scores = torch.cat(pool.scores)  # [P]
    n = min(budget, scores.numel())
    order = torch.sort(-scores, stable=True).indices[:n]
    return sorted(order.tolist())


def build_draft_tree(
    root_token: int, pool: CandidatePool, keep: list[int], draft_to_target: torch.Tensor
) -> DraftTree:
    """A :class:`DraftTree` of the kept pool nodes, tokens mapped to target ids.

    Args:
        root_token: the pending root (target id).
        keep: ascending, ancestor-closed pool indices (from :func:`select_top`).
        draft_to_target: ``[N_d]`` target id of each draft id.
    """
    tokens = torch.cat(pool.tokens)
    targets = draft_to_target[tokens[keep]].tolist() if keep else []
    scores = torch.cat(pool.scores)[keep].tolist() if keep else []
    parents = torch.cat(pool.parents)[keep].tolist() if keep else []
    tree = DraftTree(root_token)
    node_of: dict[int, int] = {-1: 0}
    for idx, tok, sc, par in zip(keep, targets, scores, parents):
        parent_node = node_of.get(par)
        if parent_node is None:  # cannot happen for ancestor-closed input; stay safe
            continue
        node_of[idx] = tree.add(parent_node, tok, sc, NodeSource.DRAFTER)
    return tree

