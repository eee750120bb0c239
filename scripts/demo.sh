#!/usr/bin/env bash
# The demo on a fresh machine: sets up .venv, then runs the daemon with two resident models
# and shows every handoff between them.
set -euo pipefail
cd "$(dirname "$0")/.."
ARBITERD_EXTRAS="engine,demo,gui" source scripts/setup.sh
exec .venv/bin/arbiterd demo "$@"
