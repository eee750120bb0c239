"""docs/architecture.md stays true to the tree: every path it names exists, and it stays a page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
# A path of the repository, as the page names one: `arbiterd/daemon/models/slots.py`.
PATH_RE = re.compile(r"`((?:arbiterd|docs|tests|benchmarks|packaging|scripts)/[\w./-]*)`")
# Five minutes of reading at a careful pace.
MAX_WORDS = 1500


def test_every_path_the_page_names_exists() -> None:
    named = PATH_RE.findall(DOC.read_text(encoding="utf-8"))
    assert len(named) > 20  # the page names the modules it describes, in backticks
    missing = sorted({path for path in named if not (ROOT / path).exists()})
    assert missing == []


def test_the_page_reads_in_five_minutes() -> None:
    assert len(DOC.read_text(encoding="utf-8").split()) <= MAX_WORDS


def test_the_readme_links_the_page() -> None:
    assert "docs/architecture.md" in (ROOT / "README.md").read_text(encoding="utf-8")
