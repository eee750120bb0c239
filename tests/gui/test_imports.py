"""The tray is only a client: of arbiterd's own modules, its modules import only the shared
records and their states, rendering, errors, config and paths, and the control protocol
(issue 17)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import arbiterd.gui

GUI = Path(arbiterd.gui.__file__).parent
ALLOWED = frozenset(
    {
        "arbiterd.events",
        "arbiterd.states",
        "arbiterd.status",
        "arbiterd.render",
        "arbiterd.errors",
        "arbiterd.config",
        "arbiterd.paths",
        "arbiterd.control",
        "arbiterd.wire",
    }
)


def arbiterd_imports(source: str) -> set[str]:
    """Every arbiterd module `source` imports, at its top or inside a function: a `from arbiterd
    import x` names arbiterd.x, since x may be a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if node.module == "arbiterd":
                found |= {f"arbiterd.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return {name for name in found if name == "arbiterd" or name.startswith("arbiterd.")}


def test_the_check_sees_every_kind_of_import() -> None:
    source = (
        "import arbiterd.cli.main\n"
        "from arbiterd import events, render\n"
        "from arbiterd.gui import palette\n"
        "def later():\n"
        "    from arbiterd.daemon.supervisor import Supervisor\n"
    )
    assert arbiterd_imports(source) == {
        "arbiterd.cli.main",
        "arbiterd.events",
        "arbiterd.render",
        "arbiterd.gui",
        "arbiterd.daemon.supervisor",
    }


def test_every_gui_module_is_checked() -> None:
    names = {path.name for path in GUI.glob("*.py")}
    assert {"app.py", "connection.py", "state.py", "tray.py", "history.py"} <= names


@pytest.mark.parametrize("path", sorted(GUI.glob("*.py")), ids=lambda p: p.name)
def test_a_gui_module_imports_neither_the_cli_nor_the_daemon(path: Path) -> None:
    imported = arbiterd_imports(path.read_text(encoding="utf-8"))
    outside = {
        name
        for name in imported
        if name not in ALLOWED and name != "arbiterd.gui" and not name.startswith("arbiterd.gui.")
    }
    assert not outside, f"{path.name} imports {sorted(outside)}"
