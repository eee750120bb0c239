# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with everything arbiterd needs.
# Silent when nothing changed. The first run builds llama-cpp-python, the inference engine, from
# source, and a progress line says so while it builds: the whole setup took 8 min 9 s on a fresh
# 2-core machine. The engine's wheel is kept in $ENGINE_CACHE under a key of its version and
# build flags, so a later install takes about a minute (43 s measured for engine,dev). pip's own
# output goes to $VENV/setup.log; its end is shown when pip fails.
#
# Environment:
#   ARBITERD_EXTRAS  the extras to install (default: engine,dev)
#   ARBITERD_VENV    where the environment goes (default: .venv in the checkout). For trying this
#                    script against a throwaway one: test.sh and demo.sh run from .venv.
#   PYTHON           the interpreter that makes it (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ARBITERD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${ARBITERD_EXTRAS:-engine,dev}"
ENGINE_VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$ROOT/pyproject.toml" | cut -d= -f3)"
ENGINE_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/arbiterd/engine"

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
    # with status 'done'" when it ends (those words when its output is not a terminal). Runs in
    # the background until the build ends, it is sent TERM, or the shell that started it is gone.
    local log=$1 started="" next=0 every=60 tty="" stop=""
    local build="Building wheel for llama-cpp-python (pyproject.toml)"
    if [[ -t 2 && -z ${CI:-} ]]; then
        tty=1
        every=5
    fi
    trap 'stop=1' TERM
    while [[ -z $stop ]] && kill -0 $$ 2>/dev/null; do
        if [[ -z $started ]]; then
            if grep -qF "$build: started" "$log"; then
                started=$SECONDS
                echo "setup: building llama-cpp-python $ENGINE_VERSION, the inference engine," \
                    "from source; the first setup takes ~8 min on 2 cores, later runs reuse" \
                    "the built wheel" >&2
            fi
        elif grep -qF "$build: finished" "$log"; then
            break
        elif ((SECONDS - started >= next)); then
            if [[ $tty ]]; then
                printf '\r\033[Ksetup: building llama-cpp-python: %s' \
                    "$(duration $((SECONDS - started)))" >&2
            elif ((next > 0)); then
                echo "setup: still building llama-cpp-python: $(duration $((SECONDS - started)))" >&2
            fi
            next=$((next + every))
        fi
        sleep 1
    done
    [[ $started ]] || return 0
    [[ -z $tty ]] || printf '\r\033[K' >&2
    if grep -qF "$build: finished with status 'done'" "$log"; then
        echo "setup: built llama-cpp-python in $(duration $((SECONDS - started)))" >&2
    fi
}

engine_cmake_args() {
    # ggml's AMX matrix multiply segfaults on Q4_K weights (llama.cpp issue 20824; reproduced
    # here with gemma-3-270m on a CPU with amx_int8): a native build on such a CPU crashes on
    # the first prompt, so the engine is built without AMX wherever the compiler can say so.
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    # shellcheck disable=SC2086  # the flags are words on purpose
    if [[ $(uname -m) == x86_64 ]] && echo 'int x;' | cc $no_amx -x c -c -o /dev/null - 2>/dev/null
    then
        echo "-DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
    fi
}

engine_key() {
    # What the built wheel depends on: a change to any of these builds it again.
    printf '%s\n' "$ENGINE_VERSION" "$(engine_cmake_args)" "$(uname -m)" \
        "$("$VENV/bin/python" -c 'import sys; print(sys.implementation.cache_tag)')" \
        | sha256sum | cut -c1-16
}

install_engine() {
    # The engine's wheel, built once per key into $ENGINE_CACHE (pip's own cache keys a built
    # wheel by version only, and would hand back one built with other flags), then installed.
    local dir
    dir="$ENGINE_CACHE/$ENGINE_VERSION-$(engine_key)"
    if ! compgen -G "$dir/llama_cpp_python-*.whl" >/dev/null; then
        CMAKE_ARGS="$(engine_cmake_args)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            "$VENV/bin/python" -m pip wheel --progress-bar off --no-cache-dir --no-deps \
            -w "$dir" "llama-cpp-python==$ENGINE_VERSION" || return
    fi
    "$VENV/bin/python" -m pip install --progress-bar off "$dir"/llama_cpp_python-*.whl
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
            && "$VENV/bin/python" -m pip install --progress-bar off -e "$ROOT[$EXTRAS]"
    } >>"$log" 2>&1 || status=$?
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    if ((status)); then
        echo "setup: pip failed (exit status $status); the end of $log:" >&2
        tail -n 30 "$log" >&2
        return "$status"
    fi
    echo "setup: ready in $(duration $((SECONDS - began)))" >&2
}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: arbiterd needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need_system_packages python3-venv
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"

# The stamp says what is installed: the engine's key on its first line, the extras on its second
# (test.sh and demo.sh ask for different ones; pip keeps what an earlier install added).
stamp="$VENV/.arbiterd-installed"
key="$(engine_key)"
have=""
[[ ! -f $stamp ]] || have="$(sed -n 2p "$stamp")"
missing=""
for extra in ${EXTRAS//,/ }; do
    [[ " $have " == *" $extra "* ]] || missing+=" $extra"
done
if [[ -n $missing || "$ROOT/pyproject.toml" -nt "$stamp" || $(head -n 1 "$stamp") != "$key" ]]; then
    install_into_venv
    printf '%s\n%s\n' "$key" "$(echo $have ${EXTRAS//,/ } | tr ' ' '\n' | sort -u | xargs)" >"$stamp"
fi
