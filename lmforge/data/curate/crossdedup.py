"""Exact and near-duplicate removal across all work units, in stages that any number of tasks run.

The in-process way (``Deduplicator``: every kept document's key and signature in one process's
memory) stops at what one machine holds. Here the same decisions are taken in steps whose work
is split by unit, by key range or by LSH band, each step's output in files under the job's work
folder (``DEST/units/dedup``, local or in an object store):

1. **signatures** (one item per unit): each document's exact key (``text.exact_key``) and MinHash
   signature (``dedup.signature``: the same as in-process); the keys sorted into ``partitions``
   key ranges, the signatures whole (for verification) and cut into LSH bands in datatrove's
   signature-file layout (``bucket_BBB/UUUUUU.minhash.sig``, records sorted).
2. **duplicates** (one item per key range and one per band): the exact finder sorts a key range of
   every unit and marks each repeat of a key, pointing at its first occurrence in input order; the
   band items are datatrove's ``MinhashDedupBuckets``, which merges the sorted band files of all
   units and writes the candidate pairs (documents whose band is equal).
3. **clusters** (one item): every candidate pair is verified on the full signatures (estimated
   Jaccard ≥ ``threshold``, as in-process), verified pairs are joined (union-find) and each
   cluster keeps its first document in input order.

A document is then removed as ``dedup/exact`` when an earlier document has its key, else as
``dedup/near`` when it is in a cluster and not the cluster's first. Everything is a function of
the documents and their order, not of the number of tasks. One difference from the in-process
rule, which compares a document with the *kept* documents only: chains are joined here (a ≈ b,
b ≈ c, a ≉ c: c goes too). The finder holds 20 bytes per document of its key range, the
cluster step the candidate pairs; `partitions` grows with the input (one per 64 GB).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lmforge.config.curation import DedupConfig
from lmforge.data import remote
from lmforge.errors import UserError

EXACT = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("doc", "<u4")])
REMOVED = np.dtype([("doc", "<u4"), ("first_unit", "<u4"), ("first_doc", "<u4")])
PARTITION_BYTES = 64 << 30
NO_SIGNATURE = np.uint32(0xFFFFFFFF)


class Store(Protocol):
    """The job's work folder (``job.WorkDir``)."""

    def uri(self, *parts: str) -> str: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def read_bytes(self, rel: str) -> bytes | None: ...
    def names(self, rel: str) -> list[str]: ...


@dataclass(frozen=True)
class DedupPlan:
    exact: bool
    near: bool
    partitions: int  # exact-key ranges, one finder item each
    bands: int
    rows: int
    num_perm: int
    threshold: float

    @property
    def duplicate_items(self) -> int:
        return (self.partitions if self.exact else 0) + (self.bands if self.near else 0)


def dedup_plan(cfg: DedupConfig | None, total_bytes: int | None) -> DedupPlan | None:
    """The stages' shape for ``cfg`` over an input of ``total_bytes`` (None: unknown)."""
    if cfg is None or not (cfg.exact or cfg.near):
        return None
    bands = rows = 0
    if cfg.near:
        check_near_available()
        from lmforge.data.curate.scale import lsh_params

        bands, rows = lsh_params(cfg)
    parts = 1
    if total_bytes and total_bytes > PARTITION_BYTES:
        parts = min(256, 1 << math.ceil(math.log2(total_bytes / PARTITION_BYTES)))
    return DedupPlan(cfg.exact, cfg.near, parts, bands, rows, cfg.num_perm, cfg.threshold)


def check_near_available() -> None:
    for module in ("datasketch", "datatrove"):
        try:
            __import__(module)
        except ImportError:
            raise UserError(f"near-duplicate removal needs {module}: pip install 'lmforge[curate]'") from None


def _save(store: Store, rel: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    store.write_bytes(rel, buf.getvalue())


def _load(store: Store, rel: str) -> np.ndarray | None:
    data = store.read_bytes(rel)
    return None if data is None else np.load(io.BytesIO(data), allow_pickle=False)


def _band_dtype(rows: int) -> np.dtype:
    return np.dtype([(f"h{i}", "<u4") for i in range(rows)] + [("doc", "<u4")])


# ----------------------------------------------------------------------------- 1. signatures


def write_signatures(store: Store, plan: DedupPlan, unit: int, keys: list, sigs: list) -> None:
    """A unit's exact keys (per key range) and MinHash signatures (whole, and per band)."""
    n = len(keys)
    if plan.exact:
        have = [i for i, k in enumerate(keys) if k is not None]
        arr = np.zeros(len(have), EXACT)
        if have:
            kv = np.frombuffer(b"".join(keys[i] for i in have), dtype=">u8").reshape(-1, 2)
            arr["hi"], arr["lo"], arr["doc"] = kv[:, 0], kv[:, 1], have
        arr.sort(order=["hi", "lo", "doc"])
        bits = plan.partitions.bit_length() - 1
        part = arr["hi"] >> np.uint64(64 - bits) if bits else np.zeros(len(arr), np.uint64)
        for p in np.unique(part):
            _save(store, f"dedup/exact/{int(p):03d}/{unit:06d}.npy", arr[part == p])
    if plan.near:
        full = np.full((n, plan.num_perm), NO_SIGNATURE, np.uint32)
        have = [i for i, s in enumerate(sigs) if s is not None]
        if have:
            full[have] = np.stack([sigs[i] for i in have])
        _save(store, f"dedup/sigs/{unit:06d}.npy", full)
        dt = _band_dtype(plan.rows)
        for b in range(plan.bands):
            rec = np.zeros(len(have), dt)
            for i in range(plan.rows):
                rec[f"h{i}"] = full[have, b * plan.rows + i]
            rec["doc"] = have
            rec.sort(order=list(dt.names))
            if len(rec):  # datatrove's record layout: the band's values then the document id, no header
                store.write_bytes(f"dedup/bands/bucket_{b:03d}/{unit:06d}.minhash.sig", rec.tobytes())


# ----------------------------------------------------------------------------- 2. duplicates


def find_duplicates(store: Store, plan: DedupPlan, item: int) -> None:
    """Item ``item`` of the duplicates stage: an exact key range, then the LSH bands."""
    if plan.exact and item < plan.partitions:
        _find_exact(store, item)
    else:
        _find_candidates(store, plan, item - (plan.partitions if plan.exact else 0))


def _find_exact(store: Store, part: int) -> None:
    folder = f"dedup/exact/{part:03d}"
    arrays, units = [], []
    for name in store.names(folder):
        a = _load(store, f"{folder}/{name}")
        arrays.append(a)
        units.append(np.full(len(a), int(name[:6]), np.uint32))
    if not arrays:
        return
    keys, unit = np.concatenate(arrays), np.concatenate(units)
    order = np.lexsort((keys["doc"], unit, keys["lo"], keys["hi"]))  # by key, then input order
    keys, unit = keys[order], unit[order]
    repeat = np.zeros(len(keys), bool)
    repeat[1:] = (keys["hi"][1:] == keys["hi"][:-1]) & (keys["lo"][1:] == keys["lo"][:-1])
    first = np.maximum.accumulate(np.where(repeat, 0, np.arange(len(keys))))
    rows = np.flatnonzero(repeat)
    for u in np.unique(unit[rows]):
        mine = rows[unit[rows] == u]
        out = np.zeros(len(mine), REMOVED)
        out["doc"], out["first_unit"], out["first_doc"] = keys["doc"][mine], unit[first[mine]], keys["doc"][first[mine]]
        _save(store, f"dedup/exact-removed/{int(u):06d}/{part:03d}.npy", out)


def _minhash_config(plan: DedupPlan):
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    # 32-bit values: datasketch's signature, whose bands are written above (the hash function
    # named here is not used by the bucket step).
    return MinhashConfig(num_buckets=plan.bands, hashes_per_bucket=plan.rows,
                         hash_config=HashConfig(precision=32, hash_fc="sha1"))


def _find_candidates(store: Store, plan: DedupPlan, band: int) -> None:
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets
    from loguru import logger

    if not store.names(f"dedup/bands/bucket_{band:03d}"):
        return  # no document has a signature
    step = MinhashDedupBuckets(input_folder=remote.datatrove_folder(store.uri("dedup/bands")),
                               output_folder=remote.datatrove_folder(store.uri("dedup/pairs")), config=_minhash_config(plan))
    logger.disable("datatrove")  # its progress lines are for its own executors' task logs
    try:
        step.run(None, rank=band, world_size=plan.bands)
    finally:
        logger.enable("datatrove")


# ----------------------------------------------------------------------------- 3. clusters


def cluster(store: Store, plan: DedupPlan) -> None:
    """Verify the candidate pairs, join them, and list each cluster's later documents per unit."""
    pairs = [np.frombuffer(store.read_bytes(f"dedup/pairs/{name}") or b"", "<u4").reshape(-1, 4)
             for name in store.names("dedup/pairs") if name.endswith(".dups")]
    pairs = np.unique(np.concatenate(pairs), axis=0) if pairs else np.zeros((0, 4), np.uint32)
    pairs = pairs[np.lexsort((pairs[:, 3], pairs[:, 1], pairs[:, 2], pairs[:, 0]))]  # grouped by unit pair
    sigs: dict[int, np.ndarray] = {}

    def signatures_of(u: int) -> np.ndarray:
        if u not in sigs:
            if len(sigs) >= 64:  # bounded memory: the pairs come grouped by unit
                sigs.pop(next(iter(sigs)))
            sigs[u] = _load(store, f"dedup/sigs/{u:06d}.npy")
        return sigs[u]

    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])  # path halving
            x = parent[x]
        return x

    starts = np.flatnonzero(np.r_[True, (pairs[1:, 0] != pairs[:-1, 0]) | (pairs[1:, 2] != pairs[:-1, 2])]) \
        if len(pairs) else []
    for s, e in zip(starts, [*starts[1:], len(pairs)]):
        u1, u2 = int(pairs[s, 0]), int(pairs[s, 2])
        a, b = signatures_of(u1)[pairs[s:e, 1]], signatures_of(u2)[pairs[s:e, 3]]
        similar = (a == b).mean(axis=1) >= plan.threshold
        for d1, d2 in pairs[s:e][similar][:, [1, 3]]:
            x, y = root((u1 << 32) | int(d1)), root((u2 << 32) | int(d2))
            if x != y:  # the earlier document (input order) stays the root
                parent[max(x, y)] = min(x, y)
                parent.setdefault(min(x, y), min(x, y))
    removed: dict[int, list[tuple[int, int, int]]] = {}
    for node in parent:
        r = root(node)
        if r != node:
            removed.setdefault(node >> 32, []).append((node & 0xFFFFFFFF, r >> 32, r & 0xFFFFFFFF))
    for u, rows in removed.items():
        _save(store, f"dedup/near-removed/{u:06d}.npy", np.array(sorted(rows), REMOVED))


# ----------------------------------------------------------------------------- results


def removals(store: Store, plan: DedupPlan, unit: int) -> dict[int, tuple[str, int, int]]:
    """The unit's removed documents: index → (reason, unit and index of the document it repeats)."""
    out: dict[int, tuple[str, int, int]] = {}
    if plan.near:
        near = _load(store, f"dedup/near-removed/{unit:06d}.npy")
        for r in near if near is not None else ():
            out[int(r["doc"])] = ("near", int(r["first_unit"]), int(r["first_doc"]))
    if plan.exact:  # exact takes precedence: an earlier document has the very same text
        folder = f"dedup/exact-removed/{unit:06d}"
        for name in store.names(folder):
            for r in _load(store, f"{folder}/{name}"):
                out[int(r["doc"])] = ("exact", int(r["first_unit"]), int(r["first_doc"]))
    return out
