"""`arbiterd install` / `uninstall`: start at login, as the user, and reversibly.

Owns the files arbiterd puts into the user's desktop session — the systemd user unit, the XDG
autostart entry of the tray, the menu entry, the icon, a starter config — and the manifest of
what it wrote, and of the folders it made for them, so that uninstall removes exactly that (a
file the user changed since is kept, and said so; a folder that holds anything else stays).
With `--copy` (issue 30) it also owns a venv of arbiterd's own under $XDG_DATA_HOME/arbiterd:
the clone it runs from, built into a wheel and installed there, so that the service keeps
running when the clone moves; uninstall removes that venv too.
The templates are package data (see TEMPLATES); @ARBITERD@ on their command lines becomes the
arbiterd that runs this. Never touches a file outside the user's XDG directories, never
overwrites a config.toml.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from arbiterd.cli.discovery import find_models
from arbiterd.cli.starter import starter_config_text
from arbiterd.config import APP_DIR, default_config_path
from arbiterd.errors import InstallError
from arbiterd.paths import make_private_dirs

# packaging/ at the top of the source tree holds the one copy of the templates; arbiterd/_packaging
# links to it, so that a wheel carries them as package data and an editable install reads them
# in place. (A package-dir mapping of packaging/ instead would need a packaging/__init__.py, and
# that would shadow the `packaging` library for anything run from the checkout.)
TEMPLATES = resources.files("arbiterd") / "_packaging"
PLACEHOLDER = "@ARBITERD@"
# The lines that run arbiterd; a comment that names the placeholder is kept as written.
COMMAND_KEYS = ("ExecStart=", "ExecReload=", "Exec=")
UNIT = "arbiterd.service"
# The starter config serves at most this many of the models found (cli/discovery.py).
MAX_FOUND_MODELS = 20
# A folder's entry in the manifest: install made it, so uninstall removes it when it is empty.
FOLDER = "folder"
# The venv `install --copy` made: uninstall removes it whole.
VENV = "venv"

Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]
# Runs one step of a copy with its output on the terminal (pip's progress); its exit status.
Builder = Callable[[list[str]], int]


@dataclass(frozen=True)
class Placement:
    """One file install writes: its template (None: generated) and where it goes."""

    template: str | None
    target: Path
    keep_existing: bool = False  # config.toml: the user's, never overwritten


def _xdg(env: Mapping[str, str], var: str, fallback: str) -> Path:
    value = env.get(var, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path(env.get("HOME") or Path.home()) / fallback


def placements(env: Mapping[str, str]) -> list[Placement]:
    config_home = _xdg(env, "XDG_CONFIG_HOME", ".config")
    data_home = _xdg(env, "XDG_DATA_HOME", ".local/share")
    return [
        Placement("systemd/arbiterd.service", config_home / "systemd" / "user" / UNIT),
        Placement("autostart/arbiterd-tray.desktop", autostart_path(env)),
        Placement("applications/arbiterd.desktop", data_home / "applications" / "arbiterd.desktop"),
        Placement(
            "icons/arbiterd.svg",
            data_home / "icons" / "hicolor" / "scalable" / "apps" / "arbiterd.svg",
        ),
        Placement(None, default_config_path(env), keep_existing=True),
    ]


def how_to_start(env: Mapping[str, str]) -> str:
    """How the user starts a daemon that is not running: through the unit `install` wrote, or
    by hand where there is none."""
    unit = _xdg(env, "XDG_CONFIG_HOME", ".config") / "systemd" / "user" / UNIT
    if unit.is_file():
        return f"start it: systemctl --user start {UNIT}"
    return (
        "start it: arbiterd daemon (in a terminal of its own), or `arbiterd install` to have "
        "it start at each login"
    )


def autostart_path(env: Mapping[str, str]) -> Path:
    return _xdg(env, "XDG_CONFIG_HOME", ".config") / "autostart" / "arbiterd-tray.desktop"


def manifest_path(env: Mapping[str, str]) -> Path:
    return _xdg(env, "XDG_STATE_HOME", ".local/state") / APP_DIR / "installed.json"


def arbiterd_command() -> str:
    """The absolute path of the arbiterd script next to this interpreter (a venv's, say)."""
    script = Path(sys.executable).parent / "arbiterd"
    if script.is_file() and os.access(script, os.X_OK):
        return str(script)
    found = shutil.which("arbiterd")
    if found is None:
        raise InstallError("cannot find the arbiterd command to put into the service files")
    return str(Path(found).resolve())


def render(template: str, command: str) -> str:
    try:
        text = (TEMPLATES / template).read_text()
    except OSError as exc:
        raise InstallError(
            f"cannot read the template {template} ({exc.strerror}): this arbiterd was installed "
            "without its packaging files; reinstall it"
        ) from None
    return "".join(
        line.replace(PLACEHOLDER, command) if line.startswith(COMMAND_KEYS) else line
        for line in text.splitlines(keepends=True)
    )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def missing_folders(target: Path) -> list[Path]:
    """The folders writing `target` would make, outermost first."""
    missing: list[Path] = []
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def running_from_clone() -> Path | None:
    """The source checkout this arbiterd runs from (an editable install of a clone), or None
    for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / ".git").exists() else None


def venv_path(env: Mapping[str, str]) -> Path:
    return _xdg(env, "XDG_DATA_HOME", ".local/share") / APP_DIR / VENV


@dataclass(frozen=True)
class Copy:
    """`install --copy`: the clone at `source` built into a wheel (by this interpreter, which
    has the build backend; nothing is fetched for it) and installed into the venv at `venv`,
    with the extras this arbiterd has and its engine's version pinned, so that pip takes the
    engine it built for this machine from its cache instead of building it again. Without
    `with_deps` only arbiterd itself is installed (its dependencies must come another way)."""

    source: Path
    venv: Path
    extras: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()
    with_deps: bool = True

    @property
    def command(self) -> str:
        return str(self.venv / "bin" / "arbiterd")

    def steps(self, wheels: Path) -> list[list[str]]:
        python = str(self.venv / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
        build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        wheel = str(wheels / "arbiterd-*.whl")
        steps = []
        if not (self.venv / "pyvenv.cfg").is_file():
            steps.append([sys.executable, "-m", "venv", str(self.venv)])
        steps.append([*build, "--quiet", "--wheel-dir", str(wheels), str(self.source)])
        if self.with_deps:
            extras = f"[{','.join(self.extras)}]" if self.extras else ""
            steps.append([*pip, f"{wheel}{extras}", *self.pins])
        # Always: the clone's code as it is now, also when its version number did not change.
        steps.append([*pip, "--force-reinstall", "--no-deps", wheel])
        return steps


def copy_of_this_clone(env: Mapping[str, str]) -> Copy:
    """The Copy `install --copy` makes of the clone this arbiterd runs from; InstallError for
    an arbiterd that is installed already (it is a copy: there is nothing to move)."""
    clone = running_from_clone()
    if clone is None:
        raise InstallError(
            f"--copy installs a clone into a venv of its own; this arbiterd is installed "
            f"already ({Path(__file__).resolve().parents[1]}), so the service runs it where it "
            "is: run `arbiterd install` without --copy"
        )
    extras = tuple(
        extra
        for extra, module in (("engine", "llama_cpp"), ("gui", "PySide6"))
        if importlib.util.find_spec(module) is not None
    )
    pins: tuple[str, ...] = ()
    with contextlib.suppress(metadata.PackageNotFoundError):
        pins = (f"llama-cpp-python=={metadata.version('llama-cpp-python')}",)
    return Copy(clone, venv_path(env), extras, pins if "engine" in extras else ())


class Installer:
    """Plans and applies install/uninstall; `say` receives one line per thing done."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        run: Runner | None = None,
        say: Callable[[str], None] = print,
        dry_run: bool = False,
        build: Builder | None = None,
    ) -> None:
        self.env = os.environ if env is None else env
        self._run = run or _run_systemctl
        self._build = build or _run_shown
        self._say = say
        self.dry_run = dry_run

    def install(self, *, enable: bool = True, copy: Copy | None = None) -> None:
        manifest = self._read_manifest()
        command = arbiterd_command() if copy is None else self._copy(copy, manifest)
        for placement in placements(self.env):
            target = placement.target
            if target.exists() and placement.keep_existing:
                self._say(f"kept     {target} (yours; never overwritten)")
                continue
            if placement.template is None:
                found = find_models(self.env)
                for warning in found.warnings:
                    self._say(f"note     {warning}")
                models = found.models[:MAX_FOUND_MODELS]
                if not models:
                    looked = ", ".join(str(place.folder) for place in found.places)
                    self._say(
                        f"skipped  {target}: no GGUF found in {looked}; "
                        "the daemon serves the embedded default model until you write one"
                    )
                    continue
                if len(found.models) > len(models):
                    self._say(
                        f"note     {len(found.models) - len(models)} more models found are left "
                        "out of the starter config (`arbiterd models` lists them all)"
                    )
                text = starter_config_text(models)
            else:
                text = render(placement.template, command)
            if target.exists() and target.read_text() == text:
                self._say(f"same     {target}")
            else:
                self._say(f"{'would write' if self.dry_run else 'wrote'}    {target}")
                if self.dry_run and placement.template is None:  # the starter config: shown
                    self._say("\n".join(f"    {line}" for line in text.splitlines()))
                manifest.update(dict.fromkeys(map(str, missing_folders(target)), FOLDER))
                self._write(target, text)
            manifest[str(target)] = _digest(text)
        manifest.update(dict.fromkeys(map(str, missing_folders(manifest_path(self.env))), FOLDER))
        self._write_manifest(manifest)
        clone = running_from_clone()
        if copy is not None:
            self._say(
                f"note     the service runs {command}, a copy of the clone at {clone}: the "
                "clone may move; run `arbiterd install --copy` again from it to update the copy"
            )
        elif clone is not None:
            self._say(
                f"note     the service runs {command}, from the clone at {clone}: moving or "
                "deleting that clone stops it (run `arbiterd install` again from where it goes)"
            )
        self._systemd(
            ["daemon-reload"],
            *([["enable", "--now", UNIT]] if enable else []),
            otherwise="without a systemd user manager, start `arbiterd daemon` "
            "(and `arbiterd tray`) yourself",
        )

    def uninstall(self) -> None:
        manifest = self._read_manifest()
        if not manifest:
            self._say(f"nothing to undo: no record of an install in {manifest_path(self.env)}")
            return
        self._systemd(
            ["disable", "--now", UNIT],
            ["daemon-reload"],
            otherwise="without a systemd user manager there is no service to stop (stop an "
            "`arbiterd daemon` you started yourself); the files go all the same",
        )
        folders = sorted((Path(n) for n, d in manifest.items() if d == FOLDER), reverse=True)
        for name, digest in sorted(manifest.items()):
            target = Path(name)
            if digest == VENV:
                self._remove_venv(target)
                continue
            if digest == FOLDER or not target.exists():
                continue
            if _digest(target.read_text()) != digest:
                self._say(f"kept     {target} (changed since install)")
                continue
            self._say(f"{'would remove' if self.dry_run else 'removed'}  {target}")
            if not self.dry_run:
                target.unlink()
        if not self.dry_run:
            manifest_path(self.env).unlink(missing_ok=True)
        for folder in folders:  # the innermost first: each is empty once its contents went
            self._remove_folder(folder)

    # -- helpers ------------------------------------------------------------------------------

    def _copy(self, copy: Copy, manifest: dict[str, str]) -> str:
        """Make or update the venv `copy` names (recorded in `manifest`); its arbiterd."""
        self._say(f"copying  {copy.source} into {copy.venv} (pip's progress follows)")
        folders = missing_folders(copy.venv / "pyvenv.cfg")[:-1]
        with tempfile.TemporaryDirectory(prefix="arbiterd-wheel-") as wheels:
            for planned in copy.steps(Path(wheels)):
                # The wheel's file name is known once it is built: a pattern until then.
                step = [_built(arg, Path(wheels)) for arg in planned]
                if self.dry_run:
                    self._say(f"would run {' '.join(step)}")
                    continue
                code = self._build(step)
                if code != 0:
                    raise InstallError(
                        f"`{' '.join(step)}` failed (exit status {code}); nothing else was "
                        "installed"
                    )
                self._say(f"ran      {' '.join(step[:4])} ...")
        manifest.update(dict.fromkeys(map(str, folders), FOLDER))
        manifest[str(copy.venv)] = VENV
        return copy.command

    def _remove_venv(self, venv: Path) -> None:
        if not (venv / "pyvenv.cfg").is_file():
            return  # gone already, or no longer a venv: not ours to remove
        self._say(f"{'would remove' if self.dry_run else 'removed'}  {venv} (the copy)")
        if not self.dry_run:
            shutil.rmtree(venv)

    def _remove_folder(self, folder: Path) -> None:
        """Remove a folder install made, when nothing but what it wrote was ever in it."""
        if not folder.is_dir():
            return
        if self.dry_run:
            self._say(f"would remove  {folder} (if nothing else is in it)")
        elif any(folder.iterdir()):
            self._say(f"kept     {folder} (it holds files of yours or arbiterd's journal)")
        else:
            self._say(f"removed  {folder}")
            folder.rmdir()

    def _write(self, target: Path, text: str) -> None:
        if self.dry_run:
            return
        if target.parent.name == APP_DIR:
            # arbiterd's own folders (config, state) are private at every level; the desktop's
            # (systemd/user, autostart, applications, icons) are made as the desktop makes them.
            make_private_dirs(target.parent, InstallError)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(text)
            tmp.replace(target)
        except OSError as exc:
            raise InstallError(f"cannot write {target}: {exc.strerror}") from None

    def _read_manifest(self) -> dict[str, str]:
        path = manifest_path(self.env)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError:
            raise InstallError(f"{path} is damaged; remove it to start over") from None
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_manifest(self, manifest: dict[str, str]) -> None:
        self._write(manifest_path(self.env), json.dumps(manifest, indent=2) + "\n")

    def _systemd(self, *steps: list[str], otherwise: str) -> None:
        """Runs each `systemctl --user` step; at the first that fails, says why and `otherwise`."""
        commands = [["systemctl", "--user", *step] for step in steps]
        if self.dry_run:
            for command in commands:
                self._say(f"would run {' '.join(command)}")
            return
        for command in commands:
            done = self._run(command)
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines()
                reason = lines[-1] if lines else "no systemd user manager"
                self._say(f"note     `{' '.join(command)}` failed ({reason}): {otherwise}")
                return
            self._say(f"ran      {' '.join(command)}")


def _built(arg: str, wheels: Path) -> str:
    """`arg`, with the built wheel's path in place of its pattern once it exists."""
    pattern = str(wheels / "arbiterd-*.whl")
    if not arg.startswith(pattern):
        return arg
    built = sorted(wheels.glob("arbiterd-*.whl"))
    return str(built[0]) + arg.removeprefix(pattern) if built else arg


def _run_shown(command: list[str]) -> int:
    return subprocess.run(command, check=False).returncode


def _run_systemctl(command: list[str]) -> subprocess.CompletedProcess[str]:
    if shutil.which(command[0]) is None:
        return subprocess.CompletedProcess(command, 127, "", f"{command[0]} not found")
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
