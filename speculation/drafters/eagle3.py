"""EAGLE-3 drafter behind the :class:`~speculation.drafters.base.Drafter` protocol.

Per request (ALGORITHMS.md section 3, "Inference drafting and dynamic tree"):

* ``begin`` stores the prompt's pairs ``(f_i, x_{i+1})``, i = 0..n-1: the target's fused aux
  features at token i and the next token (the last pair carries the pending root).
* ``observe`` stores the newly committed pairs: aux at the accepted nodes (root first) paired with
  the accepted tokens after them and the bonus token.
* ``propose`` (1) encodes the pending pairs in one drafter forward, appending their keys/values to
  the drafter's KV cache (only committed context lives there), then (2) grows the dynamic tree:
  ``depth`` forwards over the k beam tokens, each beam item fed with its parent's output y at RoPE
  position ``n + level - 1`` and attending to the committed cache plus its own ancestors (tree
  keys sit in scratch rows after the committed ones and are overwritten next step), and (3)
  reranks the pool to ``total_tokens - 1`` nodes (:mod:`speculation.drafters.candidate_pool`).

``Proposal.drafter_forwards`` = 1 (encode) + ``depth``. Weights can be replaced between steps with
:meth:`Eagle3Drafter.load_state_dict` (loads into a copy, then swaps the reference); the drafter
keeps the aux history, so the next ``propose`` re-encodes the context with the new weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from speculation.config import Eagle3Config
from speculation.cost import VerifyCostModel
from speculation.drafters.base import DraftContext, Proposal, StopRule
from speculation.drafters.checkpoint import CHECKPOINT_ROOT, EAGLE3, load_for_target
from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model
from speculation.drafters.candidate_pool import CandidatePool
from speculation.drafters.draft_kv import DraftKVCache
from speculation.drafters.feature_pairs import FeaturePairsDrafter
from speculation.drafters.head import untrained_head
from speculation.target import TargetModel

__all__ = ["CHECKPOINT_ROOT", "Eagle3Drafter", "build_eagle3_drafter", "random_model"]


class Eagle3Drafter(FeaturePairsDrafter):
    """EAGLE-3 dynamic-tree drafter (see the module docstring).

    Args:
        config: tree knobs (``total_tokens``, ``depth``, ``top_k``).
        model: the draft network, in the dtype it should run in.
        embed_weight: ``[V, H]`` the target's input embedding (shared, frozen, never copied).
    """

    name = "eagle3"

    def __init__(self, config: Eagle3Config, model: Eagle3Model, embed_weight: torch.Tensor) -> None:
        self.config = config
        self._init_pairs(model, embed_weight)
        self.cache = self._new_cache()
        self._last_y: torch.Tensor | None = None  # [H]
        self._last_logp: torch.Tensor | None = None  # [N_d] fp32

    @property
    def arch(self) -> Eagle3Arch:
        return self.model.arch

    def _new_cache(self) -> DraftKVCache:
        a = self.model.arch
        return DraftKVCache(a.num_kv_heads, a.head_dim, self.dtype)

    def _reset_cache(self, new: bool) -> None:
        if new:
            self.cache = self._new_cache()
        self.cache.length = 0

    # ------------------------------------------------------------------ protocol
    def propose(self, ctx: DraftContext) -> Proposal:
        tree, forwards, _ = self.draft(ctx, self.config.total_tokens - 1)
        return Proposal(tree=tree, drafter_forwards=forwards)

    def _grow_pool(self, stop: StopRule | None) -> tuple[CandidatePool, int, int]:
        """Beam expansion; ``stop(levels, beam cumulative log-probs [k])`` is asked before each
        expansion (dynamic-depth pruning). Returns (pool, expansion forwards, levels drafted)."""
        pool, expansions = self._grow(stop)
        return pool, expansions, expansions + 1

    # ------------------------------------------------------------------ internals
    def _encode(self, tokens: list[int]) -> None:
        """One forward over the pending pairs ``(f_i, x_{i+1})``, i in [encoded, n_pairs)."""
        m = self.model
        n0, n1 = self._encoded, self._n_pairs
        g = m.fuse(self._aux[n0:n1])[None]  # [1, P, H]
        e = self._embed(torch.tensor(tokens[n0 + 1 : n1 + 1], dtype=torch.long))[None]  # [1, P, H]
        pos = torch.arange(n0, n1)
        q, k, v = m.qkv(e, g, pos)  # [1, nh, P, hd], [1, nkv, P, hd] x2
        self.cache.ensure(n1 + self.config.top_k * self.config.depth)
        self.cache.write(n0, k, v)
        keys, values = self.cache.view(n1)
        # Only the last pair's output is needed (it predicts the first draft level); the last
        # query sees every committed row, so no mask is needed.
        attn = F.scaled_dot_product_attention(q[:, :, -1:], keys, values, enable_gqa=True)  # [1, nh, 1, hd]
        y = m.finish(g[:, -1:], attn.transpose(1, 2).reshape(1, 1, -1))  # [1, 1, H]
        self._last_y = y[0, 0]
        self._last_logp = torch.log_softmax(m.logits(self._last_y).float(), dim=-1)
        self._encoded = n1
        self.cache.length = n1

    def _grow(self, stop: StopRule | None = None) -> tuple[CandidatePool, int]:
        """Beam expansion over up to ``depth`` levels; returns the pool and the expansions run."""
        cfg, m = self.config, self.model
        n = self._encoded
        assert self._last_logp is not None and self._last_y is not None
        k = min(cfg.top_k, self.arch.draft_vocab_size)
        self.cache.ensure(n + k * cfg.depth)
        pool = CandidatePool()
        beam_score, beam_tok = self._last_logp.topk(k)  # [k], [k]
        pool.add_level(beam_tok, beam_score, torch.full((k,), -1, dtype=torch.long))
        beam_pool = torch.arange(k)  # pool index of each beam item
        beam_hidden = self._last_y.expand(k, -1)  # [k, H]: the parent's output
        anc = torch.zeros(k, k * cfg.depth, dtype=torch.bool)  # ancestor-or-self over scratch rows
        anc[:, :k] = torch.eye(k, dtype=torch.bool)
        rows = torch.arange(k)
        expansions = 0
        for level in range(cfg.depth):
            if stop is not None and stop(level + 1, beam_score):
                break
            expansions += 1
            width = (level + 1) * k
            e = self._embed(self._draft_ids[beam_tok])[None]  # [1, k, H]
            q, kk, vv = m.qkv(e, beam_hidden[None], torch.full((k,), n + level, dtype=torch.long))
            self.cache.write(n + level * k, kk, vv)
            keys, values = self.cache.view(n + width)
            mask = torch.ones(k, n + width, dtype=torch.bool)
            mask[:, n:] = anc[:, :width]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            y = m.finish(beam_hidden[None], attn.transpose(1, 2).reshape(1, k, -1))[0]  # [k, H]
            logp = torch.log_softmax(m.logits(y).float(), dim=-1)  # [k, N_d]
            child_lp, child_tok = logp.topk(k, dim=-1)  # [k, k]
            child_score = beam_score[:, None] + child_lp  # [k, k]
            start = pool.add_level(child_tok, child_score, beam_pool.repeat_interleave(k))
            if level == cfg.depth - 1:
                break
            flat = child_score.reshape(-1)
            sel = flat.topk(k).indices  # [k] over k*k candidates
            parent = sel // k
            beam_tok = child_tok.reshape(-1)[sel]
            beam_score = flat[sel]
            beam_hidden = y[parent]
            beam_pool = start + sel
            anc = anc[parent].clone()
            anc[rows, width + rows] = True
        return pool, expansions


# ---------------------------------------------------------------------- construction
def random_model(target: Any, draft_vocab_size: int, seed: int = 0) -> Eagle3Model:
    """An untrained head for ``target``: random layer, draft vocabulary = the first N_d token ids,
    LM head initialised from the target's output rows of those ids."""
    arch = Eagle3Arch.from_target_config(target.model.config, target.vocab_size, draft_vocab_size)
    return untrained_head(Eagle3Model, arch, target, seed)


def build_eagle3_drafter(
    config: Eagle3Config, target: Any, cost_model: VerifyCostModel | None = None
) -> Eagle3Drafter:
    """An :class:`Eagle3Drafter` for an in-process target (a :class:`TargetModel`).

    ``cost_model`` is not used: the tree size is the config's (``Eagle3Config.verify_curve_size`` is 0).
    """
    if not isinstance(target, TargetModel):
        raise ValueError("the eagle3 drafter needs an in-process target (its embeddings and config)")
    dtype = target.dtype
    if config.checkpoint == Eagle3Config.RANDOM:
        model = random_model(target, config.draft_vocab_size, config.seed)
    else:
        model = load_for_target(config.checkpoint, target, EAGLE3)
    embed = target.model.get_input_embeddings().weight.detach()
    return Eagle3Drafter(config, model.to(dtype), embed)
