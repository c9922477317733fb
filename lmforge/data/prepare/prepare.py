"""`data prepare`: raw text -> tokenized, packed MDS shards with a held-out split.

Layout of a prepared dataset ``DEST``::

    DEST/train/            MDS (index.json + shards), column "tokens" = ndarray:uint16|uint32
    DEST/val/              same, only when eval_fraction > 0
    DEST/lmforge-dataset.json   the done-marker: inputs, arguments, tokenizer, summary

Work units (``units``): the input is cut into units that do not depend on how many processes or
tasks run the job (whole files grouped up to ``unit_bytes``, large JSONL files cut into byte
ranges at line boundaries). Each unit is tokenized and packed on its own (``packing``: documents
joined with EOS, cut into ``seq_len`` samples, the partial last sample of each split dropped and
counted) into shards named ``shard.UUUUUU.NNNNN.mds[.zstd]``; ``index.json`` lists every unit's
shards in unit order. So the plain command, ``--executor local --tasks 3`` and a thousand Slurm
tasks write the same samples in the same order. The cost of cutting: one partial sample per unit
and split (see ``units``).

Split: a document goes to ``val`` when a hash of its content is below ``eval_fraction``
(``packing``), so re-runs and added files never move a document between splits. A corpus of few
documents (one ``.txt`` file is one document) may leave one split without a full sample: then
the val split is instead the last ``eval_fraction`` of the packed samples (at least one, never
all), a held-out tail cut by tokens, and the other split's few tokens are dropped (counted in
val's ``dropped_tokens``).

How it runs (``job``, ``executors``): in this process (the per-document work in ``workers``
processes) or as tasks on datatrove's executors. Each unit publishes its shards into DEST and
then its marker (``DEST/work/units/U.json``); the last step writes ``index.json`` for each split,
then the dataset marker, and removes ``DEST/work`` (``dest``: the order, and what a kill at any
point leaves). The same command again redoes only the units without a marker. Bad input for the
job as a whole (no documents, a ``seq_len`` longer than the data) removes what the job wrote; a
failing object store, a dead task or a bad input file met by a unit keep it (the same command
goes on from there).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

from lmforge.data import remote
from lmforge.data.prepare import dest
from lmforge.data.prepare.executors import ExecutorSpec, JobRun, check_executor, throughput_line
from lmforge.data.prepare.job import Job, WorkDir, source_stats, source_summary, unit_markers
from lmforge.data.prepare.packing import SPLITS, Encoder
from lmforge.data.text.sources import SourceStats, list_files, no_documents_message
from lmforge.data.text.tokenizer import Tokenizer, load_tokenizer
from lmforge.data.prepare.units import DEFAULT_UNIT_BYTES, check_on_bad_input
from lmforge.guard import check_output, check_target
from lmforge.errors import UserError
from lmforge.run_files import DATASET_MARKER as MARKER

FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- identity / marker


def input_fingerprint(sources) -> str:
    """What identifies the inputs' content cheaply: path, size and (local) mtime of every file."""
    h = hashlib.sha256()
    for src in sources:
        entry = [src.uri, src.size]
        if src.kind == "file" and not remote.is_remote(src.uri) and os.path.exists(src.uri):
            entry.append(os.stat(src.uri).st_mtime_ns)
        elif src.kind == "builtin":
            entry.append(sys.version)
        h.update(json.dumps(entry).encode())
    return h.hexdigest()[:16]


def _identity(marker: dict) -> dict:
    # A dataset prepared before units existed was one stream: what the default unit size makes.
    return {k: marker.get(k) for k in ("inputs", "input_fingerprint", "args")} | {
        "tokenizer": (marker.get("tokenizer") or {}).get("fingerprint"),
        "unit_bytes": marker.get("unit_bytes", DEFAULT_UNIT_BYTES),
    }


def _difference(old: dict, new: dict, flags: tuple[str, str]) -> str:
    """What makes the prepared dataset ``old`` another than the one asked for (``new``), in the user's words."""
    a, b = _identity(old), _identity(new)
    if a["inputs"] != b["inputs"]:
        return f"inputs {' '.join(old.get('inputs', []))}"
    if a["input_fingerprint"] != b["input_fingerprint"]:
        return "the same inputs as they were before they changed (sizes or modification times)"
    names = {"seq_len": flags[1], "eval_fraction": flags[0], "text_field": "--text-field",
             "compression": "--compression", "curate": "curation settings",
             "decontaminate_index": "decontamination tasks"}
    for key in names:
        if (a["args"] or {}).get(key) != (b["args"] or {}).get(key):
            was = (a["args"] or {}).get(key)
            return f"{names[key]} {was}" if key not in ("curate", "decontaminate_index") else f"other {names[key]}"
    if a["tokenizer"] != b["tokenizer"]:
        return f"another tokenizer ({(old.get('tokenizer') or {}).get('path')})"
    return f"--unit-mb {a['unit_bytes'] / (1 << 20):g}"


def summary_seq_len(summary: dict) -> int | None:
    """The sample length (tokens) a prepared dataset was packed at, from its marker/summary."""
    return (summary.get("args") or {}).get("seq_len")


def read_summary(path: str) -> dict:
    """The marker/summary of a prepared dataset (local folder or object-store URI)."""
    uri = remote.join(path, MARKER)
    try:
        if remote.is_remote(path):
            fs, p = remote.fs_and_path(uri)
            with fs.open(p, "rb") as f:
                raw = f.read()
        else:
            with open(remote.local_path(uri), "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: not a prepared dataset (no {MARKER}; run `lmforge data prepare`)") from None
    except OSError as e:
        raise UserError(f"{uri}: cannot read it ({type(e).__name__}: {e})") from None
    try:
        marker = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{uri}: corrupt dataset marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != "lmforge-dataset":
        raise UserError(f"{uri}: not an lmforge dataset marker")
    return marker


def _existing_marker(out: str) -> dict | None:
    try:
        return read_summary(out)
    except UserError:
        return None


# ----------------------------------------------------------------------------- prepare


def _check_args(seq_len, eval_fraction, workers, compression, unit_bytes) -> str | None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: expected a positive integer")
    if not (0.0 <= float(eval_fraction) < 1.0):
        raise UserError(f"--eval-fraction {eval_fraction}: expected a number in [0, 1)")
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: expected a positive integer")
    if not isinstance(unit_bytes, int) or unit_bytes < 1:
        raise UserError(f"--unit-mb: expected a positive size (got {unit_bytes} bytes)")
    if compression in (None, "", "none"):
        return None
    algo = str(compression).partition(":")[0]
    if algo not in ("zstd", "gz", "bz2"):
        raise UserError(f"--compression {compression}: expected zstd, zstd:LEVEL, gz, bz2 or none")
    return str(compression)


def prepare(inputs: list[str] | str, tokenizer: str | Tokenizer, out: str, seq_len: int, *,
            eval_fraction: float = 0.0, workers: int = 1, compression: str | None = "zstd",
            text_field: str = "text", overwrite: bool = False, progress: bool | None = None,
            log: Callable[[str], None] | None = None, curate=None, removed_out: str | None = None,
            flags: tuple[str, str] = ("--eval-fraction", "--seq-len"), executor: ExecutorSpec | None = None,
            unit_bytes: int = DEFAULT_UNIT_BYTES, on_bad_input: str = "skip") -> dict:
    """Tokenize and pack ``inputs`` into the prepared dataset ``out``; returns its marker/summary.

    ``curate`` (a ``CurateConfig`` or its mapping) deduplicates, filters and decontaminates the
    documents first; the summary's ``curation`` counts every removal by reason, and
    ``removed_out`` receives a sample of removed documents per reason. ``flags`` name the
    eval fraction and the sequence length in error messages as the caller's user sets them
    (``data prepare``'s flags, or a run config's keys). ``executor`` runs the job as tasks on
    datatrove's executors (None: in this process, with ``workers`` processes). An input file that
    cannot be read is skipped, counted and named (``skipped_inputs``), or with ``on_bad_input``
    "fail" stops the job, which keeps the units done. A re-run with the
    same inputs, arguments (curation included) and tokenizer returns the existing summary with
    ``already_prepared: True`` and writes nothing; a re-run of an interrupted job finishes it.
    On Slurm the jobs are submitted and the summary says so (``submitted``).
    """
    inputs = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
    compression = _check_args(seq_len, eval_fraction, workers, compression, unit_bytes)
    check_on_bad_input(on_bad_input)
    check_executor(executor)
    from lmforge.data.curate import resolve_curation

    curate, index = resolve_curation(curate)
    if removed_out is not None and os.path.isfile(removed_out):
        raise UserError(f"--removed-out {removed_out}: exists and is not a folder")
    eval_fraction = float(eval_fraction)
    out = str(out)
    tok = load_tokenizer(tokenizer)
    stats = SourceStats()
    sources = list_files(inputs, stats)
    tok_path = tok.path if tok.path is None or not os.path.exists(tok.path) else os.path.abspath(tok.path)
    reads = [("the input", i) for i in inputs] + [("the tokenizer", tok_path)]
    check_output(out, "--out", "dataset", overwrite=overwrite, reads=reads, command="data prepare")  # before any write
    if removed_out is not None:
        check_target(removed_out, "--removed-out", reads + [("--out", out)])
    marker = {
        "format": "lmforge-dataset",
        "version": FORMAT_VERSION,
        "inputs": inputs,
        "input_fingerprint": input_fingerprint(sources),
        "args": {"seq_len": seq_len, "eval_fraction": eval_fraction, "text_field": text_field,
                 "compression": compression},
        "tokenizer": {"path": tok_path, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "eos_id": tok.eos_id, "pad_id": tok.pad_id, "bos_id": tok.bos_id},
    }
    if curate is not None:  # only then: datasets prepared without curation keep their identity
        marker["args"]["curate"] = curate.model_dump(mode="json")
        if index is not None:
            marker["args"]["decontaminate_index"] = index.fingerprint

    marker["unit_bytes"] = unit_bytes
    units, dedup = dest.units_and_dedup(sources, unit_bytes, curate.dedup if curate is not None else None)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    job = Job(out, units, text_field, curate, index, dedup, encoder=(Encoder, (tok.to_json(), tok.eos_id, eval_fraction)),
              splits=("train", "val") if eval_fraction > 0 else ("train",), seq_len=seq_len, dtype=dtype,
              compression=compression, on_bad_input=on_bad_input, finalize=finalize,
              after_marker=_drop_unlisted_shards,
              context={"marker": marker, "marker_name": MARKER, "inputs": inputs,
                       "skipped_inputs": stats.skipped_inputs, "flags": flags, "eval_fraction": eval_fraction,
                       "removed_out": removed_out, "workers": workers, "executor": executor.kind if executor else None,
                       "tasks": executor.tasks if executor else None, "unit_bytes": unit_bytes})
    existing = _existing_marker(out)
    same = existing is not None and _identity(existing) == _identity(marker)
    other = None if existing is None else f"a different prepared dataset ({_difference(existing, marker, flags)})"
    resumed = dest.start(job, _identity(marker), same, other, overwrite, "data prepare")
    if resumed is None:
        if log:
            log(f"already prepared: {out}")
        return existing | {"already_prepared": True}
    run, summary = dest.run(job, executor, workers, sys.stderr.isatty() if progress is None else bool(progress))
    if summary is None:
        return {"format": "lmforge-dataset-job", "out": out, "resumed": resumed, "units": len(units),
                "submitted": run.submitted}
    return summary


# ----------------------------------------------------------------------------- the last step


def finalize(job: Job, run: JobRun | None = None) -> dict:
    """Every unit done: write each split's index over the units' shards, then the marker; remove
    the job's work folder. Returns the marker (the dataset's summary)."""
    ctx = job.context
    frac_flag, seq_flag = ctx["flags"]
    markers = unit_markers(job)
    stats = source_stats(markers, ctx["skipped_inputs"])
    if stats.documents == 0:
        raise UserError(no_documents_message(ctx["inputs"], stats))
    curation = None
    if job.curate is not None:
        from lmforge.data.curate.curator import Accounting

        acct = Accounting(action=job.curate.action)
        for m in markers:
            acct.add_counts(m["curation"])
        curation = acct.summary(job.curate)
        if curation["documents_kept"] == 0:
            raise UserError(f"curation removed all {curation['documents_in']} documents (by reason: "
                            f"{', '.join(f'{k} {v}' for k, v in curation['by_reason'].items())}); loosen or turn off "
                            "the filters that removed them")
    splits, entries = {}, {}
    for split in job.splits:
        parts = [m["splits"][split] for m in markers]
        entries[split] = [e for p in parts for e in p["shard_entries"]]
        s = {k: sum(p[k] for p in parts) for k in ("documents", "tokens", "bytes", "samples", "dropped_tokens")}
        s["bytes_per_token"] = round(s["bytes"] / s["tokens"], 6) if s["tokens"] else None
        s["shards"] = len(entries[split])
        splits[split] = {k: s[k] for k in ("documents", "tokens", "bytes", "bytes_per_token", "samples", "shards",
                                           "dropped_tokens")}
    if sum(s["samples"] for s in splits.values()) == 0:
        raise UserError(f"{seq_flag} {job.seq_len}: larger than the data (it has only "
                        f"{sum(s['tokens'] for s in splits.values())} tokens, not one full sample of {job.seq_len})")
    for split in job.splits:
        _write_index(job.out, split, entries[split])
    if "val" in splits and 0 in (splits["val"]["samples"], splits["train"]["samples"]):
        splits = _tail_holdout(job, splits, ctx["eval_fraction"], (frac_flag, seq_flag))
    new = set(run.new_units) if run is not None else set(range(len(markers)))
    tokens_now = sum(markers[u]["tokens"] for u in new)
    seconds = run.seconds if run is not None else sum(markers[u]["seconds"] for u in new)
    marker = ctx["marker"] | {
        "dtype": job.dtype,
        "documents": sum(s["documents"] for s in splits.values()),
        "tokens": sum(s["tokens"] for s in splits.values()),
        "bytes": sum(s["bytes"] for s in splits.values()),
        "samples": sum(s["samples"] for s in splits.values()),
        "shards": sum(s["shards"] for s in splits.values()),
        "splits": splits,
        **source_summary(stats),
        "units": len(markers),
        "unit_bytes": ctx["unit_bytes"],
        "executor": ctx["executor"],
        "tasks": ctx["tasks"],
        "workers": ctx["workers"],
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens_now / seconds, 1) if seconds > 0 and tokens_now else None,
    }
    if run is not None:
        marker["units_done_earlier"] = len(markers) - len(new)  # by an interrupted run of the same command
    if run is not None and tokens_now and seconds > 0:
        marker["cores"] = run.cores
        if run.cpu_seconds is not None:
            marker["cpu_seconds"] = round(run.cpu_seconds, 3)
        marker["throughput"] = throughput_line(tokens_now, seconds, run.cores, run.cpu_seconds)
    if curation is not None:
        marker["curation"] = curation
    marker["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    removed = dest.write_removed_samples(job, markers)
    remote.put_bytes(remote.join(job.out, MARKER), (json.dumps(marker, indent=2) + "\n").encode())  # complete
    dest.finish(job)
    if removed is not None:
        marker["curation"]["removed_samples"] = removed
    return marker


def input_warnings(summary: dict) -> list[str]:
    """What reading the inputs skipped or replaced, one line each: `data prepare` prints them under its
    table, and a run that prepares its raw data says them as warnings (not only in the dataset card)."""
    lines = [f"skipped {s['input']}: {s['reason']}" for s in summary.get("skipped_inputs") or []]
    if summary.get("skipped_lines"):
        lines.append(f"skipped {summary['skipped_lines']} records, e.g. {summary['skipped_line_examples'][0]}")
    if summary.get("invalid_utf8_replacements"):
        lines.append(f"{summary['invalid_utf8_replacements']} invalid UTF-8 sequences replaced (U+FFFD), in "
                     f"{', '.join(summary.get('invalid_utf8_files') or [])}: is it in another encoding?")
    return lines


def _write_index(out: str, split: str, entries: list[dict]) -> None:
    remote.put_bytes(remote.join(out, split, "index.json"),
                     json.dumps({"version": 2, "shards": entries}, sort_keys=True).encode())


def _split_reader(out: str, split: str, tmp: str):
    from lmforge.data.mds import MDSReader

    uri = remote.join(out, split)
    if not remote.is_remote(out):
        return MDSReader(remote.local_path(uri), cache_dir=os.path.join(tmp, "cache"))
    local = os.path.join(tmp, "src")
    remote.download(remote.join(uri, "index.json"), os.path.join(local, "index.json"))
    return MDSReader(local, cache_dir=os.path.join(tmp, "cache"), name=uri,
                     fetch=lambda base: remote.download(remote.join(uri, base), os.path.join(local, base)))


def _drop_unlisted_shards(job: Job) -> None:
    """The units' shards no index lists any more (replaced by the tail hold-out's): removed only once
    the marker is written, so that a run stopped before it finalizes again from the units' shards."""
    for split in job.splits:
        uri = remote.join(job.out, split)
        index = remote.get_bytes(remote.join(uri, "index.json"))
        if index is None:
            continue
        listed = {(e["zip_data"] or e["raw_data"])["basename"] for e in json.loads(index)["shards"]}
        for name in remote.listdir(uri):
            if name.startswith("shard.") and name not in listed:
                if remote.is_remote(uri):
                    fs, p = remote.fs_and_path(remote.join(uri, name))
                    fs.rm_file(p)
                else:
                    os.remove(os.path.join(remote.local_path(uri), name))


def _tail_holdout(job: Job, splits: dict, eval_fraction: float,
                  flags: tuple[str, str]) -> dict:
    """Few documents: one split got every full sample (the per-document draw put every document on
    one side): the val split becomes the last ``eval_fraction`` of those samples, train the rest.
    Returns the splits' summaries (the units' shards no index lists any more go after the marker)."""
    from lmforge.data.mds import MDSWriter

    frac_flag, seq_flag = flags
    seq_len = job.seq_len
    source, other = ("train", "val") if splits["train"]["samples"] else ("val", "train")
    whole = splits[source]
    n = whole["samples"]
    if n < 2:
        raise UserError(f"{frac_flag} {eval_fraction}: the data makes only {n} sample of {seq_len} tokens, "
                        f"nothing is left to hold out; set {frac_flag} 0 (or lower {seq_flag}, or add data)")
    k = min(n - 1, max(1, round(eval_fraction * n)))
    new = {}
    with tempfile.TemporaryDirectory() as tmp:
        reader = _split_reader(job.out, source, tmp)
        try:
            for split, lo, hi in (("train", 0, n - k), ("val", n - k, n)):
                with MDSWriter(os.path.join(tmp, split), {"tokens": f"ndarray:{job.dtype}"},
                               compression=job.compression, prefix="tail.") as w:
                    for i in range(lo, hi):
                        w.write({"tokens": reader.get_tokens(i)})
                new[split] = w.shards
        finally:
            reader.close()
        for split in SPLITS:  # the units' shards are replaced by the cut
            for e in new[split]:
                name = (e["zip_data"] or e["raw_data"])["basename"]
                WorkDir(job.out).publish(os.path.join(tmp, split, name), remote.join(job.out, split, name))
            _write_index(job.out, split, new[split])
    bpt = whole["bytes_per_token"]
    held = k * seq_len
    held_bytes = round(held * bpt) if bpt else 0
    # Documents stay counted where the per-document draw put them; the other split's few tokens
    # (less than one sample) are dropped with its remainder.
    val = splits["val"] | {"tokens": held, "bytes": held_bytes, "bytes_per_token": bpt, "samples": k,
                           "shards": len(new["val"]), "held_out": f"tail: the last {k} of {n} samples"}
    train = splits["train"] | {"tokens": whole["tokens"] - held, "bytes": whole["bytes"] - held_bytes,
                               "bytes_per_token": bpt, "samples": n - k, "shards": len(new["train"])}
    val["dropped_tokens"] = splits[other]["tokens"] + (whole["dropped_tokens"] if source == "val" else 0)
    train["dropped_tokens"] = whole["dropped_tokens"] if source == "train" else 0
    return {"train": train, "val": val}
