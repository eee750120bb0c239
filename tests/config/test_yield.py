"""The [yield] table (issue 45): for which programs that do not take part the daemon steps
aside. Its defaults, each key read, and each bad value refused with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbiterd.config import YieldRules, load_config
from arbiterd.errors import ConfigError

MINIMAL = '[models.qwen]\npath = "/models/qwen.gguf"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def rules(tmp_path: Path, env: dict[str, str], table: str) -> YieldRules:
    """The rules of a config whose [yield] table holds `table`."""
    return load_config(write(tmp_path, f"{MINIMAL}\n[yield]\n{table}\n"), env=env).yield_rules


def test_without_a_yield_table_the_defaults_apply(tmp_path: Path, env: dict[str, str]) -> None:
    absent = load_config(write(tmp_path, MINIMAL), env=env).yield_rules
    assert absent == YieldRules()
    assert rules(tmp_path, env, "") == YieldRules()
    assert absent.enabled
    assert absent.programs == ("blender", "*comfyui*", "*/steamapps/common/*")
    assert {"Xorg", "gnome-shell", "*firefox*", "steam"} <= set(absent.ignore)
    assert (absent.min_bytes, absent.grace_s, absent.scan_s) == (512 << 20, 10.0, 10.0)
    assert absent.nodes == ()  # every GPU node under /dev


def test_each_key_is_read(tmp_path: Path, env: dict[str, str]) -> None:
    table = """\
enabled = false
programs = ["Blender", "*krita*"]
ignore = ["gamescope"]
min_bytes = "2GiB"
grace_s = 30
scan_s = 0.5
nodes = ["/dev/dri/renderD129", "~/nodes/kfd"]
"""
    assert rules(tmp_path, env, table) == YieldRules(
        enabled=False,
        programs=("Blender", "*krita*"),
        ignore=("gamescope",),
        min_bytes=2 << 30,
        grace_s=30.0,
        scan_s=0.5,
        nodes=(Path("/dev/dri/renderD129"), Path(env["HOME"]) / "nodes/kfd"),
    )


def test_empty_lists_and_zero_are_taken_as_written(tmp_path: Path, env: dict[str, str]) -> None:
    table = "programs = []\nignore = []\nmin_bytes = 0\ngrace_s = 0\nscan_s = 0.1\nnodes = []"
    assert rules(tmp_path, env, table) == YieldRules(
        programs=(), ignore=(), min_bytes=0, grace_s=0.0, scan_s=0.1, nodes=()
    )


def test_a_relative_node_path_follows_the_config_files_folder(
    tmp_path: Path, env: dict[str, str]
) -> None:
    nodes = rules(tmp_path, env, 'nodes = ["dev/renderD128"]').nodes
    assert nodes == (tmp_path / "etc" / "dev" / "renderD128",)


GLOBS = 'a list of program names or globs (e.g. ["blender", "*comfyui*"])'
NODES = 'a list of device node paths (e.g. ["/dev/dri/renderD128"])'


@pytest.mark.parametrize(
    ("table", "key_path", "expected"),
    [
        pytest.param('programs = "blender"', "yield.programs", GLOBS, id="programs_str"),
        pytest.param('programs = ["blender", 3]', "yield.programs", GLOBS, id="programs_int"),
        pytest.param('programs = ["blender", ""]', "yield.programs", GLOBS, id="programs_empty"),
        pytest.param('programs = ["  "]', "yield.programs", GLOBS, id="programs_blank"),
        pytest.param('ignore = "Xorg"', "yield.ignore", GLOBS, id="ignore_str"),
        pytest.param("ignore = [true]", "yield.ignore", GLOBS, id="ignore_bool"),
        pytest.param(
            'min_bytes = "lots"',
            "yield.min_bytes",
            'a size such as "22GiB" or "512MB", got "lots"',
            id="min_bytes_word",
        ),
        pytest.param("min_bytes = -1", "yield.min_bytes", "got -1", id="min_bytes_negative"),
        pytest.param(
            "grace_s = -1",
            "yield.grace_s",
            "a non-negative number of seconds, got -1",
            id="grace_negative",
        ),
        pytest.param('grace_s = "10"', "yield.grace_s", "number of seconds", id="grace_str"),
        pytest.param(
            "scan_s = 0.05", "yield.scan_s", "at least 0.1 seconds, got 0.05", id="scan_too_often"
        ),
        pytest.param("scan_s = nan", "yield.scan_s", "got nan", id="scan_nan"),
        pytest.param('enabled = "yes"', "yield.enabled", 'true or false, got "yes"', id="enabled"),
        pytest.param(
            'program = ["blender"]',
            "yield.program",
            "unknown key; expected one of: enabled, programs, ignore, min_bytes, grace_s, "
            "scan_s, nodes (did you mean programs?)",
            id="unknown_key",
        ),
        pytest.param('nodes = "/dev/dri/renderD128"', "yield.nodes", NODES, id="nodes_str"),
        pytest.param('nodes = [""]', "yield.nodes", NODES, id="nodes_empty"),
        pytest.param("nodes = [128]", "yield.nodes", NODES, id="nodes_int"),
        pytest.param('nodes = ["dri\\u0000x"]', "yield.nodes", NODES, id="nodes_nul"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(
    tmp_path: Path, env: dict[str, str], table: str, key_path: str, expected: str
) -> None:
    path = write(tmp_path, f"{MINIMAL}\n[yield]\n{table}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key_path}: "), message
    assert expected in message, message


@pytest.mark.parametrize(("value", "got"), [("3", "got 3"), ('"blender"', 'got "blender"')])
def test_yield_that_is_not_a_table_is_refused(
    tmp_path: Path, env: dict[str, str], value: str, got: str
) -> None:
    path = write(tmp_path, f"yield = {value}\n{MINIMAL}")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    assert str(caught.value) == f"{path}: yield: expected a table ([yield]), {got}"
