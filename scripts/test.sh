#!/usr/bin/env bash
# Second command of the README: set up (with test extras), then run the test suite.
#
#   bash scripts/test.sh            # everything (what .ci/run runs)
#   bash scripts/test.sh fast       # the inner-loop tier: unit + integration tests, no e2e (~3 min on 2 cores)
#   bash scripts/test.sh e2e        # the end-to-end tier alone
#   bash scripts/test.sh ARGS...    # pytest arguments, e.g. -k resume tests/test_trainer.py
#
# Tiers are pytest markers (pyproject.toml): unmarked = unit, `integration`, `e2e`.
set -euo pipefail
cd "$(dirname "$0")/.."
LMFORGE_EXTRAS=test bash scripts/setup.sh
tier=()
case "${1:-}" in
  fast) shift; tier=(-m "not e2e"); export LMFORGE_UNIT_SECONDS_STRICT=1 ;;  # a unit test over 1 CPU second fails
  e2e) shift; tier=(-m "e2e") ;;
esac
# Headless Chromium for the report's browser test (Debian's package; that test skips where there is
# none). On a fresh machine the install takes a minute or two, so it runs alongside the tests: the
# browser test waits for "$LMFORGE_BROWSER_SETUP/done" (the script's output is in .../log).
export LMFORGE_BROWSER_SETUP="$(mktemp -d "${TMPDIR:-/tmp}/lmforge-browser.XXXXXX")"
if [ "${tier[*]:-}" = "-m not e2e" ]; then
  touch "$LMFORGE_BROWSER_SETUP/done"  # the browser test is end to end
else
  { bash scripts/install-browser.sh >"$LMFORGE_BROWSER_SETUP/log" 2>&1; touch "$LMFORGE_BROWSER_SETUP/done"; } &
fi
# llama.cpp for the GGUF export's checks (tests/test_gguf.py, end to end): llama-cpp-python compiles
# llama.cpp on a machine whose pip wheel cache lacks it (minutes), so it too builds alongside the tests,
# which run those checks last and wait for "$LMFORGE_LLAMACPP_SETUP/done" (output in .../log).
export LMFORGE_LLAMACPP_SETUP="$(mktemp -d "${TMPDIR:-/tmp}/lmforge-llamacpp.XXXXXX")"
if [ "${tier[*]:-}" = "-m not e2e" ]; then
  touch "$LMFORGE_LLAMACPP_SETUP/done"
else
  { bash scripts/install-llamacpp.sh >"$LMFORGE_LLAMACPP_SETUP/log" 2>&1; touch "$LMFORGE_LLAMACPP_SETUP/done"; } &
fi
. .venv/bin/activate
# Two test processes (pytest-xdist), work-stealing: most end-to-end tests wait on their
# subprocesses and servers rather than use a core, so two halve the wall time on 2 cores
# (BENCHMARKS.md). LMFORGE_TEST_WORKERS=0 runs everything in one process.
exec python -m pytest -n "${LMFORGE_TEST_WORKERS:-2}" --dist worksteal "${tier[@]}" "$@"
