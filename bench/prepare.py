"""Benchmark: `data prepare` tokens/s on builtin:python-stdlib with 1 and 2 workers, next to the
bare tokenizer (`encode_batch_fast` on the same documents, same batches) in the same run.

    python bench/prepare.py [--vocab-size 8192] [--seq-len 2048]

Target (issue [data]): prepare with 2 workers >= 70% of the bare tokenizer's tokens/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from lmforge.data.prepare import _chunks, prepare
from lmforge.data.sources import iter_documents
from lmforge.data.tokenizer import train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    inputs = ["builtin:python-stdlib"]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        tok = train_tokenizer(inputs, args.vocab_size, os.path.join(tmp, "tok"))
        train_s = time.perf_counter() - t

        docs = list(iter_documents(inputs))
        t = time.perf_counter()
        tokens = sum(len(e.ids) + 1 for c in _chunks(docs) for e in tok.backend.encode_batch_fast(c))
        bare = tokens / (time.perf_counter() - t)

        rows = []
        for workers in (1, 2):
            s = prepare(inputs, tok, os.path.join(tmp, f"ds{workers}"), args.seq_len, eval_fraction=0.005,
                        workers=workers, progress=False)
            assert s["tokens"] == tokens
            rows.append((workers, s["seconds"], s["tokens_per_second"]))

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"corpus builtin:python-stdlib: {len(docs)} documents, {tokens:,} tokens "
          f"(vocab {tok.vocab_size}); tokenizer training {train_s:.1f}s")
    print(f"{'what':<28}{'seconds':>9}{'tokens/s':>12}{'vs bare':>9}")
    print(f"{'bare encode_batch_fast':<28}{tokens / bare:>9.2f}{bare:>12,.0f}{1:>9.0%}")
    for workers, seconds, tps in rows:
        print(f"{f'prepare --workers {workers}':<28}{seconds:>9.2f}{tps:>12,.0f}{tps / bare:>9.0%}")


if __name__ == "__main__":
    main()
