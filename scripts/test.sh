#!/usr/bin/env bash
# Second command of the README: set up (with test extras), then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
LMFORGE_EXTRAS=test bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
