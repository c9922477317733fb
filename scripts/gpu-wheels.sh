#!/usr/bin/env bash
# Download, into .whl/, the wheels that bench/gpu.sh installs on a GPU machine that has
# Python 3.12 with torch, triton, transformers, tokenizers, safetensors, numpy, pyyaml, rich,
# pandas, pyarrow and fsspec already, but no network: lmforge's remaining run-time dependencies
# (pydantic and its parts, zstandard for MDS shards) and the `gpu` extra (torchao for FP8,
# liger-kernel for the fused loss). mlflow, wandb and s3fs are not needed: the bench turns the
# trackers off and reads local data, and lmforge imports them only when a run uses them.
#
#   bash scripts/gpu-wheels.sh          # then carry .whl to the GPU machine (it is git-ignored)
#
# Versions: torchao 0.17 is the release for torch 2.11 (0.17 and 0.18 both need torch >= 2.11);
# liger-kernel 0.8.5 (accum_dtype needs >= 0.8). One version of each: pip --target refuses two.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${GPU_PYTHON_VERSION:-3.12}
mkdir -p .whl
rm -f .whl/*.whl
WHEELS=(
  "pydantic==2.14.3" "pydantic-core==2.50.4" "annotated-types==0.8.0" "typing-inspection==0.4.5"
  "typing-extensions==4.16.0" "zstandard==0.25.0"
  "torchao==0.17.0" "liger-kernel==0.8.5"
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
