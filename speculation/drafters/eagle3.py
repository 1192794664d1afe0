"""EAGLE-3 drafter behind the :class:`~speculation.drafters.base.Drafter` protocol.

Per request (docs/algorithms.md §3, "Inference drafting and dynamic tree"):

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

Batched drafting (:class:`~speculation.drafters.base.BatchStagedDrafter`): drafters sharing one
network propose together, ONE forward for the encode of every row and one per tree level for the
rows still growing (per-row context lengths are padded and masked, :func:`batch_view`); the solo
``propose`` is the batch of one.

``Proposal.drafter_forwards`` = 1 (encode) + ``depth``. Weights can be replaced between steps with
:meth:`Eagle3Drafter.load_state_dict` (loads into a copy, then swaps the reference); the drafter
keeps the aux history, so the next ``propose`` re-encodes the context with the new weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from speculation.config import Eagle3Config
from speculation.policy.cost import VerifyCost
from speculation.drafters.base import StopRule
from speculation.drafters.checkpoint import CHECKPOINT_ROOT, EAGLE3, load_for_target
from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model
from speculation.drafters.candidate_pool import CandidatePool
from speculation.drafters.draft_kv import DraftKVCache, batch_view, length_mask
from speculation.drafters.feature_pairs import FeaturePairsDrafter, count_forward, shared_network
from speculation.drafters.head import untrained_head
from speculation.model.target import TargetModel

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

    # ------------------------------------------------------------------ batched internals
    @classmethod
    def _encode_batch(cls, drafters: Sequence[FeaturePairsDrafter], tokens: Sequence[list[int]]) -> None:
        """One forward over every row's pending pairs ``(f_i, x_{i+1})``, i in [encoded, n_pairs).

        Rows are padded to the longest pending run P; row b's keys/values go to its own cache at
        rows ``[encoded_b, n_pairs_b)``; only its last pair's output is kept (it predicts the first
        draft level), attending to the row's committed rows (a length mask over the padded batch).
        """
        ds = [cast(Eagle3Drafter, d) for d in drafters]
        m, cfg = ds[0].model, ds[0].config
        B, H = len(ds), m.arch.hidden_size
        n0 = [d._encoded for d in ds]
        n1 = [d._n_pairs for d in ds]
        P = max(b - a for a, b in zip(n0, n1))
        aux = ds[0]._aux.new_zeros(B, P, 3 * H)  # [B, P, 3H], zero padded
        ids = torch.zeros(B, P, dtype=torch.long)
        pos = torch.zeros(B, P, dtype=torch.long)
        for b, (d, a, e) in enumerate(zip(ds, n0, n1)):
            aux[b, : e - a] = d._aux[a:e]
            ids[b, : e - a] = torch.tensor(tokens[b][a + 1 : e + 1], dtype=torch.long)
            pos[b, : e - a] = torch.arange(a, e)
        g = m.fuse(aux)  # [B, P, H]
        q, k, v = m.qkv(ds[0]._embed(ids), g, pos)  # [B, nh, P, hd], [B, nkv, P, hd] x2
        count_forward(m)
        for b, (d, a, e) in enumerate(zip(ds, n0, n1)):
            d.cache.ensure(e + cfg.top_k * cfg.depth)
            d.cache.write(a, k[b : b + 1, :, : e - a], v[b : b + 1, :, : e - a])
            d.cache.length = e
        keys, values, N = batch_view([d.cache for d in ds], n1, 0)
        last = torch.tensor([e - a - 1 for a, e in zip(n0, n1)])  # [B] the last pending pair of each row
        rows = torch.arange(B)
        q_last = q[rows, :, last][:, :, None]  # [B, nh, 1, hd]
        # the last query sees every committed row of its own sequence (padding masked out)
        mask = None if min(n1) == N else length_mask(n1, N)[:, None, None, :]  # [B, 1, 1, N]
        attn = F.scaled_dot_product_attention(q_last, keys, values, attn_mask=mask, enable_gqa=True)  # [B, nh, 1, hd]
        y = m.finish(g[rows, last][:, None], attn.transpose(1, 2).reshape(B, 1, -1))[:, 0]  # [B, H]
        logp = torch.log_softmax(m.logits(y).float(), dim=-1)  # [B, N_d]
        for b, d in enumerate(ds):
            d._last_y, d._last_logp = y[b], logp[b]
            d._encoded = n1[b]

    @classmethod
    def _grow_batch(
        cls, drafters: Sequence[FeaturePairsDrafter], stops: Sequence[StopRule | None]
    ) -> list[tuple[CandidatePool, int, int]]:
        """Beam expansion over up to ``depth`` levels for B rows at once: level l is ONE forward
        over the k beam items of every row still growing. Row b's tree keys sit in the shared
        scratch rows ``N + l*k .. N + (l+1)*k`` of the padded batch (:func:`batch_view`; N = the
        longest committed context) and its queries see its committed rows plus their ancestors.
        ``stops[b](levels, beam cumulative log-probs [k])`` is asked before each expansion
        (dynamic-depth pruning); a stopped row leaves the batch. Per row: (pool, expansions,
        levels drafted = expansions + 1)."""
        ds = [cast(Eagle3Drafter, d) for d in drafters]
        cfg, m = ds[0].config, ds[0].model
        B, H = len(ds), m.arch.hidden_size
        n = torch.tensor([d._encoded for d in ds])  # [B]
        k = min(cfg.top_k, m.arch.draft_vocab_size)
        kbuf, vbuf, N = batch_view([d.cache for d in ds], n.tolist(), k * cfg.depth)
        committed = length_mask(n.tolist(), N)  # [B, N]
        pools = [CandidatePool() for _ in ds]
        beam_score, beam_tok = torch.stack([cast(torch.Tensor, d._last_logp) for d in ds]).topk(k)  # [B, k] x2
        for pool, sc, tok in zip(pools, beam_score, beam_tok):
            pool.add_level(tok, sc, torch.full((k,), -1, dtype=torch.long))
        beam_pool = torch.arange(k).repeat(B, 1)  # [B, k] pool index of each beam item
        beam_hidden = torch.stack([cast(torch.Tensor, d._last_y) for d in ds])[:, None].expand(B, k, H)  # [B, k, H]
        anc = torch.zeros(B, k, k * cfg.depth, dtype=torch.bool)  # ancestor-or-self over scratch rows
        anc[:, :, :k] = torch.eye(k, dtype=torch.bool)
        live = list(range(B))  # rows of ``ds`` still growing, in batch order
        expansions = [0] * B
        rows = torch.arange(k)
        for level in range(cfg.depth):
            keep = [i for i, b in enumerate(live) if stops[b] is None or not stops[b](level + 1, beam_score[i])]
            if not keep:
                break
            if len(keep) < len(live):  # some rows stopped: the batch shrinks to the others
                idx = torch.tensor(keep)
                live = [live[i] for i in keep]
                n, committed, kbuf, vbuf = n[idx], committed[idx], kbuf[idx], vbuf[idx]
                beam_score, beam_tok, beam_pool, beam_hidden, anc = (
                    beam_score[idx], beam_tok[idx], beam_pool[idx], beam_hidden[idx], anc[idx])
            Bl = len(live)
            for b in live:
                expansions[b] += 1
            width = (level + 1) * k
            e = ds[0]._embed(ds[0]._draft_ids[beam_tok])  # [Bl, k, H]
            q, kk, vv = m.qkv(e, beam_hidden, (n + level)[:, None].expand(Bl, k))
            count_forward(m)
            kbuf[:, :, N + level * k : N + width] = kk
            vbuf[:, :, N + level * k : N + width] = vv
            mask = torch.cat((committed[:, None, :].expand(Bl, k, N), anc[:, :, :width]), dim=2)[:, None]  # [Bl, 1, k, N+w]
            attn = F.scaled_dot_product_attention(q, kbuf[:, :, : N + width], vbuf[:, :, : N + width],
                                                  attn_mask=mask, enable_gqa=True)  # [Bl, nh, k, hd]
            y = m.finish(beam_hidden, attn.transpose(1, 2).reshape(Bl, k, -1))  # [Bl, k, H]
            logp = torch.log_softmax(m.logits(y).float(), dim=-1)  # [Bl, k, N_d]
            child_lp, child_tok = logp.topk(k, dim=-1)  # [Bl, k, k]
            child_score = beam_score[:, :, None] + child_lp  # [Bl, k, k]
            start = torch.tensor([pools[b].add_level(child_tok[i], child_score[i], beam_pool[i].repeat_interleave(k))
                                  for i, b in enumerate(live)])  # [Bl]
            if level == cfg.depth - 1:
                break
            flat = child_score.reshape(Bl, -1)  # [Bl, k*k]
            sel = flat.topk(k, dim=-1).indices  # [Bl, k]
            parent = sel // k
            beam_tok = child_tok.reshape(Bl, -1).gather(1, sel)
            beam_score = flat.gather(1, sel)
            beam_hidden = y.gather(1, parent[:, :, None].expand(Bl, k, H))
            beam_pool = start[:, None] + sel
            anc = anc.gather(1, parent[:, :, None].expand(Bl, k, anc.shape[-1])).clone()
            anc[:, rows, width + rows] = True
        return [(pool, x, x + 1) for pool, x in zip(pools, expansions)]


# ---------------------------------------------------------------------- construction
def random_model(target: Any, draft_vocab_size: int, seed: int = 0) -> Eagle3Model:
    """An untrained head for ``target``: random layer, draft vocabulary = the first N_d token ids,
    LM head initialised from the target's output rows of those ids."""
    arch = Eagle3Arch.from_target_config(target.model.config, target.vocab_size, draft_vocab_size)
    return untrained_head(Eagle3Model, arch, target, seed)


def build_eagle3_drafter(
    config: Eagle3Config, target: Any, cost_model: VerifyCost | None = None
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
    model = shared_network(model.to(dtype))  # equal weights, one network: the engine batches its forwards
    embed = target.model.get_input_embeddings().weight.detach()
    return Eagle3Drafter(config, model, embed)
