"""Online drafter updates from served feedback, for every registered family (EAGLE-3, SpecBlock).

A candidate update trains a *copy* of the live head (fp32 master weights, fresh AdamW) for a
budget of optimizer steps on the replay buffer's train part, through the family's own loss
(:meth:`~adaptation.family.DrafterFamily.loss`): no target forward is recomputed, the features are
the aux states serving already produced (TIDE's point), and the targets are the committed tokens.

**Loss: distillation on the served text, mistakes always in.** With ``x_t`` the committed text of a request and
``r_t`` = 1 where ``x_t`` is a step's bonus token after the first step (the draft's accepted path
ended just before it: a *mistake position*), the loss mask is

    m_t = r_t  OR  (u_t < keep)         u_t ~ U(0, 1) i.i.d., keep = ``accepted_keep``
    L   = family loss over the rows whose predicted token has m = 1, with the hard target
          P(v) = [v = x]   (cross-entropy on the committed token = KL(P || q) + const)

so every mistake is trained, and accepted positions with probability ``keep``. ``keep < 1`` is
OSD's emphasis on mistakes; the default ``keep = 1`` trains every position, because that is what
measured better: on HumanEval feedback (18 train requests, EAGLE-3, lr 3e-4) the held-out replay
tau rose 1.70 -> 2.40 after 32 steps with every position against 1.70 -> 2.27 with keep = 0.25, and
2.53 against 2.44 after 128 steps (``benchmarks/results/online_knobs_eagle3_code_fp32.json``): the
accepted positions are still mispredicted often in the tree's lower ranks, and dropping them
throws away three quarters of the signal. Why the committed token and not Draft-OPD's forward KL on accepted + γ^k reverse KL on rejected: the
engine's feedback carries the target's top-k *ids* only (no logits), so under greedy verification
the target's distribution at a position is known only through its argmax, the committed token;
Draft-OPD's reverse KL needs the target's probabilities at the rejected draft tokens, which would
mean recomputing target logits, exactly what online updates must not pay for. OSD's cross-entropy
at rejected positions uses only the free signal. For SpecBlock the family runs with
``valid_prefix_mask=False``: the prefix mask stops counting a slot after a position outside the
mask, and with a sparse, mistake-centred mask (``keep < 1``) it would train slot 0 only; without
it, slot k of anchor i trains exactly when ``x_{i+2+k}`` is in the mask (EAGLE-3's TTT does the
same per step).

**Which windows: recency.** Each optimizer step draws ``batch_sequences`` windows; a window's
request is drawn from the train part (oldest first, ``n`` requests) with probability

    p_i  proportional to  2 ** (-(n - 1 - i) / h)            h = ``recency_half_life`` (requests)

so the request ``h`` places back weighs half the newest. ``h = None`` draws uniformly. After a
domain shift the buffer still holds mostly the old domain; uniform draws then spend most of a
candidate's steps on text the drafter no longer serves, while the held-out part the gate replays
on is the freshest traffic.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from adaptation.batches import FeatureBatch
from adaptation.families import FAMILIES
from adaptation.family import DrafterFamily
from adaptation.feedback import FeedbackSequence
from adaptation.specblock_loss import SpecBlockFamily
from speculation.config import ConfigError
from speculation.drafters.base import Drafter, WeightSwappable

StateDict = dict[str, torch.Tensor]


@runtime_checkable
class TrainableDrafter(Drafter, WeightSwappable, Protocol):
    """A feature drafter online adaptation can train and swap: its head and the target's embedding.

    Attributes:
        model: the draft head (an ``nn.Module`` over the draft vocabulary, with ``arch``).
        embed_weight: ``[V, H]`` the target's input embedding (frozen, shared).
        dtype: the dtype the head runs in.
    """

    model: Any
    embed_weight: torch.Tensor

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class OnlineConfig:
    """Knobs of one candidate update.

    Attributes:
        lr: AdamW learning rate. Range (0, 1].
        accepted_keep: fraction of accepted (non-mistake) positions kept in the loss. Range [0, 1].
        unroll_steps: TTT steps (EAGLE-3) / blocks (SpecBlock) per batch; 0 = the family's default. >= 0.
        batch_sequences: training windows per optimizer step. >= 1.
        window_tokens: longest window cut from a buffered sequence. >= 8.
        grad_clip: global gradient-norm clip. > 0.
        weight_decay: AdamW weight decay. >= 0.
        seed: seeds window sampling and the mask's Bernoulli draws.
        recency_half_life: requests back at which a request's draw weight halves (module
            docstring); None = uniform. > 0.
    """

    lr: float = 3e-4
    accepted_keep: float = 1.0
    unroll_steps: int = 0
    batch_sequences: int = 4
    window_tokens: int = 128
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    recency_half_life: float | None = None

    def __post_init__(self) -> None:
        checks = [
            ("lr", 0 < self.lr <= 1, "in (0, 1]"),
            ("accepted_keep", 0 <= self.accepted_keep <= 1, "in [0, 1]"),
            ("unroll_steps", self.unroll_steps >= 0, ">= 0"),
            ("batch_sequences", self.batch_sequences >= 1, ">= 1"),
            ("window_tokens", self.window_tokens >= 8, ">= 8"),
            ("grad_clip", self.grad_clip > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"adapt.online.{name} must be {rule}, got {getattr(self, name)!r}")
        h = self.recency_half_life
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0):
            raise ConfigError(f"adapt.online.recency_half_life must be a number > 0 or null, got {h!r}")

    def draw_weights(self, n: int) -> torch.Tensor | None:
        """``[n]`` draw probabilities of the train part's requests, oldest first (module
        docstring); None for uniform draws."""
        if self.recency_half_life is None:
            return None
        age = torch.arange(n - 1, -1, -1, dtype=torch.float64)
        w = torch.exp2(-age / self.recency_half_life)
        return w / w.sum()


def online_family(drafter: TrainableDrafter) -> DrafterFamily:
    """The training plug-in for ``drafter`` (by its name), set up for online updates (module docstring)."""
    try:
        family = FAMILIES[drafter.name]
    except KeyError:
        raise ConfigError(
            f"online adaptation has no training family for drafter {drafter.name!r}; known: {sorted(FAMILIES)}"
        ) from None
    if isinstance(family, SpecBlockFamily):
        arch = drafter.model.arch
        tree = dataclasses.replace(family.eval_tree, block_size=min(family.eval_tree.block_size, arch.block_size))
        family = dataclasses.replace(family, valid_prefix_mask=False, block_size=arch.block_size,
                                     num_layers=arch.num_layers, shift=arch.shift, eval_tree=tree)
    return family


def mistake_mask(seq: FeedbackSequence, keep: float, generator: torch.Generator) -> torch.Tensor:
    """``[L]`` loss mask m_t (module docstring); m_0 = 0 (nothing predicts the first root)."""
    L = seq.length
    mistakes = seq.mistakes[:L]
    mask = mistakes | (torch.rand(L, generator=generator) < keep)
    mask[0] = False
    return mask


def stack_rows(rows: list[FeatureBatch]) -> FeatureBatch:
    """Right-pad one-row batches into one ``[B, S, ...]`` batch (padding is masked out)."""
    S = max(r.input_ids.shape[1] for r in rows)

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = S - x.shape[1]
        if extra == 0:
            return x
        shape = (x.shape[0], extra, *x.shape[2:])
        return torch.cat([x, x.new_zeros(shape)], dim=1)

    return FeatureBatch(
        aux=torch.cat([pad(r.aux) for r in rows]),
        input_ids=torch.cat([pad(r.input_ids) for r in rows]),
        loss_mask=torch.cat([pad(r.loss_mask) for r in rows]),
        topk_values=torch.cat([pad(r.topk_values) for r in rows]),
        topk_indices=torch.cat([pad(r.topk_indices) for r in rows]),
        num_tokens=sum(r.num_tokens for r in rows),
    )


def _window(seq: FeedbackSequence, start: int, length: int) -> FeedbackSequence:
    end = min(seq.length, start + length)
    return FeedbackSequence(
        tokens=seq.tokens[start : end + 1], aux=seq.aux[start:end], mistakes=seq.mistakes[start : end + 1],
        step_tokens=(),
    )


@dataclass(frozen=True)
class UpdateResult:
    """A trained candidate.

    Attributes:
        state: the candidate's weights (fp32 copies), loadable by the drafter's ``load_state_dict``.
        steps: optimizer steps run.
        step_seconds: wall seconds of each optimizer step.
        mean_loss: mean training loss over the steps (nan if no step had a counted row).
        trained_rows: rows counted by the first unrolled step, summed over steps.
    """

    state: StateDict
    steps: int
    step_seconds: tuple[float, ...]
    mean_loss: float
    trained_rows: int


class OnlineUpdater:
    """Trains candidate updates of one live drafter's head (module docstring).

    Args:
        drafter: the drafter whose head is updated (its weights are read, never modified).
        config: update knobs.
    """

    def __init__(self, drafter: TrainableDrafter, config: OnlineConfig | None = None) -> None:
        if not isinstance(drafter, TrainableDrafter):
            raise TypeError(f"{type(drafter).__name__} is not a trainable feature drafter (model, embed_weight, weights)")
        self.config = config or OnlineConfig()
        self.family = online_family(drafter)
        self.embed = drafter.embed_weight.detach().float()
        self.template = drafter.model
        steps = self.config.unroll_steps or self.family.unroll_defaults["ttt_steps"]
        self.unroll = steps
        self._rounds = 0

    def _batch(self, sequences: list[FeedbackSequence], weights: torch.Tensor | None,
               gen: torch.Generator) -> FeatureBatch:
        rows = []
        for _ in range(self.config.batch_sequences):
            if weights is None:
                i = int(torch.randint(len(sequences), (1,), generator=gen))
            else:
                i = int(torch.multinomial(weights, 1, generator=gen))
            seq = sequences[i]
            span = max(1, seq.length - self.config.window_tokens + 1)
            w = _window(seq, int(torch.randint(span, (1,), generator=gen)), self.config.window_tokens)
            rows.append(w.to_batch_row(mistake_mask(w, self.config.accepted_keep, gen)))
        return stack_rows(rows)

    def train(self, base: StateDict, sequences: list[FeedbackSequence], steps: int) -> UpdateResult:
        """A candidate: ``base`` weights trained ``steps`` optimizer steps on ``sequences``."""
        usable = [s for s in sequences if s.length >= 3]  # order kept: oldest first
        if not usable:
            raise ValueError("no buffered training sequence has 3 or more positions: nothing to train on")
        cfg = self.config
        model = copy.deepcopy(self.template).float()
        model.load_state_dict(base)
        model.train()
        t2d = model.target_to_draft()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self._rounds)
        self._rounds += 1
        seconds: list[float] = []
        losses: list[float] = []
        rows = 0
        weights = cfg.draw_weights(len(usable))
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = self._batch(usable, weights, gen)
            res = self.family.loss(model, self.embed, batch, t2d, self.unroll, gen)
            opt.zero_grad(set_to_none=True)
            if res.loss.requires_grad:
                res.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                losses.append(float(res.loss.detach()))
            rows += res.loss_tokens
            seconds.append(time.perf_counter() - t0)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        return UpdateResult(state, steps, tuple(seconds), mean_loss, rows)
