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
  reranks the pool to ``total_tokens - 1`` nodes (:mod:`speculation.drafters.eagle3_tree`).

``Proposal.drafter_forwards`` = 1 (encode) + ``depth``. Weights can be replaced between steps with
:meth:`Eagle3Drafter.load_state_dict` (loads into a copy, then swaps the reference); the drafter
keeps the aux history, so the next ``propose`` re-encodes the context with the new weights.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from speculation.config import Eagle3Config
from speculation.drafters.base import DraftContext, Proposal, StepOutcome, StopRule
from speculation.drafters.checkpoint import (
    CheckpointError,
    TargetFingerprint,
    find_checkpoint,
    load_checkpoint,
)
from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model
from speculation.drafters.eagle3_tree import CandidatePool, build_draft_tree, select_top
from speculation.tree import DraftTree

CHECKPOINT_ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
"""Where ``checkpoint: auto`` looks for a checkpoint matching the target (``<repo>/checkpoints``)."""


class DraftKVCache:
    """Growable K/V rows of one sequence: ``[0, length)`` committed pairs, then scratch tree rows.

    Buffers: ``k``, ``v`` ``[1, nkv, capacity, hd]``.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256) -> None:
        self.k = torch.empty(1, num_kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def ensure(self, rows: int) -> None:
        """Grow (doubling) so ``rows`` rows fit; committed rows are kept."""
        cap = self.k.shape[2]
        if rows <= cap:
            return
        while cap < rows:
            cap *= 2
        k = self.k.new_empty(self.k.shape[0], self.k.shape[1], cap, self.k.shape[3])
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``start .. start + T`` := ``k``, ``v`` ``[1, nkv, T, hd]``."""
        t = k.shape[2]
        self.k[:, :, start : start + t] = k
        self.v[:, :, start : start + t] = v

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :end], self.v[:, :, :end]


class Eagle3Drafter:
    """EAGLE-3 dynamic-tree drafter (see the module docstring).

    Args:
        config: tree knobs (``total_tokens``, ``depth``, ``top_k``).
        model: the draft network, in the dtype it should run in.
        embed_weight: ``[V, H]`` the target's input embedding (shared, frozen, never copied).
    """

    name = "eagle3"
    needs_aux = True
    target_topk = 0

    def __init__(self, config: Eagle3Config, model: Eagle3Model, embed_weight: torch.Tensor) -> None:
        if embed_weight.shape != (model.arch.target_vocab_size, model.arch.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(embed_weight.shape)}, the drafter expects "
                f"[{model.arch.target_vocab_size}, {model.arch.hidden_size}]"
            )
        self.config = config
        self.embed_weight = embed_weight
        self.model = model.eval()
        self._draft_ids = model.draft_ids()
        self._aux = torch.empty(0, 3 * model.arch.hidden_size)
        self._n_pairs = 0
        self._encoded = 0
        self.cache = self._new_cache()
        self._last_y: torch.Tensor | None = None  # [H]
        self._last_logp: torch.Tensor | None = None  # [N_d] fp32
        self._lock = threading.Lock()  # a swap never lands in the middle of a propose

    def __getstate__(self) -> dict:
        """Picklable (shipped to a DrafterWorker): the lock is per process, recreated on load."""
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ properties
    @property
    def arch(self) -> Eagle3Arch:
        return self.model.arch

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def _new_cache(self) -> DraftKVCache:
        a = self.model.arch
        return DraftKVCache(a.num_kv_heads, a.head_dim, self.dtype)

    # ------------------------------------------------------------------ weights
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights into a copy of the network, then swap it in (atomic between steps)."""
        fresh = copy.deepcopy(self.model)
        fresh.load_state_dict(state_dict)
        self.swap_model(fresh)

    def swap_model(self, model: Eagle3Model) -> None:
        """Replace the network (same architecture; cast in place to the drafter's dtype).

        Thread-safe against :meth:`propose`; the context is re-encoded at the next propose.
        """
        if model.arch != self.model.arch:
            raise ValueError(f"cannot swap in a drafter of another architecture: {model.arch} != {self.model.arch}")
        model = model.to(self.dtype).eval()
        draft_ids = model.draft_ids()
        with self._lock:
            self.model, self._draft_ids = model, draft_ids
            self._encoded = 0
            self.cache.length = 0

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        if prompt_aux is None:
            raise ValueError("the eagle3 drafter needs the target's aux hidden states (prefill with need_aux=True)")
        n = prompt_aux.shape[0]
        if n != ctx.prompt_len or len(ctx.tokens) != n + 1:
            raise ValueError(f"prompt aux has {n} rows for a prompt of {ctx.prompt_len} tokens + 1 root")
        self._check_aux(prompt_aux)
        self._aux = torch.empty(max(256, 2 * n), 3 * self.arch.hidden_size, dtype=prompt_aux.dtype)
        self._n_pairs = 0
        self._encoded = 0
        self.cache = self._new_cache()
        self._append_aux(prompt_aux)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        if outcome.aux_hidden is None:
            raise ValueError("the eagle3 drafter needs aux hidden states at the accepted nodes")
        if outcome.aux_hidden.shape[0] != len(outcome.accepted):
            raise ValueError(f"aux rows {outcome.aux_hidden.shape[0]} != accepted nodes {len(outcome.accepted)}")
        self._append_aux(outcome.aux_hidden)

    def propose(self, ctx: DraftContext) -> Proposal:
        tree, forwards, _ = self.draft(ctx, self.config.total_tokens - 1)
        return Proposal(tree=tree, drafter_forwards=forwards)

    @torch.inference_mode()
    def draft(
        self, ctx: DraftContext, budget: int | Callable[[int], int], stop: StopRule | None = None
    ) -> tuple[DraftTree, int, int]:
        """Grow the beam, stopping early where ``stop`` says so; keep the ``budget`` best nodes.

        ``budget`` may depend on the levels drafted (a callable ``levels -> nodes``).
        ``stop(levels, beam_scores)`` is asked before each expansion with the number of levels
        drafted so far and the beam's cumulative log-probs ``[k]``; True ends drafting there
        (dynamic-depth pruning). Returns ``(tree, drafter forwards, levels drafted)``.
        """
        if self._n_pairs != len(ctx.tokens) - 1:
            raise RuntimeError(
                f"eagle3 drafter holds {self._n_pairs} feature rows for a context of {len(ctx.tokens)} tokens "
                "(begin/observe were not called for every step)"
            )
        with self._lock:
            forwards = 0
            if self._encoded < self._n_pairs:
                self._encode(ctx.tokens)
                forwards += 1
            pool, expansions = self._grow(stop)
            keep = budget(expansions + 1) if callable(budget) else budget
            tree = build_draft_tree(ctx.root_token, pool, select_top(pool, keep), self._draft_ids)
        return tree, forwards + expansions, expansions + 1

    # ------------------------------------------------------------------ internals
    def _check_aux(self, aux: torch.Tensor) -> None:
        if aux.dim() != 2 or aux.shape[1] != 3 * self.arch.hidden_size:
            raise ValueError(f"aux hidden states must be [n, {3 * self.arch.hidden_size}], got {tuple(aux.shape)}")

    def _append_aux(self, rows: torch.Tensor) -> None:
        self._check_aux(rows)
        end = self._n_pairs + rows.shape[0]
        if end > self._aux.shape[0]:
            grown = self._aux.new_empty(max(end, 2 * self._aux.shape[0]), self._aux.shape[1])
            grown[: self._n_pairs] = self._aux[: self._n_pairs]
            self._aux = grown
        self._aux[self._n_pairs : end] = rows.to(self._aux.dtype)
        self._n_pairs = end

    def _embed(self, target_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(target_ids, self.embed_weight).to(self.dtype)

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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Eagle3Model(arch)
    model.set_vocab(torch.arange(arch.draft_vocab_size))
    model.init_head_from_target(target.model.get_output_embeddings().weight.detach().float())
    return model


def resolve_checkpoint(checkpoint: str, live: TargetFingerprint) -> Path:
    """The checkpoint path for ``checkpoint`` (``auto`` = the committed one matching the target)."""
    if checkpoint == Eagle3Config.AUTO:
        found = find_checkpoint(CHECKPOINT_ROOT, live)
        if found is None:
            raise CheckpointError(
                f"no EAGLE-3 checkpoint for target {live.name!r} (hidden {live.hidden_size}, vocab "
                f"{live.vocab_size}) under {CHECKPOINT_ROOT}; train one with `graftblock train eagle3`, "
                f"pass eagle3.checkpoint: PATH, or use checkpoint: random"
            )
        return found
    return Path(checkpoint).expanduser()


def build_eagle3_drafter(config: Eagle3Config, target: Any) -> Eagle3Drafter:
    """An :class:`Eagle3Drafter` for an in-process target (needs ``target.model``)."""
    if not hasattr(target, "model"):
        raise ValueError("the eagle3 drafter needs an in-process target (its embeddings and config)")
    dtype = target.dtype
    if config.checkpoint == Eagle3Config.RANDOM:
        model = random_model(target, config.draft_vocab_size, config.seed)
    else:
        live = TargetFingerprint.from_target(target)
        model = load_checkpoint(resolve_checkpoint(config.checkpoint, live), live)
    embed = target.model.get_input_embeddings().weight.detach()
    return Eagle3Drafter(config, model.to(dtype), embed)
