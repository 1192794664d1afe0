"""The asset cache (``$GRAFTBLOCK_CACHE``, by default ``~/.cache/graftblock``) and the file
operations every asset shares: inter-process locks, atomic writes, hashing, permissions.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


CACHE_ENV = "GRAFTBLOCK_CACHE"


_DEFAULT_CACHE = Path("~/.cache/graftblock")


CHUNK_BYTES = 1 << 20


class AssetError(RuntimeError):
    """A model or data set could not be found, fetched, verified or parsed."""


def cache_dir() -> Path:
    """Root of the asset cache: ``$GRAFTBLOCK_CACHE`` or ``~/.cache/graftblock``."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    return Path(raw).expanduser() if raw else _DEFAULT_CACHE.expanduser()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
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


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share(path: Path) -> None:
    """Give ``path`` (and, for a folder, what it holds) the modes the umask allows.

    ``tempfile`` creates private (0600/0700) files; cache entries are meant to be
    readable like any other file the user writes.
    """
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def remove_stale(parent: Path, pattern: str) -> None:
    """Remove temporaries a killed run left behind (call with the matching lock held)."""
    for stale in parent.glob(pattern):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[Any]:
    """Open a temporary file next to ``target``; rename it onto ``target`` on success."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        share(Path(tmp_name))
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
