"""Raw-text sources: files, folders, globs, object-store URIs, Hugging Face datasets, builtins.

An *input* is what the user typed (``data/``, ``logs/*.jsonl.gz``, ``s3://b/corpus``,
``hf://wikitext/wikitext-103-raw-v1:train``, ``builtin:python-stdlib``). ``list_files`` expands
inputs into ``Source`` entries; ``iter_documents`` yields one string per document.

Formats (each also as ``.gz`` / ``.zst``): ``.txt``/``.text``/``.md`` (the whole file is one
document), ``.jsonl`` (one JSON object per line, text in ``text_field``), ``.json`` (a JSON array
of objects or strings, or JSON lines), ``.parquet`` (column ``text_field``). Inside folders only
those extensions are read (others are skipped and reported); a file named explicitly with another
extension is read as text. Invalid UTF-8 is decoded with U+FFFD and counted; a JSON line that is
not JSON or lacks the field is skipped and counted; only a corpus with no document left is fatal.
"""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from lmforge.errors import UserError, json_error, json_kind

TEXT_EXTS = (".txt", ".text", ".md")
JSON_EXTS = (".jsonl", ".json")
PARQUET_EXTS = (".parquet",)
KNOWN_EXTS = TEXT_EXTS + JSON_EXTS + PARQUET_EXTS
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
GLOB_CHARS = set("*?[")
_EXAMPLES = 5  # how many skipped-line examples the summary keeps


class UnreadableInput(UserError):
    """An input file whose content cannot be read (corrupt or truncated, not the format its name
    says, no text column): `data prepare --on-bad-input skip` skips it, counted and named."""


@dataclass(frozen=True)
class Source:
    """One readable thing: a local path, a remote URI, ``builtin:NAME`` or ``hf://...``."""

    uri: str
    size: int | None = None  # bytes on disk/in the store (compressed size), when known

    @property
    def path(self) -> str:
        return self.uri

    @property
    def kind(self) -> str:
        if self.uri.startswith("builtin:"):
            return "builtin"
        if self.uri.startswith("hf://"):
            return "hf"
        return "file"


@dataclass
class SourceStats:
    """What reading the inputs found; filled in while ``iter_documents`` runs."""

    files: int = 0
    documents: int = 0
    skipped_inputs: list[dict] = field(default_factory=list)  # {"input", "reason"}
    invalid_utf8: int = 0  # U+FFFD characters inserted for undecodable bytes
    invalid_utf8_files: list[str] = field(default_factory=list)  # first few, for the message
    skipped_lines: int = 0  # JSON records that were not JSON / lacked the text field
    skipped_line_examples: list[str] = field(default_factory=list)

    def skip_input(self, uri: str, reason: str) -> None:
        self.skipped_inputs.append({"input": uri, "reason": reason})

    def skip_line(self, where: str, reason: str) -> None:
        self.skipped_lines += 1
        if len(self.skipped_line_examples) < _EXAMPLES:
            self.skipped_line_examples.append(f"{where}: {reason}")

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "documents": self.documents,
            "skipped_inputs": list(self.skipped_inputs),
            "invalid_utf8_replacements": self.invalid_utf8,
            "invalid_utf8_files": list(self.invalid_utf8_files),
            "skipped_lines": self.skipped_lines,
            "skipped_line_examples": list(self.skipped_line_examples),
        }


# ----------------------------------------------------------------------------- listing


def _split_compression(name: str) -> tuple[str, str | None]:
    """``a.jsonl.gz`` -> (``.jsonl``, ``gzip``); the format extension is lower-cased."""
    base, ext = os.path.splitext(name.lower())
    compression = COMPRESSIONS.get(ext)
    if compression:
        ext = os.path.splitext(base)[1]
    return ext, compression


def _is_hidden(path: str) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in path.split("/"))


def _expand_local(inp: str, stats: SourceStats | None) -> list[Source]:
    path = inp[len("file://") :] if inp.startswith("file://") else inp
    path = os.path.expanduser(path)
    if any(c in path for c in GLOB_CHARS):
        matches = sorted(globlib.glob(path, recursive=True))
        files = [m for m in matches if os.path.isfile(m)]
        if not files:
            raise UserError(f"input {inp}: the pattern matches no files")
        return [Source(m, os.path.getsize(m)) for m in files]
    if os.path.isdir(path):
        out = []
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                if name.startswith("."):
                    continue
                full = os.path.join(folder, name)
                out.append(full)
        return _filter_folder(inp, [(p, os.path.getsize(p)) for p in sorted(out)], stats)
    if os.path.isfile(path):
        return [Source(path, os.path.getsize(path))]
    raise UserError(f"input {inp}: no such file or folder")


def _filter_folder(inp: str, entries: list[tuple[str, int]], stats: SourceStats | None) -> list[Source]:
    """Keep the files of a folder that have a known extension; report the others."""
    keep = []
    for path, size in entries:
        ext, _ = _split_compression(path)
        if ext in KNOWN_EXTS:
            keep.append(Source(path, size))
        elif stats is not None:
            stats.skip_input(path, f"unsupported extension (expected {', '.join(KNOWN_EXTS)}, optionally .gz/.zst)")
    if not keep:
        raise UserError(
            f"input {inp}: the folder has no readable files (expected {', '.join(KNOWN_EXTS)}, optionally .gz/.zst)"
        )
    return keep


def _expand_remote(inp: str, stats: SourceStats | None) -> list[Source]:
    from lmforge.data.remote import fs_and_path

    fs, path = fs_and_path(inp)
    try:
        if any(c in path for c in GLOB_CHARS):
            found = fs.glob(path, detail=True)
            files = sorted((p, info.get("size")) for p, info in found.items() if info.get("type") != "directory")
            if not files:
                raise UserError(f"input {inp}: the pattern matches no files")
            return [Source(fs.unstrip_protocol(p), s) for p, s in files]
        if fs.isdir(path):
            found = fs.find(path, detail=True)
            entries = sorted(
                (p, info.get("size")) for p, info in found.items() if not _is_hidden(p[len(path.rstrip("/")) :])
            )
            kept = _filter_folder(inp, entries, stats)
            return [Source(fs.unstrip_protocol(s.uri), s.size) for s in kept]
        if fs.isfile(path):
            return [Source(inp, fs.size(path))]
    except (OSError, PermissionError) as e:
        raise UserError(f"input {inp}: cannot list it ({type(e).__name__}: {_one_line(e)})") from None
    raise UserError(f"input {inp}: no such file or folder")


def is_local_input(inp: str) -> bool:
    """A path, glob or ``file://`` URI (not ``builtin:``, ``hf://`` or an object store)."""
    return not inp.startswith(("builtin:", "hf://")) and ("://" not in inp or inp.startswith("file://"))


def list_files(inputs: list[str] | str, stats: SourceStats | None = None) -> list[Source]:
    """Expand inputs (paths, folders, globs, URIs, ``builtin:``/``hf://``) into sources, in order.

    A missing path or a glob matching nothing is a ``UserError``; files in folders with an
    unsupported extension are recorded in ``stats.skipped_inputs``.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise UserError("--input: at least one input is required")
    out: list[Source] = []
    for inp in inputs:
        inp = str(inp)
        if inp.startswith("builtin:"):
            from lmforge.data.text.builtin import BUILTIN_CORPORA

            if inp[len("builtin:") :] not in BUILTIN_CORPORA:
                raise UserError(
                    f"input {inp}: unknown built-in corpus (expected one of: "
                    + ", ".join(f"builtin:{n}" for n in BUILTIN_CORPORA)
                    + ")"
                )
            out.append(Source(inp))
        elif inp.startswith("hf://"):
            parse_hf_uri(inp)  # validate early
            out.append(Source(inp))
        elif is_local_input(inp):
            out.extend(_expand_local(inp, stats))
        else:
            out.extend(_expand_remote(inp, stats))
    return out


# ----------------------------------------------------------------------------- decoding


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


UTF8_BOM = b"\xef\xbb\xbf"


def decode_utf8(raw: bytes, where: str, stats: SourceStats | None) -> str:
    """Decode UTF-8; undecodable bytes become U+FFFD and are counted (exactly) in ``stats``. A UTF-8
    byte-order mark at the start (some editors write one) is dropped: it is no part of the text."""
    if raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        if stats is not None:
            # U+FFFD that was already in the file is not a replacement; subtract those.
            stats.invalid_utf8 += text.count("\ufffd") - raw.count("\ufffd".encode())
            if len(stats.invalid_utf8_files) < _EXAMPLES:
                stats.invalid_utf8_files.append(where)
        return text


def _clean_json_string(text: str, where: str, stats: SourceStats | None) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``) that cannot be encoded; replace and count."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        fixed = text.encode("utf-8", errors="replace").decode("utf-8")
        if stats is not None:
            stats.invalid_utf8 += sum(1 for a, b in zip(text, fixed) if a != b)
            if len(stats.invalid_utf8_files) < _EXAMPLES:
                stats.invalid_utf8_files.append(where)
        return fixed


def _open_raw(uri: str):
    """Binary file object for a local path or a remote URI."""
    if "://" in uri and not uri.startswith("file://"):
        from lmforge.data.remote import fs_and_path

        fs, path = fs_and_path(uri)
        return fs.open(path, "rb")
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return open(path, "rb")


def _open_decompressed(uri: str, compression: str | None):
    raw = _open_raw(uri)
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        return io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 20)
    return raw


class _ZstdFrames(io.RawIOBase):
    """A zstd stream read frame after frame, refusing one cut short: zstandard's own stream reader
    returns a truncated file's text as if the file ended there (its tail lost without a word)."""

    def __init__(self, raw):
        import zstandard

        self.raw, self.zstd = raw, zstandard.ZstdDecompressor()
        self.frame, self.pending, self.out = None, b"", b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.out:
            data, self.pending = self.pending or self.raw.read(1 << 16), b""  # small: what precedes damage is read
            if not data:
                if self.frame is not None and not self.frame.eof:
                    import zstandard

                    raise zstandard.ZstdError("truncated: the file ends inside a frame")
                return 0
            if self.frame is None or self.frame.eof:
                self.frame = self.zstd.decompressobj()
            self.out = self.frame.decompress(data)
            if self.frame.eof:
                self.pending = self.frame.unused_data  # the next frame's start
        n = min(len(buf), len(self.out))
        buf[:n] = self.out[:n]
        self.out = self.out[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _read_text_file(src: Source, compression: str | None, stats: SourceStats | None) -> Iterator[str]:
    with _open_decompressed(src.uri, compression) as f:
        raw = f.read()
    if not raw.strip():
        if stats is not None:
            stats.skip_input(src.uri, "empty file")
        return
    if b"\0" in raw[:8192]:  # text has no NUL bytes (UTF-16 text has, and is not UTF-8 either)
        if stats is not None:
            stats.skip_input(src.uri, "a binary file (NUL bytes), not UTF-8 text")
        return
    yield decode_utf8(raw, src.uri, stats)


def _text_of(record, text_field: str, where: str, stats: SourceStats | None) -> str | None:
    if isinstance(record, str):
        text = record
    elif isinstance(record, dict):
        if text_field not in record:
            if stats is not None:
                stats.skip_line(where, f'no field "{text_field}"')
            return None
        text = record[text_field]
        if not isinstance(text, str):
            if stats is not None:
                stats.skip_line(where, f'field "{text_field}" is {type(text).__name__}, not a string')
            return None
    else:
        if stats is not None:
            stats.skip_line(where, f"{json_kind(record)}, expected an object with a \"{text_field}\" field")
        return None
    if not text:
        if stats is not None:
            stats.skip_line(where, f'field "{text_field}" is empty')
        return None
    return _clean_json_string(text, where, stats)


def _read_json_file(src: Source, compression: str | None, text_field: str, stats: SourceStats | None) -> Iterator[str]:
    with _open_decompressed(src.uri, compression) as f:
        if not hasattr(f, "peek"):  # fsspec files have no peek(); a buffered wrapper does
            f = io.BufferedReader(f)
        head = f.peek(64)[:64]
        if head.removeprefix(UTF8_BOM).lstrip()[:1] == b"[":  # a JSON array: small enough to load whole by nature
            raw = f.read()
            try:
                records = json.loads(decode_utf8(raw, src.uri, stats))
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":
                    raise UnreadableInput(f"{src.uri}: not valid JSON ({e})") from None
                records = None  # JSON Lines whose first row is an array: read as lines, each row judged
            if records is not None:
                for i, rec in enumerate(records):
                    text = _text_of(rec, text_field, f"{src.uri}[{i}]", stats)
                    if text is not None:
                        yield text
                return
            lines = io.BytesIO(raw)
        else:
            lines = f
        for lineno, line in enumerate(lines, 1):
            text = _json_line(line, f"{src.uri}:{lineno}", text_field, stats)
            if text is not None:
                yield text


def _json_line(line: bytes, where: str, text_field: str, stats: SourceStats | None) -> str | None:
    """The text of one JSON line; None (counted in ``stats``) for a blank, broken or text-less line."""
    if not line.strip():
        return None
    try:
        rec = json.loads(decode_utf8(line, where, stats))
    except json.JSONDecodeError as e:
        if stats is not None:
            stats.skip_line(where, json_error(e))
        return None
    return _text_of(rec, text_field, where, stats)


def splittable(src: Source) -> bool:
    """A file whose documents are lines that can be read from any byte offset: uncompressed JSONL."""
    ext, compression = _split_compression(src.uri)
    return src.kind == "file" and ext == ".jsonl" and compression is None


def _read_jsonl_range(src: Source, start: int, end: int, text_field: str, stats: SourceStats | None) -> Iterator[str]:
    """The documents whose line starts in bytes [start, end) of an uncompressed JSONL file.

    A line belongs to the range its first byte is in, so consecutive ranges read every line once
    whatever their sizes: a range that does not start a file skips the line running into it.
    """
    with _open_raw(src.uri) as raw:
        f = raw if hasattr(raw, "peek") else io.BufferedReader(raw, buffer_size=1 << 20)
        pos = start
        if start > 0:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # to the end of the line that holds byte start - 1
        else:
            f.seek(0)
        while pos < end:
            line = f.readline()
            if not line:
                return
            text = _json_line(line, f"{src.uri}:byte {pos}", text_field, stats)
            pos += len(line)
            if text is not None:
                yield text


def _read_parquet_file(src: Source, compression: str | None, text_field: str, stats: SourceStats | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open_decompressed(src.uri, compression) as f:
        # Parquet needs random access; decompressed streams are read into memory first.
        data = f if compression is None and f.seekable() else io.BytesIO(f.read())
        try:
            pf = pq.ParquetFile(data)
        except (pa.ArrowInvalid, OSError) as e:
            raise UnreadableInput(f"{src.uri}: not a readable parquet file ({_one_line(e)})") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            raise UnreadableInput(f"{src.uri}: no column \"{text_field}\" (columns: {', '.join(names)}); use --text-field")
        col_type = pf.schema_arrow.field(text_field).type
        if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
            raise UnreadableInput(f"{src.uri}: column \"{text_field}\" is {col_type}, expected a string column")
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                row += 1
                if not text:
                    if stats is not None:
                        stats.skip_line(f"{src.uri}:row {row}", f'"{text_field}" is null or empty')
                    continue
                yield _clean_json_string(text, src.uri, stats)


def parse_hf_uri(uri: str) -> tuple[str, str | None, str]:
    """``hf://NAME[/CONFIG][:SPLIT]`` -> (name, config, split).

    ``hf://wikitext/wikitext-103-raw-v1:train`` is dataset ``wikitext``, config
    ``wikitext-103-raw-v1``; three parts (``hf://org/name/config``) name an org's dataset.
    For an org's dataset without a config write ``hf://org/name/:train``.
    """
    rest = uri[len("hf://") :]
    split = "train"
    if ":" in rest:
        rest, split = rest.rsplit(":", 1)
    parts = rest.split("/")
    if not rest or not split or any(not p for p in parts[:-1]) or len(parts) > 3:
        raise UserError(f"input {uri}: expected hf://NAME[/CONFIG][:SPLIT] or hf://ORG/NAME/[CONFIG][:SPLIT]")
    if len(parts) == 1:
        return parts[0], None, split
    if len(parts) == 2:
        return parts[0], parts[1] or None, split
    return f"{parts[0]}/{parts[1]}", parts[2] or None, split


def _read_hf(src: Source, text_field: str, stats: SourceStats | None) -> Iterator[str]:
    name, config, split = parse_hf_uri(src.uri)
    try:
        import datasets
    except ImportError:
        raise UserError(f"input {src.uri}: Hugging Face datasets need `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
        why = "offline mode is set (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) and it is not cached" if offline else _one_line(e)
        raise UserError(
            f"input {src.uri}: cannot load Hugging Face dataset {name!r} (config {config!r}, split {split!r}): {why}; "
            "it needs network access or a local cache"
        ) from None
    if text_field not in ds.column_names:
        raise UserError(f"input {src.uri}: no column \"{text_field}\" (columns: {', '.join(ds.column_names)}); use --text-field")
    for i, text in enumerate(ds[text_field] if len(ds) < 100_000 else (r[text_field] for r in ds)):
        if not isinstance(text, str) or not text:
            if stats is not None:
                stats.skip_line(f"{src.uri}[{i}]", f'"{text_field}" is empty or not a string')
            continue
        yield text


def _read_builtin(src: Source, stats: SourceStats | None) -> Iterator[str]:
    from lmforge.data.text.builtin import iter_builtin

    for where, content in iter_builtin(src.uri[len("builtin:") :]):
        text = decode_utf8(content, where, stats) if isinstance(content, bytes) else content
        if text.strip():
            yield text


def read_source(src: Source, text_field: str = "text", stats: SourceStats | None = None,
                byte_range: tuple[int, int] | None = None) -> Iterator[str]:
    """Documents of one source, in file order; with ``byte_range`` (a ``splittable`` file only)
    those whose line starts in that range of bytes."""
    if src.kind == "builtin":
        yield from _read_builtin(src, stats)
        return
    if src.kind == "hf":
        yield from _read_hf(src, text_field, stats)
        return
    ext, compression = _split_compression(src.uri)
    try:
        if byte_range is not None:
            yield from _read_jsonl_range(src, *byte_range, text_field, stats)
        elif ext in JSON_EXTS:
            yield from _read_json_file(src, compression, text_field, stats)
        elif ext in PARQUET_EXTS:
            yield from _read_parquet_file(src, compression, text_field, stats)
        else:
            yield from _read_text_file(src, compression, stats)
    except FileNotFoundError:
        raise UnreadableInput(f"{src.uri}: no such file (it disappeared while reading)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib: a gzip stream damaged past its header
        raise UnreadableInput(f"{src.uri}: corrupt or truncated {compression or 'file'} ({_one_line(e)})") from None
    except OSError as e:  # a local file's is its own; an object store's may pass (not skipped)
        error = UserError if "://" in src.uri and not src.uri.startswith("file://") else UnreadableInput
        raise error(f"{src.uri}: cannot read it ({type(e).__name__}: {_one_line(e)})") from None
    except Exception as e:
        # zstandard raises its own ZstdError for corrupt frames.
        if type(e).__name__ == "ZstdError":
            raise UnreadableInput(f"{src.uri}: corrupt or truncated zstd ({_one_line(e)})") from None
        raise


def iter_documents(inputs: list[str] | str, text_field: str = "text", stats: SourceStats | None = None) -> Iterator[str]:
    """Yield every document of ``inputs`` in a deterministic order.

    Raises ``UserError`` (after reading everything) when no usable document was found.
    """
    stats = stats if stats is not None else SourceStats()
    sources = list_files(inputs, stats)
    before = stats.documents
    for src in sources:
        stats.files += 1
        for text in read_source(src, text_field, stats):
            stats.documents += 1
            yield text
    if stats.documents == before:
        raise UserError(no_documents_message(inputs, stats))


def no_documents_message(inputs: list[str] | str, stats: SourceStats) -> str:
    inputs = [inputs] if isinstance(inputs, str) else inputs
    why = []
    if stats.skipped_lines:
        why.append(f"{stats.skipped_lines} records skipped, e.g. {stats.skipped_line_examples[0]}")
    if stats.skipped_inputs:
        first = stats.skipped_inputs[0]
        why.append(f"{len(stats.skipped_inputs)} inputs skipped, e.g. {first['input']}: {first['reason']}")
    detail = f" ({'; '.join(why)})" if why else ""
    return f"input {' '.join(inputs)}: no usable documents{detail}"
