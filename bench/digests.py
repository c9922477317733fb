"""How fast a checkpoint's files are hashed (`lmforge.checksums.file_digests`: the sha256 of every
file a save records and a resume checks), one file at a time against several at once.

A checkpoint holds one shard file per rank; rank 0 hashes them all after each save and again when
a run resumes. The files are written first, so they are read from the page cache: this measures
the hashing, not the disk (on a real run the disk may be the limit).

    python bench/digests.py                 # 4 files × 256 MB
    python bench/digests.py --files 8 --mb 128
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmforge.checksums import file_digests, hash_workers  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=4, help="shard files (ranks)")
    p.add_argument("--mb", type=int, default=256, help="size of each file, MB")
    p.add_argument("--rounds", type=int, default=3, help="timings per setting (the fastest is shown)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.files):
            with open(os.path.join(folder, f"__{i}_0.distcp"), "wb") as f:
                for _ in range(args.mb):
                    f.write(os.urandom(1 << 20))
        total_gb = args.files * args.mb / 1024
        print(f"# {platform.machine()} CPU, {os.cpu_count()} cores, {args.files} files × {args.mb} MB "
              f"(page cache), fastest of {args.rounds}")
        print(f"{'workers':>12} {'seconds':>8} {'GB/s':>6}")
        results = {}
        for workers in (1, None):
            best = min(_timed(folder, workers) for _ in range(args.rounds))
            results[workers] = best
            label = "1" if workers == 1 else f"default ({hash_workers(args.files)})"
            print(f"{label:>12} {best:8.2f} {total_gb / best:6.2f}")
        print(f"speed-up: {results[1] / results[None]:.2f}×")


def _timed(folder: str, workers: int | None) -> float:
    t = time.perf_counter()
    file_digests(folder, workers=workers)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
