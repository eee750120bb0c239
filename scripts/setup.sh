# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with everything arbiterd needs.
# Idempotent and quiet when nothing changed; the first run builds llama-cpp-python from source
# (~8 minutes on 2 cores; pip caches the wheel, so later runs take seconds).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"

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

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: arbiterd needs Python >= 3.11 ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || need_system_packages python3-venv
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"

stamp="$VENV/.arbiterd-installed"
if [[ ! -f "$stamp" || "$ROOT/pyproject.toml" -nt "$stamp" ]]; then
    echo "setup: installing arbiterd and its dependencies into .venv" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$VENV/bin/python" -m pip install -q \
        -e "$ROOT[${ARBITERD_EXTRAS:-engine,dev}]"
    touch "$stamp"
fi
