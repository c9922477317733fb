"""Benchmark: near-dedup that scales out — the dedup stages of `data prepare --dedup exact,near`
over ~16K tiny work units (1T tokens at 256 MB units make ~16K units), and their projection to
1T tokens on 1,000 cores.

    python bench/dedup_scale.py [--units 16384] [--docs 8] [--band-parts 2] [--groups 16] [--node-parts 16]
                                [--dense 131072]

Each unit holds DOCS documents with synthetic MinHash signatures (128 values) and exact keys:
10% of the documents are near copies of an earlier one (1-6 of the 128 values changed; some
copy a copy: chains), 3% exact copies. The signatures stage writes each unit's files as a task
would; every later stage's items then run one after another in this process, on the real code
(`job.run_items`) and real files, each measured: wall time, peak memory (tracemalloc: numpy's
arrays included), ranged reads. Two runs: the wide one (16K units: the items and the reads of
1T) and a dense one (8 units of many documents, every stage in one part: the cost and memory
per document, where an item's fixed cost does not matter).

The projection to 1T tokens (assumed ≈ 4 TB of text, 2 KB = 500 tokens per document: 2e9
documents) on 1,000 cores, per stage: the items `dedup_plan` makes for 4 TB in 14,901 units;
time = (the dense run's seconds per document × 2e9 + each item's fixed cost, its ranged reads
scaled to the files it reads at 1T) / min(1000, its items at 1T); an item's memory = the dense
run's peak per document × the documents one item holds at 1T. The signatures' MinHash itself is
projected from its measured rate on real text (the stdlib's docs). The box this runs on is
shared and loaded: compare times as ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from lmforge.config.curation import DedupConfig  # noqa: E402
from lmforge.data.curate import crossdedup  # noqa: E402
from lmforge.data.curate.crossdedup import DedupPlan, dedup_plan, write_signatures  # noqa: E402
from lmforge.data.prepare.job import Job, WorkDir, run_items  # noqa: E402
from lmforge.data.prepare.units import DEFAULT_UNIT_BYTES, Slice, Unit  # noqa: E402

TOKENS_1T, BYTES_PER_TOKEN, TOKENS_PER_DOC, CORES = 10**12, 4, 500, 1000
DOCS_1T = TOKENS_1T // TOKENS_PER_DOC


READS = [0]  # ranged reads (what an object store bills as GETs), counted around WorkDir.read_range
_read_range = WorkDir.read_range


def _counted_read_range(self, rel: str, start: int, end: int) -> bytes:
    READS[0] += 1
    return _read_range(self, rel, start, end)


WorkDir.read_range = _counted_read_range


def synthetic_units(units: int, docs: int, perm: int, seed: int = 0):
    """(keys, signatures) per unit: random documents, 10% near copies, 3% exact copies."""
    rng = np.random.default_rng(seed)
    n = units * docs
    sigs = rng.integers(0, 2**32 - 1, (n, perm), dtype=np.uint32)
    keys = rng.integers(0, 2**63, (n, 2), dtype=np.uint64)
    near = np.flatnonzero(rng.random(n) < 0.10)
    for i in near[near > 0]:  # in order: a copy may copy a copy (a chain)
        sigs[i] = sigs[rng.integers(0, i)]
        k = rng.integers(1, 7)
        sigs[i, rng.choice(perm, k, replace=False)] = rng.integers(0, 2**32 - 1, k, dtype=np.uint32)
    exact = np.flatnonzero(rng.random(n) < 0.03)
    keys[exact[exact > 0]] = keys[rng.integers(0, exact[exact > 0])]
    raw = keys.astype(">u8").tobytes()
    for u in range(units):
        yield ([raw[16 * i:16 * i + 16] for i in range(u * docs, (u + 1) * docs)],
               list(sigs[u * docs:(u + 1) * docs]))


def measured(fn):
    READS[0] = 0
    tracemalloc.start()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, READS[0]


def read_time(folder: str, units: int) -> float:
    """Seconds per small ranged read of a file here (open, seek, read, close)."""
    wd = WorkDir(folder)
    names = [f"dedup/sigs/{u:06d}.bin" for u in range(min(2000, units))]
    t = time.perf_counter()
    for name in names:
        wd.read_range(name, 0, 8)
    return (time.perf_counter() - t) / len(names)


def minhash_mb_per_s() -> float:
    """MinHash signatures (and exact keys) of real text, MB/s on one core."""
    from lmforge.data.text.builtin import pydoc_topics
    from lmforge.data.curate.dedup import signatures

    texts = [t for _, t in pydoc_topics()][:300]
    t = time.perf_counter()
    signatures(texts, DedupConfig())
    return sum(len(x.encode()) for x in texts) / 1e6 / (time.perf_counter() - t)


def files_per_item(kind: str, plan: DedupPlan) -> int:
    """The files one item of a stage reads its part of (its fixed ranged reads scale with them)."""
    return {"duplicates": plan.units, "verify": plan.bands * plan.band_parts, "components": plan.node_parts,
            "clusters": plan.node_parts, "removals": plan.node_parts}.get(kind, 1)


def run(units: int, docs: int, parts: tuple[int, int, int]) -> tuple[DedupPlan, dict, int, float]:
    """Every dedup stage over ``units`` synthetic units of ``docs`` documents cut in ``parts`` (band
    parts, groups, node ranges): per stage kind (the components steps that did work together)
    [items, seconds, reads, the largest item's peak bytes, steps]."""
    cfg = DedupConfig()
    bands, rows = lsh_params_of(cfg)
    plan = DedupPlan(True, True, 1, bands, rows, cfg.num_perm, cfg.threshold, band_parts=parts[0], groups=parts[1],
                     node_parts=parts[2], rounds=dedup_plan(cfg, units * docs * 2048, units).rounds, units=units)
    out: dict = {}

    def add(kind: str, items: int, stats: list) -> None:
        row = out.setdefault(kind, [0, 0.0, 0, 0, 0])
        row[0] = max(row[0], items)
        row[1] += sum(x[0] for x in stats)
        row[2] += sum(x[2] for x in stats)
        row[3] = max(row[3], max(x[1] for x in stats))
        row[4] += 1  # steps of this kind

    with tempfile.TemporaryDirectory(prefix="lmforge-dedup-bench-") as folder:
        wd = WorkDir(folder)
        job = Job(folder, [Unit(u, (Slice("x"),), 1) for u in range(units)], "text", dedup=plan)
        data = list(synthetic_units(units, docs, cfg.num_perm))
        add("signatures", units, [measured(lambda u=u: write_signatures(wd, plan, u, *data[u])) for u in range(units)])
        t_read = read_time(folder, units)
        for stage in job.stages():
            if stage.name in ("signatures", "units"):
                continue
            stats = [measured(lambda i=i: run_items(job, stage, [i])) for i in range(stage.items)]
            if not (stage.name.startswith("components") and wd.names(stage.name) == ["settled.json"]):
                add(stage.name.split("-")[0], stage.items, stats)
        removed = sum(len(crossdedup.removals(wd, plan, u)) for u in range(units))
    return plan, out, removed, t_read


def lsh_params_of(cfg: DedupConfig) -> tuple[int, int]:
    from lmforge.data.curate.scale import lsh_params

    return lsh_params(cfg)


def share(kind: str, plan: DedupPlan) -> int:
    """How many items a stage's documents are spread over (an item's memory holds its share)."""
    return {"signatures": plan.units, "duplicates": plan.band_parts, "verify": plan.groups,
            "removals": plan.groups}.get(kind, plan.node_parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=8, help="documents per unit")
    ap.add_argument("--band-parts", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--node-parts", type=int, default=16)
    ap.add_argument("--dense", type=int, default=131072, help="documents of the run that measures the cost per "
                    "document (8 units, every stage in one part)")
    args = ap.parse_args()
    cfg = DedupConfig()
    bytes_1t = TOKENS_1T * BYTES_PER_TOKEN
    big = dedup_plan(cfg, bytes_1t, units=bytes_1t // DEFAULT_UNIT_BYTES)
    dense = run(8, args.dense // 8, (1, 1, 1))
    wide = run(args.units, args.docs, (args.band_parts, args.groups, args.node_parts))
    report(args, big, dense, wide)


def report(args, big, dense, wide) -> None:
    """The wide run's stages (16K units: the items and the reads of 1T), each projected to 1T tokens:
    the dense run's seconds and peak memory per document (few, large items), the wide run's cost
    per item beyond that (its reads scaled to the files an item reads at 1T), over
    min(1,000, the stage's items at 1T)."""
    plan, rows, removed, t_read = wide
    d_plan, d_rows, _, _ = dense
    docs = args.units * args.docs
    print(f"wide: {args.units:,} units × {args.docs} documents = {docs:,} documents, {plan.duplicate_items} "
          f"duplicates items, {plan.groups} groups, {plan.node_parts} node ranges; dense: 8 units × "
          f"{args.dense // 8:,} documents, one part each; at 1T tokens (4 TB, {big.units:,} units, {DOCS_1T:.1e} "
          f"documents): {big.duplicate_items:,} duplicates items, {big.groups} groups, {big.node_parts} node ranges, "
          f"{big.rounds} rounds planned")
    print(f"removed (wide): {removed:,} documents; a ranged read here: {t_read * 1e6:.0f} µs\n")
    head = ("stage", "steps", "items", "items at 1T", "reads/item", "time s", "peak MB/item", "dense: µs/doc",
            "1T: GB/item", f"1T on {CORES:,} cores")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    total = 0.0
    for kind, (items, seconds, reads, peak, steps) in rows.items():
        _, d_seconds, _, d_peak, _ = d_rows[kind]
        per_doc = d_seconds / args.dense
        items_1t = {"signatures": big.units, "duplicates": big.duplicate_items, "verify": big.groups,
                    "removals": big.groups}.get(kind, big.node_parts)
        reads_item = reads / items
        fixed = max(0.0, seconds - per_doc * docs) / items - reads_item * t_read
        fixed_1t = max(0.0, fixed) + reads_item * files_per_item(kind, big) / files_per_item(kind, plan) * t_read
        t_1t = (per_doc * DOCS_1T + items_1t * fixed_1t) / min(CORES, items_1t)
        mem_1t = d_peak * share(kind, d_plan) / share(kind, big) * DOCS_1T / args.dense
        total += t_1t
        print(f"| {kind} | {steps} | {items:,} | {items_1t:,} | {reads_item:,.0f} | {seconds:.1f} | "
              f"{peak / 1e6:.2f} | {per_doc * 1e6:.1f} | {mem_1t / 1e9:.2f} | {t_1t / 60:.1f} min |")
    rate = minhash_mb_per_s()
    minhash = TOKENS_1T * BYTES_PER_TOKEN / 1e6 / rate / CORES
    print(f"| MinHash of the text (in signatures) | — | — | {big.units:,} | — | — | — | — | — | "
          f"{minhash / 60:.1f} min ({rate:.2f} MB/s per core) |")
    print(f"\ndedup at 1T tokens on {CORES:,} cores: {(total + minhash) / 60:.0f} min (tokenizing not included: "
          "bench/prepare.py)")


if __name__ == "__main__":
    main()
