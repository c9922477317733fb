"""llama.cpp itself, through llama-cpp-python (the `llamacpp` extra), for the GGUF export's checks.

The package compiles llama.cpp from source (minutes on 2 cores), so scripts/test.sh builds it
alongside the other tests (scripts/install-llamacpp.sh, pip's wheel cache reused) and the tests
that need it wait for "$LMFORGE_LLAMACPP_SETUP/done". When that install ran and failed, they
fail with its log; without it (plain pytest, the extra not installed) they skip.
"""

from __future__ import annotations

import os
import time

import pytest


def llama_cpp(wait_s: float = 1800):
    setup = os.environ.get("LMFORGE_LLAMACPP_SETUP")
    if setup and os.path.isdir(setup):
        deadline = time.monotonic() + wait_s
        while not os.path.exists(os.path.join(setup, "done")) and time.monotonic() < deadline:
            time.sleep(1)
    import importlib

    importlib.invalidate_caches()  # installed while this process ran
    try:
        import llama_cpp as lib
    except ImportError:
        log = os.path.join(setup or "", "log")
        if setup and os.path.isfile(log):
            with open(log) as f:
                pytest.fail("scripts/install-llamacpp.sh did not install llama-cpp-python:\n" + f.read()[-3000:])
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llamacpp]', or bash scripts/test.sh)")
    return lib


def load(lib, path, **kw):
    """A `llama_cpp.Llama` for a small model: one thread (the tests share two cores), every
    position's logits kept, an fp32 KV cache (llama.cpp's default, f16, would round every key and
    value: the comparisons are of the model file, not of the cache), quiet."""
    return lib.Llama(model_path=str(path), n_ctx=kw.pop("n_ctx", 64), n_threads=1, n_threads_batch=1,
                     logits_all=True, verbose=False, type_k=lib.GGML_TYPE_F32, type_v=lib.GGML_TYPE_F32, **kw)


def logits(llm, ids: list[int]):
    """llama.cpp's logits [len(ids), vocab] for ``ids`` from an empty context."""
    llm.reset()
    llm.eval(ids)
    return llm.scores[:len(ids)].copy()


def greedy(llm, ids: list[int], n: int) -> list[int]:
    """``n`` tokens from llama.cpp's own sampler at temperature 0."""
    llm.reset()
    out = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out
