"""Shared pytest setup: keep Hugging Face offline and make the repo importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module with one torch intra-op thread (tiny models are much faster that way).

    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    from tests.helpers import single_thread

    with single_thread():
        yield
