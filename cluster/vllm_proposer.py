"""graftblock's retrieval drafter as a vLLM v1 ``custom_class`` proposer (imports vLLM; runs in .venv-vllm).

    LLM(model=..., speculative_config={"method": "custom_class",
        "model": "cluster.vllm_proposer.RetrievalProposer", "num_speculative_tokens": K})

vLLM v1 verifies token chains, so each request proposes the best path of the retrieval
drafter's tree (:class:`~speculation.drafters.retrieval_chain.RetrievalChainProposer`). vLLM
hands the proposer its persistent batch by row; a row's state is kept until the row's text stops
extending what that row proposed after (a finished request whose row is reused starts afresh).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.config import VllmConfig

from speculation.config import RetrievalConfig
from speculation.drafters.retrieval_chain import RetrievalChainProposer


class RetrievalProposer:
    """``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]`` for vLLM."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.config = RetrievalConfig(max_depth=max(RetrievalConfig.max_depth, self.k), cost_aware=False)
        self.rows: dict[int, RetrievalChainProposer] = {}

    def load_model(self, target_model: torch.nn.Module) -> None:
        """vLLM's CPU runner hands every drafter the target here; retrieval needs no weights."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: object = None,
    ) -> list[list[int]]:
        """One chain per batch row: ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` is row i's text.

        Rows that sampled nothing this step (still prefilling) or reached the context limit get
        an empty chain, as vLLM's own n-gram proposer does.
        """
        chains: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                chains.append([])
                continue
            row = self.rows.get(i)
            if row is None:
                row = self.rows[i] = RetrievalChainProposer(self.config, self.vocab_size, self.k)
            chain = row.propose(token_ids_cpu[i, :n].tolist())
            chains.append(chain[: self.max_model_len - n])
        return chains
