"""Modules stay small: a file of the library longer than ~500 lines says at its top why.

The layout is meant to show the architecture (one concern per module); a module that grows past
this size either splits or states the reason in the first lines of its docstring, where a reader
opening it sees it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "taco_triton"
MAX_LINES = 500
REASON = "Longer than the project's ~500 lines per module"

LONG = sorted(p for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > MAX_LINES)


@pytest.mark.parametrize("path", LONG, ids=[str(p.relative_to(PACKAGE)) for p in LONG])
def test_a_long_module_says_why_at_its_top(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    head = " ".join(doc.split("\n\n")[:2]).replace("\n", " ")
    assert REASON in head, (f"{path.relative_to(PACKAGE)} has {len(path.read_text().splitlines())} lines: split it, or "
                            f"say why in its docstring's first two paragraphs ('({REASON}: ...)')")
