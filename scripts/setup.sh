# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with everything arbiterd needs.
# Silent when nothing changed. The first run builds the arbiterd engine from source: the pinned
# llama-cpp-python's source distribution with arbiterd/native/llama-residency.patch applied to
# its vendored llama.cpp, which lets a model leave the GPU and come back in place (the in-place
# backend). A progress line shows while it builds: ~8-10 min on 2 cores (12 min 11 s measured,
# 13 min 56 s for the whole setup, while another compile shared the cores). When the patch does
# not apply (another llama-cpp-python pinned), one line says so and the stock llama-cpp-python
# is built instead: models then use the reload backend. The built wheel is kept in
# $ENGINE_CACHE under a key of the engine's version, the patch's sha256, the GPU backend and the
# build flags, so a changed patch builds again and a later install takes about a minute (43 s
# measured for engine,dev). pip's own output goes to $VENV/setup.log; its end is shown when pip
# fails.
#
# The GPU backend is the first whose toolchain and device are both present: CUDA (nvcc and an
# NVIDIA GPU), ROCm (hipcc and /dev/kfd), Vulkan (glslc, vulkan.h and a /dev/dri render node);
# else the CPU. A line says which, and why, when the engine builds.
#
# Environment:
#   ARBITERD_EXTRAS        the extras to install (default: engine,dev)
#   ARBITERD_VENV          where the environment goes (default: .venv in the checkout). For trying
#                          this script against a throwaway one: test.sh and demo.sh run from .venv.
#   ARBITERD_ENGINE        the engine's backend: cpu, cuda, rocm or vulkan (default: detected);
#                          vulkan without its toolchain says what is missing and builds for the CPU
#   ARBITERD_WANT_PACKAGES Debian packages to install first where we may (test.sh: the device tier's)
#   ARBITERD_CUDA_ARCHITECTURES
#                          the CUDA architectures to build for (e.g. 90, or "86;89"); default:
#                          the GPU present (a machine without one must name them)
#   ARBITERD_ENGINE_PATCH  the patch applied inside vendor/llama.cpp (default:
#                          arbiterd/native/llama-residency.patch; tests pass a small one)
#   PYTHON                 the interpreter that makes it (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ARBITERD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${ARBITERD_EXTRAS:-engine,dev}"
ENGINE_VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$ROOT/pyproject.toml" | cut -d= -f3)"
ENGINE_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/arbiterd/engine"
ENGINE_PATCH="${ARBITERD_ENGINE_PATCH:-$ROOT/arbiterd/native/llama-residency.patch}"
[[ $ENGINE_PATCH == /* ]] || ENGINE_PATCH="$PWD/$ENGINE_PATCH"
# Left in the patched build's cache folder when the patch did not apply to this version: later
# installs take the stock wheel without downloading the source again to find out.
ENGINE_NOT_PATCHED="patch-does-not-apply"
# Beside the patched engine's wheel, and installed under the environment's share/: llama.cpp's
# tokenizer test data from the source it was built from (tests/worker/test_vocab_index.py).
ENGINE_VOCAB_TESTS="llama-vocab-tests"

need_system_packages() {
    # Debian packages the tests or the demo use, installed when missing and we may (root + apt).
    local missing=()
    if ! command -v dpkg-query >/dev/null; then
        echo "setup: not a Debian system; make sure these are installed: $*" >&2
        return 0
    fi
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing ${missing[*]}" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }
    else
        echo "setup: please install: ${missing[*]}" >&2
        return 1
    fi
}

duration() {
    printf '%d min %02d s' $(($1 / 60)) $(($1 % 60))
}

watch_engine_build() {
    # Says while pip builds the engine, and for how long, reading pip's log ($1): pip writes
    # "Building wheel for NAME (pyproject.toml): started" when a build starts and "...: finished
    # with status 'done'" when it ends (those words when its output is not a terminal). NAME is
    # the requirement's, llama-cpp-python, for a build from the index, and the source's metadata's,
    # llama_cpp_python, for a build from a folder, as the engine is built. Runs in the background
    # until the build ends, it is sent TERM, or the shell that started it is gone.
    local log=$1 started="" next=0 every=60 tty="" stop=""
    local build="Building wheel for llama[-_]cpp[-_]python \(pyproject\.toml\)"
    if [[ -t 2 && -z ${CI:-} ]]; then
        tty=1
        every=5
    fi
    trap 'stop=1' TERM
    while [[ -z $stop ]] && kill -0 $$ 2>/dev/null; do
        if [[ -z $started ]]; then
            ! grep -qE "$build: started" "$log" || started=$SECONDS
        elif grep -qE "$build: finished" "$log"; then
            break
        elif ((SECONDS - started >= next)); then
            if [[ $tty ]]; then
                printf '\r\033[Ksetup: building the engine: %s' \
                    "$(duration $((SECONDS - started)))" >&2
            elif ((next > 0)); then
                echo "setup: still building the engine: $(duration $((SECONDS - started)))" >&2
            fi
            next=$((next + every))
        fi
        sleep 1
    done
    [[ $started ]] || return 0
    [[ -z $tty ]] || printf '\r\033[K' >&2
    if grep -qE "$build: finished with status 'done'" "$log"; then
        echo "setup: built the engine in $(duration $((SECONDS - started)))" >&2
    fi
}

find_tool() {
    # The path of tool $1: on PATH, or where its toolkit installs it without touching PATH ($2).
    command -v "$1" || { [[ -x $2 ]] && echo "$2"; }
}

vulkan_build_missing() {
    # What a Vulkan build of the engine lacks here, in words (status 0), or nothing (status 1).
    # ggml-vulkan compiles its shaders with glslc, needs the headers from 1.3.239 on (older than
    # Debian 12's were never built; the patch makes that one build), the loader to link against
    # and SPIRV-Headers' CMake package. Debian/Ubuntu: glslc libvulkan-dev spirv-headers; Fedora:
    # glslc vulkan-headers vulkan-loader-devel spirv-headers-devel. With $VULKAN_SDK (LunarG's
    # SDK, which CMake's FindVulkan also reads) they are looked for there.
    local root=${VULKAN_SDK:-/usr} header version
    header="$root/include/vulkan/vulkan_core.h"
    if [[ -n ${VULKAN_SDK:-} && ! -x $VULKAN_SDK/bin/glslc ]] || ! command -v glslc >/dev/null; then
        echo "glslc (the shader compiler) is missing"
    elif [[ ! -f $header ]]; then
        echo "the Vulkan headers ($header) are missing"
    elif version="$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\)$/\1/p' "$header")" \
        && ((${version:-0} < 239)); then
        echo "the Vulkan headers are too old (1.3.${version:-?}; 1.3.239 or later is needed)"
    elif ! compgen -G "$root/lib*/libvulkan.so" >/dev/null \
        && ! compgen -G "$root/lib/*/libvulkan.so" >/dev/null; then
        echo "the Vulkan loader (libvulkan.so) is missing"
    elif ! compgen -G "$root/share/cmake*/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null \
        && ! compgen -G "$root/lib*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null \
        && ! compgen -G "$root/lib/*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null; then
        echo "SPIRV-Headers (its CMake package) is missing"
    else
        return 1
    fi
}

choose_engine_backend() {
    # Sets ENGINE_BACKEND, and ENGINE_BACKEND_WHY for the line that names it: the one
    # ARBITERD_ENGINE names, else the first whose toolchain and a device to run it on are both
    # here. A toolchain alone is not enough: CUDA images run on machines without a GPU (this
    # project's CI is one), and an engine built for CUDA there would have no device to use.
    local without=() missing
    case ${ARBITERD_ENGINE:-} in
    vulkan)
        ENGINE_BACKEND=vulkan
        ENGINE_BACKEND_WHY="ARBITERD_ENGINE=vulkan"
        if missing="$(vulkan_build_missing)"; then
            ENGINE_BACKEND=cpu
            ENGINE_BACKEND_WHY="ARBITERD_ENGINE=vulkan, but $missing: the CPU engine instead"
            echo "setup: no Vulkan engine: $missing; building the CPU engine" >&2
        fi
        return 0
        ;;
    cpu | cuda | rocm)
        ENGINE_BACKEND=$ARBITERD_ENGINE
        ENGINE_BACKEND_WHY="ARBITERD_ENGINE=$ARBITERD_ENGINE"
        return 0
        ;;
    ?*)
        echo "setup: ARBITERD_ENGINE=$ARBITERD_ENGINE is not an engine backend:" \
            "use cpu, cuda, rocm or vulkan" >&2
        return 1
        ;;
    esac
    if [[ $(find_tool nvcc /usr/local/cuda/bin/nvcc) ]]; then
        if compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null || [[ -e /dev/nvidia0 ]]; then
            ENGINE_BACKEND=cuda
            ENGINE_BACKEND_WHY="nvcc and an NVIDIA GPU found"
            return 0
        fi
        without+=("nvcc without an NVIDIA GPU")
    fi
    if [[ $(find_tool hipcc /opt/rocm/bin/hipcc) ]]; then
        if [[ -e /dev/kfd ]]; then
            ENGINE_BACKEND=rocm
            ENGINE_BACKEND_WHY="hipcc and /dev/kfd found"
            return 0
        fi
        without+=("hipcc without /dev/kfd")
    fi
    if ! vulkan_build_missing >/dev/null; then
        if compgen -G '/dev/dri/renderD*' >/dev/null; then
            ENGINE_BACKEND=vulkan
            ENGINE_BACKEND_WHY="the Vulkan toolchain and a /dev/dri render node found"
            return 0
        fi
        without+=("the Vulkan toolchain without a /dev/dri render node")
    fi
    ENGINE_BACKEND=cpu
    ENGINE_BACKEND_WHY="no GPU toolchain with a device found"
    if ((${#without[@]})); then
        ENGINE_BACKEND_WHY+=": $(printf '%s, ' "${without[@]}")"
        ENGINE_BACKEND_WHY=${ENGINE_BACKEND_WHY%, }
    fi
    ENGINE_BACKEND_WHY+="; ARBITERD_ENGINE=cuda (or rocm, vulkan) chooses one"
}

engine_cmake_args() {
    local args=() nvcc
    case $ENGINE_BACKEND in
    cuda)
        args+=(-DGGML_CUDA=on)
        # CMake looks for nvcc on PATH; the toolkit's own folder is often not on it.
        nvcc="$(find_tool nvcc /usr/local/cuda/bin/nvcc)" || true
        [[ -z $nvcc || $nvcc == "$(command -v nvcc)" ]] || args+=("-DCMAKE_CUDA_COMPILER=$nvcc")
        # ggml builds for the GPU present by default, which fails where there is none.
        [[ -z ${ARBITERD_CUDA_ARCHITECTURES:-} ]] ||
            args+=("-DCMAKE_CUDA_ARCHITECTURES='$ARBITERD_CUDA_ARCHITECTURES'")
        ;;
    rocm) args+=(-DGGML_HIP=on) ;;
    vulkan) args+=(-DGGML_VULKAN=on) ;;
    esac
    # ggml's RPC backend, with every GPU backend: llama.cpp's rpc-server on another machine (or
    # on this one) becomes a device models can be placed on (arbiterd devices, rpc_servers).
    args+=(-DGGML_RPC=on)
    # ggml's AMX matrix multiply segfaults on Q4_K weights (llama.cpp issue 20824; reproduced
    # here with gemma-3-270m on a CPU with amx_int8): a native build on such a CPU crashes on
    # the first prompt, so the engine is built without AMX wherever the compiler can say so.
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    # shellcheck disable=SC2086  # the flags are words on purpose
    if [[ $(uname -m) == x86_64 ]] && echo 'int x;' | cc $no_amx -x c -c -o /dev/null - 2>/dev/null
    then
        args+=("-DCMAKE_C_FLAGS='$no_amx'" "-DCMAKE_CXX_FLAGS='$no_amx'")
    fi
    echo "${args[*]}"
}

engine_patch_sha() {
    if [[ -f $ENGINE_PATCH ]]; then
        sha256sum <"$ENGINE_PATCH" | cut -d' ' -f1
    else
        echo missing
    fi
}

engine_key() {
    # What the built wheel depends on: a change to any of these builds it again. $1 is the
    # patch's sha256, or "stock" for the engine built without it.
    printf '%s\n' "$ENGINE_VERSION" "$1" "$ENGINE_BACKEND" "$(engine_cmake_args)" "$(uname -m)" \
        "$("$VENV/bin/python" -c 'import sys; print(sys.implementation.cache_tag)')" \
        | sha256sum | cut -c1-16
}

apply_engine_patch() {
    # Applies the patch to the folder $2 under $1, all of it or none of it. git apply outside a
    # repository patches files as patch -p1 does and checks every hunk before it writes any. It
    # runs in $1, with the ceiling above it, so that no repository is found: the source
    # distribution carries llama-cpp-python's .git and vendor/llama.cpp's link into it, and in a
    # repository git apply takes paths from the top of its work tree.
    if command -v git >/dev/null; then
        (cd "$1" && GIT_CEILING_DIRECTORIES="$(dirname "$1")" \
            git apply --directory="$2" "$ENGINE_PATCH")
    else
        patch -d "$1/$2" -p1 --batch --forward --dry-run -i "$ENGINE_PATCH" >/dev/null \
            && patch -d "$1/$2" -p1 --batch --forward -i "$ENGINE_PATCH"
    fi
}

engine_wheel() {
    # Builds the engine from the source folder $1 into the folder $2.
    CMAKE_ARGS="$(engine_cmake_args)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/python" -m pip wheel --progress-bar off --no-cache-dir --no-deps -w "$2" "$1"
}

keep_vocab_tests() {
    # Copies llama.cpp's tokenizer test data from the source folder $1 into the folder $2: per
    # tokenizer family a vocabulary-only GGUF, inputs (.inp) and the ids upstream's code gives
    # them (.out), what its test-tokenizer-0 reads. The patch changes how a vocabulary finds a
    # token by its text, and the tests check it against these.
    local inp
    mkdir -p "$2" || return
    for inp in "$1"/vendor/llama.cpp/models/ggml-vocab-*.gguf.inp; do
        [[ -f $inp ]] || continue  # none: the pattern itself
        cp "${inp%.inp}" "$inp" "${inp%.inp}.out" "$2/" || return
    done
}

say_engine_not_patched() {
    # $1: the note in the patched build's folder, which holds what git apply (or patch) said.
    echo "setup: ${ENGINE_PATCH#"$ROOT/"} does not apply to llama-cpp-python $ENGINE_VERSION;" \
        "building the stock engine instead: models will use the reload backend (why: $1)" >&3
}

build_engine_in() {
    # Downloads the engine's source into the folder $1, patches it and builds it into $2; when the
    # patch does not apply, builds the source as it is into $3 and leaves a note in $2 saying so.
    local tmp=$1 patched=$2 stock=$3 sdist tree src
    local how="from source; the first build takes ~8-10 min on 2 cores, later runs reuse the wheel"
    "$VENV/bin/python" -m pip download --progress-bar off --no-binary :all: --no-deps \
        -d "$tmp" "llama-cpp-python==$ENGINE_VERSION" || return
    sdist=("$tmp"/*.tar.gz)
    mkdir "$tmp/src" && tar -xzf "${sdist[0]}" -C "$tmp/src" || return
    tree=("$tmp"/src/*/)
    src=${tree[0]%/}
    if apply_engine_patch "$tmp" "${src#"$tmp/"}/vendor/llama.cpp" 2>"$tmp/why"; then
        echo "setup: building the arbiterd engine (llama-cpp-python $ENGINE_VERSION with the" \
            "residency patch) for $ENGINE_BACKEND, $how" >&3
        engine_wheel "$src" "$patched" && keep_vocab_tests "$src" "$patched/$ENGINE_VOCAB_TESTS"
    else
        cat "$tmp/why"
        mkdir -p "$patched" && cp "$tmp/why" "$patched/$ENGINE_NOT_PATCHED" || return
        say_engine_not_patched "$patched/$ENGINE_NOT_PATCHED"
        echo "setup: building the stock engine (llama-cpp-python $ENGINE_VERSION) for" \
            "$ENGINE_BACKEND, $how" >&3
        engine_wheel "$src" "$stock"
    fi
}

install_engine() {
    # The engine's wheel, built once per key into $ENGINE_CACHE (pip's own cache keys a built
    # wheel by version only, and would hand back one built with other flags), then installed.
    # pip's output goes to the log; what a person should read goes to fd 3, the terminal's.
    local patched stock dir tmp status=0
    patched="$ENGINE_CACHE/$ENGINE_VERSION-$(engine_key "$(engine_patch_sha)")"
    stock="$ENGINE_CACHE/$ENGINE_VERSION-$(engine_key stock)"
    dir=$patched
    if [[ -f $patched/$ENGINE_NOT_PATCHED ]]; then
        if compgen -G "$stock/llama_cpp_python-*.whl" >/dev/null; then
            say_engine_not_patched "$patched/$ENGINE_NOT_PATCHED"
            dir=$stock
        else
            rm "$patched/$ENGINE_NOT_PATCHED"  # the stock wheel is gone: try the patch again
        fi
    fi
    if ! compgen -G "$dir/llama_cpp_python-*.whl" >/dev/null; then
        echo "setup: engine backend $ENGINE_BACKEND ($ENGINE_BACKEND_WHY)" >&3
        tmp="$(mktemp -d "${TMPDIR:-/tmp}/arbiterd-engine.XXXXXX")" || return
        build_engine_in "$tmp" "$patched" "$stock" || status=$?
        rm -rf "$tmp"
        ((status == 0)) || return "$status"
        [[ ! -f $patched/$ENGINE_NOT_PATCHED ]] || dir=$stock
    fi
    # The same version may be installed already, built from another patch or for another
    # backend, and pip keeps an installed version: the engine goes in by force. Its dependencies
    # come with arbiterd's, next.
    "$VENV/bin/python" -m pip install --progress-bar off --force-reinstall --no-deps \
        "$dir"/llama_cpp_python-*.whl || return
    rm -rf "${VENV:?}/share/arbiterd/$ENGINE_VOCAB_TESTS"
    [[ ! -d $dir/$ENGINE_VOCAB_TESTS ]] || {
        mkdir -p "$VENV/share/arbiterd" \
            && cp -r "$dir/$ENGINE_VOCAB_TESTS" "$VENV/share/arbiterd/$ENGINE_VOCAB_TESTS"
    }
}

install_into_venv() {
    local log="$VENV/setup.log" began=$SECONDS watcher status=0
    echo "setup: installing arbiterd and its dependencies into $VENV (pip's log: $log)" >&2
    : >"$log"
    watch_engine_build "$log" &
    watcher=$!
    {
        "$VENV/bin/python" -m pip install --progress-bar off --upgrade pip \
            && { [[ ,$EXTRAS, != *,engine,* ]] || install_engine; } \
            && "$VENV/bin/python" -m pip install --progress-bar off -e "${ROOT}[$EXTRAS]"
    } 3>&2 >>"$log" 2>&1 || status=$?
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    if ((status)); then
        echo "setup: pip failed (exit status $status); the end of $log:" >&2
        tail -n 30 "$log" >&2
        return "$status"
    fi
    echo "setup: ready in $(duration $((SECONDS - began)))" >&2
}

if [[ -n ${ARBITERD_WANT_PACKAGES:-} ]]; then
    # shellcheck disable=SC2086  # a list of package names
    need_system_packages $ARBITERD_WANT_PACKAGES || true
fi
choose_engine_backend || exit 1
if [[ ,$EXTRAS, == *,engine,* && ! -f $ENGINE_PATCH ]]; then
    echo "setup: the engine's patch $ENGINE_PATCH is missing" \
        "(ARBITERD_ENGINE_PATCH names another)" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: arbiterd needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need_system_packages python3-venv
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"

# The stamp says what is installed: the engine's key on its first line (with the patch's hash and
# the backend: a changed patch or another ARBITERD_ENGINE installs again), the extras on its
# second (test.sh and demo.sh ask for different ones; pip keeps what an earlier install added).
stamp="$VENV/.arbiterd-installed"
key="$(engine_key "$(engine_patch_sha)")"
have=""
[[ ! -f $stamp ]] || have="$(sed -n 2p "$stamp")"
new_extras=""
for extra in ${EXTRAS//,/ }; do
    [[ " $have " == *" $extra "* ]] || new_extras+=" $extra"
done
if [[ -n $new_extras || "$ROOT/pyproject.toml" -nt "$stamp" || $(head -n 1 "$stamp") != "$key" ]]
then
    install_into_venv
    # shellcheck disable=SC2086  # split into words on purpose: one extra a line for sort
    printf '%s\n%s\n' "$key" "$(echo $have ${EXTRAS//,/ } | tr ' ' '\n' | sort -u | xargs)" >"$stamp"
fi
