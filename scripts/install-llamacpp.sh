#!/usr/bin/env bash
# llama-cpp-python (the `llamacpp` extra, pinned in pyproject.toml) into ./.venv, for the checks of
# the GGUF export by llama.cpp itself (tests/test_gguf.py). scripts/test.sh runs this alongside the
# tests; the tests that need it wait for it.
#
# PyPI has only the package's source: pip compiles llama.cpp with cmake once (BENCHMARKS.md: about
# 5.5 minutes of CPU with these flags, 8 with the package's own) and then installs the wheel from its
# cache in seconds. The build is kept small and portable: CPU only, no multimodal library
# (-DLLAVA_BUILD=OFF), no HTTPS client, -O1 (a third less compile time; the tests' models are tiny),
# and no -march=native, so that a cached wheel runs on any x86-64 machine. It runs at a lower
# priority (nice) so the tests beside it keep the CPU they would have had.
set -u
cd "$(dirname "$0")/.."
. "${LMFORGE_VENV:-.venv}/bin/activate"
if python -c "import llama_cpp" 2>/dev/null; then
  echo "setup: llama-cpp-python $(python -c 'import llama_cpp; print(llama_cpp.__version__)') is installed"
  exit 0
fi
req=$(grep -o '"llama-cpp-python[^"]*"' pyproject.toml | head -1 | tr -d '"')  # the extra's pin
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG' '-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG'}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
echo "setup: installing $req (a compile of llama.cpp unless pip's wheel cache has it)"
start=$SECONDS
if ! nice -n 10 python -m pip install -q $req; then
  echo "setup: pip could not build or install $req"
  exit 1
fi
echo "setup: installed $req in $((SECONDS - start)) s"
