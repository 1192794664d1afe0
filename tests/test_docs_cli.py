"""docs/cli.md's usage blocks are generated from the parsers; a flag added without regenerating
them (``python docs/gen_cli.py``) fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", REPO / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_matches_the_parsers(monkeypatch, capsys):
    """In process (the CLI is imported once for the session, not per check): the same check as
    ``python docs/gen_cli.py --check``."""
    gen = _gen_cli()
    monkeypatch.setenv("COLUMNS", gen.WIDTH)  # render() sets it; restored after the test
    rc = gen.main(["--check"])
    assert rc == 0, f"docs/cli.md is stale; run `python docs/gen_cli.py`:\n{capsys.readouterr().err}"


def test_a_stale_block_is_reported_by_name(monkeypatch, tmp_path, capsys):
    """The check can fail: a doc whose bench block lost a line is stale for ``graftblock bench``."""
    gen = _gen_cli()
    monkeypatch.setenv("COLUMNS", gen.WIDTH)
    text = gen.DOC.read_text(encoding="utf-8")
    stale = tmp_path / "cli.md"
    m = next(b for b in gen.BLOCK.finditer(text) if b.group("cmd") == "graftblock bench")
    body = m.group("body")
    stale.write_text(text.replace(body, body.split("\n", 1)[1], 1), encoding="utf-8")
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
    assert "stale for: graftblock bench" in capsys.readouterr().err
