"""SpecBlock drafter behind the :class:`~speculation.drafters.base.Drafter` protocol.

Per request (docs/algorithms.md §4):

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

Batched drafting (:class:`~speculation.drafters.base.BatchStagedDrafter`): drafters sharing one
network propose together, ONE forward for encode + block 1 of every row and one per later block
for the rows still growing (their leaves padded to the most any row has; per-row context lengths
padded and masked, :func:`~speculation.drafters.draft_kv.batch_view`); the solo ``propose`` is the
batch of one.

``Proposal.drafter_forwards`` = 1 (encode + block 1) + the later blocks run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from speculation.config import SpecBlockConfig
from speculation.policy.cost import VerifyCost
from speculation.drafters.base import Proposal, StopRule
from speculation.drafters.checkpoint import SPECBLOCK, load_for_target
from speculation.drafters.candidate_pool import CandidatePool
from speculation.drafters.draft_kv import DraftKVCache, batch_view, length_mask
from speculation.drafters.feature_pairs import FeaturePairsDrafter, count_forward, shared_network
from speculation.drafters.head import untrained_head
from speculation.drafters.specblock_model import RankClass, SpecBlockArch, SpecBlockModel
from speculation.model.target import TargetModel
from speculation.spec.tree import DraftTree

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

    def _proposal(self, tree: DraftTree, forwards: int, levels: int) -> Proposal:
        return Proposal(tree=tree, drafter_forwards=forwards, stats={"blocks": float(levels // self.K)})

    # ------------------------------------------------------------------ batched internals
    @classmethod
    def _encode_batch(cls, drafters: Sequence[FeaturePairsDrafter], tokens: Sequence[list[int]]) -> None:
        """Block 1 at every row's pending anchors [encoded_b, n_pairs_b) in ONE forward; all their
        K_c slots join the row's cross cache.

        Rows are padded to the longest pending run P. Per layer, the keys of row b are a padded
        batch (:func:`batch_view`): its committed rows ``[0, encoded_b K_c)``, padding, then the P*K_c
        new rows at a shared offset. New query (i, k) sees the row's committed rows and new rows
        (j, k') with j < i or (j == i and k' <= k); padded anchors come after every real one, so no
        real query sees them.
        """
        ds = [cast(SpecBlockDrafter, d) for d in drafters]
        m, Kc, K = ds[0].model, ds[0].Kc, ds[0].K  # all the checkpoint's slots, even when fewer are drafted
        B, H = len(ds), m.arch.hidden_size
        n0 = [d._encoded for d in ds]
        n1 = [d._n_pairs for d in ds]
        P = max(e - a for a, e in zip(n0, n1))
        aux = ds[0]._aux.new_zeros(B, P, 3 * H)  # [B, P, 3H], zero padded
        ids = torch.zeros(B, P, dtype=torch.long)
        anchors = torch.zeros(B, P, dtype=torch.long)
        for b, (d, a, e) in enumerate(zip(ds, n0, n1)):
            aux[b, : e - a] = d._aux[a:e]
            ids[b, : e - a] = torch.tensor(tokens[b][a + 1 : e + 1], dtype=torch.long)
            anchors[b] = a + torch.arange(P)
        cond = m.condition_from_aux(aux)  # [B, P, H]
        emb = ds[0]._embed(ids)  # [B, P, H]
        pos = anchors[:, :, None] + 1 + torch.arange(Kc)  # [B, P, Kc]
        qa, qk = torch.arange(P).repeat_interleave(Kc), torch.arange(Kc).repeat(P)  # [P*Kc]
        local = (qa[None, :] < qa[:, None]) | ((qa[None, :] == qa[:, None]) & (qk[None, :] <= qk[:, None]))
        for d, e in zip(ds, n1):
            for c in d.caches:
                c.ensure(e * Kc)
        committed = [a * Kc for a in n0]
        bufs = [batch_view([d.caches[li] for d in ds], committed, P * Kc) for li in range(m.arch.num_layers)]
        N = bufs[0][2]
        mask = torch.cat((length_mask(committed, N)[:, None, :].expand(B, P * Kc, N),
                          local[None].expand(B, P * Kc, P * Kc)), dim=2)[:, None]  # [B, 1, P*Kc, N + P*Kc]

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kbuf, vbuf, _ = bufs[li]
            kbuf[:, :, N:] = k  # a batch of one: the cache's own rows [encoded*Kc, n_pairs*Kc)
            vbuf[:, :, N:] = v
            if B > 1:
                for b, (d, a, e) in enumerate(zip(ds, n0, n1)):
                    d.caches[li].write(a * Kc, k[b : b + 1, :, : (e - a) * Kc], v[b : b + 1, :, : (e - a) * Kc])
            return F.scaled_dot_product_attention(q, kbuf, vbuf, attn_mask=mask, enable_gqa=True)

        out = m.block(cond, emb, pos, attend, slots=Kc)  # [B, P, K_c, H]
        count_forward(m)
        for b, (d, a, e) in enumerate(zip(ds, n0, n1)):
            d._block1 = out[b, e - a - 1, :K]  # [K, H]: the root anchor's slots drafted
            d._encoded = e
            for c in d.caches:
                c.length = e * Kc

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
        """One later block of this sequence alone (:meth:`_run_blocks` for a batch of one), its keys
        at cache rows ``scratch + l*K + k``. Returns d ``[L, K, H]``."""
        bufs = [batch_view([c], [scratch], len(pending) * self.K) for c in self.caches]
        return self._run_blocks([self], [pending], bufs, scratch)[0]

    @classmethod
    def _run_blocks(
        cls, ds: Sequence[SpecBlockDrafter], pendings: Sequence[list[PendingLeaf]],
        bufs: Sequence[tuple[torch.Tensor, torch.Tensor, int]], scratch: int,
    ) -> torch.Tensor:
        """One later block for B rows in ONE forward: row b's leaf l starts from its inherited slot
        (cross-block inheritance).

        Its keys go to the batch buffers' rows ``scratch + l*K + k`` (leaves padded to the most
        any row has, L); query (l, k) of row b sees the committed rows of b's anchors before the
        root (K_c each), the leaf's TTT rows and its own slots <= k (a padded leaf sees only its
        own slots). Returns d ``[B, L, K, H]``.
        """
        m, K, Kc = ds[0].model, ds[0].K, ds[0].Kc
        B, H = len(ds), m.arch.hidden_size
        L = max(len(p) for p in pendings)
        conds = torch.zeros(B, L, H, dtype=ds[0].dtype)
        toks = torch.zeros(B, L, dtype=torch.long)
        for b, pending in enumerate(pendings):
            conds[b, : len(pending)] = torch.stack([p.cond for p in pending])
            toks[b, : len(pending)] = torch.tensor([p.token for p in pending])
        cond = m.condition_from_parent(conds)  # [B, L, H]
        emb = ds[0]._embed(ds[0]._draft_ids[toks])  # [B, L, H]
        n = torch.tensor([d._encoded for d in ds])
        pos = (n[:, None] + torch.arange(K)).repeat_interleave(L, dim=0).view(B, L, K)  # the root anchor's positions
        cols = scratch + L * K  # capacity reserved by the caller
        mask = torch.zeros(B, L * K, cols, dtype=torch.bool)
        own = torch.arange(K)
        causal = own[None, :] <= own[:, None]  # [K, K]
        for b, (d, pending) in enumerate(zip(ds, pendings)):
            mask[b, :, : (d._encoded - 1) * Kc] = True
            for li in range(L):
                r = slice(li * K, (li + 1) * K)
                if li < len(pending):
                    mask[b, r, pending[li].ttt] = True
                mask[b, r, scratch + li * K : scratch + (li + 1) * K] = causal
        mask = mask[:, None]  # [B, 1, L*K, cols]

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kbuf, vbuf, _ = bufs[li]
            kbuf[:, :, scratch:cols] = k
            vbuf[:, :, scratch:cols] = v
            return F.scaled_dot_product_attention(q, kbuf[:, :, :cols], vbuf[:, :, :cols], attn_mask=mask,
                                                  enable_gqa=True)

        d_out = m.block(cond, emb, pos, attend, slots=K)  # [B, L, K, H]
        count_forward(m)
        return d_out

    @classmethod
    def _grow_batch(
        cls, drafters: Sequence[FeaturePairsDrafter], stops: Sequence[StopRule | None]
    ) -> list[tuple[CandidatePool, int, int]]:
        """Block 1 from each row's cache, then later blocks batched over the rows still growing
        (one forward per block for all of them); ``stops[b](levels, pending-leaf scores)`` is asked
        before each later block. Per row: (pool, later blocks run, levels drafted = blocks x K)."""
        ds = [cast(SpecBlockDrafter, d) for d in drafters]
        cfg, K, Kc, m = ds[0].config, ds[0].K, ds[0].Kc, ds[0].model
        B = len(ds)
        n = [d._encoded for d in ds]
        bufs = [batch_view([d.caches[li] for d in ds], [a * Kc for a in n], ds[0]._scratch_rows())
                for li in range(m.arch.num_layers)]  # room for every later block's rows (beam leaves x K each)
        scratch = bufs[0][2]  # next free row for later blocks, shared by the batch
        pools = [CandidatePool() for _ in ds]
        block1 = torch.stack([cast(torch.Tensor, d._block1) for d in ds])  # [B, K, H]
        logp, classes, top_prob = ds[0]._heads(block1)
        pendings = [
            d._expand(pool, logp[b], classes[b], top_prob[b], block1[b], -1, 0.0, [],
                      list(range((a - 1) * Kc, (a - 1) * Kc + K)), True)  # the root anchor's drafted slots
            for b, (d, pool, a) in enumerate(zip(ds, pools, n))
        ]
        blocks = [1] * B
        budget = cfg.total_tokens - 1
        live = list(range(B))
        for _ in range(cfg.max_blocks - 1):
            live = [b for b in live if pendings[b] and not (
                stops[b] is not None and stops[b](blocks[b] * K, torch.tensor([p.score for p in pendings[b]])))]
            if not live:
                break
            for b in live:
                width = min(cfg.beam, max(1, (budget - pools[b].size) // K))
                pendings[b] = sorted(pendings[b], key=lambda p: -p.score)[:width]
            sub = bufs if len(live) == B else [(kb[live], vb[live], nn) for kb, vb, nn in bufs]
            d = cls._run_blocks([ds[b] for b in live], [pendings[b] for b in live], sub, scratch)  # [Bl, L, K, H]
            Bl, L = d.shape[0], d.shape[1]
            if len(live) < B:  # write the rows back: later blocks of these rows attend to them
                idx = torch.tensor(live)
                for (kb, vb, _), (skb, svb, _) in zip(bufs, sub):
                    kb[idx, :, scratch : scratch + L * K] = skb[:, :, scratch : scratch + L * K]
                    vb[idx, :, scratch : scratch + L * K] = svb[:, :, scratch : scratch + L * K]
            logp, classes, top_prob = (t.view(Bl, L, *t.shape[1:]) for t in ds[0]._heads(d.reshape(Bl * L, K, -1)))
            for i, b in enumerate(live):
                new_pending: list[PendingLeaf] = []
                for li, p in enumerate(pendings[b]):
                    rows = list(range(scratch + li * K, scratch + (li + 1) * K))
                    new_pending += ds[b]._expand(pools[b], logp[i, li], classes[i, li], top_prob[i, li], d[i, li],
                                                 p.node, p.score, p.ttt, rows, False)
                pendings[b] = new_pending
                blocks[b] += 1
            scratch += L * K
        return [(pool, nb - 1, nb * K) for pool, nb in zip(pools, blocks)]


# ---------------------------------------------------------------------- construction
def random_model(target: Any, config: SpecBlockConfig) -> SpecBlockModel:
    """An untrained head for ``target`` (draft vocabulary = the first N_d ids, LM head from the target)."""
    arch = SpecBlockArch.from_target_config(
        target.model.config, target.vocab_size, config.draft_vocab_size, block_size=config.block_size,
        num_layers=config.num_layers, shift=config.shift,
    )
    return untrained_head(SpecBlockModel, arch, target, config.seed)


def build_specblock_drafter(
    config: SpecBlockConfig, target: Any, cost_model: VerifyCost | None = None
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
    model = shared_network(model.to(target.dtype))  # equal weights, one network: the engine batches its forwards
    embed = target.model.get_input_embeddings().weight.detach()
    return SpecBlockDrafter(config, model, embed)


__all__ = ["RankClass", "SpecBlockDrafter", "build_specblock_drafter", "random_model", "slot_widths"]
