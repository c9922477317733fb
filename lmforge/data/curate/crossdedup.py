"""Exact and near-duplicate removal across all work units, in stages that any number of tasks run.

The in-process way (``Deduplicator``: every kept document's key and signature in one process's
memory) stops at what one machine holds. Here the same decisions are taken in steps whose work
is split by unit, by key range, by band and hash range, by unit group or by node range, each
step's output in files under the job's work folder (``DEST/work/dedup``, local or in an object
store). No step holds every pair, and the number of items of each grows with the input:

1. **signatures** (one item per unit): each document's exact key (``text.exact_key``) and MinHash
   signature (``dedup.signature``: the same as in-process). Per unit, three files: the keys, and
   the signatures' LSH bands, each sorted and cut into parts (key ranges; band × hash range) that
   a later item reads with one ranged read; and the whole signatures, for verification.
2. **duplicates** (one item per key range, then one per band and hash range): the exact finder
   sorts a key range of every unit and marks each repeat of a key, pointing at its first
   occurrence in input order. A band item sorts the band's records of one hash range of every
   unit and pairs each document with the previous one of equal band values (the pairs datatrove's
   ``MinhashDedupBuckets`` writes), cut into parts by the unit group of the pair's first document.
3. **verify** (one item per unit group): the group's candidate pairs, each verified on the two
   full signatures (estimated Jaccard ≥ ``threshold``, as in-process): the verified edges, cut
   into parts by node range.
4. **components-RR** (one item per node range, alternating): the connected components of the
   verified edges, by Kiveris et al.'s large-star / small-star steps ("Connected components in
   MapReduce and beyond", 2014): each step groups the edges of a node range by node, rewires them
   towards the smallest node seen, and cuts its output by node range for the next step. When a
   large and a small step change nothing, every component is a star around its smallest node —
   its first document in input order; the steps planned after that are settled without work.
5. **clusters** (one item per node range), then **removals** (one per unit group): each star's
   other documents, regrouped per unit (``near-removed/UUUUUU.npy``).

A document is then removed as ``dedup/exact`` when an earlier document has its key, else as
``dedup/near`` when it is in a cluster and not its first. Everything is a function of the
documents and their order, not of the number of tasks or of the parts. One difference from the
in-process rule, which compares a document with the *kept* documents only: chains are joined here
(a ≈ b, b ≈ c, a ≉ c: c goes too). Memory per item is its part: 20 bytes per document of a key
range, a band part's records, a group's pairs with their signatures, a node range's edges (a
cluster of n copies puts n edges on its first document's range).
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
PAIR = np.dtype([("u1", "<u4"), ("d1", "<u4"), ("u2", "<u4"), ("d2", "<u4")])
EDGE = np.dtype([("src", "<u8"), ("dst", "<u8")])
NO_SIGNATURE = np.uint32(0xFFFFFFFF)
# Input per part of each kind of item: ~30M documents of text per exact key range (20 bytes each),
# ~15M per band part (its band's records, ~36 bytes each), ~8M per unit group and node range.
KEY_RANGE_BYTES = 64 << 30
BAND_PART_BYTES = 32 << 30
GROUP_BYTES = 16 << 30
MAX_PARTS = 1 << 16


class Store(Protocol):
    """The job's work folder (``job.WorkDir``)."""

    def uri(self, *parts: str) -> str: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def read_bytes(self, rel: str) -> bytes | None: ...
    def read_range(self, rel: str, start: int, end: int) -> bytes: ...
    def names(self, rel: str) -> list[str]: ...
    def write_json(self, rel: str, obj) -> None: ...
    def read_json(self, rel: str): ...


@dataclass(frozen=True)
class DedupPlan:
    exact: bool
    near: bool
    partitions: int  # exact-key ranges, one finder item each
    bands: int
    rows: int
    num_perm: int
    threshold: float
    band_parts: int = 1  # hash ranges per band: band × range is a duplicates item
    groups: int = 1  # unit groups: a verify item, and a removals item
    node_parts: int = 1  # node ranges: an item of each components step and of clusters
    rounds: int = 1  # large-star + small-star rounds planned (those after convergence cost nothing)
    units: int = 1

    @property
    def duplicate_items(self) -> int:
        return (self.partitions if self.exact else 0) + (self.bands * self.band_parts if self.near else 0)

    @property
    def steps(self) -> int:
        return 2 * self.rounds

    def group_of(self, unit: np.ndarray | int):
        return (np.asarray(unit, np.uint64) * np.uint64(self.groups) // np.uint64(max(1, self.units))).astype(np.int64)


def _parts(total_bytes: int | None, per_part: int) -> int:
    """A power of two of parts, one per ``per_part`` bytes of input (1 when the size is not known)."""
    if not total_bytes or total_bytes <= per_part:
        return 1
    return min(MAX_PARTS, 1 << math.ceil(math.log2(total_bytes / per_part)))


def dedup_plan(cfg: DedupConfig | None, total_bytes: int | None, units: int = 1) -> DedupPlan | None:
    """The stages' shape for ``cfg`` over an input of ``total_bytes`` (None: unknown) in ``units`` units."""
    if cfg is None or not (cfg.exact or cfg.near):
        return None
    bands = rows = 0
    if cfg.near:
        check_near_available()
        from lmforge.data.curate.scale import lsh_params

        bands, rows = lsh_params(cfg)
    # Rounds: O(log n) in practice for a graph of n documents (~1 per 100 bytes, at most); the
    # steps after convergence are settled without work, so a generous plan costs nothing.
    docs = max(2, (total_bytes or 1 << 30) // 100)
    return DedupPlan(cfg.exact, cfg.near, _parts(total_bytes, KEY_RANGE_BYTES), bands, rows, cfg.num_perm,
                     cfg.threshold, band_parts=_parts(total_bytes, BAND_PART_BYTES),
                     groups=min(units, _parts(total_bytes, GROUP_BYTES)), node_parts=_parts(total_bytes, GROUP_BYTES),
                     rounds=math.ceil(math.log2(docs)) + 8, units=units)


def check_near_available() -> None:
    try:
        import datasketch  # noqa: F401 - the MinHash signatures and LSH parameters
    except ImportError:
        raise UserError("near-duplicate removal needs datasketch: pip install 'lmforge[curate]'") from None


# ----------------------------------------------------------------------------- files


def _save(store: Store, rel: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    store.write_bytes(rel, buf.getvalue())


def _load(store: Store, rel: str) -> np.ndarray | None:
    data = store.read_bytes(rel)
    return None if data is None else np.load(io.BytesIO(data), allow_pickle=False)


def _save_parts(store: Store, rel: str, arr: np.ndarray, part: np.ndarray, parts: int) -> None:
    """``arr`` cut into ``parts`` parts (row i goes to ``part[i]``, order kept within a part) in one
    file: the parts' offsets (``parts + 1`` little-endian uint64, in records), then the records."""
    order = np.argsort(part, kind="stable")
    offsets = np.zeros(parts + 1, "<u8")
    np.cumsum(np.bincount(part, minlength=parts), out=offsets[1:])
    store.write_bytes(rel, offsets.tobytes() + np.ascontiguousarray(arr[order]).tobytes())


def _load_part(store: Store, rel: str, dtype: np.dtype, part: int, parts: int) -> np.ndarray:
    """Part ``part`` of a file ``_save_parts`` wrote: two ranged reads, whatever the file's size."""
    lo, hi = np.frombuffer(store.read_range(rel, 8 * part, 8 * part + 16), "<u8")
    if hi == lo:
        return np.zeros(0, dtype)
    start = 8 * (parts + 1) + int(lo) * dtype.itemsize
    return np.frombuffer(store.read_range(rel, start, start + int(hi - lo) * dtype.itemsize), dtype)


def _load_parts_of(store: Store, folder: str, dtype: np.dtype, part: int, parts: int,
                   sources: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Part ``part`` of every file in ``folder`` (or of ``sources``), concatenated, with each row's
    file number (the file's name without its extension)."""
    from concurrent.futures import ThreadPoolExecutor

    names = sources if sources is not None else [n for n in store.names(folder) if n.endswith(".bin")]
    # From an object store, many ranged reads in flight (16K files of 1T tokens: ~30 s, not ~15 min).
    with ThreadPoolExecutor(32 if remote.is_remote(store.uri(folder)) else 1) as pool:
        arrays = list(pool.map(lambda name: _load_part(store, f"{folder}/{name}", dtype, part, parts), names))
    origin = [np.full(len(a), int(name.split(".")[0]), np.uint32) for a, name in zip(arrays, names)]
    if not arrays:
        return np.zeros(0, dtype), np.zeros(0, np.uint32)
    return np.concatenate(arrays), np.concatenate(origin)


def _band_dtype(rows: int) -> np.dtype:
    return np.dtype([(f"h{i}", "<u4") for i in range(rows)] + [("doc", "<u4")])


def _node_part(nodes: np.ndarray, parts: int) -> np.ndarray:
    """A node's range: a mix of its bits (units and documents spread evenly over the ranges)."""
    if parts == 1:
        return np.zeros(len(nodes), np.int64)
    x = nodes.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits
    return (x >> np.uint64(64 - int(math.log2(parts)))).astype(np.int64)


# ----------------------------------------------------------------------------- 1. signatures


def write_signatures(store: Store, plan: DedupPlan, unit: int, keys: list, sigs: list) -> None:
    """A unit's exact keys (in key ranges), MinHash signatures (whole) and bands (in band × hash range)."""
    n = len(keys)
    if plan.exact:
        have = [i for i, k in enumerate(keys) if k is not None]
        arr = np.zeros(len(have), EXACT)
        if have:
            kv = np.frombuffer(b"".join(keys[i] for i in have), dtype=">u8").reshape(-1, 2)
            arr["hi"], arr["lo"], arr["doc"] = kv[:, 0], kv[:, 1], have
        arr.sort(order=["hi", "lo", "doc"])
        bits = plan.partitions.bit_length() - 1
        part = (arr["hi"] >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros(len(arr), np.int64)
        _save_parts(store, f"dedup/exact/{unit:06d}.bin", arr, part, plan.partitions)
    if plan.near:
        full = np.full((n, plan.num_perm), NO_SIGNATURE, np.uint32)
        have = [i for i, s in enumerate(sigs) if s is not None]
        if have:
            full[have] = np.stack([sigs[i] for i in have])
        store.write_bytes(f"dedup/sigs/{unit:06d}.bin", np.uint64(n).tobytes() + full.tobytes())
        dt = _band_dtype(plan.rows)
        records, part = [], []
        for b in range(plan.bands):
            rec = np.zeros(len(have), dt)
            for i in range(plan.rows):
                rec[f"h{i}"] = full[have, b * plan.rows + i]
            rec["doc"] = have
            rec.sort(order=list(dt.names))
            records.append(rec)
            part.append(b * plan.band_parts + (rec["h0"].astype(np.uint64) * np.uint64(plan.band_parts) >> np.uint64(32)))
        _save_parts(store, f"dedup/bands/{unit:06d}.bin", np.concatenate(records), np.concatenate(part).astype(np.int64),
                    plan.bands * plan.band_parts)


# ----------------------------------------------------------------------------- 2. duplicates


def find_duplicates(store: Store, plan: DedupPlan, item: int) -> None:
    """Item ``item`` of the duplicates stage: an exact key range, then a band's hash range."""
    if plan.exact and item < plan.partitions:
        _find_exact(store, plan, item)
    else:
        _find_candidates(store, plan, item - (plan.partitions if plan.exact else 0))


def _find_exact(store: Store, plan: DedupPlan, part: int) -> None:
    keys, unit = _load_parts_of(store, "dedup/exact", EXACT, part, plan.partitions)
    if not len(keys):
        return
    order = np.lexsort((keys["doc"], unit, keys["lo"], keys["hi"]))  # by key, then input order
    keys, unit = keys[order], unit[order]
    repeat = np.zeros(len(keys), bool)
    repeat[1:] = (keys["hi"][1:] == keys["hi"][:-1]) & (keys["lo"][1:] == keys["lo"][:-1])
    first = np.maximum.accumulate(np.where(repeat, 0, np.arange(len(keys))))
    rows = np.flatnonzero(repeat)
    rows = rows[np.argsort(unit[rows], kind="stable")]
    for s, e in _runs(unit[rows]):  # per unit
        mine = rows[s:e]
        out = np.zeros(len(mine), REMOVED)
        out["doc"], out["first_unit"], out["first_doc"] = keys["doc"][mine], unit[first[mine]], keys["doc"][first[mine]]
        _save(store, f"dedup/exact-removed/{int(unit[mine[0]]):06d}/{part:03d}.npy", out)


def _find_candidates(store: Store, plan: DedupPlan, item: int) -> None:
    """The candidate pairs of one band's hash range: documents sorted by the band's values, then by
    unit and document (input order); each one paired with the one before when their values are
    equal. Written cut by the unit group of the pair's first document."""
    dt = _band_dtype(plan.rows)
    rec, unit = _load_parts_of(store, "dedup/bands", dt, item, plan.bands * plan.band_parts)
    pairs = np.zeros(0, PAIR)
    if len(rec) > 1:
        order = np.lexsort((rec["doc"], unit, *[rec[f"h{i}"] for i in reversed(range(plan.rows))]))
        rec, unit = rec[order], unit[order]
        same = np.ones(len(rec) - 1, bool)
        for i in range(plan.rows):
            same &= rec[f"h{i}"][1:] == rec[f"h{i}"][:-1]
        at = np.flatnonzero(same)
        pairs = np.zeros(len(at), PAIR)
        pairs["u1"], pairs["d1"], pairs["u2"], pairs["d2"] = unit[at], rec["doc"][at], unit[at + 1], rec["doc"][at + 1]
    _save_parts(store, f"dedup/pairs/{item:05d}.bin", pairs, plan.group_of(pairs["u1"]), plan.groups)


# ----------------------------------------------------------------------------- 3. verify


def verify(store: Store, plan: DedupPlan, group: int) -> None:
    """The candidate pairs whose first document is in unit group ``group``, verified on the full
    signatures; the verified edges (both directions) cut by node range for the components."""
    pairs, _ = _load_parts_of(store, "dedup/pairs", PAIR, group, plan.groups)
    pairs = np.unique(pairs)  # sorted by first unit; a pair found by several bands is verified once
    similar = np.zeros(len(pairs), bool)
    for s, e in _runs(pairs["u1"]):  # one unit's pairs at a time: their two signatures in memory
        block = pairs[s:e]
        a = signature_rows(store, plan, int(block["u1"][0]), block["d1"])
        b = np.empty_like(a)
        order = np.lexsort((block["d2"], block["u2"]))  # by the other unit: one read per run of its rows
        for s2, e2 in _runs(block["u2"][order]):
            rows = order[s2:e2]
            b[rows] = signature_rows(store, plan, int(block["u2"][rows[0]]), block["d2"][rows])
        similar[s:e] = (a == b).mean(axis=1) >= plan.threshold
    pairs = pairs[similar]
    a = (pairs["u1"].astype(np.uint64) << np.uint64(32)) | pairs["d1"]
    b = (pairs["u2"].astype(np.uint64) << np.uint64(32)) | pairs["d2"]
    _save_edges(store, f"dedup/components/00/{group:05d}.bin", np.concatenate([a, b]), np.concatenate([b, a]), plan)


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of equal values (``values`` grouped)."""
    if not len(values):
        return []
    cuts = np.flatnonzero(values[1:] != values[:-1]) + 1
    return list(zip([0, *cuts.tolist()], [*cuts.tolist(), len(values)]))


def signature_rows(store: Store, plan: DedupPlan, unit: int, docs: np.ndarray) -> np.ndarray:
    """The full signatures of documents ``docs`` of ``unit``: one ranged read per run of neighbours."""
    width = plan.num_perm * 4
    out = np.empty((len(docs), plan.num_perm), np.uint32)
    order = np.argsort(docs, kind="stable")
    sorted_docs = docs[order]
    cuts = np.flatnonzero(np.diff(sorted_docs.astype(np.int64)) > 64) + 1  # a gap of 64 rows: another read
    for run in np.split(np.arange(len(docs)), cuts):
        if not len(run):
            continue
        lo, hi = int(sorted_docs[run[0]]), int(sorted_docs[run[-1]]) + 1
        block = np.frombuffer(store.read_range(f"dedup/sigs/{unit:06d}.bin", 8 + lo * width, 8 + hi * width),
                              np.uint32).reshape(-1, plan.num_perm)
        out[order[run]] = block[sorted_docs[run].astype(np.int64) - lo]
    return out


# ----------------------------------------------------------------------------- 4. components


def _save_edges(store: Store, rel: str, src: np.ndarray, dst: np.ndarray, plan: DedupPlan) -> None:
    edges = np.zeros(len(src), EDGE)
    edges["src"], edges["dst"] = src, dst
    _save_parts(store, rel, edges, _node_part(edges["src"], plan.node_parts), plan.node_parts)


def component_step(store: Store, plan: DedupPlan, step: int, part: int) -> dict:
    """Item ``part`` of components step ``step`` (1-based; odd: large-star, even: small-star): the
    edges of the nodes in this node range, rewired. Returns its marker: whether anything changed."""
    edges, _ = _load_parts_of(store, f"dedup/components/{step - 1:02d}", EDGE, part, plan.node_parts)
    edges = np.unique(edges[edges["src"] != edges["dst"]])  # sorted by node (src), then neighbour
    src, dst = edges["src"], edges["dst"]
    if step % 2:  # large-star: a node's larger neighbours go to the smallest of it and its neighbours
        starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]]) if len(src) else np.zeros(0, np.int64)
        least = np.minimum(src, np.repeat(np.minimum.reduceat(dst, starts), np.diff(np.r_[starts, len(src)]))) \
            if len(src) else src
        keep = dst > src
        new_a, new_b = dst[keep], least[keep]
        changed = bool((least[keep] != src[keep]).any())
    else:  # small-star: a node and its smaller neighbours go to the smallest of them
        keep = dst < src
        s, d = src[keep], dst[keep]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]]) if len(s) else np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, len(s)])
        least = np.repeat(np.minimum.reduceat(d, starts), counts) if len(s) else d
        other = d != least
        new_a, new_b = np.r_[d[other], s[starts]], np.r_[least[other], least[starts]]
        changed = bool((counts > 1).any())
    new_a, new_b = new_a.astype(np.uint64), new_b.astype(np.uint64)
    _save_edges(store, f"dedup/components/{step:02d}/{part:05d}.bin", np.r_[new_a, new_b], np.r_[new_b, new_a], plan)
    return {"changed": changed}


def converged_at(store: Store, plan: DedupPlan, step: int) -> int | None:
    """The components step whose output is final, when the steps before ``step`` converged (a
    large and a small step that changed nothing), else None."""
    if step <= 2:
        return None
    last = store.read_json(f"components-{step - 1:02d}/settled.json") or {}
    if "final" in last:
        return last["final"]
    if step % 2 == 0:  # convergence is seen after a small step
        return None
    for s in (step - 2, step - 1):
        for item in range(plan.node_parts):
            marker = store.read_json(f"components-{s:02d}/{item:06d}.json")
            if marker is None or marker.get("changed", True):
                return None
    return step - 1


# ----------------------------------------------------------------------------- 5. clusters, removals


def clusters(store: Store, plan: DedupPlan, part: int) -> None:
    """The stars of node range ``part``: each document linked to a smaller one is removed, pointing at
    it (its component's first document); cut by unit group."""
    final = converged_at(store, plan, plan.steps + 1)
    if final is None:
        raise RuntimeError(f"near-duplicate clusters did not converge in {plan.rounds} rounds")
    edges, _ = _load_parts_of(store, f"dedup/components/{final:02d}", EDGE, part, plan.node_parts)
    edges = np.unique(edges[edges["dst"] < edges["src"]])
    rows = np.zeros(len(edges), REMOVED)
    rows["doc"] = edges["src"] & np.uint64(0xFFFFFFFF)
    rows["first_unit"], rows["first_doc"] = edges["dst"] >> np.uint64(32), edges["dst"] & np.uint64(0xFFFFFFFF)
    unit = (edges["src"] >> np.uint64(32)).astype(np.uint32)
    out = np.zeros(len(rows), [("unit", "<u4"), *REMOVED.descr])
    out["unit"] = unit
    for name in REMOVED.names:
        out[name] = rows[name]
    _save_parts(store, f"dedup/clusters/{part:05d}.bin", out, plan.group_of(unit), plan.groups)


def collect_removals(store: Store, plan: DedupPlan, group: int) -> None:
    """The near duplicates of unit group ``group``, one file per unit, in document order."""
    dt = np.dtype([("unit", "<u4"), *REMOVED.descr])
    rows, _ = _load_parts_of(store, "dedup/clusters", dt, group, plan.groups)
    rows = np.sort(rows, order=["unit", "doc"])
    for s, e in _runs(rows["unit"]):  # per unit
        out = np.zeros(e - s, REMOVED)
        for name in REMOVED.names:
            out[name] = rows[name][s:e]
        _save(store, f"dedup/near-removed/{int(rows['unit'][s]):06d}.npy", out)


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
