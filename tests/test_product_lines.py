"""bench/product_lines.py sorts commits by the issues their messages name, in every spelling the
history uses, and counts code lines without blank lines, imports and docstrings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from product_lines import code_line_numbers, issues_named  # noqa: E402


@pytest.mark.parametrize(("message", "named"), [
    ("bench: one copy of the cell (issue 22)", {22}),
    ("kernels: one paged-attention kernel (issue 22 duplicates): the wrapper is gone", {22}),
    ("Issue 22: host time per decode step measured", {22}),
    ("the step's fast paths reuse the shared rules (issues 22, 30)", {22, 30}),
    ("Recover the work of the previous stop (issues 22-27: engine reshape, isolation)", set(range(22, 28))),
    ("engine_throughput vs llama.cpp, quiet rerun (issue 30)", {30}),
    ("Merge branch 'llamacpp'", set()),
])
def test_issues_named_reads_every_spelling(message: str, named: set[int]):
    assert issues_named(message) == named


def test_code_lines_leave_out_blank_lines_imports_and_docstrings():
    text = ('"""Module docstring\n\nover three lines."""\n'
            "from __future__ import annotations\n"
            "import ast\n"
            "\n"
            "def f(x: int) -> int:\n"
            '    """One line."""\n'
            "    return x + 1\n")
    assert code_line_numbers(text) == {7, 9}
