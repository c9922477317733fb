#!/usr/bin/env bash
# First command of the README: set up, then run the quickstart (built-in corpus, tokenizer,
# a small model on the CPU, evaluation, generations, checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec lmforge train -f examples/quickstart.yaml "$@"
