"""docs/cli.md's usage blocks are generated from the parsers; a flag added without regenerating
them (``python docs/gen_cli.py``) fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_cli_reference_matches_the_parsers():
    res = subprocess.run([sys.executable, "docs/gen_cli.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, f"docs/cli.md is stale; run `python docs/gen_cli.py`:\n{res.stdout}{res.stderr}"
