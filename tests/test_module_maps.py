"""Each package's module map is true to its folder (issue 41): the map in a package's
`__init__.py` docstring names every module and subpackage the folder holds, and names nothing
it does not.

The one format every map follows: a line of the docstring indented exactly four spaces, whose
first word is a module's name (`loop`) or a subpackage's with a slash (`engine/`), followed by
two spaces or the end of the line; its description may go on in lines indented deeper. Other
four-space lines whose first word is not a bare name followed by two spaces (`token.lock   …`,
`queue/*      …`) are not map entries. `__init__` and `__main__` may be named; `__main__` need
not be.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "arbiterd"
_ENTRY = re.compile(r"^ {4}(?P<name>[A-Za-z_]\w*)(?P<slash>/?)(?= {2}|$)", re.M)
# Modules a map may leave out: the package's own file, and `python -m` entry points.
_MAY_GO_UNNAMED = {"__init__", "__main__"}


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)


def _map(package: Path) -> tuple[set[str], set[str]]:
    """(modules, subpackages) the package's docstring names."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    modules: set[str] = set()
    subpackages: set[str] = set()
    for match in _ENTRY.finditer(doc or ""):
        (subpackages if match["slash"] else modules).add(match["name"])
    return modules, subpackages


def _folder(package: Path) -> tuple[set[str], set[str]]:
    """(modules, subpackages) the folder holds."""
    modules = {p.stem for p in package.glob("*.py")}
    subpackages = {
        p.name
        for p in package.iterdir()
        if p.is_dir() and not p.is_symlink() and (p / "__init__.py").is_file()
    }
    return modules, subpackages


def test_every_folder_of_python_modules_is_a_package() -> None:
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert (
        sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []
    )


def test_the_rule_reads_the_maps_it_was_written_for() -> None:
    # A rule that read nothing would pass every folder: it must see the known entries.
    modules, subpackages = _map(PACKAGE / "worker")
    assert {"loop", "residency", "policy"} <= modules
    assert subpackages == {"engine"}
    modules, _ = _map(PACKAGE / "arena")
    assert "token" in modules
    assert "queue" not in modules  # token.lock and queue/* are the arena's files, not modules


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_module_map_names_exactly_what_the_folder_holds(package: Path) -> None:
    named_modules, named_subpackages = _map(package)
    modules, subpackages = _folder(package)
    unnamed = sorted(
        (modules - _MAY_GO_UNNAMED - named_modules)
        | {f"{s}/" for s in subpackages - named_subpackages}
    )
    absent = sorted((named_modules - modules) | {f"{s}/" for s in named_subpackages - subpackages})
    where = f"{package.relative_to(ROOT)}/__init__.py"
    assert unnamed == [], f"{where}: its map does not name {unnamed}"
    assert absent == [], f"{where}: its map names {absent}, which the folder does not hold"
