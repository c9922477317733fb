"""Throughput of the training data stream (TokenStream) on one CPU core.

Writes a synthetic ~50M-token dataset (uint16 tokens, seq 2048, zstd shards) with MDSWriter
to a temporary folder, then measures batches/s and tokens/s at seq 2048 / micro-batch 8 in
the main process (num_workers=0), pinned to one core. The reference is what a 1B model trains
at on one H100 (~45k tokens/s); the target is 10x that.

    python bench/stream.py [--tokens 50_000_000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lmforge.data.mds import MDSWriter
from lmforge.data.stream.tokens import TokenStream
from lmforge.plan.layout import Layout

H100_1B_TOKENS_PER_S = 45_000
SEQ, MB, GB = 2048, 8, 64


def write_dataset(root: Path, tokens: int) -> tuple[int, float]:
    rng = np.random.default_rng(0)
    n = tokens // SEQ
    t0 = time.perf_counter()
    with MDSWriter(str(root), {"tokens": "ndarray:uint16"}, compression="zstd") as w:
        for _ in range(n):
            w.write({"tokens": rng.integers(0, 50_000, SEQ, dtype=np.uint16)})
    return n, time.perf_counter() - t0


def measure(stream: TokenStream, seconds: float) -> tuple[int, float]:
    it = iter(stream)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(it)
        n += 1
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        n, write_s = write_dataset(root, args.tokens)
        size = sum(p.stat().st_size for p in root.iterdir())
        cache = str(Path(tmp) / "cache")

        def make() -> TokenStream:
            return TokenStream(str(root), seq_len=SEQ, layout=Layout(global_batch=GB, micro_batch=MB),
                               seed=0, cache_dir=cache)

        t0 = time.perf_counter()
        cold = make()
        first = next(iter(cold))
        cold_open_s = time.perf_counter() - t0
        assert first.shape == (MB, SEQ)
        # touch every shard once so the steady-state numbers exclude one-time decompression
        t0 = time.perf_counter()
        for i in range(0, len(cold.readers[0]), 50):
            cold.readers[0].get_tokens(i)
        decompress_s = time.perf_counter() - t0 + cold_open_s

        batches, secs = measure(make(), args.seconds)
        # resume deep into epoch 3 and time until the first batch
        warm = make()
        state = warm.state_dict() | {"samples_seen": 3 * warm.samples_per_epoch + GB * 17}
        t0 = time.perf_counter()
        resumed = make()
        resumed.load_state_dict(state)
        next(iter(resumed))
        resume_s = time.perf_counter() - t0

    tok_s = batches * MB * SEQ / secs
    rows = [
        ("dataset", f"{n} samples x {SEQ} tokens = {n * SEQ / 1e6:.1f}M tokens, {size / 1e6:.0f} MB zstd"),
        ("write (MDSWriter, zstd)", f"{write_s:.1f} s  ({n * SEQ / write_s / 1e6:.1f}M tokens/s)"),
        ("open + first batch, cold", f"{cold_open_s:.2f} s"),
        ("decompress all shards once", f"{decompress_s:.2f} s"),
        ("batches/s (mb 8, seq 2048)", f"{batches / secs:,.0f}"),
        ("tokens/s", f"{tok_s:,.0f}"),
        ("vs 1B on H100 (45k tok/s)", f"{tok_s / H100_1B_TOKENS_PER_S:,.0f}x  (target >= 10x)"),
        ("resume mid-epoch 3 -> first batch", f"{resume_s * 1000:.0f} ms"),
    ]
    print(f"TokenStream benchmark — 1 core, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
