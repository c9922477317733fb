#!/usr/bin/env bash
# GPU speed on one CUDA machine, in one table (see bench/gpu.py for what each row is).
#
#   bash scripts/gpu-wheels.sh        # here, once: the wheels the GPU machine lacks → .whl/
#   bash bench/gpu.sh headline [NAME,...]
#                                     # on the GPU machine (carry .whl and .bench), one device call of
#                                     # ≤ 9 minutes: llama-3b bf16/FP8 at the auto micro-batch, the
#                                     # llama-8b slice bf16/FP8, the MoE stack and its twin, the GPU
#                                     # tests, `lmforge train` llama-1b — most important first, each
#                                     # under its own budget (BUDGET: the call's seconds, 525); NAMEs
#                                     # (`python bench/gpu.py list`) are appended to the list
#   bash bench/gpu.sh 1               # the GPU tests, SDPA
#                                     # probe, llama-1b eager vs compiled at vocab 32k and 128k
#   bash bench/gpu.sh 2               # FP8 tensorwise/rowwise vs bf16, llama-1b and llama-3b
#   bash bench/gpu.sh 3               # `lmforge train` 60 steps vs the bench loop; FSDP2 on one rank vs none
#   bash bench/gpu.sh 4               # MoE: the GPU MoE tests and bench/moe.py's moe-9b-shaped stack vs its dense twin
#   bash bench/gpu.sh 5               # [long-context] llama-1b at 8k, 16k and 32k tokens per row (about 3 minutes)
#   bash bench/gpu.sh vllm            # [run-anywhere] vLLM loads the HF export of a dense and a MoE model
#                                     # and its greedy output equals lmforge's (bench/vllm_check.py; needs
#                                     # vLLM on the machine: the GPU image has none, see the script)
#   bash bench/gpu.sh all             # everything in one go (no time budget)
#   bash bench/gpu.sh only NAME,...   # chosen configs (`python bench/gpu.py list`)
#
# Rows accumulate in .bench/gpu.jsonl (a copy goes to $OUT); each call prints the table of
# everything in it. Bring the file back between calls (it is git-ignored: carry `.bench`).
# Needs the machine's Python with torch/triton; lmforge runs from this checkout (PYTHONPATH),
# its missing dependencies from .whl/ installed with --target (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=/tmp/lmforge-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# The commit the rows are for: .bench/COMMIT first (write it here before a device call:
# `git rev-parse --short HEAD > .bench/COMMIT`), since a device machine's copy of the checkout can
# carry an older .git than the working tree it runs (seen 2026-11-26: rows labelled with the
# session's first commit).
export LMFORGE_COMMIT=${LMFORGE_COMMIT:-$(cat .bench/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p .bench
"$PY" -c "import torch; print('#', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
"$PY" -m lmforge --version >/dev/null  # lmforge and its dependencies import

gpu_tests() {
  # Correct first: the CUDA paths CI cannot run — liger and chunked loss vs plain cross-entropy,
  # compiled FlexAttention vs the dense mask, FP8 steps, no host sync between log steps.
  timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_loss.py \
    tests/test_attention.py tests/test_fp8.py tests/test_trainer.py 2>&1 | tail -15 || echo "# GPU tests: exit $?"
}
moe() {
  # [moe-scale] the grouped GEMM on CUDA against the loop, then the moe-9b-shaped stack (bf16, compiled, 8 × 2048).
  timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_moe.py 2>&1 | tail -8 || echo "# MoE GPU tests: exit $?"
  timeout "${MOE_TIMEOUT:-360}" "$PY" bench/moe.py --device cuda 2>&1 | tee -a "${OUT:-.bench}/moe.txt" || echo "# bench/moe.py: exit $?"
}
start=$SECONDS
case "$what" in
  headline)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader \
      2>/dev/null | sed 's/^/# /' || true
    # BUDGET counts from this script's start (the wheels' install and the imports above included)
    "$PY" bench/gpu.py headline "${2:-}" --budget "$(( ${BUDGET:-525} - SECONDS ))" ;;
  1) gpu_tests; "$PY" bench/gpu.py part 1 --budget "$(( ${BUDGET:-560} - (SECONDS - start) ))" ;;
  2|3) "$PY" bench/gpu.py part "$what" --budget "${BUDGET:-540}" ;;
  4) moe ;;
  5) "$PY" bench/gpu.py part 5 --budget "${BUDGET:-300}" ;;  # [long-context]
  all) gpu_tests; for p in 1 2 3 5; do "$PY" bench/gpu.py part "$p" --budget 100000; done; moe ;;
  only) "$PY" bench/gpu.py only "${2:?usage: bash bench/gpu.sh only NAME,... (python bench/gpu.py list)}" --budget "${BUDGET:-540}" ;;
  table) "$PY" bench/gpu.py table ;;
  vllm)
    if "$PY" -c "import vllm" 2>/dev/null; then
      timeout "${BUDGET:-560}" "$PY" bench/vllm_check.py || echo "# bench/vllm_check.py: exit $?"
    else
      echo "# vLLM is not installed for $PY: the vLLM check cannot run here (bench/vllm_check.py)"
    fi ;;
  *) echo "usage: bash bench/gpu.sh headline [NAME,...]|1|2|3|4|5|vllm|all|only NAME,...|table" >&2; exit 2 ;;
esac
