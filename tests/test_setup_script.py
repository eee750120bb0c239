"""scripts/setup.sh against a throwaway environment whose python stands in for pip: what a person
sees while the engine builds, when pip fails, and when nothing changed; the engine built from the
patched source, the stock fallback when the patch does not apply, and the backend it builds for."""

from __future__ import annotations

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"

# The venv's python as setup.sh drives it, each call recorded in bin/calls:
# `-m pip download ... -d DIR llama-cpp-python==V` leaves in DIR a small source distribution
# shaped like the real one (its vendor/llama.cpp keeps the submodule's dangling .git file, and
# its models/ a vocabulary with tokenizer test data and one without);
# `-m pip wheel ... -w DIR SRC` builds the engine for $BUILD_S seconds, printing what pip prints
# for a source folder when its output is not a terminal, records the CMAKE_ARGS it was given and
# SRC's patched lines, and leaves a wheel in DIR (or exits $PIP_STATUS); `-m pip install`
# succeeds.
FAKE_PYTHON = r"""#!/bin/bash
calls="$(dirname "$0")/calls"
echo "$*" >> "$calls"
args=("$@")
last="${args[${#args[@]} - 1]}"
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in -d | -w) dir="${args[i + 1]}" ;; esac
done
case "$*" in
*" download "*)
    echo "Collecting llama-cpp-python==0.3.36"
    tree="$(mktemp -d)"
    llama="$tree/llama_cpp_python-0.3.36/vendor/llama.cpp"
    mkdir -p "$llama/src" "$llama/include"
    echo "gitdir: ../../.git/modules/vendor/llama.cpp" > "$llama/.git"
    printf '// llama-context.cpp\nint llama_context_size;\n' > "$llama/src/llama-context.cpp"
    mkdir "$llama/models"
    for name in spm.gguf spm.gguf.inp spm.gguf.out bare.gguf; do
        echo "$name" > "$llama/models/ggml-vocab-$name"
    done
    mkdir -p "$dir"
    tar -czf "$dir/llama_cpp_python-0.3.36.tar.gz" -C "$tree" llama_cpp_python-0.3.36
    rm -rf "$tree"
    echo "Saved $dir/llama_cpp_python-0.3.36.tar.gz"
    ;;
*" wheel "*)
    echo "CMAKE_ARGS=$CMAKE_ARGS" >> "$calls"
    llama="$last/vendor/llama.cpp"
    echo "SOURCE $(grep -h '^int\|^#define' "$llama/src/llama-context.cpp" \
        "$llama/include/llama-residency.h" 2>/dev/null | xargs)" >> "$calls"
    echo "Processing $last"
    echo "  Building wheel for llama_cpp_python (pyproject.toml): started"
    sleep "$BUILD_S"
    if [ "$PIP_STATUS" -ne 0 ]; then
        echo "  Building wheel for llama_cpp_python (pyproject.toml): finished with status 'error'"
        echo "ERROR: Failed building wheel for llama_cpp_python"
        exit "$PIP_STATUS"
    fi
    echo "  Building wheel for llama_cpp_python (pyproject.toml): finished with status 'done'"
    mkdir -p "$dir" && touch "$dir/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    ;;
*" -e "*)
    echo "Successfully installed arbiterd-0.1.0"
    ;;
"-c "*)
    echo cpython-311
    ;;
esac
"""

# Patches to the fake source's vendor/llama.cpp, in the form of the real one (git diff, a new
# header and a changed source file): one that applies, another that applies, one that does not.
PATCH = """\
diff --git a/include/llama-residency.h b/include/llama-residency.h
new file mode 100644
index 0000000..8e6d8f2
--- /dev/null
+++ b/include/llama-residency.h
@@ -0,0 +1 @@
+#define LLAMA_RESIDENCY_ABI 1
diff --git a/src/llama-context.cpp b/src/llama-context.cpp
index 1c2d3e4..5f6a7b8 100644
--- a/src/llama-context.cpp
+++ b/src/llama-context.cpp
@@ -1,2 +1,3 @@
 // llama-context.cpp
 int llama_context_size;
+int llama_context_release_device;
"""
PATCH_V2 = PATCH.replace("+int llama_context_release_device;", "+int llama_context_restore;")
PATCH_STALE = PATCH.replace(" int llama_context_size;", " int llama_context_bytes;")

# What the fake build found in its source: the changed line and the new header, or neither.
PATCHED_SOURCE = (
    "SOURCE int llama_context_size; int llama_context_release_device; #define LLAMA_RESIDENCY_ABI 1"
)
PATCHED_V2_SOURCE = (
    "SOURCE int llama_context_size; int llama_context_restore; #define LLAMA_RESIDENCY_ABI 1"
)
STOCK_SOURCE = "SOURCE int llama_context_size;"
FALLBACK = (
    "does not apply to llama-cpp-python 0.3.36; building the stock engine instead: models will "
    "use the reload backend (why: "
)


def _fresh_venv(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return path


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A fake venv; the engine's patch is residency.patch beside it."""
    (tmp_path / "residency.patch").write_text(PATCH)
    (tmp_path / "tmp").mkdir()
    return _fresh_venv(tmp_path, "venv")


def setup(
    venv: Path,
    *,
    build_s: float = 0,
    pip_status: int = 0,
    extras: str = "engine,dev",
    engine: str | None = "cpu",
    path: str | None = None,
    more_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": path or os.environ["PATH"],
        "HOME": str(venv.parent),
        "TMPDIR": str(venv.parent / "tmp"),
        "XDG_CACHE_HOME": str(venv.parent / "cache"),
        "ARBITERD_EXTRAS": extras,
        "ARBITERD_VENV": str(venv),
        # relative, as a person may pass it: setup.sh resolves it from where it is sourced
        "ARBITERD_ENGINE_PATCH": "residency.patch",
        "BUILD_S": str(build_s),
        "PIP_STATUS": str(pip_status),
    }
    if engine is not None:
        env["ARBITERD_ENGINE"] = engine
    env.update(more_env or {})
    return subprocess.run(
        ["bash", "-c", f"source {SETUP}"],
        cwd=venv.parent,
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )


def calls(venv: Path) -> list[str]:
    path = venv / "bin" / "calls"
    return path.read_text().splitlines() if path.exists() else []


def pip_calls(venv: Path) -> list[str]:
    """What setup asked pip to do (it also asks the venv's python for its cache tag)."""
    return [c for c in calls(venv) if "-m pip" in c]


def builds(venv: Path) -> list[str]:
    """What each engine build was given: its CMAKE_ARGS and its source's patched lines."""
    return [c for c in calls(venv) if c.startswith(("CMAKE_ARGS=", "SOURCE"))]


def installed_wheels(venv: Path) -> list[str]:
    return [c.rsplit(" ", 1)[1] for c in pip_calls(venv) if c.endswith(".whl")]


def test_setup_says_what_it_builds_and_that_later_runs_reuse_it(venv: Path) -> None:
    done = setup(venv, build_s=3)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^setup: engine backend cpu \(ARBITERD_ENGINE=cpu\)$", done.stderr, re.M)
    assert re.search(
        r"^setup: building the arbiterd engine \(llama-cpp-python 0\.3\.36 with the residency "
        r"patch\) for cpu, from source;.* later runs reuse the wheel$",
        done.stderr,
        re.M,
    ), done.stderr
    # pip names a build from a folder by its metadata, llama_cpp_python: the watcher saw it
    assert re.search(r"^setup: built the engine in 0 min 0[0-9] s$", done.stderr, re.M)
    assert "Collecting" not in done.stderr  # pip's own lines stay in its log
    assert "Successfully installed" in (venv / "setup.log").read_text()
    assert re.search(r"^setup: ready in 0 min 0[0-9] s$", done.stderr, re.M), done.stderr
    assert (venv / ".arbiterd-installed").exists()


def test_the_engine_is_built_from_the_patched_source_and_its_folder_removed(venv: Path) -> None:
    done = setup(venv)
    assert done.returncode == 0, done.stderr
    download = next(c for c in pip_calls(venv) if " download " in c)
    assert "--no-binary :all: --no-deps" in download
    assert download.endswith(" llama-cpp-python==0.3.36")
    assert builds(venv)[1] == PATCHED_SOURCE
    assert "does not apply" not in done.stderr
    assert list((venv.parent / "tmp").iterdir()) == []


def test_the_tokenizer_test_data_comes_with_the_engine_built_and_reused(
    venv: Path, tmp_path: Path
) -> None:
    assert setup(venv).returncode == 0
    other = _fresh_venv(tmp_path, "other")
    assert setup(other).returncode == 0  # the engine from the cache, without its source
    for environment in (venv, other):
        data = environment / "share" / "arbiterd" / "llama-vocab-tests"
        assert sorted(path.name for path in data.iterdir()) == [
            "ggml-vocab-spm.gguf",
            "ggml-vocab-spm.gguf.inp",
            "ggml-vocab-spm.gguf.out",
        ]


def test_setup_that_fails_shows_the_end_of_pips_log(venv: Path) -> None:
    done = setup(venv, pip_status=1)
    assert done.returncode == 1
    assert "ERROR: Failed building wheel for llama_cpp_python" in done.stderr
    assert str(venv / "setup.log") in done.stderr
    assert not (venv / ".arbiterd-installed").exists()
    assert list((venv.parent / "tmp").iterdir()) == []


def test_setup_says_nothing_when_nothing_changed(venv: Path) -> None:
    assert setup(venv).returncode == 0
    before = pip_calls(venv)
    done = setup(venv)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert pip_calls(venv) == before


def test_the_engine_is_built_once_and_reused_by_a_new_environment(
    venv: Path, tmp_path: Path
) -> None:
    assert setup(venv).returncode == 0
    other = _fresh_venv(tmp_path, "other")
    done = setup(other)
    assert done.returncode == 0, done.stderr
    assert "building the" not in done.stderr
    assert "engine backend" not in done.stderr
    assert not any(" download " in c or " wheel " in c for c in pip_calls(other))
    assert installed_wheels(other) == installed_wheels(venv)


def test_a_changed_patch_builds_the_engine_again(venv: Path) -> None:
    assert setup(venv).returncode == 0
    (venv.parent / "residency.patch").write_text(PATCH_V2)
    done = setup(venv)
    assert done.returncode == 0, done.stderr
    assert "building the arbiterd engine" in done.stderr
    assert builds(venv)[3] == PATCHED_V2_SOURCE
    first, second = installed_wheels(venv)
    assert Path(first).parent != Path(second).parent
    # pip keeps an installed version: the same version, rebuilt, goes in by force
    engine_installs = [c for c in pip_calls(venv) if c.endswith(".whl")]
    assert all("--force-reinstall --no-deps" in c for c in engine_installs)


def test_a_patch_that_does_not_apply_builds_the_stock_engine_and_says_so(
    venv: Path, tmp_path: Path
) -> None:
    (tmp_path / "residency.patch").write_text(PATCH_STALE)
    done = setup(venv)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "does not apply" in line]
    assert len(said) == 1, done.stderr
    assert said[0].startswith(f"setup: {tmp_path / 'residency.patch'} {FALLBACK}"), said
    why = Path(re.sub(r".*\(why: (.*)\)$", r"\1", said[0]))
    assert "llama-context.cpp" in why.read_text()  # git apply's own words
    assert re.search(
        r"^setup: building the stock engine \(llama-cpp-python 0\.3\.36\) for cpu",
        done.stderr,
        re.M,
    )
    assert builds(venv)[1] == STOCK_SOURCE
    assert list((tmp_path / "tmp").iterdir()) == []

    # Another environment takes the stock wheel without fetching the source again, and is told.
    other = _fresh_venv(tmp_path, "other")
    done = setup(other)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "does not apply" in line] == said
    assert not any(" download " in c or " wheel " in c for c in pip_calls(other))
    assert installed_wheels(other) == installed_wheels(venv)

    # Without that wheel, another environment tries the patch again, and is told once.
    Path(installed_wheels(venv)[0]).unlink()
    third = _fresh_venv(tmp_path, "third")
    done = setup(third)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "does not apply" in line] == said
    assert builds(third)[1] == STOCK_SOURCE

    # A patch that applies again is built, into a folder of its own.
    (tmp_path / "residency.patch").write_text(PATCH)
    done = setup(venv)
    assert done.returncode == 0, done.stderr
    assert "does not apply" not in done.stderr
    assert builds(venv)[3] == PATCHED_SOURCE
    stock, patched = installed_wheels(venv)
    assert Path(stock).parent != Path(patched).parent


def test_a_missing_patch_is_one_line_and_installs_nothing(venv: Path, tmp_path: Path) -> None:
    (tmp_path / "residency.patch").unlink()
    done = setup(venv)
    assert done.returncode == 1
    assert done.stderr == (
        f"setup: the engine's patch {tmp_path / 'residency.patch'} is missing"
        " (ARBITERD_ENGINE_PATCH names another)\n"
    )
    assert calls(venv) == []


def vulkan_sdk(where: Path, *, header_version: int = 239, without: str = "") -> dict[str, str]:
    """The environment of a Vulkan toolchain laid out as LunarG's SDK is, in `where`: glslc on
    PATH, the headers of 1.3.`header_version`, the loader, SPIRV-Headers — less `without`."""
    parts = {
        "glslc": ("bin/glslc", "#!/bin/sh\nexit 0\n"),
        "headers": (
            "include/vulkan/vulkan_core.h",
            f"#define VK_HEADER_VERSION {header_version}\n",
        ),
        "loader": ("lib/libvulkan.so", ""),
        "spirv": ("share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake", ""),
    }
    for name, (relative, text) in parts.items():
        if name != without:
            (where / relative).parent.mkdir(parents=True, exist_ok=True)
            (where / relative).write_text(text)
            (where / relative).chmod(0o755)
    return {"VULKAN_SDK": str(where), "PATH": f"{where / 'bin'}{os.pathsep}{os.environ['PATH']}"}


GPU_BACKEND_FLAGS = ("-DGGML_CUDA", "-DGGML_HIP", "-DGGML_VULKAN")


def cpu_build(build: str) -> bool:
    """Whether a recorded build is the CPU engine: ggml's RPC backend (every build has it, so
    an RPC server's devices can be used) and no GPU backend."""
    return "-DGGML_RPC=on" in build and not any(flag in build for flag in GPU_BACKEND_FLAGS)


@pytest.mark.parametrize(
    ("engine", "flag"),
    [("cuda", "-DGGML_CUDA=on"), ("rocm", "-DGGML_HIP=on"), ("vulkan", "-DGGML_VULKAN=on")],
)
def test_another_backend_builds_the_engine_again_for_it(
    venv: Path, tmp_path: Path, engine: str, flag: str
) -> None:
    sdk = vulkan_sdk(tmp_path / "sdk") if engine == "vulkan" else {}
    assert setup(venv).returncode == 0
    assert cpu_build(builds(venv)[0])
    done = setup(venv, engine=engine, path=sdk.get("PATH"), more_env=sdk)
    assert done.returncode == 0, done.stderr
    assert f"setup: engine backend {engine} (ARBITERD_ENGINE={engine})\n" in done.stderr
    assert f"patch) for {engine}, from source" in done.stderr
    assert builds(venv)[2].startswith(f"CMAKE_ARGS={flag}")
    first, second = installed_wheels(venv)
    assert Path(first).parent != Path(second).parent


def test_cuda_builds_for_the_architectures_named(venv: Path) -> None:
    # A machine without a GPU (a build host, a container) must name them: ggml's default is
    # the GPU present.
    done = setup(venv, engine="cuda", more_env={"ARBITERD_CUDA_ARCHITECTURES": "86;90"})
    assert done.returncode == 0, done.stderr
    assert "-DCMAKE_CUDA_ARCHITECTURES='86;90'" in builds(venv)[0]
    assert setup(venv, engine="cuda").returncode == 0
    assert "CMAKE_CUDA_ARCHITECTURES" not in builds(venv)[2]  # another key, built again


GPU_DEVICES = ["/proc/driver/nvidia/gpus/*", "/dev/nvidia0", "/dev/kfd", "/dev/dri/renderD*"]


@pytest.mark.skipif(
    any(glob.glob(pattern) for pattern in GPU_DEVICES),
    reason="this machine has a GPU device: its toolchain would be used",
)
def test_a_gpu_toolchain_without_a_device_builds_for_the_cpu(venv: Path, tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ["nvcc", "hipcc"]:
        (tools / tool).write_text("#!/bin/sh\nexit 1\n")
        (tools / tool).chmod(0o755)
    done = setup(venv, engine=None, path=f"{tools}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"^setup: engine backend cpu \(no GPU toolchain with a device found: nvcc without an "
        r"NVIDIA GPU, hipcc without /dev/kfd(, the Vulkan toolchain without a /dev/dri render "
        r"node)?; "
        r"ARBITERD_ENGINE=cuda \(or rocm, vulkan\) chooses one\)$",
        done.stderr,
        re.M,
    ), done.stderr
    assert cpu_build(builds(venv)[0])


@pytest.mark.parametrize(
    ("without", "header_version", "said"),
    [
        ("glslc", 239, "glslc (the shader compiler) is missing"),
        ("headers", 239, "the Vulkan headers (SDK/include/vulkan/vulkan_core.h) are missing"),
        ("", 238, "the Vulkan headers are too old (1.3.238; 1.3.239 or later is needed)"),
        ("loader", 239, "the Vulkan loader (libvulkan.so) is missing"),
        ("spirv", 239, "SPIRV-Headers (its CMake package) is missing"),
    ],
)
def test_vulkan_without_its_toolchain_says_what_is_missing_in_one_line_and_builds_for_the_cpu(
    venv: Path, tmp_path: Path, without: str, header_version: int, said: str
) -> None:
    sdk = vulkan_sdk(tmp_path / "sdk", header_version=header_version, without=without)
    done = setup(venv, engine="vulkan", path=sdk["PATH"], more_env=sdk)
    assert done.returncode == 0, done.stderr
    said = said.replace("SDK/", f"{tmp_path / 'sdk'}/")
    assert done.stderr.count(said) == 2  # the one line now, and the build's reason after
    assert f"setup: no Vulkan engine: {said}; building the CPU engine\n" in done.stderr
    assert cpu_build(builds(venv)[0])


def test_an_unknown_backend_is_one_line_and_installs_nothing(venv: Path) -> None:
    done = setup(venv, engine="metal")
    assert done.returncode == 1
    assert done.stderr == (
        "setup: ARBITERD_ENGINE=metal is not an engine backend: use cpu, cuda, rocm or vulkan\n"
    )
    assert calls(venv) == []


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AMX is an x86-64 extension")
def test_the_engine_is_built_without_amx(venv: Path) -> None:
    assert setup(venv).returncode == 0
    assert "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in builds(venv)[0]


def test_asking_for_more_extras_installs_them_and_fewer_installs_nothing(venv: Path) -> None:
    assert setup(venv, extras="engine,dev,demo").returncode == 0
    before = pip_calls(venv)
    fewer = setup(venv, extras="engine,demo")
    assert (fewer.returncode, fewer.stderr) == (0, "")
    assert pip_calls(venv) == before
    more = setup(venv, extras="engine,gui")
    assert more.returncode == 0, more.stderr
    assert "[engine,gui]" in (venv / "bin" / "calls").read_text()
