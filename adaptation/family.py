"""What a drafter family brings to training, behind one small protocol.

The :class:`~adaptation.trainer.Trainer` owns everything the families share: the training text,
the feature cache, the draft vocabulary, batches, the optimizer and its schedule, resume, the
evaluation schedule, checkpoints, the manifest and run logging. A family (a
:class:`DrafterFamily`) contributes only what differs between drafters:

* its network (:meth:`DrafterFamily.new_model`) and checkpoint format (``kind``);
* its loss over a batch of cached features (:meth:`DrafterFamily.loss`);
* its held-out metrics (:meth:`DrafterFamily.heldout_metrics`);
* the drafter that decodes with the trained head for the tau measurement
  (:meth:`DrafterFamily.eval_drafter`);
* its own knobs (the family object's fields, validated on construction), its defaults for the
  shared ``unroll`` knobs, and the command-line flags that set its knobs.

:mod:`adaptation.families` maps ``graftblock train <name>`` to the registered families.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from adaptation.batches import FeatureBatch
from speculation.config import ConfigError
from speculation.drafters.base import Drafter
from speculation.drafters.checkpoint import CheckpointKind


def check_knob(name: str, ok: bool, rule: str, value: Any) -> None:
    """Raise ``ConfigError("train.<name> must be <rule>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"train.{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class StepLoss:
    """One training batch's loss and what the trainer logs of it.

    Attributes:
        loss: the scalar to backpropagate (fp32).
        metrics: ``train.*`` figures of this batch (``train.acc_0``: top-1 agreement of the first
            drafted position, shown on the progress bar when present).
        loss_tokens: rows the first drafted position's loss counted.
    """

    loss: torch.Tensor
    metrics: dict[str, float]
    loss_tokens: int


class DraftNetwork(Protocol):
    """A draft head as the trainer drives it: an ``nn.Module`` over a reduced draft vocabulary
    (see :class:`~speculation.drafters.head.DraftVocabMixin`) with an ``arch`` that has ``to_dict``."""

    arch: Any

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Take the draft vocabulary: ``[N_d]`` sorted target ids."""
        ...

    def init_head_from_target(self, target_head_weight: torch.Tensor) -> None:
        """Start the LM head from the target's output rows ``[V, H]`` of the draft tokens."""
        ...

    def target_to_draft(self) -> torch.Tensor:
        """``[V]`` draft id of every target id, -1 outside the draft vocabulary."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def float(self) -> Any: ...

    @property
    def training(self) -> bool: ...


class DrafterFamily(Protocol):
    """One drafter family's training plug-in (see the module docstring).

    Implementations are frozen dataclasses whose fields are the family's knobs; ``name``,
    ``kind`` and ``unroll_defaults`` are class constants.
    """

    @property
    def name(self) -> str:
        """The ``graftblock train`` sub-command (``eagle3``, ``specblock``); also the run label."""
        ...

    @property
    def kind(self) -> CheckpointKind:
        """The checkpoint format the trained head is saved in."""
        ...

    @property
    def unroll_defaults(self) -> Mapping[str, int]:
        """This family's defaults for the shared ``ttt_steps`` and ``curriculum_steps`` knobs
        (what one unrolled step is belongs to the family: a draft step, a block, ...)."""
        ...

    def config_dict(self) -> dict[str, Any]:
        """The family's knobs as recorded beside the shared ones (manifest, MLflow params)."""
        ...

    def new_model(self, target: Any, draft_vocab_size: int) -> DraftNetwork:
        """A freshly initialised head (global RNG, seeded by the trainer) for ``target``."""
        ...

    def loss(
        self,
        model: Any,
        embed_weight: torch.Tensor,
        batch: FeatureBatch,
        target_to_draft: torch.Tensor,
        steps: int,
        generator: torch.Generator,
    ) -> StepLoss:
        """The training loss of ``batch`` with ``steps`` unrolled steps.

        ``embed_weight`` ``[V, H]``: the target's input embedding (frozen); ``target_to_draft``
        ``[V]``: the head's map to draft ids; ``generator``: this optimizer step's random draws,
        seeded by (seed, step), so a resumed run draws what the interrupted one would.
        """
        ...

    def heldout_metrics(
        self,
        model: Any,
        embed_weight: torch.Tensor,
        target_to_draft: torch.Tensor,
        batches: Iterable[FeatureBatch],
        steps: int,
    ) -> dict[str, float]:
        """``heldout.*`` figures over the held-out batches (the trainer sets eval mode, no-grad and
        the training precision); ``steps``: the configured unroll (``ttt_steps``)."""
        ...

    def eval_drafter(self, head: Any, embed_weight: torch.Tensor) -> Drafter:
        """The drafter that decodes with ``head`` (an eval-mode copy in the target's dtype) for
        the tau measurement."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags that set this family's knobs to ``graftblock train <name>``."""
        ...

    def configure(self, flags: Mapping[str, Any]) -> DrafterFamily:
        """This family with the knobs given by parsed flag values (``flags``: values by dest)."""
        ...
