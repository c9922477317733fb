"""A `data prepare` / `data dedup` job: its stages, the work of each stage's items, and the state
it keeps in ``DEST/work`` while it runs.

Stages run one after the other; the items of a stage are independent, so any number of tasks
can share them (task ``r`` of ``n`` takes items ``r, r + n, ...``: ``StageTask``, the step
datatrove's executors run) or one process can do them all (``run_items``):

* ``signatures`` (one item per work unit; with dedup): the documents' dedup keys and signatures;
* ``duplicates``, ``clusters`` (with dedup): the decisions (``curate.crossdedup``);
* ``units`` (one item per work unit): read the unit's documents, drop its duplicates, run the
  filters and decontamination, then tokenize and pack them into the unit's own MDS shards
  (`prepare`) or write the kept documents as JSONL (`dedup`), publish that into DEST, and write
  the unit's marker.

Restart: an item is done when its marker ``work/<stage>/<item>.json`` exists; it is written
after everything the item publishes. A task that dies leaves no marker, and the next run of the
command redoes its item over whatever it left (the same names, the same bytes). Nothing is listed
in DEST's index before every unit is done (the job's last step, `prepare`'s ``finalize``), so a
sample is never listed twice.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.config.curation import CurateConfig
from lmforge.data import remote
from lmforge.data.curate import crossdedup
from lmforge.data.curate.crossdedup import DedupPlan
from lmforge.data.curate.curator import Accounting
from lmforge.data.curate.pipeline import ChunkPool
from lmforge.data.prepare import packing
from lmforge.data.prepare.packing import Packer
from lmforge.data.text.sources import SourceStats
from lmforge.data.prepare.units import Unit, unit_documents
from lmforge.errors import UserError

WORK = "work"  # DEST/work: the job's plan, markers, dedup files and logs; removed when the job is done
SETTLED = "settled.json"  # a stage's one marker for all its items: nothing to do (components after convergence)


class WorkDir:
    """``DEST/work``, local or in an object store."""

    def __init__(self, out: str):
        self.out = out
        self.root = remote.join(out, WORK)

    def uri(self, *parts: str) -> str:
        return remote.join(self.root, *parts)

    def write_bytes(self, rel: str, data: bytes) -> None:
        remote.put_bytes(self.uri(rel), data)

    def read_bytes(self, rel: str) -> bytes | None:
        return remote.get_bytes(self.uri(rel))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        return remote.get_range(self.uri(rel), start, end)

    def names(self, rel: str) -> list[str]:
        return remote.listdir(self.uri(rel))

    def write_json(self, rel: str, obj) -> None:
        self.write_bytes(rel, json.dumps(obj).encode())

    def read_json(self, rel: str):
        data = self.read_bytes(rel)
        return None if data is None else json.loads(data)

    def done(self, stage: str) -> set[int]:
        """The items of ``stage`` whose marker is written (all of them for a stage settled as a whole)."""
        names = self.names(stage)
        if SETTLED in names:
            return set(range((self.read_json(f"{stage}/{SETTLED}") or {})["items"]))
        return {int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()}

    def staging(self) -> str:
        """A local folder for an item's files before they are published (beside DEST when it is local,
        so that publishing is a rename)."""
        if remote.is_remote(self.out):
            return tempfile.mkdtemp(prefix="lmforge-unit-")
        base = remote.local_path(self.uri("tmp"))
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(dir=base)

    def publish(self, local_file: str, uri: str) -> None:
        if remote.is_remote(uri):
            remote.upload_file(local_file, uri)
        else:
            dest = remote.local_path(uri)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.move(local_file, dest)  # a rename when both are on one file system

    def remove(self, keep_logs: bool = False) -> None:
        """Remove the work folder (but its ``logs`` with ``keep_logs``: Slurm's scripts and task logs,
        which the last step's own task is still writing to)."""
        if not keep_logs:
            remote.remove_tree(self.root)
            return
        for name in self.names(""):
            if name != "logs":
                remote.remove_tree(self.uri(name))


class TaskDied(UserError):
    """A task's process ended before its items were done (killed, out of memory), or a unit is
    not done: the job stops, and the same command finishes it. Not bad input: what the job
    wrote stays."""

    exit_code = 1


class BadInput(UserError):
    """Bad input met by an item (a corrupt or unreadable input file, with ``--on-bad-input fail``):
    the job stops; the items already done stay."""


@dataclass(frozen=True)
class Stage:
    name: str  # signatures, duplicates, verify, components-RR, clusters, removals (dedup), units, finalize
    items: int


@dataclass
class Job:
    """Everything a task needs (it is pickled to the executors' processes and machines)."""

    out: str
    units: list[Unit]
    text_field: str
    curate: CurateConfig | None = None
    index: object | None = None  # the decontamination TaskIndex
    dedup: DedupPlan | None = None
    # `prepare`: (Encoder, its arguments) and the packing; `dedup`: None (kept documents as JSONL)
    encoder: tuple[Callable, tuple] | None = None
    splits: tuple[str, ...] = ("train",)
    seq_len: int = 0
    dtype: str = "uint16"
    compression: str | None = None
    on_bad_input: str = "skip"  # an input file that cannot be read: skip it (counted, named) or fail
    # The job's last step (the index over every unit, the marker), for an executor that runs it
    # as a task of its own (Slurm); otherwise the command calls it when the stages are done.
    finalize: Callable[["Job"], dict] | None = None
    after_marker: Callable[["Job"], None] | None = None  # what the last step removes once the marker is written
    context: dict = field(default_factory=dict)  # what `finalize` needs besides

    def stages(self) -> list[Stage]:
        out, d = [], self.dedup
        if d is not None:
            out += [Stage("signatures", len(self.units)), Stage("duplicates", d.duplicate_items)]
            if d.near:
                out += [Stage("verify", d.groups), *[Stage(f"components-{s:02d}", d.node_parts)
                                                     for s in range(1, d.steps + 1)],
                        Stage("clusters", d.node_parts), Stage("removals", d.groups)]
        return out + [Stage("units", len(self.units))]


# ----------------------------------------------------------------------------- running items


def run_items(job: Job, stage: Stage, items: Iterable[int], workers: int = 1) -> None:
    """Do ``stage``'s work for ``items`` (those not done yet) in this process, with ``workers``
    processes for the per-document work. A task's error is also left in ``work/errors`` for the
    command to report whichever task met it: bad input, a failing store, or a crash (a bug:
    rerunning fails the same way, so it is said so, not "run it again")."""
    wd = WorkDir(job.out)
    done = wd.done(stage.name)
    todo = [i for i in items if i not in done]
    if not todo or settle(job, stage):
        return
    try:
        if stage.name == "signatures":
            _signatures(job, wd, todo, workers)
        elif stage.name == "units":
            _units(job, wd, todo, workers)
        elif stage.name == "finalize":
            job.finalize(job)
        else:
            step = _DEDUP_STEPS.get(stage.name.split("-")[0])
            if step is None:
                raise ValueError(stage.name)
            for i in todo:
                wd.write_json(f"{stage.name}/{i:06d}.json", step(wd, job.dedup, stage, i) or {})
    except UserError as e:
        store, died = isinstance(e, remote.StoreError), isinstance(e, TaskDied)
        _error(wd, stage, {"message": str(e), "store": store, "died": died})
        if store or died:
            raise
        raise BadInput(str(e)) from None
    except Exception as e:
        import traceback

        _error(wd, stage, {"message": f"{type(e).__name__}: {e}", "crash": True, "traceback": traceback.format_exc()})
        raise


def _error(wd: WorkDir, stage: Stage, record: dict) -> None:
    wd.write_json(f"errors/{stage.name}-{uuid.uuid4().hex[:8]}.json", {"stage": stage.name} | record)


# A dedup stage's item: (work folder, plan, stage, item) -> its marker's content.
_DEDUP_STEPS: dict[str, Callable] = {
    "duplicates": lambda wd, plan, stage, i: crossdedup.find_duplicates(wd, plan, i),
    "verify": lambda wd, plan, stage, i: crossdedup.verify(wd, plan, i),
    "components": lambda wd, plan, stage, i: crossdedup.component_step(wd, plan, int(stage.name.split("-")[1]), i),
    "clusters": lambda wd, plan, stage, i: crossdedup.clusters(wd, plan, i),
    "removals": lambda wd, plan, stage, i: crossdedup.collect_removals(wd, plan, i),
}


def settle(job: Job, stage: Stage) -> bool:
    """A components step planned after the components converged: done without work, by one marker
    for all its items (pointing at the final step), so that no executor starts for it."""
    if not stage.name.startswith("components-"):
        return False
    wd = WorkDir(job.out)
    final = crossdedup.converged_at(wd, job.dedup, int(stage.name.split("-")[1]))
    if final is None:
        return False
    wd.write_json(f"{stage.name}/{SETTLED}", {"items": stage.items, "final": final})
    return True


class StageTask:
    """A stage as a step of a datatrove pipeline: task ``rank`` of ``world_size`` does the items
    ``rank, rank + world_size, ...``, one after the other in its own process."""

    def __init__(self, job: Job, stage: Stage, threads: int = 1):
        self.job, self.stage, self.threads = job, stage, threads

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        # The tokenizer's thread pool: this task's share of the cores, not all of them.
        os.environ["RAYON_NUM_THREADS"] = str(self.threads)
        run_items(self.job, self.stage, range(rank, self.stage.items, world_size))

    def __repr__(self) -> str:
        return f"lmforge {self.stage.name} ({self.stage.items} items)"


def _chunked(pairs: Iterable[tuple[int, str]], max_chars: int) -> Iterator[tuple[list[int], list[str]]]:
    """(document indexes, texts) in chunks of about ``max_chars`` characters (``packing.chunk_documents``)."""
    for chunk in packing.chunk_documents(pairs, max_chars, text=lambda p: p[1]):
        yield [i for i, _ in chunk], [t for _, t in chunk]


def _signatures(job: Job, wd: WorkDir, todo: list[int], workers: int) -> None:
    chars = packing.CHUNK_CHARS if workers <= 1 else packing.CHUNK_CHARS_POOL

    class Acc:
        def __init__(self, u):
            self.u, self.keys, self.sigs, self.start = u, [], [], time.perf_counter()

    def items():
        for u in todo:
            acc = Acc(u)
            docs = enumerate(unit_documents(job.units[u], job.text_field, SourceStats(), job.on_bad_input))
            for _, texts in _chunked(docs, chars):
                yield acc, texts
            yield acc, None

    with ChunkPool("signatures", job.curate, workers=workers) as pool:
        for acc, texts, result in pool.map(items()):
            if texts is not None:
                acc.keys += result[0]
                acc.sigs += result[1]
                continue
            crossdedup.write_signatures(wd, job.dedup, acc.u, acc.keys, acc.sigs)
            wd.write_json(f"signatures/{acc.u:06d}.json", {"documents": len(acc.keys), "bytes": job.units[acc.u].bytes,
                                                           "seconds": round(time.perf_counter() - acc.start, 3)})


def _units(job: Job, wd: WorkDir, todo: list[int], workers: int) -> None:
    if job.encoder is None and not per_document_checks(job.curate, job.index):
        workers = 1  # `data dedup` alone: no work per document for a worker process, only the trip there and back
    chars = packing.CHUNK_CHARS if workers <= 1 else packing.CHUNK_CHARS_POOL
    open_units: dict[int, UnitWork] = {}  # started and not finished: their staging folders go on error

    def items():
        for u in todo:
            w = open_units[u] = UnitWork(job, wd, u)
            for ids, texts in _chunked(w.documents(), chars):
                yield (w, ids), texts
            yield (w, None), None

    try:
        with ChunkPool("documents", job.curate, job.index, job.encoder, workers) as pool:
            for (w, ids), texts, result in pool.map(items()):
                if texts is None:
                    w.finish()
                    del open_units[w.u]
                else:
                    w.add(ids, texts, result)
    finally:
        for w in open_units.values():
            shutil.rmtree(w.stage, ignore_errors=True)


def per_document_checks(cfg: CurateConfig | None, index) -> bool:
    """Whether the units stage runs filters or decontamination on each document."""
    return cfg is not None and bool(cfg.filters.enabled() or index is not None)


class UnitWork:
    """One unit of the ``units`` stage: its documents in, its shards (or JSONL part) and marker out."""

    def __init__(self, job: Job, wd: WorkDir, u: int):
        self.job, self.wd, self.u, self.unit = job, wd, u, job.units[u]
        self.start = time.perf_counter()
        self.stats = SourceStats()
        cfg = job.curate
        self.acct = Accounting(action=cfg.action, sample_limit=cfg.removed_sample) if cfg is not None else None
        self.flag = cfg is not None and cfg.action == "flag"
        self.removed = crossdedup.removals(wd, job.dedup, u) if job.dedup is not None else {}
        self.stage = wd.staging()
        self.packers = None
        if job.encoder is not None:
            self.packers = {s: Packer(os.path.join(self.stage, s), job.seq_len, job.dtype, job.compression,
                                      prefix=f"{u:06d}.") for s in job.splits}
        else:
            self.part = open(os.path.join(self.stage, "part.jsonl"), "w", encoding="utf-8")
            self.written = 0

    def documents(self) -> Iterator[tuple[int, str]]:
        """(index in the unit, text) of the documents that go on (duplicates are dropped here)."""
        for i, text in enumerate(unit_documents(self.unit, self.job.text_field, self.stats, self.job.on_bad_input)):
            if self.acct is not None:
                self.acct.documents_in += 1
                self.acct.bytes_in += len(text.encode("utf-8", "replace"))
            hit = self.removed.get(i)
            if hit is not None:
                reason, first_unit, first_doc = hit
                self.acct.add(i, f"dedup/{reason}", text, unit=self.u, duplicate_of=[first_unit, first_doc])
                if not self.flag:
                    continue
            yield i, text

    def add(self, ids: list[int], texts: list[str], result) -> None:
        out, matched = result
        for pos, reason, tasks in matched:
            self.acct.add(ids[pos], reason, texts[pos], unit=self.u, **({"tasks": tasks} if tasks else {}))
        if self.packers is not None:
            for split, (tokens, docs, nbytes) in out.items():
                if split in self.packers:
                    self.packers[split].add(tokens, docs, nbytes)
            return
        for t in out:
            self.part.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        self.written += len(out)

    def finish(self) -> None:
        marker = {"unit": self.u, "bytes": self.unit.bytes, "source": self.stats.to_dict()}
        if self.packers is not None:
            splits = {s: p.finish() for s, p in self.packers.items()}
            for s, info in splits.items():
                for entry in info["shard_entries"]:
                    name = (entry["zip_data"] or entry["raw_data"])["basename"]
                    self.wd.publish(os.path.join(self.stage, s, name), remote.join(self.job.out, s, name))
            marker["splits"] = splits
            marker["tokens"] = sum(s["tokens"] for s in splits.values())
        else:
            self.part.close()
            self.wd.publish(os.path.join(self.stage, "part.jsonl"), self.wd.uri("parts", f"{self.u:06d}.jsonl"))
            marker["documents_written"] = self.written
        if self.acct is not None:
            marker["curation"] = self.acct.counts()
            rows = [r for reason in sorted(self.acct.samples) for r in self.acct.samples[reason]]
            if rows:
                self.wd.write_bytes(f"removed/{self.u:06d}.jsonl", "".join(
                    json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
        marker["seconds"] = round(time.perf_counter() - self.start, 3)
        self.wd.write_json(f"units/{self.u:06d}.json", marker)  # last: the unit is done
        shutil.rmtree(self.stage, ignore_errors=True)


# ----------------------------------------------------------------------------- reading the results


def unit_markers(job: Job) -> list[dict]:
    """Every unit's marker, in unit order (all units must be done)."""
    from concurrent.futures import ThreadPoolExecutor

    wd = WorkDir(job.out)
    # Thousands of small reads: from an object store, many at a time.
    with ThreadPoolExecutor(32 if remote.is_remote(job.out) else 1) as pool:
        out = list(pool.map(lambda u: wd.read_json(f"units/{u:06d}.json"), range(len(job.units))))
    for u, m in enumerate(out):
        if m is None:
            raise TaskDied(f"--out {job.out}: unit {u} is not done; re-run the command to finish it")
    return out


def removed_samples(job: Job, offsets: list[int], limit: int) -> dict[str, list[dict]]:
    """Up to ``limit`` removed documents per reason, in input order, with their position in the
    whole input (``doc``) and, for duplicates, the position of the document they repeat."""
    wd = WorkDir(job.out)
    out: dict[str, list[dict]] = {}
    for name in wd.names("removed"):
        for line in (wd.read_bytes(f"removed/{name}") or b"").decode().splitlines():
            r = json.loads(line)
            bucket = out.setdefault(r["reason"], [])
            if len(bucket) >= limit:
                continue
            u = r.pop("unit")
            r["doc"] += offsets[u]
            if "duplicate_of" in r:
                fu, fd = r["duplicate_of"]
                r["duplicate_of"] = offsets[fu] + fd
            bucket.append(r)
    return out


def unit_offsets(markers: list[dict]) -> list[int]:
    """Each unit's first document's position in the whole input."""
    out, n = [], 0
    for m in markers:
        out.append(n)
        n += m["source"]["documents"]
    return out


def source_stats(markers: list[dict], skipped_inputs: list[dict]) -> SourceStats:
    """What reading the inputs found, summed over the units (``skipped_inputs``: found while listing them)."""
    stats = SourceStats(skipped_inputs=list(skipped_inputs))
    for m in markers:
        d = m["source"]
        stats.files += d["files"]
        stats.documents += d["documents"]
        stats.skipped_inputs += d["skipped_inputs"]
        stats.invalid_utf8 += d["invalid_utf8_replacements"]
        stats.invalid_utf8_files = (stats.invalid_utf8_files + d["invalid_utf8_files"])[:5]
        stats.skipped_lines += d["skipped_lines"]
        stats.skipped_line_examples = (stats.skipped_line_examples + d["skipped_line_examples"])[:5]
    return stats


def source_summary(stats: SourceStats) -> dict:
    """What reading the inputs skipped or replaced, as a summary's fields (``prepare.input_warnings`` says them)."""
    return {"skipped_inputs": stats.skipped_inputs, "invalid_utf8_replacements": stats.invalid_utf8,
            "invalid_utf8_files": stats.invalid_utf8_files, "skipped_lines": stats.skipped_lines,
            "skipped_line_examples": stats.skipped_line_examples}


def write_removed(samples: dict[str, list[dict]], out_dir: str) -> list[str]:
    """One JSONL per reason (``dedup-near.jsonl``, ``c4-curly_bracket.jsonl``, ...)."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for reason, rows in sorted(samples.items()):
        path = os.path.join(out_dir, reason.replace("/", "-") + ".jsonl")
        remote.write_local_atomic(Path(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
        written.append(path)
    return written
