"""Benchmark: `data prepare` tokens/s on builtin:python-stdlib with 1 and 2 workers, next to the
bare tokenizer (`encode_batch_fast` on the same documents, same batches) in the same run.

    python bench/prepare.py [--vocab-size 8192] [--seq-len 2048]

Target (issue [data]): prepare with 2 workers >= 70% of the bare tokenizer's tokens/s.

Second table (issue [data-curation]): input MB/s of `prepare --workers 2` with every filter on
(language, C4, FineWeb, Gopher quality and repetition) and with dedup + filters, next to the bare
tokenizer on the same documents, for the built-in corpus (code: most documents are removed early)
and for 10 MB of English-like prose from bench/curate.py (most documents reach every filter).
Target: prepare with filters >= 60% of the bare tokenizer's throughput.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from lmforge.data.prepare import chunk_documents, prepare
from lmforge.data.sources import iter_documents
from lmforge.data.tokenizer import train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--no-curation", action="store_true", help="skip the curation table")
    ap.add_argument("--curation-only", action="store_true", help="only the curation table")
    args = ap.parse_args()
    if args.curation_only:
        return curation_table(args)
    inputs = ["builtin:python-stdlib"]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        tok = train_tokenizer(inputs, args.vocab_size, os.path.join(tmp, "tok"))
        train_s = time.perf_counter() - t

        docs = list(iter_documents(inputs))
        t = time.perf_counter()
        tokens = sum(len(e.ids) + 1 for c in chunk_documents(docs) for e in tok.backend.encode_batch_fast(c))
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
    if not args.no_curation:
        curation_table(args)


FILTERS = ["language", "c4", "fineweb", "gopher_quality", "gopher_repetition"]


def curation_table(args) -> None:
    import json
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from curate import synthetic

    prose, _ = synthetic(10, seed=1)
    print(f"\nprepare with curation (--workers 2, MB/s of input; load average {os.getloadavg()[0]:.1f})")
    print(f"{'corpus':<16}{'bare tokenizer':>16}{'prepare':>10}{'+ filters':>11}{'vs bare':>9}"
          f"{'+ dedup':>9}{'vs bare':>9}{'flag-only':>11}{'vs bare':>9}  kept with filters")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prose.jsonl")
        with open(path, "w") as f:
            for d in prose:
                f.write(json.dumps({"text": d}) + "\n")
        tok = train_tokenizer([path], args.vocab_size, os.path.join(tmp, "tok"))
        for name, inputs in (("python-stdlib", ["builtin:python-stdlib"]), ("prose 10 MB", [path])):
            docs = list(iter_documents(inputs))
            mb = sum(len(d.encode()) for d in docs) / 1e6
            t = time.perf_counter()
            for c in chunk_documents(docs):
                tok.backend.encode_batch_fast(c)
            bare = mb / (time.perf_counter() - t)
            out = []
            # flag-only: every document is still tokenized (the worst case: nothing saved by removals).
            for i, curate in enumerate((None, {"filters": FILTERS}, {"dedup": True, "filters": FILTERS},
                                        {"filters": FILTERS, "action": "flag"})):
                s = prepare(inputs, tok, os.path.join(tmp, f"{name[:5]}{i}"), 64, workers=2, progress=False,
                            curate=curate)
                out.append((mb / s["seconds"], s.get("curation")))
            kept = out[1][1]
            print(f"{name:<16}{bare:>16.2f}{out[0][0]:>10.2f}{out[1][0]:>11.2f}{out[1][0] / bare:>9.0%}"
                  f"{out[2][0]:>9.2f}{out[2][0] / bare:>9.0%}{out[3][0]:>11.2f}{out[3][0] / bare:>9.0%}"
                  f"  {kept['documents_kept']}/{kept['documents_in']}")


if __name__ == "__main__":
    main()
