"""Offline drafter training, one trainer for every family: features cached per shard, unrolled
training-time-test steps, checkpoints, resume, evaluation.

What a drafter family contributes (its network, its loss, its held-out metrics, the drafter for
the tau measurement, its knobs) comes from a :class:`~adaptation.family.DrafterFamily`; the rest
is here and identical for every family.

Data flow per epoch: raw items (conversations) are grouped into shards of ``shard_size``; a
shard's features are extracted from the target on first use and cached
(:mod:`adaptation.features`); its sequences are packed into length-sorted batches of at
most ``batch_tokens`` tokens (:mod:`adaptation.batches`) and trained with the family's loss
(AdamW, warmup then linear decay, clipping, bf16 autocast with fp32 master weights and fp32
softmax/CE).

Curriculum: until ``curriculum_tokens`` tokens have been trained, only ``curriculum_steps`` steps
are unrolled (several times cheaper), then all ``ttt_steps``.

Resume: ``<workdir>/state.pt`` (weights, optimizer, data cursor, counters, MLflow run id) is
rewritten atomically every ``save_every_steps`` and at the end; a killed run restarts at the
saved batch, and the family's random draws are seeded per optimizer step, so it continues as the
uninterrupted run would. At every ``eval_every_tokens`` the head is evaluated (the family's
held-out metrics and real speculative tau) and saved as a bf16 checkpoint under
``<workdir>/checkpoints/``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adaptation.batches import FeatureBatch, make_batch, plan_batches
from adaptation.data import TrainData
from adaptation.evaluation import ACCEPT_DEPTHS, measure_tau
from adaptation.family import DrafterFamily, DraftNetwork, check_knob
from adaptation.features import FeatureCache, ShardData
from adaptation.vocab import DraftVocab, select_draft_vocab, token_counts
from speculation.config import ConfigError
from speculation.drafters.checkpoint import TargetFingerprint, save_checkpoint
from tracking.train import MetricsSink, NullSink


@dataclass(frozen=True)
class TrainConfig:
    """The knobs every family shares (``graftblock train <family>``); a family adds its own."""

    max_len: int = 1024
    """Tokens per training sequence (longer conversations are truncated). Range [16, 8192]."""
    draft_vocab_size: int = 8192
    """Draft vocabulary N_d (the LM head is H x N_d). Range [1, target vocab]."""
    vocab_items: int = 2000
    """Raw items (conversations) whose assistant tokens are counted to choose the vocab. >= 1."""
    ttt_steps: int = 7
    """Unrolled training-time-test steps per batch (what one step is belongs to the family: an
    EAGLE-3 draft step, a SpecBlock block). Range [1, 16]."""
    curriculum_steps: int = 2
    """Steps unrolled while ``tokens < curriculum_tokens``. Range [1, ttt_steps]."""
    curriculum_tokens: int = 0
    """Training tokens trained with ``curriculum_steps`` first (0 = no curriculum). >= 0."""
    lr: float = 1e-4
    """Peak learning rate (AdamW, betas 0.9/0.95). Range (0, 1]."""
    min_lr_ratio: float = 0.1
    """Final lr / peak lr of the linear decay over the budget (``max_tokens`` or ``max_minutes``,
    whichever is used up first). Range [0, 1]."""
    warmup_steps: int = 20
    """Linear warmup steps. >= 0."""
    weight_decay: float = 0.0
    """AdamW weight decay. >= 0."""
    grad_clip: float = 0.5
    """Global gradient-norm clip. > 0."""
    batch_tokens: int = 2048
    """Padded tokens per optimizer step (B x S). >= max_len."""
    max_tokens: int = 1_000_000
    """Stop after this many training tokens (all epochs). >= 1."""
    max_minutes: float = 0.0
    """Stop after this many wall minutes of training, summed over resumes (0 = no limit). >= 0."""
    epochs: int = 1
    """Passes over the data (later passes reuse the feature cache). >= 1."""
    topk: int = 32
    """Target logits kept per position (soft targets). Range [1, 1024]."""
    shard_size: int = 32
    """Sequences per feature shard. >= 1."""
    eval_every_tokens: int = 250_000
    """Evaluate + save a checkpoint every this many training tokens (0 = only at the end). >= 0."""
    eval_every_minutes: float = 0.0
    """Also evaluate + save every this many wall minutes (0 = off). >= 0."""
    eval_at_start: bool = False
    """Also evaluate the untrained head (a tau point at 0 tokens)."""
    eval_prompts: int = 8
    """Held-out prompts for the tau measurement (0 = skip it). >= 0."""
    eval_max_new_tokens: int = 64
    """New tokens per tau prompt. >= 1."""
    save_every_steps: int = 25
    """Rewrite the resume state every this many optimizer steps. >= 1."""
    log_every_steps: int = 5
    """Log training metrics every this many steps. >= 1."""
    seed: int = 0
    """Initialisation, batch-order and per-step draw seed. >= 0."""
    autocast_bf16: bool = True
    """bf16 autocast for the forward/backward (fp32 master weights, fp32 softmax/CE)."""

    def __post_init__(self) -> None:
        check_knob("max_len", 16 <= self.max_len <= 8192, "in [16, 8192]", self.max_len)
        check_knob("draft_vocab_size", self.draft_vocab_size >= 1, ">= 1", self.draft_vocab_size)
        check_knob("vocab_items", self.vocab_items >= 1, ">= 1", self.vocab_items)
        check_knob("ttt_steps", 1 <= self.ttt_steps <= 16, "in [1, 16]", self.ttt_steps)
        check_knob("curriculum_steps", 1 <= self.curriculum_steps <= self.ttt_steps,
                   f"in [1, ttt_steps={self.ttt_steps}]", self.curriculum_steps)
        check_knob("curriculum_tokens", self.curriculum_tokens >= 0, ">= 0", self.curriculum_tokens)
        check_knob("lr", 0 < self.lr <= 1, "in (0, 1]", self.lr)
        check_knob("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]", self.min_lr_ratio)
        check_knob("warmup_steps", self.warmup_steps >= 0, ">= 0", self.warmup_steps)
        check_knob("weight_decay", self.weight_decay >= 0, ">= 0", self.weight_decay)
        check_knob("grad_clip", self.grad_clip > 0, "> 0", self.grad_clip)
        check_knob("batch_tokens", self.batch_tokens >= self.max_len, f">= max_len={self.max_len}",
                   self.batch_tokens)
        check_knob("max_tokens", self.max_tokens >= 1, ">= 1", self.max_tokens)
        check_knob("max_minutes", self.max_minutes >= 0, ">= 0", self.max_minutes)
        check_knob("epochs", self.epochs >= 1, ">= 1", self.epochs)
        check_knob("topk", 1 <= self.topk <= 1024, "in [1, 1024]", self.topk)
        check_knob("shard_size", self.shard_size >= 1, ">= 1", self.shard_size)
        check_knob("eval_every_tokens", self.eval_every_tokens >= 0, ">= 0", self.eval_every_tokens)
        check_knob("eval_every_minutes", self.eval_every_minutes >= 0, ">= 0", self.eval_every_minutes)
        check_knob("eval_prompts", self.eval_prompts >= 0, ">= 0", self.eval_prompts)
        check_knob("eval_max_new_tokens", self.eval_max_new_tokens >= 1, ">= 1", self.eval_max_new_tokens)
        check_knob("save_every_steps", self.save_every_steps >= 1, ">= 1", self.save_every_steps)
        check_knob("log_every_steps", self.log_every_steps >= 1, ">= 1", self.log_every_steps)
        check_knob("seed", self.seed >= 0, ">= 0", self.seed)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainState:
    """Everything a resumed run needs besides weights and optimizer state."""

    step: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    sequences: int = 0
    epoch: int = 0
    shard: int = 0
    batch: int = 0
    elapsed_s: float = 0.0
    last_eval_tokens: int = -1
    last_eval_elapsed_s: float = 0.0
    mlflow_run_id: str | None = None
    last_loss: float = math.nan
    evals: list[dict] = field(default_factory=list)
    done: bool = False
    extract_s: float = 0.0
    """Wall seconds spent extracting target features into the cache (0 for shards already cached)."""
    shards_extracted: int = 0
    shards_reused: int = 0
    """Training shards loaded from the cache a previous run (or epoch) wrote."""


def _lr(cfg: TrainConfig, step: int, progress: float) -> float:
    """``lr * min(1, (step+1)/warmup) * (1 - (1 - min_ratio) * min(1, progress))``.

    ``progress`` is the fraction of the budget used: max(tokens / max_tokens, minutes / max_minutes).
    """
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    return cfg.lr * warm * (1.0 - (1.0 - cfg.min_lr_ratio) * min(1.0, progress))


class Trainer:
    """Trains one head of ``family`` for ``target`` in ``workdir`` (resumable).

    Args:
        cfg: the shared training knobs.
        family: the drafter family (its network, loss, held-out metrics, tau drafter and knobs).
        target: a :class:`~speculation.model.target.TargetModel` (extraction and evaluation dtype).
        data: the training text (:class:`~adaptation.data.TrainData`).
        workdir: features, checkpoints and resume state live here.
        target_name: recorded in checkpoints and manifests (e.g. ``smollm2-135m``).
        sink: run logging (MLflow or nothing).
        progress: show a tqdm bar.
        on_stop_signal: stop cleanly (state saved, run marked killed) on SIGTERM.
        features_dir: the feature cache (default ``<workdir>/features``); families can share one.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        family: DrafterFamily,
        target: Any,
        data: TrainData,
        workdir: str | Path,
        target_name: str,
        sink: MetricsSink | None = None,
        progress: bool = True,
        on_stop_signal: bool = True,
        features_dir: str | Path | None = None,
    ) -> None:
        shadowed = sorted(set(family.config_dict()) & set(cfg.to_dict()))
        if shadowed:
            raise ConfigError(f"train: family {family.name!r} knobs {shadowed} shadow shared training knobs")
        self.cfg = cfg
        self.family = family
        self.target = target
        self.data = data
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.target_name = target_name
        self.sink: MetricsSink = sink or NullSink()
        self.progress = progress
        self.device: torch.device = torch.device(target.device)
        if self.device.type != "cpu" and cfg.eval_prompts and data.eval_prompts:
            raise ConfigError(
                f"train: the tau measurement (eval_prompts={cfg.eval_prompts}) runs the drafters' CPU decode "
                f"loop; with the target on {self.device} pass --eval-prompts 0 and measure tau of the exported "
                "checkpoint on a CPU host with `graftblock bench` (the held-out acc_k metrics do run here)"
            )
        self.fingerprint = TargetFingerprint.from_target(target, name=target_name)
        self.cache = FeatureCache(Path(features_dir) if features_dir else self.workdir / "features")
        self.embed = target.model.get_input_embeddings().weight.detach()
        self.state = TrainState()
        self.vocab: DraftVocab | None = None
        self.model: DraftNetwork | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._stop_requested = False
        self._install_signals = on_stop_signal
        self._t0 = 0.0
        self._base_elapsed = 0.0
        self._t2d = torch.empty(0, dtype=torch.long)

    # ------------------------------------------------------------------ setup
    @property
    def state_path(self) -> Path:
        return self.workdir / "state.pt"

    def config_dict(self) -> dict:
        """The full training config as recorded: the shared knobs, then the family's."""
        return {**self.cfg.to_dict(), **self.family.config_dict()}

    def _choose_vocab(self) -> DraftVocab:
        path = self.workdir / "vocab.json"
        if path.is_file():
            return DraftVocab.from_dict(json.loads(path.read_text()))
        samples = itertools.islice(self.data.vocab_samples(), self.cfg.vocab_items)
        vocab = select_draft_vocab(token_counts(samples, self.target.vocab_size),
                                   min(self.cfg.draft_vocab_size, self.target.vocab_size))
        path.write_text(json.dumps(vocab.to_dict()))
        return vocab

    def setup(self) -> None:
        """Vocabulary, head (fresh or resumed), optimizer and the feature-cache contract."""
        self.cache.check_meta({
            "target": self.fingerprint.to_dict(),
            "topk": self.cfg.topk,
            "max_len": self.cfg.max_len,
            "shard_size": self.cfg.shard_size,
            "data": self.data.description,
        })
        self.vocab = self._choose_vocab()
        torch.manual_seed(self.cfg.seed)
        model = self.family.new_model(self.target, int(self.vocab.ids.numel()))
        model.set_vocab(self.vocab.ids)
        model.init_head_from_target(self.target.model.get_output_embeddings().weight.detach().float())
        self.model = model.float().to(self.device).train()
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay
        )
        if self.state_path.is_file():
            saved = torch.load(self.state_path, map_location="cpu", weights_only=False)
            model.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["optimizer"])
            self.state = TrainState(**saved["state"])
        self._t2d = model.target_to_draft()

    def saved_run_id(self) -> str | None:
        """The MLflow run id recorded by an earlier (interrupted) run in this workdir."""
        if not self.state_path.is_file():
            return None
        return torch.load(self.state_path, map_location="cpu", weights_only=False)["state"].get("mlflow_run_id")

    def _eval_due(self) -> bool:
        cfg, st = self.cfg, self.state
        by_tokens = cfg.eval_every_tokens and st.tokens - max(st.last_eval_tokens, 0) >= cfg.eval_every_tokens
        by_time = cfg.eval_every_minutes and self._elapsed() - st.last_eval_elapsed_s >= 60.0 * cfg.eval_every_minutes
        return bool(by_tokens or by_time)

    def _save_state(self) -> None:
        assert self.model is not None and self.opt is not None
        self.state.elapsed_s = self._elapsed()
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "state": asdict(self.state)}, tmp)
        tmp.replace(self.state_path)

    def _elapsed(self) -> float:
        return self._base_elapsed + (time.perf_counter() - self._t0)

    # ------------------------------------------------------------------ data
    def _shards(self) -> Iterator[tuple[int, list[Any]]]:
        """``(shard index, raw items)`` of the current epoch, starting at the saved shard."""
        it = self.data.items()
        for idx in itertools.count():
            items = list(itertools.islice(it, self.cfg.shard_size))
            if not items:
                return
            if idx >= self.state.shard:
                yield idx, items

    def _heldout_shard(self) -> ShardData | None:
        if not self.data.heldout:
            return None
        return self.cache.get_or_extract("heldout", self.data.heldout, self.target.model, self.target.aux_layers,
                                         self.cfg.topk)

    # ------------------------------------------------------------------ evaluation
    def heldout_metrics(self, heldout: ShardData) -> dict[str, float]:
        """The family's ``heldout.*`` metrics over fixed batches of the held-out shard (plan seed 0),
        in eval mode, without gradients, at the training precision."""
        assert self.model is not None
        batches: Iterator[FeatureBatch] = (
            make_batch(heldout, idx).to(self.device)
            for idx in plan_batches(heldout.lengths(), self.cfg.batch_tokens, seed=0)
        )
        was_training = self.model.training
        self.model.train(False)
        try:
            with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                                 enabled=self.cfg.autocast_bf16):
                return self.family.heldout_metrics(self.model, self.embed, self._t2d, batches,
                                                   self.cfg.ttt_steps)
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def measure_tau(self, prompts: list[list[int]]) -> dict[str, float]:
        """Real greedy speculative decoding on ``prompts`` with the family's drafter over an
        eval-mode copy of the head in the target's dtype (``tau``, ``accepted_per_step``, ...)."""
        head = copy.deepcopy(self.model).to(self.target.dtype).eval()
        return measure_tau(self.target, self.family.eval_drafter(head, self.embed), prompts,
                           self.cfg.eval_max_new_tokens)

    def evaluate(self, heldout: ShardData | None) -> dict[str, float]:
        """Held-out metrics and (if prompts) tau; saves a checkpoint for this point."""
        assert self.model is not None
        metrics: dict[str, float] = {"tokens": float(self.state.tokens)}
        if heldout is not None:
            metrics.update(self.heldout_metrics(heldout))
        if self.data.eval_prompts and self.cfg.eval_prompts:
            t = time.perf_counter()
            tau = self.measure_tau(self.data.eval_prompts[: self.cfg.eval_prompts])
            metrics.update({f"heldout.{k}": v for k, v in tau.items()})
            metrics["heldout.tau_eval_s"] = time.perf_counter() - t
        record = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
        record["tokens"] = self.state.tokens
        record["step"] = self.state.step
        record["elapsed_s"] = round(self._elapsed(), 1)  # wall time so far: extraction, training, evaluations
        self.state.evals.append(record)
        self.state.last_eval_tokens = self.state.tokens
        self.state.last_eval_elapsed_s = self._elapsed()
        ck = self.workdir / "checkpoints" / f"tokens_{self.state.tokens:010d}"
        save_checkpoint(ck, self.model, self.fingerprint, manifest=self.manifest(record),
                        kind=self.family.kind)
        self.sink.log_metrics(metrics, step=self.state.tokens)
        return metrics

    def manifest(self, last_eval: dict | None = None, command: str | None = None) -> dict:
        """What a checkpoint is: target, data, training counters, held-out results, tau curve."""
        assert self.vocab is not None
        last_eval = last_eval or (self.state.evals[-1] if self.state.evals else {})
        return {
            "format": self.family.kind.format,
            "target": {"name": self.target_name, **self.fingerprint.to_dict()},
            "data": self.data.description,
            "draft_vocab": {"size": int(self.vocab.ids.numel()), "coverage": self.vocab.coverage,
                            "counted_tokens": self.vocab.counted_tokens},
            "training": {
                "steps": self.state.step,
                "tokens": self.state.tokens,
                "loss_tokens": self.state.loss_tokens,
                "sequences": self.state.sequences,
                "epochs_started": self.state.epoch + 1,
                "wall_s": round(self._elapsed() if self._t0 else self.state.elapsed_s, 1),
                "last_loss": self.state.last_loss,
                "feature_extract_s": round(self.state.extract_s, 1),
                "feature_shards": {"extracted": self.state.shards_extracted, "reused": self.state.shards_reused},
                "config": self.config_dict(),
            },
            "heldout": last_eval,
            "tau_curve": [
                {"tokens": e["tokens"], "tau": e.get("heldout.tau"), "acc_0": e.get("heldout.acc_0"),
                 "accept_ge": [e.get(f"heldout.accept_ge_{j}") for j in range(1, ACCEPT_DEPTHS + 1)],
                 "elapsed_s": e.get("elapsed_s"), "eval_s": e.get("heldout.tau_eval_s")}
                for e in self.state.evals
            ],
            "command": command,
            "created_unix": int(time.time()),
        }

    # ------------------------------------------------------------------ training
    def _step_generator(self) -> torch.Generator:
        """This optimizer step's random draws: seeded by (seed, step), so a resumed run draws what
        the interrupted one would."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.state.step)

    def _train_step(self, batch: FeatureBatch) -> dict[str, float]:
        assert self.model is not None and self.opt is not None
        cfg = self.cfg
        steps = cfg.curriculum_steps if self.state.tokens < cfg.curriculum_tokens else cfg.ttt_steps
        lr = _lr(cfg, self.state.step, self._progress())
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = batch.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            res = self.family.loss(self.model, self.embed, batch, self._t2d, steps, self._step_generator())
        self.opt.zero_grad(set_to_none=True)
        if res.loss.requires_grad:
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.opt.step()
        self.state.step += 1
        self.state.tokens += batch.num_tokens
        self.state.sequences += batch.input_ids.shape[0]
        self.state.loss_tokens += res.loss_tokens
        self.state.last_loss = float(res.loss.detach())
        out = {"train.loss": self.state.last_loss, "train.lr": lr, "train.ttt_steps": float(steps)}
        out.update(res.metrics)
        return out

    @staticmethod
    def _bar_figures(metrics: dict[str, float]) -> dict[str, str]:
        """Progress-bar postfix: the loss and, when the family reports it, ``train.acc_0``."""
        shown = {"loss": metrics["train.loss"]}
        if "train.acc_0" in metrics:
            shown["acc0"] = metrics["train.acc_0"]
        return {k: f"{v:.3f}" for k, v in shown.items()}

    def _progress(self) -> float:
        frac = self.state.tokens / self.cfg.max_tokens
        if self.cfg.max_minutes:
            frac = max(frac, self._elapsed() / (60.0 * self.cfg.max_minutes))
        return frac

    def _should_stop(self) -> str | None:
        if self._stop_requested:
            return "signal"
        if self.state.tokens >= self.cfg.max_tokens:
            return "max_tokens"
        if self.cfg.max_minutes and self._elapsed() >= 60.0 * self.cfg.max_minutes:
            return "max_minutes"
        return None

    def run(self, export: str | Path | None = None, command: str | None = None) -> dict:
        """Train until a stop condition; evaluate, write the final checkpoint (and ``export``)."""
        self.setup()
        assert self.model is not None
        self._t0 = time.perf_counter()
        self._base_elapsed = self.state.elapsed_s
        self.state.mlflow_run_id = self.sink.run_id or self.state.mlflow_run_id
        old_handler = None
        if self._install_signals:
            old_handler = signal.signal(signal.SIGTERM, self._on_signal)
        self.sink.log_params({"train": self.config_dict(), "target": self.target_name,
                              "draft_vocab_coverage": self.vocab.coverage if self.vocab else None,
                              "data": self.data.description})
        bar = None
        if self.progress:
            bar = tqdm(total=self.cfg.max_tokens, initial=min(self.state.tokens, self.cfg.max_tokens),
                       unit="tok", unit_scale=True, desc=f"train {self.family.name}", dynamic_ncols=True)
        heldout = self._heldout_shard()
        reason = None
        try:
            if self.cfg.eval_at_start and self.state.tokens == 0 and not self.state.evals:
                self.evaluate(heldout)
            while self.state.epoch < self.cfg.epochs:
                trained_any = False
                for shard_idx, items in self._shards():
                    reason = self._should_stop()
                    if reason:
                        break
                    cached = self.cache.has(shard_idx)
                    samples = [] if cached else self.data.to_samples(items)
                    if not cached and not samples:
                        self.state.shard = shard_idx + 1
                        continue
                    t_shard = time.perf_counter()
                    shard = self.cache.get_or_extract(shard_idx, samples, self.target.model,
                                                      self.target.aux_layers, self.cfg.topk)
                    if cached:
                        self.state.shards_reused += 1
                    else:
                        self.state.extract_s += time.perf_counter() - t_shard
                        self.state.shards_extracted += 1
                    plan = plan_batches(shard.lengths(), self.cfg.batch_tokens,
                                        seed=self.cfg.seed * 1_000_003 + self.state.epoch * 10_007 + shard_idx)
                    for b in range(self.state.batch, len(plan)):
                        reason = self._should_stop()
                        if reason:
                            break
                        before = self.state.tokens
                        metrics = self._train_step(make_batch(shard, plan[b]))
                        trained_any = True
                        self.state.batch = b + 1
                        if bar is not None:
                            bar.update(self.state.tokens - before)
                            bar.set_postfix(self._bar_figures(metrics))
                        if self.state.step % self.cfg.log_every_steps == 0:
                            metrics["train.tokens_per_s"] = self.state.tokens / max(self._elapsed(), 1e-9)
                            self.sink.log_metrics(metrics, step=self.state.tokens)
                        if self.state.step % self.cfg.save_every_steps == 0:
                            self._save_state()
                        if self._eval_due():
                            self.evaluate(heldout)
                            self._save_state()
                    reason = reason or self._should_stop()
                    if reason:
                        break
                    self.state.shard = shard_idx + 1
                    self.state.batch = 0
                if reason:
                    break
                self.state.epoch += 1
                self.state.shard = 0
                self.state.batch = 0
                if not trained_any:
                    reason = "data exhausted"
                    break
            reason = reason or "epochs done"
            if reason != "signal" and self.state.last_eval_tokens != self.state.tokens:
                self.evaluate(heldout)
            self.state.done = reason != "signal"
            self._save_state()
            manifest = self.manifest(command=command)
            manifest["training"]["stop_reason"] = reason
            final = save_checkpoint(self.workdir / "final", self.model, self.fingerprint, manifest=manifest,
                                    kind=self.family.kind)
            if export is not None:
                save_checkpoint(export, self.model, self.fingerprint, manifest=manifest,
                                kind=self.family.kind)
            self.sink.log_artifact(final.parent / "manifest.json")
            self.sink.finish("FINISHED" if reason != "signal" else "KILLED")
            return manifest
        except BaseException:
            self._save_state()
            self.sink.finish("FAILED")
            raise
        finally:
            if bar is not None:
                bar.close()
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self._stop_requested = True
