"""``graftblock report``: the committed BENCHMARKS.md, benchmarks/archive.md and README headline are
what the JSON under benchmarks/results/ generates, summary first, every link resolving.

No model weights: only the JSON, the notes and the renderers are read.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import render, report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"(#{1,6}) (.+)", line)
        if m and not in_code:
            a = report.anchor(m.group(2))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_generated_files_are_not_stale():
    stale = report.stale()
    assert not stale, (f"stale against benchmarks/results/*.json: {', '.join(str(p.relative_to(ROOT)) for p in stale)}; "
                       "run `graftblock report` and commit the result")


def test_registry_covers_every_result_kind():
    assert RESULTS, "no result JSON found"
    kinds = {report.kind_of(json.loads(p.read_text()), p) for p in RESULTS}
    assert kinds <= set(render.RENDERERS)
    missing = [p.name for p in RESULTS if p.stem not in report.GROUP_OF]
    assert not missing, f"results without a group in benchmarks/report.py GROUP_OF: {missing}"
    assert set(report.GROUP_OF.values()) <= set(report.GROUPS)
    assert set(report.ARCHIVE_OF) | set(report.ARCHIVE_OF.values()) <= {p.stem for p in RESULTS}


def test_unknown_kind_is_a_clear_error_naming_the_file(tmp_path, monkeypatch):
    bogus = tmp_path / "mystery_run.json"
    bogus.write_text(json.dumps({"kind": "not_a_kind", "env": {}}))
    with pytest.raises(render.UnknownKind, match=r"mystery_run\.json.*not_a_kind"):
        report.kind_of(json.loads(bogus.read_text()), bogus)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    with pytest.raises(render.UnknownKind, match=r"mystery_run\.json"):
        report.result_files()


def test_every_result_is_rendered_once_in_benchmarks_or_archive():
    bench = (ROOT / "BENCHMARKS.md").read_text()
    archive = (ROOT / "benchmarks" / "archive.md").read_text()
    for p in RESULTS:
        raw = f"Raw results: [`{p.relative_to(ROOT)}`]"
        where = (bench.count(raw), archive.count(raw))
        assert where == ((0, 1) if p.stem in report.ARCHIVE_OF else (1, 0)), (p.name, where)


def test_verdict_table_comes_first_then_contents():
    text = (ROOT / "BENCHMARKS.md").read_text()
    h2 = [line for line in text.splitlines() if line.startswith("## ")]
    assert h2[:2] == ["## Verdicts", "## Contents"]
    verdicts = text.split("## Verdicts", 1)[1].split("## Contents", 1)[0]
    table = [line for line in verdicts.splitlines() if line.startswith("|")]
    assert table[0] == "| question | target | measured | date | command | section |"
    assert len(table) - 2 == len(report.CLAIMS)


def test_every_link_resolves_to_a_heading():
    bench = (ROOT / "BENCHMARKS.md").read_text()
    archive = (ROOT / "benchmarks" / "archive.md").read_text()
    readme = (ROOT / "README.md").read_text()
    targets = {"BENCHMARKS.md": _anchors(bench), "archive.md": _anchors(archive)}
    checks = [(bench, "", "BENCHMARKS.md"), (bench, "BENCHMARKS.md", "BENCHMARKS.md"),
              (archive, "../BENCHMARKS.md", "BENCHMARKS.md"), (archive, "", "archive.md"),
              (readme.split(report.HEADLINE_BEGIN)[1].split(report.HEADLINE_END)[0], "BENCHMARKS.md", "BENCHMARKS.md")]
    n = 0
    for text, prefix, target in checks:
        for a in re.findall(rf"\]\({re.escape(prefix)}#([^)]+)\)", text):
            assert a in targets[target], f"{prefix}#{a} names no heading of {target}"
            n += 1
    toc = bench.split("## Contents", 1)[1]
    assert n > 60 and toc.count("](#") >= len(RESULTS) - len(report.ARCHIVE_OF)
    for link in re.findall(r"\]\((benchmarks/results/[^)]+)\)", bench):  # raw results and plots exist
        assert (ROOT / link).exists(), link
    for link in re.findall(r"\]\((results/[^)]+)\)", archive):
        assert (ROOT / "benchmarks" / link).exists(), link


def test_headline_rows_come_from_the_json():
    table = report.headline(report.result_files())
    rows = table.splitlines()[2:]
    assert len(rows) == sum(c.headline is not None for c in report.CLAIMS) >= 5
    assert all(row.count("](BENCHMARKS.md#") == 1 for row in rows)


def test_check_names_what_is_stale(tmp_path, monkeypatch, capsys):
    paths = {}
    for name, src in (("BENCHMARKS.md", report.BENCHMARKS), ("archive.md", report.ARCHIVE),
                      ("README.md", report.README)):
        paths[name] = tmp_path / name
        shutil.copy(src, paths[name])
    monkeypatch.setattr(report, "BENCHMARKS", paths["BENCHMARKS.md"])
    monkeypatch.setattr(report, "ARCHIVE", paths["archive.md"])
    monkeypatch.setattr(report, "README", paths["README.md"])
    check = argparse.Namespace(check=True)
    assert report.run(check) == 0
    paths["archive.md"].write_text(paths["archive.md"].read_text() + "\nedited by hand\n")
    assert report.run(check) == 1
    err = capsys.readouterr().err
    assert "stale" in err and "archive.md" in err and "BENCHMARKS.md" not in err.split("differ")[0]
    assert report.run(argparse.Namespace(check=False)) == 0
    assert report.run(check) == 0


def test_cli_wires_the_report_subcommand():
    from graftblock import cli

    args = cli.build_parser().parse_args(["report", "--check"])
    assert args.func is cli.cmd_report and args.check is True


def test_no_rendered_page_points_outside_the_repository():
    """A result that recorded an absolute dataset path outside the checkout (an early sweep read
    Spec-Bench from a shared folder) renders it by its last two parts, with a note; names and
    paths in the repo render as recorded."""
    outside = "/somewhere/else/spec_bench/question.jsonl"
    assert render.dataset_label(outside) == "spec_bench/question.jsonl"
    assert "ship in the package as `--dataset spec_bench`" in render.dataset_note(outside)
    inside = str(render.ROOT / "benchmarks" / "data.jsonl")
    for name in ("code_edit", "data/x.jsonl", inside):
        assert render.dataset_label(name) == name and render.dataset_note(name) == ""
    beside = re.compile(r"(?:\.\./|/work/)shared/")  # the folder beside a checkout that a clone lacks
    for page in ("BENCHMARKS.md", "benchmarks/archive.md", "README.md"):
        text = (render.ROOT / page).read_text(encoding="utf-8")
        assert not beside.search(text), f"{page} points at a folder beside the checkout"
