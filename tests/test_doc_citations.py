"""Every test the prose cites exists (issue 41): the docs vouch only for checks that still run.

Read: docs/*.md, README.md, benchmarks/README.md, and the package's own text (arbiterd/**/*.py,
its docstrings and comments, and arbiterd/**/*.md). A citation is

- a path under tests/ (`tests/PATH.py`, `tests/gui/replay-sample.jsonl`, `tests/device`): it
  must exist;
- `tests/PATH.py::test_name` (`::test_more` may follow, and in Markdown a backticked
  `::test_more` continues the last file named): the file must define that test, at module level
  or in a class;
- in Markdown, a backticked bare `test_name` (as in the tables whose header names the file): a
  test of that name must be defined somewhere under tests/.

A test renamed or removed without its line in the doc fails here. (docs/security.md's citations
were checked alone before issue 41, by the rules above.)
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECURITY_DOC = ROOT / "docs" / "security.md"
# A path under tests/, with any `::name`s after it; a trailing dot or comma is the sentence's.
_PATH = re.compile(r"(?<![\w/.-])tests/[\w/.*-]*?(?=[.,:;]?(?:[^\w/.*-]|$)|::)((?:::\w+)*)")
_SPAN = re.compile(r"`([^`]+)`")
_MORE = re.compile(r"^::(test_\w+)$")
_BARE = re.compile(r"^test_\w+$")


def _texts() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    package = sorted(p for p in (ROOT / "arbiterd").rglob("*") if p.suffix in {".py", ".md"})
    return [*docs, ROOT / "README.md", ROOT / "benchmarks" / "README.md", *package]


@cache
def _tests_in(path: Path) -> frozenset[str]:
    """The names of every test function (at module level or in a class) a file defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    )


@cache
def _every_test() -> frozenset[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names |= _tests_in(path)
    return frozenset(names)


def _citations(text: str, markdown: bool) -> list[tuple[str, str | None]]:
    """(path or "", test or None) for every citation in a text, in its order."""
    cited: list[tuple[str, str | None]] = []
    for found in _PATH.finditer(text):
        path = found.group(0)[: len(found.group(0)) - len(found.group(1))].rstrip("/")
        tests = [name for name in found.group(1).split("::") if name]
        cited.append((path, None))
        cited.extend((path, test) for test in tests)
    if markdown:
        last_file: str | None = None
        for raw in _SPAN.findall(text):
            span = raw.strip()
            if span.startswith("tests/") and ".py" in span:
                last_file = span.split("::")[0]
            elif (match := _MORE.match(span)) and last_file is not None:
                cited.append((last_file, match.group(1)))
            elif _BARE.match(span):
                cited.append(("", span))
    return cited


def _missing(cited: list[tuple[str, str | None]]) -> list[str]:
    missing = []
    for path, test in cited:
        if not path:
            if test not in _every_test():
                missing.append(f"`{test}` (no test of that name under tests/)")
        elif "*" in path:
            if not list(ROOT.glob(path)):
                missing.append(f"`{path}` (matches nothing)")
        elif not (ROOT / path).exists():
            missing.append(f"`{path}` (no such file)")
        elif test is not None and test not in _tests_in(ROOT / path):
            missing.append(f"`{path}::{test}`")
    return missing


def test_every_test_the_docs_and_the_package_cite_exists() -> None:
    missing = []
    for text in _texts():
        cited = _citations(text.read_text(encoding="utf-8"), markdown=text.suffix == ".md")
        missing += [f"{text.relative_to(ROOT)}: {what}" for what in _missing(cited)]
    assert missing == [], "cited tests that do not exist:\n" + "\n".join(missing)


def test_the_security_doc_cites_a_test_for_its_claims() -> None:
    # Its tables cite a test per defence; finding few means the citations took a new form.
    cited = _citations(SECURITY_DOC.read_text(encoding="utf-8"), markdown=True)
    assert len({c for c in cited if c[1]}) > 50


def test_a_citation_of_a_test_that_is_gone_is_caught() -> None:
    text = (
        "`tests/test_doc_citations.py::test_a_citation_of_a_test_that_is_gone_is_caught`, "
        "`::test_no_such_test`; see tests/no_such_file.py and `test_nor_this_one`."
    )
    assert _missing(_citations(text, markdown=True)) == [
        "`tests/no_such_file.py` (no such file)",
        "`tests/test_doc_citations.py::test_no_such_test`",
        "`test_nor_this_one` (no test of that name under tests/)",
    ]
