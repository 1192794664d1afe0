"""SpecBlock drafter behind the :class:`~speculation.drafters.base.Drafter` protocol.

Per request (ALGORITHMS.md section 4):

* ``begin``/``observe`` store the committed pairs ``(f_i, x_{i+1})`` exactly as EAGLE-3 does
  (aux at the accepted nodes paired with the tokens after them and the bonus token: the
  training-consistent pairing).
* ``propose``:

  1. **Encode + block 1.** One forward over the pending anchors, K_c slots each (K_c = the
     checkpoint's K); their keys/values at every layer join the *cross cache* at rows
     ``i * K_c + k`` (query (i, k) sees all K_c slots of anchors j < i and slots k' <= k of its
     own anchor: the context training exposed). The last anchor is the root's pair; its first K
     outputs (K = ``block_size`` <= K_c) are block 1 of this step's tree. Slot k depends only on
     slots <= k of its own anchor, so drafting K < K_c slots is exact.
  2. **Widths.** Slot k's width ``W_k`` (tokens drafted there) is ``slot_widths[r_k]`` for the
     rank head's class r_k (``top_k`` with the rank head off); slot 0 takes ``beam``; with
     ``adaptive_widths`` confident slots are capped (p0 >= .9/.8/.6 -> 3/5/8; p >= .95/.85 -> 2/3).
     ``W_k = 0`` ends the chain at slot k: the give-up class does so with the default widths
     (2, 4, 6, 0), and slot 0 of block 1 never does.
  3. **Block 1 tree.** Greedy g_k hangs under g_{k-1} (g_0 under the root) with score
     ``S_k = sum_{j<=k} log q_j(g_j)``; ranks 2..W_k are siblings of g_k scored
     ``S_{k-1} + log q_k``. g_k and its siblings become *pending leaves* where ``W_k > 1``, and
     g_{K-1} always does (unless the block gave up).
  4. **Blocks 2..max_blocks (cross-block inheritance).** The best
     ``min(beam, max(1, (N - nodes) // K))`` pending leaves run in one batched forward: each
     starts a block with condition ``RMSNorm_c(d)`` of the slot it came from and its own token,
     at the root anchor's RoPE positions, attending to the cross cache of anchors before the
     root (all K_c slots each), its *TTT cache* (the inherited slots' keys of every earlier block:
     slots <= the slot it came from) and its own slots <= k; it runs K slots. Each leaf appends a
     greedy chain plus alternatives at every slot; new pending leaves inherit the TTT cache plus
     this block's keys.
  5. **Rerank** the pool to ``total_tokens - 1`` nodes by cumulative log-prob
     (:mod:`speculation.drafters.candidate_pool`; children never outscore parents).

``Proposal.drafter_forwards`` = 1 (encode + block 1) + the later blocks run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from speculation.config import SpecBlockConfig
from speculation.cost import VerifyCostModel
from speculation.drafters.base import DraftContext, Proposal, StopRule
from speculation.drafters.checkpoint import SPECBLOCK, load_for_target
from speculation.drafters.candidate_pool import CandidatePool
from speculation.drafters.draft_kv import DraftKVCache
from speculation.drafters.feature_pairs import FeaturePairsDrafter
from speculation.drafters.head import untrained_head
from speculation.drafters.specblock_model import RankClass, SpecBlockArch, SpecBlockModel
from speculation.target import TargetModel

SLOT0_CAPS = ((0.9, 3), (0.8, 5), (0.6, 8))
"""Adaptive width of slot 0: ``(p0 threshold, cap)``, first match wins."""
SLOT_CAPS = ((0.95, 2), (0.85, 3))
"""Adaptive width of slots >= 1: ``(p threshold, cap)``, first match wins."""


def slot_widths(
    config: SpecBlockConfig, classes: torch.Tensor, top_prob: torch.Tensor, first_slot_is_root: bool
) -> list[int]:
    """Width W_k per slot of one block (module docstring, step 2).

    Args:
        classes: ``[K]`` rank classes r_k (ignored when ``config.rank_head`` is False).
        top_prob: ``[K]`` draft probability of the greedy token p_k.
        first_slot_is_root: slot 0 hangs under the root (block 1): it takes ``beam``.
    """
    out = []
    for k, (r, p) in enumerate(zip(classes.tolist(), top_prob.tolist())):
        w = config.slot_widths[int(r)] if config.rank_head else config.top_k
        caps = SLOT_CAPS
        if k == 0 and first_slot_is_root:
            w, caps = config.beam, SLOT0_CAPS
        if config.adaptive_widths and w > 0:
            for threshold, cap in caps:
                if p >= threshold:
                    w = min(w, cap)
                    break
        out.append(w)
    return out


@dataclass
class PendingLeaf:
    """A node a later block can start from.

    Attributes:
        node: its pool index; token: its draft id; score: its cumulative log-prob.
        cond: ``[H]`` the slot output d it inherits; ttt: key columns (cache rows) it may attend.
    """

    node: int
    token: int
    score: float
    cond: torch.Tensor
    ttt: list[int]


class SpecBlockDrafter(FeaturePairsDrafter):
    """SpecBlock block drafter (see the module docstring).

    Args:
        config: tree knobs.
        model: the draft network, in the dtype it should run in.
        embed_weight: ``[V, H]`` the target's input embedding (shared, frozen).
    """

    name = "specblock"

    def __init__(self, config: SpecBlockConfig, model: SpecBlockModel, embed_weight: torch.Tensor) -> None:
        if config.block_size > model.arch.block_size:
            raise ValueError(
                f"specblock.block_size = {config.block_size} exceeds the checkpoint's K = {model.arch.block_size}"
            )
        self.config = config
        self._init_pairs(model, embed_weight)
        self.caches = self._new_caches()
        self._block1: torch.Tensor | None = None  # [K, H] root anchor's block-1 outputs

    @property
    def arch(self) -> SpecBlockArch:
        return self.model.arch

    @property
    def K(self) -> int:
        """Slots drafted per block (the config's, at most the checkpoint's)."""
        return self.config.block_size

    @property
    def Kc(self) -> int:
        """Slots per anchor in the cross cache: the checkpoint's K (what training exposed)."""
        return self.model.arch.block_size

    def _new_caches(self) -> list[DraftKVCache]:
        a = self.model.arch
        return [DraftKVCache(a.num_kv_heads, a.head_dim, self.dtype, capacity=1024) for _ in range(a.num_layers)]

    def _reset_cache(self, new: bool) -> None:
        if new:
            self.caches = self._new_caches()
        for c in self.caches:
            c.length = 0

    # ------------------------------------------------------------------ protocol
    def propose(self, ctx: DraftContext) -> Proposal:
        tree, forwards, levels = self.draft(ctx, self.config.total_tokens - 1)
        return Proposal(tree=tree, drafter_forwards=forwards, stats={"blocks": float(levels // self.K)})

    def _grow_pool(self, stop: StopRule | None) -> tuple[CandidatePool, int, int]:
        """Block by block; ``stop(levels, pending-leaf scores)`` is asked before each later block.
        Returns (pool, later-block forwards, levels drafted = blocks x K)."""
        pool, blocks = self._grow(stop)
        return pool, blocks - 1, blocks * self.K

    # ------------------------------------------------------------------ internals
    def _encode(self, tokens: list[int]) -> None:
        """Block 1 at the pending anchors [encoded, n_pairs); all their K_c slots join the cross cache."""
        m, Kc = self.model, self.Kc  # all the checkpoint's slots, even when fewer are drafted
        n0, n1 = self._encoded, self._n_pairs
        P = n1 - n0
        cond = m.condition_from_aux(self._aux[n0:n1])[None]  # [1, P, H]
        emb = self._embed(torch.tensor(tokens[n0 + 1 : n1 + 1], dtype=torch.long))[None]  # [1, P, H]
        anchors = torch.arange(n0, n1)
        pos = anchors[:, None] + 1 + torch.arange(Kc)  # [P, Kc]
        # new rows (i, k) see every committed row before anchor n0, then (j, k') with j < i or
        # (j == i and k' <= k) among the new rows
        qa, qk = anchors.repeat_interleave(Kc), torch.arange(Kc).repeat(P)  # [P*Kc]
        local = (qa[None, :] < qa[:, None]) | ((qa[None, :] == qa[:, None]) & (qk[None, :] <= qk[:, None]))
        mask = torch.cat((torch.ones(P * Kc, n0 * Kc, dtype=torch.bool), local), dim=1)  # [P*Kc, n1*Kc]
        for c in self.caches:
            c.ensure(n1 * Kc)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = self.caches[li]
            cache.write(n0 * Kc, k, v)
            keys, values = cache.view(n1 * Kc)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

        d = m.block(cond, emb, pos, attend, slots=Kc)  # [1, P, K_c, H]
        self._block1 = d[0, -1, : self.K]  # [K, H]: the slots drafted
        self._encoded = n1
        for c in self.caches:
            c.length = n1 * Kc

    def _scratch_rows(self) -> int:
        """Rows later blocks may write after the committed ones (beam leaves x K x blocks)."""
        return self.config.beam * self.K * max(0, self.config.max_blocks - 1)

    def _heads(self, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[R, K, H]`` -> log q ``[R, K, N_d]`` fp32, rank classes ``[R, K]``, greedy prob ``[R, K]``."""
        logits = self.model.logits(d)
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.config.rank_head:
            classes = self.model.rank_logits(d, logits).argmax(-1)
        else:
            classes = torch.zeros(d.shape[:2], dtype=torch.long)
        return logp, classes, logp.max(-1).values.exp()

    def _expand(
        self, pool: CandidatePool, logp: torch.Tensor, classes: torch.Tensor, top_prob: torch.Tensor,
        d: torch.Tensor, parent: int, score: float, ttt: list[int], rows: list[int], is_root_block: bool,
    ) -> list[PendingLeaf]:
        """Hang one block's chain and alternatives under pool node ``parent``; return pending leaves.

        ``rows[k]`` is the cache row holding slot k's keys (what a leaf from slot k inherits).
        """
        widths = slot_widths(self.config, classes, top_prob, is_root_block)
        pending: list[PendingLeaf] = []
        last = None
        for k, w in enumerate(widths):
            if w == 0:  # give up: the chain ends before slot k
                last = None
                break
            lp, tok = logp[k].topk(min(w, logp.shape[-1]))
            node = pool.add_level(tok[:1], lp[:1] + score, torch.tensor([parent]))
            leaf_ttt = ttt + rows[: k + 1]
            if len(tok) > 1:
                pool.add_level(tok[1:], lp[1:] + score, torch.full((len(tok) - 1,), parent, dtype=torch.long))
                for j in range(len(tok)):
                    pending.append(PendingLeaf(node + j, int(tok[j]), float(lp[j]) + score, d[k], leaf_ttt))
            parent, score = node, score + float(lp[0])
            last = PendingLeaf(node, int(tok[0]), score, d[k], leaf_ttt)
        if last is not None and not any(p.node == last.node for p in pending):
            pending.append(last)  # the chain's end carries on ("hitchhike")
        return pending

    def _run_block(self, pending: list[PendingLeaf], scratch: int) -> torch.Tensor:
        """One batched later block: leaf l starts from its inherited slot (cross-block inheritance).

        Its keys go to cache rows ``scratch + l*K + k``; query (l, k) sees the committed rows of
        anchors before the root (K_c each), the leaf's TTT rows and its own slots <= k. Returns d
        ``[L, K, H]``.
        """
        m, K, n = self.model, self.K, self._encoded
        L = len(pending)
        cond = m.condition_from_parent(torch.stack([p.cond for p in pending]))[None]  # [1, L, H]
        emb = self._embed(self._draft_ids[torch.tensor([p.token for p in pending])])[None]  # [1, L, H]
        pos = (n + torch.arange(K)).expand(L, K)  # the root anchor's positions
        cols = scratch + L * K  # capacity reserved by _grow: ensure() here would drop earlier scratch rows
        mask = torch.zeros(L * K, cols, dtype=torch.bool)
        mask[:, : (n - 1) * self.Kc] = True
        own = torch.arange(K)
        for li, p in enumerate(pending):
            r = slice(li * K, (li + 1) * K)
            mask[r, p.ttt] = True
            mask[r, scratch + li * K : scratch + (li + 1) * K] = own[None, :] <= own[:, None]

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache = self.caches[li]
            cache.write(scratch, k, v)
            keys, values = cache.view(cols)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

        return m.block(cond, emb, pos, attend, slots=K)[0]

    def _grow(self, stop: StopRule | None = None) -> tuple[CandidatePool, int]:
        """Block 1 from the cache, then batched later blocks; returns the pool and blocks run."""
        cfg, K, Kc = self.config, self.K, self.Kc
        assert self._block1 is not None
        n = self._encoded
        for c in self.caches:  # room for every later block's rows (at most beam leaves x K each)
            c.ensure(n * Kc + self._scratch_rows())
        root_rows = list(range((n - 1) * Kc, (n - 1) * Kc + K))  # the root anchor's drafted slots
        pool = CandidatePool()
        logp, classes, top_prob = self._heads(self._block1[None])
        pending = self._expand(pool, logp[0], classes[0], top_prob[0], self._block1, -1, 0.0, [], root_rows, True)
        blocks = 1
        scratch = n * Kc  # next free cache row for later blocks
        budget = cfg.total_tokens - 1
        for _ in range(cfg.max_blocks - 1):
            if not pending:
                break
            if stop is not None and stop(blocks * K, torch.tensor([p.score for p in pending])):
                break
            width = min(cfg.beam, max(1, (budget - pool.size) // K))
            pending = sorted(pending, key=lambda p: -p.score)[:width]
            L = len(pending)
            d = self._run_block(pending, scratch)  # [L, K, H]
            cols = scratch + L * K
            logp, classes, top_prob = self._heads(d)
            new_pending: list[PendingLeaf] = []
            for li, p in enumerate(pending):
                rows = list(range(scratch + li * K, scratch + (li + 1) * K))
                new_pending += self._expand(pool, logp[li], classes[li], top_prob[li], d[li], p.node, p.score,
                                            p.ttt, rows, False)
            pending = new_pending
            scratch = cols
            blocks += 1
        return pool, blocks


# ---------------------------------------------------------------------- construction
def random_model(target: Any, config: SpecBlockConfig) -> SpecBlockModel:
    """An untrained head for ``target`` (draft vocabulary = the first N_d ids, LM head from the target)."""
    arch = SpecBlockArch.from_target_config(
        target.model.config, target.vocab_size, config.draft_vocab_size, block_size=config.block_size,
        num_layers=config.num_layers, shift=config.shift,
    )
    return untrained_head(SpecBlockModel, arch, target, config.seed)


def build_specblock_drafter(
    config: SpecBlockConfig, target: Any, cost_model: VerifyCostModel | None = None
) -> SpecBlockDrafter:
    """A :class:`SpecBlockDrafter` for an in-process target (a :class:`TargetModel`).

    ``cost_model`` is not used: the tree size is the config's (``SpecBlockConfig.verify_curve_size`` is 0).
    """
    if not isinstance(target, TargetModel):
        raise ValueError("the specblock drafter needs an in-process target (its embeddings and config)")
    if config.checkpoint == SpecBlockConfig.RANDOM:
        model = random_model(target, config)
    else:
        model = load_for_target(config.checkpoint, target, SPECBLOCK)
    embed = target.model.get_input_embeddings().weight.detach()
    return SpecBlockDrafter(config, model.to(target.dtype), embed)


__all__ = ["RankClass", "SpecBlockDrafter", "build_specblock_drafter", "random_model", "slot_widths"]
