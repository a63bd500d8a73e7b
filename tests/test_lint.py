"""The package and its scripts pass pyflakes: a name lost in a move (an import a refactor dropped)
fails here instead of on the GPU machine (session 15: `ostinato skew --max-sessions` raised
NameError there, on a path no other test ran)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("folder", ["ostinato", "scripts"])
def test_pyflakes_finds_nothing(folder):
    out, err = io.StringIO(), io.StringIO()
    found = pyflakes_api.checkRecursive([str(ROOT / folder)], Reporter(out, err))
    assert found == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
