#!/usr/bin/env bash
# The whole test suite on a fresh machine: sets up .venv, then lint, types and every test.
set -euo pipefail
cd "$(dirname "$0")/.."
ARBITERD_EXTRAS="engine,dev,demo,gui" source scripts/setup.sh
# The install tests validate the desktop and unit files with the tools the desktop uses; the
# native tests build a fake libllama with gcc.
need_system_packages desktop-file-utils systemd gcc

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "test: pytest collected no tests for this selection" >&2
    status=0
fi
exit "$status"
