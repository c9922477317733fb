"""Benchmark: `data prepare` tokens/s on builtin:python-stdlib with 1 and 2 workers, next to the
bare tokenizer (`encode_batch_fast` on the same documents, same batches) in the same run.

    python bench/prepare.py [--vocab-size 8192] [--seq-len 2048]

Target (issue [data]): prepare with 2 workers >= 70% of the bare tokenizer's tokens/s.

Second table (issue [data-curation]): input MB/s of `prepare --workers 2` with every filter on
(language, C4, FineWeb, Gopher quality and repetition) and with dedup + filters, next to the bare
tokenizer on the same documents, for the built-in corpus (code: most documents are removed early)
and for 10 MB of English-like prose from bench/curate.py (most documents reach every filter).
Target: prepare with filters >= 60% of the bare tokenizer's throughput.

Third table (issue [data-scale]): `prepare` of the built-in corpus written as JSONL and cut into
work units, in this process (`--workers 2`) and as 1, 2 and 4 tasks of datatrove's local executor
(`--tasks N`): seconds, tokens/s, tokens/s per core, and whether the dataset is byte for byte the
plain command's. The tasks' start-up (a process pool per stage) is in the seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from lmforge.data.prepare.packing import chunk_documents
from lmforge.data.prepare.prepare import prepare
from lmforge.data.text.sources import iter_documents
from lmforge.data.text.tokenizer import train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--no-curation", action="store_true", help="skip the curation table")
    ap.add_argument("--curation-only", action="store_true", help="only the curation table")
    ap.add_argument("--tasks-only", action="store_true", help="only the tasks table")
    ap.add_argument("--unit-mb", type=float, default=2.0, help="work unit size of the tasks table")
    args = ap.parse_args()
    if args.curation_only:
        return curation_table(args)
    if args.tasks_only:
        return tasks_table(args)
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
    tasks_table(args)


def tasks_table(args) -> None:
    import json
    from pathlib import Path

    from lmforge.data.prepare.executors import ExecutorSpec

    def files(ds: str) -> dict:
        return {f"{s}/{p.name}": p.read_bytes() for s in ("train", "val") for p in sorted(Path(ds, s).iterdir())}

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stdlib.jsonl")
        with open(path, "w") as f:
            for d in iter_documents(["builtin:python-stdlib"]):
                f.write(json.dumps({"text": d}) + "\n")
        tok = train_tokenizer([path], args.vocab_size, os.path.join(tmp, "tok"))
        unit = int(args.unit_mb * (1 << 20))
        print(f"\nprepare as tasks ({os.path.getsize(path) / 1e6:.1f} MB of JSONL, units of {args.unit_mb:g} MB; "
              f"load average {os.getloadavg()[0]:.1f})")
        print(f"{'how':<28}{'units':>6}{'seconds':>9}{'tokens/s':>12}{'per core':>10}{'vs plain':>10}  same dataset")
        runs = [("this process, --workers 2", None)] + [(f"--tasks {n} (local executor)", ExecutorSpec("local", n))
                                                           for n in (1, 2, 4)]
        plain = None
        for i, (name, spec) in enumerate(runs):
            out = os.path.join(tmp, f"ds{i}")
            s = prepare([path], tok, out, args.seq_len, eval_fraction=0.005, workers=2, progress=False,
                        executor=spec, unit_bytes=unit)
            tps = s["tokens_per_second"]
            plain = plain or (tps, files(out))
            print(f"{name:<28}{s['units']:>6}{s['seconds']:>9.2f}{tps:>12,.0f}{tps / s['cores']:>10,.0f}"
                  f"{tps / plain[0]:>10.0%}  {'yes' if files(out) == plain[1] else 'NO'}")
        print(s["throughput"])


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
