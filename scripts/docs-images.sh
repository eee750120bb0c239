#!/usr/bin/env bash
# Renders the dashboard pictures in README.md and docs/tray.md again, each from the recording its
# caption names (tests/gui/replay-*.jsonl), with `arbiterd tray --screenshot FILE --replay LOG`:
# offscreen, no display and no daemon needed. docs/dashboard-small-models-before.png is not
# among them: it shows the dashboard before issue 16 and no current code draws it.
set -euo pipefail
cd "$(dirname "$0")/.."
export QT_QPA_PLATFORM=offscreen
render() {
    .venv/bin/python -m arbiterd tray --screenshot "docs/$1" --replay "tests/gui/$2"
}
render dashboard.png replay-sample.jsonl
render dashboard-small-models-after.png replay-small-models.jsonl
render dashboard-large-model-after.png replay-large-model.jsonl
render dashboard-memory-vision.png replay-memory-vision.jsonl
