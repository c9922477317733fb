#!/usr/bin/env bash
# Second command of the README: set up (with test extras), then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
LMFORGE_EXTRAS=test bash scripts/setup.sh
bash scripts/install-browser.sh  # headless Chromium for the report test (Debian package; skipped if it can't)
. .venv/bin/activate
exec python -m pytest "$@"
