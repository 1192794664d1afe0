"""The family registry is the only place a drafter family is wired into training.

A throwaway family, written here against :class:`~adaptation.family.DrafterFamily` only (a tiny
real network, a real loss, a real one-token drafter for tau), is registered in
:data:`adaptation.families.FAMILIES` for one test. The CLI then offers ``graftblock train toy``
with the shared flags (at the family's unroll defaults) and the family's own, and the shared
:class:`~adaptation.trainer.Trainer` trains it on the tiny random Llama, evaluates it, writes its
checkpoint in its own format, and resumes an interrupted run to exactly the uninterrupted weights
(the toy loss draws a random row subset every step, so the resumed run must replay the draws).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaptation.batches import FeatureBatch
from adaptation.data import TrainData, regenerate, regenerated_samples
from adaptation.families import FAMILIES
from adaptation.family import StepLoss, check_knob
from adaptation.loss_terms import shift, soft_cross_entropy
from adaptation.trainer import Trainer, TrainConfig
from graftblock.cli import build_parser
from graftblock.train import configure
from speculation.config import ConfigError
from speculation.drafters.base import DraftContext, Proposal, StepOutcome
from speculation.drafters.checkpoint import CheckpointKind, TargetFingerprint, load_checkpoint, read_manifest
from speculation.drafters.head import DraftVocabMixin, HeadArch, target_dims
from speculation.spec.tree import DraftTree, NodeSource
from tests.helpers import interrupt_training, tiny_llama, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64


@dataclass(frozen=True)
class ToyArch(HeadArch):
    """The target's dimensions plus the width of the toy's feature MLP."""

    width: int = 16


class ToyHead(DraftVocabMixin, nn.Module):
    """One-position head: ``q(x_{t+2} | f_t, x_{t+1}) = softmax(W_lm (W_2 silu(W_1 f_t) + e(x_{t+1})))``."""

    def __init__(self, arch: ToyArch) -> None:
        super().__init__()
        self.arch = arch
        H = arch.hidden_size
        self.fc1 = nn.Linear(3 * H, arch.width, bias=False)
        self.fc2 = nn.Linear(arch.width, H, bias=False)
        self.lm_head = nn.Linear(H, arch.draft_vocab_size, bias=False)
        self._register_buffers()
        self._default_init(0.02)

    def forward(self, aux: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``[..., 3H], [..., H] -> [..., N_d]`` draft logits (features cast to the head's dtype)."""
        dtype = self.fc1.weight.dtype
        return self.lm_head(self.fc2(F.silu(self.fc1(aux.to(dtype)))) + emb.to(dtype))


TOY = CheckpointKind("graftblock-toy/1", "Toy", "toy", ToyArch, ToyHead)


class ToyDrafter:
    """Drafts one token per step from the last committed pair (aux of the token before the root)."""

    name = "toy"
    needs_aux = True
    target_topk = 0

    def __init__(self, head: ToyHead, embed_weight: torch.Tensor) -> None:
        self.head, self.embed_weight = head, embed_weight
        self._last = torch.empty(0)

    def begin(self, ctx: DraftContext, prompt_aux: torch.Tensor | None) -> None:
        assert prompt_aux is not None
        self._last = prompt_aux[-1]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        logits = self.head(self._last, self.embed_weight[ctx.root_token])  # [N_d]
        logp = torch.log_softmax(logits.float(), -1)
        d = int(logp.argmax())
        tree = DraftTree(ctx.root_token)
        tree.add(0, int(self.head.draft_ids()[d]), float(logp[d]), NodeSource.DRAFTER)
        return Proposal(tree, drafter_forwards=1)

    def observe(self, ctx: DraftContext, outcome: StepOutcome) -> None:
        assert outcome.aux_hidden is not None
        self._last = outcome.aux_hidden[-1]


def _toy_rows(model: ToyHead, embed_weight: torch.Tensor, batch: FeatureBatch, t2d: torch.Tensor):
    """Per-row soft CE and top-1 agreement where ``x_{t+2}`` is trained on: ``[B*S]`` each, and the mask."""
    B, S, _ = batch.aux.shape
    top_idx = shift(batch.topk_indices, 1).reshape(B * S, -1)  # [BS, K]: z_{t+1} predicts x_{t+2}
    top_val = shift(batch.topk_values, 1).reshape(B * S, -1)
    mask = shift(batch.loss_mask, 2, False).reshape(-1) & (t2d[top_idx[:, 0]] >= 0)  # [BS]
    emb = F.embedding(shift(batch.input_ids, 1), embed_weight).reshape(B * S, -1)  # e(x_{t+1})
    logits = model(batch.aux.reshape(B * S, -1), emb)  # [BS, N_d]
    loss, correct = soft_cross_entropy(logits, top_val, t2d[top_idx])
    return loss, correct, mask


@dataclass(frozen=True)
class ToyFamily:
    """A third family as a newcomer would write it: knobs as fields, the protocol's methods."""

    width: int = 16
    """Feature-MLP width. Range [1, 256]."""
    row_keep: float = 0.8
    """Probability a trained row enters a step's loss (drawn with the step's generator). Range (0, 1]."""

    name: ClassVar[str] = "toy"
    kind: ClassVar[CheckpointKind] = TOY
    unroll_defaults: ClassVar[Mapping[str, int]] = MappingProxyType({"ttt_steps": 1, "curriculum_steps": 1})

    def __post_init__(self) -> None:
        check_knob("width", 1 <= self.width <= 256, "in [1, 256]", self.width)
        check_knob("row_keep", 0 < self.row_keep <= 1, "in (0, 1]", self.row_keep)

    def config_dict(self) -> dict[str, Any]:
        return {"width": self.width, "row_keep": self.row_keep}

    def new_model(self, target: Any, draft_vocab_size: int) -> ToyHead:
        return ToyHead(ToyArch(**target_dims(target.model.config), target_vocab_size=target.vocab_size,
                               draft_vocab_size=draft_vocab_size, width=self.width))

    def loss(self, model: ToyHead, embed_weight: torch.Tensor, batch: FeatureBatch,
             target_to_draft: torch.Tensor, steps: int, generator: torch.Generator) -> StepLoss:
        loss, correct, mask = _toy_rows(model, embed_weight, batch, target_to_draft)
        keep = mask & (torch.rand(mask.shape, generator=generator) < self.row_keep)
        acc = float(correct[keep].float().mean())
        return StepLoss(loss[keep].mean(), {"train.acc_0": acc}, int(keep.sum()))

    def heldout_metrics(self, model: ToyHead, embed_weight: torch.Tensor, target_to_draft: torch.Tensor,
                        batches: Iterable[FeatureBatch], steps: int) -> dict[str, float]:
        loss_sum = right = rows = 0.0
        for batch in batches:
            loss, correct, mask = _toy_rows(model, embed_weight, batch, target_to_draft)
            loss_sum += float(loss[mask].sum())
            right += float(correct[mask].sum())
            rows += int(mask.sum())
        if not rows:
            return {"heldout.loss": math.nan, "heldout.acc_0": math.nan}
        return {"heldout.loss": loss_sum / rows, "heldout.acc_0": right / rows}

    def eval_drafter(self, head: ToyHead, embed_weight: torch.Tensor) -> ToyDrafter:
        return ToyDrafter(head, embed_weight)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--width", type=int, default=self.width)
        parser.add_argument("--row-keep", type=float, default=self.row_keep)

    def configure(self, flags: Mapping[str, Any]) -> ToyFamily:
        return ToyFamily(width=flags["width"], row_keep=flags["row_keep"])


@functools.lru_cache(maxsize=1)
def _setup():
    model = tiny_llama(vocab_size=VOCAB, seed=11, lm_head_scale=8.0)
    target = tiny_target(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(6)] for _ in range(40)]
    samples = regenerated_samples(prompts, regenerate(model, prompts, max_new_tokens=32, batch_size=20))
    data = TrainData(items=lambda: iter(samples[4:]), to_samples=lambda items: list(items),
                     vocab_samples=lambda: iter(samples), heldout=samples[:4], eval_prompts=prompts[:4],
                     description={"source": "tiny self-distillation"})
    return target, data


ARGV = ["train", "toy", "--width", "24", "--max-len", "64", "--draft-vocab-size", str(VOCAB),
        "--batch-tokens", "256", "--max-tokens", "20000", "--epochs", "80", "--topk", "8",
        "--shard-size", "12", "--lr", "1e-1", "--warmup-steps", "3", "--eval-every-tokens", "0",
        "--eval-at-start", "--eval-prompts", "4", "--eval-max-new-tokens", "16"]


def test_an_unregistered_family_is_not_offered():
    with pytest.raises(SystemExit):
        build_parser().parse_args(ARGV)


def test_registered_families_are_named_as_their_checkpoints_advise():
    """``load_for_target`` tells users to run ``graftblock train <kind.method>``: it must exist."""
    assert FAMILIES
    for key, family in FAMILIES.items():
        assert key == family.name == family.kind.method


@dataclass(frozen=True)
class ShadowingToy(ToyFamily):
    lr: float = 0.5

    def config_dict(self) -> dict[str, Any]:
        return {**super().config_dict(), "lr": self.lr}


def test_a_family_knob_may_not_shadow_a_shared_knob(tmp_path):
    target, data = _setup()
    with pytest.raises(ConfigError, match=r"family 'toy' knobs \['lr'\] shadow shared training knobs"):
        Trainer(TrainConfig(), ShadowingToy(), target, data, tmp_path, "tiny", progress=False)


def test_a_registered_family_is_offered_trained_evaluated_saved_and_resumed(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, ToyFamily.name, ToyFamily())
    family, cfg = configure(build_parser().parse_args(ARGV))
    assert family == ToyFamily(width=24, row_keep=0.8)
    assert (cfg.ttt_steps, cfg.curriculum_steps) == (1, 1)  # the toy's unroll defaults
    assert cfg.max_tokens == 20_000
    with pytest.raises(ConfigError, match=r"train.row_keep must be in \(0, 1\]"):
        configure(build_parser().parse_args(ARGV + ["--row-keep", "0"]))
    cfg = dataclasses.replace(cfg, save_every_steps=3, autocast_bf16=False)
    target, data = _setup()

    ref = Trainer(cfg, family, target, data, tmp_path / "ref", "tiny", progress=False)
    manifest = ref.run(command="pytest")
    first, last = ref.state.evals[0], ref.state.evals[-1]
    assert first["tokens"] == 0 and last["tokens"] >= 20_000
    assert last["heldout.loss"] < first["heldout.loss"] - 0.5
    assert last["heldout.acc_0"] > first["heldout.acc_0"] + 0.05
    # tau comes from the toy's own one-token drafter: at most 1 accepted draft token per step
    for e in (first, last):
        assert e["heldout.eval_steps"] > 0 and 0 < e["heldout.accepted_per_step"] <= 1
        assert 1 < e["heldout.tau"] <= 2
    assert manifest["format"] == TOY.format
    assert manifest["training"]["config"]["width"] == 24 and manifest["training"]["config"]["ttt_steps"] == 1

    # the checkpoint is in the toy's format and loads back (bf16 weights) for this target
    head = load_checkpoint(tmp_path / "ref" / "final", TargetFingerprint.from_target(target), kind=TOY)
    assert head.arch == ref.model.arch and read_manifest(tmp_path / "ref" / "final")["format"] == TOY.format
    for k, v in ref.model.state_dict().items():
        saved = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(head.state_dict()[k], saved), k

    # a run interrupted mid-shard resumes from its saved state to exactly the uninterrupted weights
    interrupt_training(monkeypatch, Trainer(cfg, family, target, data, tmp_path / "run", "tiny", progress=False), 8)
    resumed = Trainer(cfg, family, target, data, tmp_path / "run", "tiny", progress=False)
    resumed.setup()
    assert resumed.state.step == 7  # the crash path saved the state after the 7th step
    resumed.run()
    assert (resumed.state.step, resumed.state.tokens) == (ref.state.step, ref.state.tokens)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
