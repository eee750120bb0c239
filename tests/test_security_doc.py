"""docs/security.md cites the tests that check each defence: every test it names must exist.

A citation is a backticked `tests/PATH.py`, `tests/PATH.py::test_name` (with `::test_more`
continuing the last file named), or a bare `test_name` (a test defined somewhere under tests/,
as in the tables whose header names the file). A test renamed or removed without its line in the
doc fails here, so the doc never vouches for a check that no longer runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
_SPAN = re.compile(r"`([^`]+)`")
_FILE_TEST = re.compile(r"^(tests/[\w/]+\.py)(?:::(\w+))?$")
_MORE = re.compile(r"^::(test_\w+)$")
_BARE = re.compile(r"^test_\w+$")


def _tests_in(path: Path) -> set[str]:
    """The names of every test function (at module level or in a class) a file defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def _citations() -> list[tuple[str, str | None]]:
    """(file or None, test or None) for every citation, in the doc's order."""
    cited: list[tuple[str, str | None]] = []
    last_file: str | None = None
    for raw in _SPAN.findall(DOC.read_text(encoding="utf-8")):
        span = raw.strip()
        if match := _FILE_TEST.match(span):
            last_file = match.group(1)
            cited.append((last_file, match.group(2)))
        elif (match := _MORE.match(span)) and last_file is not None:
            cited.append((last_file, match.group(1)))
        elif _BARE.match(span):
            cited.append(("", span))
    return cited


def test_every_test_the_security_doc_cites_exists() -> None:
    everywhere: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        everywhere |= _tests_in(path)
    cited = _citations()
    missing = []
    for file, test in cited:
        if not file:
            if test not in everywhere:
                missing.append(f"`{test}` (no test of that name under tests/)")
            continue
        path = ROOT / file
        if not path.is_file():
            missing.append(f"`{file}` (no such file)")
        elif test is not None and test not in _tests_in(path):
            missing.append(f"`{file}::{test}`")
    assert len(cited) > 50, f"the doc's citations were not found ({len(cited)}): a new form?"
    assert not missing, "docs/security.md cites tests that do not exist:\n" + "\n".join(missing)
