"""`data prepare`: raw text -> tokenized, packed MDS shards with a held-out split.

Layout of a prepared dataset ``DEST``::

    DEST/train/            MDS (index.json + shards), column "tokens" = ndarray:uint16|uint32
    DEST/val/              same, only when eval_fraction > 0
    DEST/lmforge-dataset.json   the done-marker: inputs, arguments, tokenizer, summary

Packing: every document is encoded, followed by EOS, and appended to its split's token stream;
the stream is cut into samples of exactly ``seq_len`` tokens (a document's remainder continues
into the next sample); the final partial sample of each split is dropped and counted.

Split: a document goes to ``val`` when blake2b(its UTF-8 bytes), read as a number in [0, 1),
is below ``eval_fraction`` -- a pure function of its content, so re-runs and added files never
move a document between splits. A corpus of few documents (one ``.txt`` file is one document)
may leave one split without a full sample: then the val split is instead the last
``eval_fraction`` of the packed samples (at least one, never all), a held-out tail cut by tokens,
and the other split's few tokens are dropped (counted in val's ``dropped_tokens``).

Parallelism: the parent reads documents in input order and cuts them into chunks; ``workers``
processes tokenize chunks; the parent consumes the results in submission order and does all
writing. The output is therefore byte-identical for any number of workers.

Crash safety: everything is written into a staging folder (``.DEST.tmp-PID`` next to a local
DEST, a local temp folder for an object-store DEST) and published at the end, the marker last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from lmforge.data import remote
from lmforge.data.sources import SourceStats, list_files, no_documents_message, read_source
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.errors import UserError

MARKER = "lmforge-dataset.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
# A chunk is the unit of work sent to a worker: big enough to amortise inter-process transfer
# and to keep the tokenizer's own batch parallelism busy, small enough to bound memory.
# In-process (workers=1) the tokenizer's own threads split a chunk's documents, so chunks are
# bigger; with worker processes smaller chunks balance the load and shorten the pipeline's tail.
CHUNK_CHARS = 1 << 20
CHUNK_CHARS_POOL = 1 << 18
CHUNK_DOCS = 2048


# ----------------------------------------------------------------------------- encoding


class _Encoder:
    """Tokenizes a chunk of documents and routes each to its split (runs in workers)."""

    def __init__(self, tokenizer_json: str, eos_id: int, eval_fraction: float):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_str(tokenizer_json)
        self.eos_id = eos_id
        self.threshold = int(eval_fraction * (1 << 64))

    def encode_chunk(self, texts: list[str]) -> dict:
        """Per split: all tokens (each document + EOS) as one uint32 array, documents, bytes."""
        fast = getattr(self.backend, "encode_batch_fast", None)
        encodings = fast(texts) if fast is not None else self.backend.encode_batch(texts)
        flat = {s: [] for s in SPLITS}
        docs = {s: 0 for s in SPLITS}
        nbytes = {s: 0 for s in SPLITS}
        for text, enc in zip(texts, encodings):
            raw = text.encode("utf-8")
            split = "val" if self.threshold and split_value(raw) < self.threshold else "train"
            ids = flat[split]
            ids.extend(enc.ids)
            ids.append(self.eos_id)
            docs[split] += 1
            nbytes[split] += len(raw)
        return {s: (np.array(flat[s], dtype=np.uint32), docs[s], nbytes[s]) for s in SPLITS}


def split_value(raw: bytes) -> int:
    """A document's position in [0, 2**64): the val split is everything below eval_fraction·2**64."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def chunk_documents(docs: Iterable[str], max_chars: int | None = None) -> Iterator[list[str]]:
    """Documents in lists of about ``max_chars`` characters (at most CHUNK_DOCS): the unit a worker encodes."""
    max_chars = max_chars or CHUNK_CHARS
    batch: list[str] = []
    size = 0
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= max_chars or len(batch) >= CHUNK_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_chunks(docs: Iterable[str], tok: Tokenizer, eval_fraction: float, workers: int,
                    curator=None) -> Iterator[tuple[list[str], dict]]:
    """(chunk, encoded chunk) in input order; tokenized in-process (workers=1) or by a process pool,
    after the curation steps when ``curator`` is given (lmforge.data.curate)."""
    from lmforge.data.curate.pipeline import run

    chunks = chunk_documents(docs, CHUNK_CHARS if workers <= 1 else CHUNK_CHARS_POOL)
    yield from run(chunks, curator, workers=workers, encoder=(_Encoder, (tok.to_json(), tok.eos_id, eval_fraction)))


# ----------------------------------------------------------------------------- packing


class _Packer:
    """Cuts one split's token stream into seq_len samples and writes them to an MDS folder."""

    def __init__(self, out_dir: str, seq_len: int, dtype: str, compression: str | None):
        from lmforge.data.mds import MDSWriter

        self.writer = MDSWriter(out_dir, {"tokens": f"ndarray:{dtype}"}, compression=compression)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.samples = 0
        self.documents = 0
        self.tokens = 0
        self.bytes = 0

    def add(self, tokens: np.ndarray, documents: int, nbytes: int) -> None:
        self.documents += documents
        self.bytes += nbytes
        self.tokens += len(tokens)
        if not len(tokens):
            return
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        if self.pending_len < self.seq_len:
            return
        buf = np.concatenate(self.pending).astype(self.dtype, copy=False)
        n = len(buf) // self.seq_len
        for i in range(n):
            self.writer.write({"tokens": buf[i * self.seq_len : (i + 1) * self.seq_len]})
        rest = buf[n * self.seq_len :]
        self.pending, self.pending_len = [rest], len(rest)
        self.samples += n

    def finish(self) -> dict:
        self.writer.finish()
        return {
            "documents": self.documents,
            "tokens": self.tokens,  # document tokens including each document's EOS (and BOS)
            "bytes": self.bytes,  # UTF-8 bytes of the documents
            "bytes_per_token": round(self.bytes / self.tokens, 6) if self.tokens else None,
            "samples": self.samples,
            "shards": len(self.writer.shards),
            "dropped_tokens": self.pending_len,  # the final partial sample
        }


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
    return {k: marker.get(k) for k in ("inputs", "input_fingerprint", "args")} | {
        "tokenizer": (marker.get("tokenizer") or {}).get("fingerprint")
    }


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


def _listing(out: str) -> list[str] | None:
    """Top-level names in ``out``; None when it does not exist."""
    if remote.is_remote(out):
        fs, p = remote.fs_and_path(out)
        try:
            if not fs.exists(p):
                return None
            return [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False)]
        except FileNotFoundError:
            return None
    p = remote.local_path(out)
    if not os.path.exists(p):
        return None
    if not os.path.isdir(p):
        raise UserError(f"--out {out}: exists and is not a folder")
    return os.listdir(p)


def _remove(out: str) -> None:
    if remote.is_remote(out):
        fs, p = remote.fs_and_path(out)
        if fs.exists(p):
            fs.rm(p, recursive=True)
    else:
        shutil.rmtree(remote.local_path(out), ignore_errors=True)


# ----------------------------------------------------------------------------- progress


class _Progress:
    """A rich progress line on a terminal; silent otherwise.

    The bar is the bytes read of the inputs' total, with its ETA; documents and tokens count what is
    tokenized. Reading runs ahead of tokenizing by a chunk at most, except for one large document
    (a .txt file is one), which is tokenized in one piece: the line says so while it waits."""

    def __init__(self, enabled: bool, total_bytes: int | None):
        self.bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]prepare"), BarColumn(), TextColumn("{task.fields[read]}"),
            TextColumn("{task.fields[docs]:,} docs"), TextColumn("{task.fields[tokens]:,} tokens"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("{task.fields[doing]}"),
            console=Console(stderr=True), transient=True,
        )
        self.total = total_bytes
        self.done_bytes = 0
        self.task = self.bar.add_task("prepare", total=total_bytes, docs=0, tokens=0, rate="", read="", doing="")
        self.start = time.perf_counter()
        self.bar.start()

    def read(self, nbytes: int, doing: str = "") -> None:
        """``nbytes`` more of the inputs were read; ``doing`` says what waits on them (or "")."""
        if self.bar is None:
            return
        self.done_bytes += nbytes
        shown = ""
        if self.total:
            frac = min(1.0, self.done_bytes / self.total)
            left = (time.perf_counter() - self.start) * (1 - frac) / frac if frac else None
            eta = f", ETA {int(left // 60)}:{int(left % 60):02d}" if left and not doing else ""
            shown = f"{int(100 * frac)}% read{eta}"
        self.bar.update(self.task, completed=self.done_bytes, read=shown, doing=doing, refresh=True)

    def update(self, docs: int, tokens: int) -> None:
        if self.bar is not None:
            rate = tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.update(self.task, docs=docs, tokens=tokens, rate=f"{rate:,.0f} tok/s", doing="", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ----------------------------------------------------------------------------- prepare


def _check_args(seq_len, eval_fraction, workers, compression) -> str | None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: expected a positive integer")
    if not (0.0 <= float(eval_fraction) < 1.0):
        raise UserError(f"--eval-fraction {eval_fraction}: expected a number in [0, 1)")
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: expected a positive integer")
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
            flags: tuple[str, str] = ("--eval-fraction", "--seq-len")) -> dict:
    """Tokenize and pack ``inputs`` into the prepared dataset ``out``; returns its marker/summary.

    ``curate`` (a ``CurateConfig`` or its mapping) deduplicates, filters and decontaminates the
    documents first; the summary's ``curation`` counts every removal by reason, and
    ``removed_out`` receives a sample of removed documents per reason. ``flags`` name the
    eval fraction and the sequence length in error messages as the caller's user sets them
    (``data prepare``'s flags, or a run config's keys). A re-run with the same
    inputs, arguments (curation included) and tokenizer returns the existing summary with
    ``already_prepared: True`` and writes nothing.
    """
    inputs = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
    compression = _check_args(seq_len, eval_fraction, workers, compression)
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

    existing = _existing_marker(out)
    if existing is not None and _identity(existing) == _identity(marker):
        if log:
            log(f"already prepared: {out}")
        return existing | {"already_prepared": True}
    listing = _listing(out)
    if listing and not overwrite:
        if existing is not None:
            raise UserError(f"--out {out}: already holds a different prepared dataset (inputs "
                            f"{' '.join(existing.get('inputs', []))}); use --overwrite or another --out")
        # Only leftovers of our own interrupted upload (train/, val/ without a marker) are replaced silently.
        if not set(listing) <= set(SPLITS):
            raise UserError(f"--out {out}: folder is not empty and is not a prepared dataset "
                            f"(holds {', '.join(sorted(listing)[:3])}); use --overwrite or another --out")

    is_remote = remote.is_remote(out)
    if is_remote:
        stage = tempfile.mkdtemp(prefix="lmforge-prepare-")
    else:
        dest = os.path.abspath(remote.local_path(out))
        parent, name = os.path.split(dest.rstrip("/"))
        os.makedirs(parent, exist_ok=True)
        stage = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
    try:
        curator = None
        if curate is not None:
            from lmforge.data.curate.curator import Curator

            curator = Curator(curate, index)
        summary = _build(sources, tok, stage, seq_len, eval_fraction, workers, compression, text_field, stats,
                         inputs, progress, curator, flags)
        marker |= summary
        marker["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with open(os.path.join(stage, MARKER), "w") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        _publish(stage, out, listing is not None)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if curator is not None and removed_out:
        marker["curation"]["removed_samples"] = curator.acct.write_samples(removed_out)
    return marker


def _build(sources, tok: Tokenizer, stage: str, seq_len: int, eval_fraction: float, workers: int,
           compression: str | None, text_field: str, stats: SourceStats, inputs: list[str],
           progress: bool | None, curator=None, flags: tuple[str, str] = ("--eval-fraction", "--seq-len")) -> dict:
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    packers = {"train": _Packer(os.path.join(stage, "train"), seq_len, dtype, compression)}
    if eval_fraction > 0:
        packers["val"] = _Packer(os.path.join(stage, "val"), seq_len, dtype, compression)

    sizes = [s.size for s in sources]
    total = sum(sizes) if sizes and all(s is not None for s in sizes) else None
    bar = _Progress(sys.stderr.isatty() if progress is None else bool(progress), total)

    def documents() -> Iterator[str]:
        for src in sources:
            stats.files += 1
            size, read = src.size or 0, 0
            for text in read_source(src, text_field, stats):
                stats.documents += 1
                # Characters stand for bytes (as many for ASCII, fewer otherwise), up to the file's size.
                step = min(len(text), size - read)
                read += step
                large = len(text) >= CHUNK_CHARS
                bar.read(step, f"tokenizing a {len(text) / 1e6:,.0f} MB document" if large else "")
                yield text
            bar.read(size - read)
    start = time.perf_counter()
    docs = tokens = 0
    try:
        for _, result in _encoded_chunks(documents(), tok, eval_fraction, workers, curator):
            for split, (ids, ndocs, b) in result.items():
                if split in packers:
                    packers[split].add(ids, ndocs, b)
                docs += ndocs
                tokens += len(ids)
            bar.update(docs, tokens)
    finally:
        bar.close()
    if stats.documents == 0:
        raise UserError(no_documents_message(inputs, stats))
    curation = curator.summary() if curator is not None else None
    if curation is not None and curation["documents_kept"] == 0:
        raise UserError(f"curation removed all {curation['documents_in']} documents (by reason: "
                        f"{', '.join(f'{k} {v}' for k, v in curation['by_reason'].items())}); loosen or turn off "
                        "the filters that removed them")
    splits = {name: p.finish() for name, p in packers.items()}
    seconds = time.perf_counter() - start
    frac_flag, seq_flag = flags
    if sum(s["samples"] for s in splits.values()) == 0:
        raise UserError(f"{seq_flag} {seq_len}: larger than the data (it has only "
                        f"{sum(s['tokens'] for s in splits.values())} tokens, not one full sample of {seq_len})")
    if "val" in splits and 0 in (splits["val"]["samples"], splits["train"]["samples"]):
        splits = _tail_holdout(stage, splits, eval_fraction, seq_len, dtype, compression, flags)
    return {
        "dtype": dtype,
        "documents": sum(s["documents"] for s in splits.values()),
        "tokens": sum(s["tokens"] for s in splits.values()),
        "bytes": sum(s["bytes"] for s in splits.values()),
        "samples": sum(s["samples"] for s in splits.values()),
        "shards": sum(s["shards"] for s in splits.values()),
        "splits": splits,
        "skipped_inputs": stats.skipped_inputs,
        "invalid_utf8_replacements": stats.invalid_utf8,
        "invalid_utf8_files": stats.invalid_utf8_files,
        "skipped_lines": stats.skipped_lines,
        "skipped_line_examples": stats.skipped_line_examples,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
        "workers": workers,
    } | ({"curation": curation} if curation is not None else {})


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


def _tail_holdout(stage: str, splits: dict, eval_fraction: float, seq_len: int, dtype: str,
                  compression: str | None, flags: tuple[str, str]) -> dict:
    """Few documents: one split got every full sample (the per-document draw put every document on
    one side): the val split becomes the last ``eval_fraction`` of those samples, train the rest."""
    from lmforge.data.mds import MDSReader, MDSWriter

    frac_flag, seq_flag = flags
    source, other = ("train", "val") if splits["train"]["samples"] else ("val", "train")
    whole = splits[source]
    n = whole["samples"]
    if n < 2:
        raise UserError(f"{frac_flag} {eval_fraction}: the data makes only {n} sample of {seq_len} tokens, "
                        f"nothing is left to hold out; set {frac_flag} 0 (or lower {seq_flag}, or add data)")
    k = min(n - 1, max(1, round(eval_fraction * n)))
    src_dir = os.path.join(stage, f"{source}.whole")
    os.replace(os.path.join(stage, source), src_dir)
    shutil.rmtree(os.path.join(stage, other))
    reader = MDSReader(src_dir, cache_dir=os.path.join(stage, "cache"))
    try:
        for split, lo, hi in (("train", 0, n - k), ("val", n - k, n)):
            with MDSWriter(os.path.join(stage, split), {"tokens": f"ndarray:{dtype}"}, compression=compression) as w:
                for i in range(lo, hi):
                    w.write({"tokens": reader.get_tokens(i)})
    finally:
        reader.close()
    shutil.rmtree(src_dir)
    shutil.rmtree(os.path.join(stage, "cache"), ignore_errors=True)
    bpt = whole["bytes_per_token"]
    held = k * seq_len
    held_bytes = round(held * bpt) if bpt else 0
    shards = {s: len(os.listdir(os.path.join(stage, s))) - 1 for s in SPLITS}  # less index.json
    # Documents stay counted where the per-document draw put them; the other split's few tokens
    # (less than one sample) are dropped with its remainder.
    val = splits["val"] | {"tokens": held, "bytes": held_bytes, "bytes_per_token": bpt, "samples": k,
                           "shards": shards["val"], "held_out": f"tail: the last {k} of {n} samples"}
    train = splits["train"] | {"tokens": whole["tokens"] - held, "bytes": whole["bytes"] - held_bytes,
                               "bytes_per_token": bpt, "samples": n - k, "shards": shards["train"]}
    val["dropped_tokens"] = splits[other]["tokens"] + (whole["dropped_tokens"] if source == "val" else 0)
    train["dropped_tokens"] = whole["dropped_tokens"] if source == "train" else 0
    return {"train": train, "val": val}


def _publish(stage: str, out: str, out_exists: bool) -> None:
    """Move the staged dataset into place; the marker becomes visible last."""
    if remote.is_remote(out):
        if out_exists:
            _remove(out)
        for split in SPLITS:
            if os.path.isdir(os.path.join(stage, split)):
                remote.upload_dir(os.path.join(stage, split), remote.join(out, split))
        remote.upload_file(os.path.join(stage, MARKER), remote.join(out, MARKER))
        return
    dest = os.path.abspath(remote.local_path(out))
    if out_exists:
        shutil.rmtree(dest)
    os.replace(stage, dest)  # one rename: the folder appears complete, marker included
