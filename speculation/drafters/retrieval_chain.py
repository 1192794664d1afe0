"""The retrieval drafter as a *chain* proposer, for engines that verify token chains only (vLLM v1).

Each step builds the retrieval drafter's best-first tree and proposes its best path: from the
root, repeatedly the child with the highest estimated path probability ``P(child)`` (children
never outscore their parent, so this is the most probable path of every length), cut to ``k``
tokens. The engine's committed text is the only feedback: the tokens appended since the last
proposal are the accepted drafts plus the bonus token, which calibrates the drafter exactly as
:meth:`RetrievalDrafter.observe` does in graftblock's own loop. Without the target's top-k at
every node, the transition table learns from committed text instead (greedy decoding commits
the target's top-1, so a committed bigram is the first entry that recycling would have written).

The proposer is pure Python over token lists, so it is tested without vLLM; the vLLM adapter is
``cluster/vllm_proposer.py``.
"""

from __future__ import annotations

from speculation.config import ConfigError, RetrievalConfig
from speculation.drafters.base import DraftContext, StepOutcome
from speculation.drafters.retrieval import RetrievalDrafter
from speculation.spec.tree import DraftTree


def best_path(tree: DraftTree, k: int) -> list[int]:
    """Node indices of the best path below the root, at most ``k`` long (root excluded)."""
    path: list[int] = []
    node = 0
    while len(path) < k:
        kids = tree.children(node)
        if not kids:
            break
        node = max(kids, key=lambda c: tree.scores[c])
        path.append(node)
    return path


class RetrievalChainProposer:
    """One request's retrieval drafter behind ``propose(tokens) -> chain``.

    ``tokens`` is the request's committed text (prompt included, the last token not yet verified
    in the engine's sense: the chain continues after it). A call whose ``tokens`` do not extend
    the previous call's by 1..k+1 tokens starts a new request.
    """

    def __init__(self, config: RetrievalConfig, vocab_size: int, k: int) -> None:
        if k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        if config.max_depth < k:
            raise ConfigError(f"retrieval.max_depth ({config.max_depth}) must be >= num_speculative_tokens ({k})")
        self.config = config
        self.vocab_size = vocab_size
        self.k = k
        self.drafter = RetrievalDrafter(config, vocab_size)
        self.tokens: list[int] = []
        self.prompt_len = 0
        self.tree = DraftTree(0)  # the last proposed tree (no cost model is set, so it is the full tree)
        self.chain: list[int] = []  # node indices in ``tree`` of the last chain

    def _continues(self, tokens: list[int]) -> bool:
        grown = len(tokens) - len(self.tokens)
        return bool(self.tokens) and 1 <= grown <= self.k + 1 and tokens[: len(self.tokens)] == self.tokens

    def propose(self, tokens: list[int]) -> list[int]:
        """The next chain of at most ``k`` draft tokens after ``tokens``."""
        if self._continues(tokens):
            self._observe(tokens)
        else:
            self.drafter = RetrievalDrafter(self.config, self.vocab_size)
            self.prompt_len = len(tokens)
            self.drafter.begin(DraftContext(list(tokens), self.prompt_len))
        self.tokens = list(tokens)
        proposal = self.drafter.propose(DraftContext(self.tokens, self.prompt_len))
        self.tree = proposal.tree
        self.chain = best_path(self.tree, self.k)
        return [self.tree.tokens[n] for n in self.chain]

    def _observe(self, tokens: list[int]) -> None:
        """Feed the drafter what the engine committed since the last chain (accepted + bonus)."""
        new = tokens[len(self.tokens):]
        tree = self.tree
        accepted = [0]
        for node, tok in zip(self.chain, new[:-1]):
            if tree.tokens[node] != tok:
                break
            accepted.append(node)
        outcome = StepOutcome(
            tree=tree,
            accepted=accepted,
            accepted_tokens=[self.tokens[-1], *new[:-1]],
            bonus_token=new[-1],
        )
        self.drafter.observe(DraftContext(tokens, self.prompt_len), outcome)
        if self.drafter.table is not None:
            self.drafter.table.seed_bigrams(tokens[len(self.tokens) - 1:])
