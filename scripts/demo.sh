#!/usr/bin/env bash
# The demo on a fresh machine: sets up .venv, then shows programs handing the GPU token around.
set -euo pipefail
cd "$(dirname "$0")/.."
ARBITERD_EXTRAS="engine,demo" source scripts/setup.sh
exec .venv/bin/python -m arbiterd.demo "$@"
