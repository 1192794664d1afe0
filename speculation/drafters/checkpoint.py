"""Drafter checkpoints (EAGLE-3, SpecBlock): one ``model.safetensors`` (+ an optional ``manifest.json``).

A :class:`CheckpointKind` names the format string, the architecture dataclass and the network
class of one drafter family; every function takes the kind (EAGLE-3 by default).

The safetensors header metadata records the format, the head's architecture and a fingerprint
of the target it was trained for. Loading checks the fingerprint against the live target and
refuses a mismatch (another model, another hidden size or vocabulary, other aux layers) with an
error that names every differing field. The target's embeddings are never stored: the drafter
takes them from the target at build time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speculation.drafters.eagle3_model import Eagle3Arch, Eagle3Model
from speculation.drafters.specblock_model import SpecBlockArch, SpecBlockModel
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
_SIGNATURE_ROWS = 8
_SIGNATURE_RTOL = 1e-2


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, malformed, or made for another target)."""


@dataclass(frozen=True)
class CheckpointKind:
    """One drafter family's checkpoint format."""

    format: str
    label: str
    method: str  # the method / ``graftblock train`` subcommand name
    arch_cls: type
    model_cls: type


EAGLE3 = CheckpointKind("graftblock-eagle3/1", "EAGLE-3", "eagle3", Eagle3Arch, Eagle3Model)
SPECBLOCK = CheckpointKind("graftblock-specblock/1", "SpecBlock", "specblock", SpecBlockArch, SpecBlockModel)
CHECKPOINT_ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
"""Where ``checkpoint: auto`` looks for a checkpoint matching the target (``<repo>/checkpoints``)."""
AUTO = "auto"


@dataclass(frozen=True)
class TargetFingerprint:
    """What identifies a target for a drafter: shapes, aux layers and an embedding signature.

    ``embed_signature`` holds the L2 norms of a few fixed embedding rows; it separates targets
    with identical shapes (e.g. a base and an instruct model) and survives fp32/bf16 casts.
    """

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    embed_signature: tuple[float, ...]

    @classmethod
    def from_target(cls, target: Any, name: str | None = None) -> "TargetFingerprint":
        """Fingerprint of a :class:`~speculation.model.target.TargetModel` (needs ``target.model``)."""
        model = target.model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        weight = model.get_input_embeddings().weight
        return cls(
            name=name or str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "")),
            model_type=str(getattr(cfg, "model_type", "")),
            hidden_size=int(target.hidden_size),
            num_layers=int(target.num_layers),
            vocab_size=int(target.vocab_size),
            aux_layers=tuple(int(i) for i in target.aux_layers),
            embed_signature=embedding_signature(weight),
        )

    @classmethod
    def from_dict(cls, d: dict) -> "TargetFingerprint":
        return cls(
            name=str(d["name"]),
            model_type=str(d["model_type"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_layers"]),
            vocab_size=int(d["vocab_size"]),
            aux_layers=tuple(int(i) for i in d["aux_layers"]),
            embed_signature=tuple(float(x) for x in d["embed_signature"]),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        d["embed_signature"] = list(self.embed_signature)
        return d

    def mismatches(self, live: "TargetFingerprint") -> list[str]:
        """Human-readable differences ``checkpoint vs live target`` (empty when compatible)."""
        out = []
        for field in ("model_type", "hidden_size", "num_layers", "vocab_size", "aux_layers"):
            a, b = getattr(self, field), getattr(live, field)
            if a != b:
                out.append(f"{field}: checkpoint {a!r} != target {b!r}")
        if not out and not _close(self.embed_signature, live.embed_signature):
            out.append(
                "embedding signature differs (same shapes, different weights): the checkpoint was trained "
                f"for target {self.name!r}, not {live.name!r}"
            )
        return out


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=_SIGNATURE_RTOL, abs_tol=1e-6) for x, y in zip(a, b))


def embedding_signature(weight: torch.Tensor) -> tuple[float, ...]:
    """L2 norms (fp64) of ``_SIGNATURE_ROWS`` evenly spaced rows of the embedding matrix ``[V, H]``."""
    rows = torch.linspace(0, weight.shape[0] - 1, _SIGNATURE_ROWS).long()
    with torch.no_grad():
        norms = weight.detach()[rows].double().norm(dim=-1)
    return tuple(round(float(x), 6) for x in norms)


def _weights_path(path: str | Path, kind: CheckpointKind = EAGLE3) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / WEIGHTS_FILE
    if not p.is_file():
        raise CheckpointError(f"{kind.label} checkpoint not found: {p}")
    return p


def save_checkpoint(
    path: str | Path,
    model: Eagle3Model | SpecBlockModel,
    fingerprint: TargetFingerprint,
    dtype: torch.dtype = torch.bfloat16,
    manifest: dict | None = None,
    kind: CheckpointKind = EAGLE3,
) -> Path:
    """Write ``model.safetensors`` (float tensors cast to ``dtype``) and, if given, ``manifest.json``.

    ``path`` is a directory (created) or a ``.safetensors`` file. Writes go through a temporary
    file and an atomic rename, so a killed process never leaves a half-written checkpoint.
    """
    p = Path(path)
    if p.suffix == ".safetensors":
        p.parent.mkdir(parents=True, exist_ok=True)
        weights = p
    else:
        p.mkdir(parents=True, exist_ok=True)
        weights = p / WEIGHTS_FILE
    tensors = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in model.state_dict().items()
    }
    meta = {
        "format": kind.format,
        "arch": json.dumps(model.arch.to_dict()),
        "target": json.dumps(fingerprint.to_dict()),
    }
    tmp = weights.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)  # safetensors creates 0600 files; checkpoints are meant to be shared/committed
    tmp.replace(weights)
    if manifest is not None:
        mpath = weights.parent / MANIFEST_FILE if weights.name == WEIGHTS_FILE else weights.with_suffix(".json")
        mtmp = mpath.with_suffix(".json.tmp")
        mtmp.write_text(json.dumps(manifest, indent=1, sort_keys=False))
        mtmp.replace(mpath)
    return weights


def read_header(path: str | Path, kind: CheckpointKind = EAGLE3) -> tuple[Any, TargetFingerprint]:
    """Architecture and target fingerprint from a checkpoint's metadata (tensors not read)."""
    weights = _weights_path(path, kind)
    try:
        with safe_open(str(weights), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # not a safetensors file
        raise CheckpointError(f"{weights}: not a readable safetensors file ({exc})") from exc
    if meta.get("format") != kind.format:
        raise CheckpointError(
            f"{weights}: not a {kind.label} checkpoint (format {meta.get('format')!r}, want {kind.format!r})"
        )
    arch = kind.arch_cls(**json.loads(meta["arch"]))
    return arch, TargetFingerprint.from_dict(json.loads(meta["target"]))


def check_compatible(
    path: str | Path, live: TargetFingerprint, kind: CheckpointKind = EAGLE3
) -> tuple[Any, TargetFingerprint]:
    """Raise :class:`CheckpointError` naming every mismatch between the checkpoint and ``live``."""
    arch, fp = read_header(path, kind)
    problems = fp.mismatches(live)
    if arch.hidden_size != live.hidden_size and not any(m.startswith("hidden_size") for m in problems):
        problems.append(f"hidden_size: checkpoint head width {arch.hidden_size} != target {live.hidden_size}")
    if arch.target_vocab_size != live.vocab_size and not any(m.startswith("vocab_size") for m in problems):
        problems.append(f"vocab_size: checkpoint {arch.target_vocab_size} != target {live.vocab_size}")
    if problems:
        raise CheckpointError(
            f"{kind.label} checkpoint {path} does not fit this target ({live.name!r}); it was trained for "
            f"{fp.name!r}: " + "; ".join(problems)
        )
    return arch, fp


def load_checkpoint(
    path: str | Path, live: TargetFingerprint, dtype: torch.dtype = torch.float32, kind: CheckpointKind = EAGLE3
) -> Any:
    """The network (``kind.model_cls``) from ``path`` after checking it against the live target."""
    arch, _ = check_compatible(path, live, kind)
    model = kind.model_cls(arch)
    weights = _weights_path(path, kind)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            state[key] = f.get_tensor(key)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{weights}: missing tensors {missing}, unexpected tensors {unexpected}")
    for key, value in model.state_dict().items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise CheckpointError(f"{weights}: tensor {key} has shape {tuple(state[key].shape)}, want {tuple(value.shape)}")
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()})
    return model.to(dtype).eval()


def find_checkpoint(root: str | Path, live: TargetFingerprint, kind: CheckpointKind = EAGLE3) -> Path | None:
    """The first ``<root>/*/model.safetensors`` of ``kind`` whose fingerprint matches ``live`` (by name)."""
    base = Path(root)
    if not base.is_dir():
        return None
    for cand in sorted(base.glob(f"*/{WEIGHTS_FILE}")):
        try:
            _, fp = read_header(cand, kind)
        except CheckpointError:
            continue
        if not fp.mismatches(live):
            return cand.parent
    return None


def read_manifest(path: str | Path) -> dict | None:
    """The ``manifest.json`` beside a checkpoint, if any."""
    weights = _weights_path(path)
    m = weights.parent / MANIFEST_FILE
    return json.loads(m.read_text()) if m.is_file() else None


def load_for_target(checkpoint: str, target: Any, kind: CheckpointKind, root: Path = CHECKPOINT_ROOT) -> Any:
    """The network for ``target`` from ``checkpoint``: a path, or ``auto`` = the first checkpoint of
    ``kind`` under ``root`` whose fingerprint matches the target (fp32; the caller casts it)."""
    live = TargetFingerprint.from_target(target)
    if checkpoint == AUTO:
        found = find_checkpoint(root, live, kind)
        if found is None:
            raise CheckpointError(
                f"no {kind.label} checkpoint for target {live.name!r} (hidden {live.hidden_size}, vocab "
                f"{live.vocab_size}) under {root}; train one with `graftblock train {kind.method}`, "
                f"pass {kind.method}.checkpoint: PATH, or use checkpoint: random"
            )
        path = found
    else:
        path = Path(checkpoint).expanduser()
    return load_checkpoint(path, live, kind=kind)
