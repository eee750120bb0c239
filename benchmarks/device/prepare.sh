#!/bin/bash
# Makes .gpu/, what benchmarks/device/run.sh needs on a GPU machine that can fetch nothing: the
# pinned llama.cpp (from the llama-cpp-python sdist) with arbiterd/native/llama-residency.patch
# applied and trimmed to the CPU and CUDA backends, llama_cpp's Python files from .venv (the
# libraries are built there), and the wheels of the two packages that machine lacks.
# .gpu/ is meant to be ignored (.git/info/exclude) and carried to the machine as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$ROOT/pyproject.toml" | cut -d= -f3)"
SITE="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

rm -rf "$ROOT/.gpu" && mkdir -p "$ROOT/.gpu/llama.cpp" "$ROOT/.gpu/whl" "$ROOT/.gpu/site"
"$ROOT/.venv/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$WORK" \
    "llama-cpp-python==$VERSION"
tar xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
src="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
(cd "$src" && git apply "$ROOT/arbiterd/native/llama-residency.patch")
(cd "$src" && tar cf - CMakeLists.txt cmake include src vendor licenses LICENSE \
    ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/*.c ggml/src/*.cpp ggml/src/*.h \
    ggml/src/*.in ggml/src/CMakeLists.txt ggml/src/ggml-cpu ggml/src/ggml-cuda ggml/src/ggml-blas) \
    | tar xf - -C "$ROOT/.gpu/llama.cpp"
cp -r "$SITE/llama_cpp" "$ROOT/.gpu/site/"
rm -rf "$ROOT/.gpu/site/llama_cpp/lib"
find "$ROOT/.gpu/site" -name __pycache__ -prune -exec rm -rf {} +
for pkg in gguf diskcache; do
    version="$("$ROOT/.venv/bin/python" -m pip show "$pkg" | sed -n 's/^Version: //p')"
    "$ROOT/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: \
        -d "$ROOT/.gpu/whl" "$pkg==$version"
done
du -sh "$ROOT/.gpu"
