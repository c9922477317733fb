"""MosaicML Streaming "MDS" format, version 2, read and written by lmforge itself.

Layout (compatible with ``mosaicml-streaming`` in both directions):

* ``index.json`` = ``{"version": 2, "shards": [entry, ...]}``; each entry describes one shard:
  ``column_names`` (sorted), ``column_encodings``, ``column_sizes`` (bytes, or null when
  variable), ``compression`` (null, ``"zstd"`` or ``"zstd:LEVEL"``), ``format: "mds"``,
  ``hashes`` (algorithm names), ``raw_data`` / ``zip_data`` (``{basename, bytes, hashes}``),
  ``samples``, ``size_limit``, ``version: 2``.
* A raw shard (``shard.00000.mds``) is: uint32 sample count ``n``; ``n + 1`` uint32 offsets,
  absolute within the shard; the shard config as JSON (Streaming writes it, readers skip it via
  the offsets); then the samples. A sample is a uint32 size per variable-size column, then the
  encoded columns concatenated in ``column_names`` order.
* A compressed shard (``shard.00000.mds.zstd``) is the raw shard compressed as one zstd frame.
* The ``ndarray`` encoding is ``[dtype code: 1 byte, unless the dtype is in the encoding]``
  ``[(ndim << 2 | shape dtype code): 1 byte, shape values, unless the shape is in the encoding]``
  then the values; dtype codes are 8·itemsize plus 0 (unsigned), 1 (signed), 2 (float), shape
  dtype codes 0..3 = uint8/16/32/64.

Readers memory-map raw shards (a sample costs one slice, never a whole-shard read); compressed
shards are decompressed once into a cache folder.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Callable

import numpy as np

from lmforge.data.remote import write_local_atomic
from lmforge.errors import UserError
from lmforge.home import cache_dir as lmforge_cache

INDEX = "index.json"

# ndarray encoding: value dtype <-> one-byte code; shape dtype <-> two-bit code.
_DTYPE_CODE = {
    "uint8": 8, "int8": 9,
    "uint16": 16, "int16": 17, "float16": 18,
    "uint32": 32, "int32": 33, "float32": 34,
    "uint64": 64, "int64": 65, "float64": 66,
}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")

# Fixed-size scalar encodings (numpy dtype names); "int" is Streaming's name for int64.
_SCALARS = {name: name for name in _DTYPE_CODE} | {"int": "int64"}
_VARIABLE = {"bytes", "str", "str_int", "str_float", "str_decimal", "json", "ndarray"}
_UNSUPPORTED = {"pil", "jpeg", "png", "pkl"}  # image/pickle columns: not for token datasets

_ZSTD_DEFAULT_LEVEL = 3


def _parse_ndarray(encoding: str) -> tuple[str | None, tuple[int, ...] | None]:
    """``ndarray[:dtype[:d0,d1,...]]`` -> (dtype or None, shape or None)."""
    parts = encoding.split(":")
    if parts[0] != "ndarray" or len(parts) > 3:
        raise ValueError(encoding)
    dtype = parts[1] if len(parts) >= 2 and parts[1] else None
    if dtype is not None and dtype not in _DTYPE_CODE:
        raise ValueError(encoding)
    shape = tuple(int(d) for d in parts[2].split(",")) if len(parts) == 3 else None
    if shape is not None and any(d < 1 for d in shape):
        raise ValueError(encoding)
    return dtype, shape


def encoded_size(encoding: str) -> int | None:
    """Fixed byte size of a column encoding, or None when it varies per sample."""
    name = encoding.split(":", 1)[0]
    if name in _SCALARS:
        return np.dtype(_SCALARS[name]).itemsize
    if name == "ndarray":
        dtype, shape = _parse_ndarray(encoding)
        if dtype is not None and shape is not None:
            return int(np.prod(shape)) * np.dtype(dtype).itemsize
        return None
    if name in _VARIABLE or name in _UNSUPPORTED:
        return None
    raise ValueError(encoding)


def _check_encoding(encoding: str, where: str) -> None:
    try:
        encoded_size(encoding)
    except (ValueError, TypeError):
        raise UserError(
            f"{where}: unknown MDS column encoding {encoding!r} (expected ndarray[:dtype[:shape]],"
            " bytes, str, int, json, str_int, str_float, str_decimal or a numpy scalar type)"
        ) from None


def encode_value(encoding: str, value: object) -> bytes:
    """Encode one column value the way Streaming does."""
    name = encoding.split(":", 1)[0]
    if name == "ndarray":
        dtype, shape = _parse_ndarray(encoding)
        arr = np.ascontiguousarray(value)
        if arr.dtype.name not in _DTYPE_CODE:
            raise ValueError(f"ndarray dtype {arr.dtype.name} is not storable in MDS")
        if arr.size == 0 or arr.ndim == 0:
            raise ValueError("MDS ndarray values must have at least one element and one axis")
        head = b""
        if dtype is None:
            head += bytes([_DTYPE_CODE[arr.dtype.name]])
        elif arr.dtype.name != dtype:
            raise ValueError(f"expected dtype {dtype}, got {arr.dtype.name}")
        if shape is None:
            biggest = max(arr.shape)
            code = next(i for i, t in enumerate(_SHAPE_DTYPES) if biggest < (1 << (8 << i)))
            head += bytes([(arr.ndim << 2) | code])
            head += np.array(arr.shape, _SHAPE_DTYPES[code]).tobytes()
        elif tuple(arr.shape) != shape:
            raise ValueError(f"expected shape {shape}, got {arr.shape}")
        return head + arr.tobytes()
    if name == "bytes":
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"expected bytes, got {type(value).__name__}")
        return bytes(value)
    if name == "str":
        if not isinstance(value, str):
            raise ValueError(f"expected str, got {type(value).__name__}")
        return value.encode("utf-8")
    if name in ("str_int", "str_float", "str_decimal"):
        return str(value).encode("utf-8")
    if name == "json":
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return json.dumps(value).encode("utf-8")
    if name in _SCALARS:
        return np.array(value, _SCALARS[name]).tobytes()
    raise ValueError(f"encoding {encoding!r} cannot be written by lmforge")


def _ndarray_header(encoding: str, buf, start: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """Parse the ndarray header at ``buf[start:]`` -> (dtype, shape, offset of the values)."""
    dtype, shape = _parse_ndarray(encoding)
    pos = start
    if dtype is None:
        dtype = _CODE_DTYPE[int(buf[pos])]
        pos += 1
    if shape is None:
        byte = int(buf[pos])
        pos += 1
        ndim, code = byte >> 2, byte & 3
        width = 1 << code
        shape = tuple(int(d) for d in np.frombuffer(bytes(buf[pos:pos + ndim * width]), _SHAPE_DTYPES[code]))
        pos += ndim * width
    return np.dtype(dtype), shape, pos


def decode_value(encoding: str, data: bytes) -> object:
    """Decode one column value (bytes of that column only)."""
    name = encoding.split(":", 1)[0]
    if name == "ndarray":
        dtype, shape, pos = _ndarray_header(encoding, data, 0)
        return np.frombuffer(data, dtype, offset=pos).reshape(shape)
    if name == "bytes":
        return bytes(data)
    if name == "str":
        return bytes(data).decode("utf-8")
    if name == "str_int":
        return int(bytes(data).decode("utf-8"))
    if name == "str_float":
        return float(bytes(data).decode("utf-8"))
    if name == "str_decimal":
        return Decimal(bytes(data).decode("utf-8"))
    if name == "json":
        return json.loads(bytes(data).decode("utf-8"))
    if name == "int":
        return int(np.frombuffer(data, np.int64)[0])
    if name in _SCALARS:
        return np.frombuffer(data, _SCALARS[name])[0]
    raise UserError(f"MDS column encoding {encoding!r} is not supported by lmforge (token datasets only)")


# ----------------------------------------------------------------------------- compression / hashes


def _compress(compression: str, data: bytes) -> bytes:
    algo, _, level = compression.partition(":")
    if algo == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=int(level or _ZSTD_DEFAULT_LEVEL)).compress(data)
    if algo == "gz":
        return gzip.compress(data, compresslevel=int(level or 9))
    if algo == "bz2":
        return bz2.compress(data, compresslevel=int(level or 9))
    raise ValueError(compression)


def _decompress(compression: str, data: bytes, raw_bytes: int) -> bytes:
    algo = compression.partition(":")[0]
    if algo == "zstd":
        import zstandard

        # max_output_size: frames written without a content size (other zstd bindings) still decode.
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
    if algo == "gz":
        return gzip.decompress(data)
    if algo == "bz2":
        return bz2.decompress(data)
    raise UserError(f"MDS compression {compression!r} is not supported (expected zstd, gz or bz2)")


def _compression_ext(compression: str) -> str:
    return compression.partition(":")[0]


def _hash(algo: str, data) -> str | None:
    """Hex digest, or None for an algorithm we cannot compute here (then it is not checked)."""
    if algo.startswith("xxh"):
        try:
            import xxhash  # optional: Streaming may write xxh hashes
        except ImportError:
            return None
        fn = getattr(xxhash, f"{algo}_hexdigest", None)
        return fn(data) if fn else None
    if algo in hashlib.algorithms_available:
        return hashlib.new(algo, data).hexdigest()
    return None


def _hashes(algos: list[str], data) -> dict[str, str]:
    return {a: h for a in algos if (h := _hash(a, data)) is not None}


# ----------------------------------------------------------------------------- writer


class MDSWriter:
    """Write samples into MDS shards in a local folder; ``index.json`` is written last.

    ``columns`` maps column name -> encoding, e.g. ``{"tokens": "ndarray:uint16"}``; ``prefix``
    goes into the shard names (``shard.{prefix}00000.mds``).
    An existing ``index.json`` in ``out_dir`` is removed first, so an interrupted write never
    leaves a folder that looks like a complete dataset.
    """

    def __init__(
        self,
        out_dir: str,
        columns: dict[str, str],
        compression: str | None = "zstd",
        size_limit: int = 1 << 26,
        hashes: list[str] | tuple[str, ...] = ("sha1",),
        prefix: str = "",
    ):
        if not columns:
            raise UserError("MDSWriter: columns must name at least one column")
        for name, enc in columns.items():
            _check_encoding(enc, f"MDS column {name!r}")
            if enc.split(":", 1)[0] in _UNSUPPORTED:
                raise UserError(f"MDS column {name!r}: encoding {enc!r} cannot be written by lmforge")
        if compression:
            algo, _, level = compression.partition(":")
            if algo not in ("zstd", "gz", "bz2") or (level and not level.isdigit()):
                raise UserError(f"MDS compression {compression!r}: expected zstd[:LEVEL], gz, bz2 or none")
        if size_limit is not None and size_limit <= 0:
            raise UserError(f"MDS size_limit must be positive, got {size_limit}")
        hashes = sorted(hashes)
        for algo in hashes:
            if _hash(algo, b"") is None:
                raise UserError(f"MDS hash {algo!r} is not available (try sha1 or md5)")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / INDEX).unlink(missing_ok=True)
        self.compression = compression or None
        self.size_limit = size_limit
        self.hashes = hashes
        self.prefix = prefix  # shard names shard.{prefix}00000.mds: shards of several writers can share a folder
        self.column_names = sorted(columns)
        self.column_encodings = [columns[n] for n in self.column_names]
        self.column_sizes = [encoded_size(e) for e in self.column_encodings]
        self.columns = dict(zip(self.column_names, self.column_encodings))
        self.shards: list[dict] = []
        # Streaming embeds the (sorted-key JSON) config in every shard; we do the same.
        self._config_bytes = json.dumps(self._config(), sort_keys=True).encode("utf-8")
        self._samples: list[bytes] = []
        self._size = 0
        self._finished = False

    def _config(self) -> dict:
        return {
            "version": 2,
            "format": "mds",
            "compression": self.compression,
            "hashes": self.hashes,
            "size_limit": self.size_limit,
            "column_names": self.column_names,
            "column_encodings": self.column_encodings,
            "column_sizes": self.column_sizes,
        }

    def _encode(self, sample: dict[str, object]) -> bytes:
        sizes, parts = [], []
        for name, enc, fixed in zip(self.column_names, self.column_encodings, self.column_sizes):
            if name not in sample:
                raise UserError(f"MDS sample lacks column {name!r} (columns: {', '.join(self.column_names)})")
            try:
                data = encode_value(enc, sample[name])
            except (ValueError, TypeError) as e:
                raise UserError(f"MDS column {name!r} ({enc}): {e}") from None
            if fixed is None:
                sizes.append(len(data))
            elif fixed != len(data):
                raise UserError(f"MDS column {name!r} ({enc}): expected {fixed} bytes, got {len(data)}")
            parts.append(data)
        return np.array(sizes, np.uint32).tobytes() + b"".join(parts)

    def write(self, sample: dict[str, object]) -> None:
        """Append one sample (numpy arrays for ndarray columns); may flush a full shard."""
        data = self._encode(sample)
        overhead = 8 + len(self._config_bytes)  # count + final offset + embedded config
        if self.size_limit and self._samples and overhead + self._size + len(data) + 4 > self.size_limit:
            self._flush()
        self._samples.append(data)
        self._size += len(data) + 4  # + its offset entry

    def _flush(self) -> None:
        n = len(self._samples)
        head = 4 + 4 * (n + 1) + len(self._config_bytes)
        offsets = np.zeros(n + 1, np.uint64)
        np.cumsum([len(s) for s in self._samples], out=offsets[1:])
        offsets += head
        if offsets[-1] >= 1 << 32:
            raise UserError("MDS shard exceeds 4 GiB; lower size_limit")
        raw = np.uint32(n).tobytes() + offsets.astype(np.uint32).tobytes() + self._config_bytes + b"".join(self._samples)
        raw_name = f"shard.{self.prefix}{len(self.shards):05d}.mds"
        raw_info = {"basename": raw_name, "bytes": len(raw), "hashes": _hashes(self.hashes, raw)}
        zip_info = None
        if self.compression:
            zipped = _compress(self.compression, raw)
            zip_name = f"{raw_name}.{_compression_ext(self.compression)}"
            zip_info = {"basename": zip_name, "bytes": len(zipped), "hashes": _hashes(self.hashes, zipped)}
            write_local_atomic(self.out_dir / zip_name, zipped)
        else:
            write_local_atomic(self.out_dir / raw_name, raw)
        self.shards.append({"samples": n, "raw_data": raw_info, "zip_data": zip_info} | self._config())
        self._samples, self._size = [], 0

    def finish(self) -> None:
        """Flush the last shard, then write ``index.json`` (the dataset's completion marker)."""
        if self._finished:
            return
        if self._samples:
            self._flush()
        index = {"version": 2, "shards": self.shards}
        write_local_atomic(self.out_dir / INDEX, json.dumps(index, sort_keys=True).encode("utf-8"))
        self._finished = True

    @property
    def num_samples(self) -> int:
        return sum(s["samples"] for s in self.shards) + len(self._samples)

    def __enter__(self) -> "MDSWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        # On error: no index.json, so the folder is visibly incomplete.


# ----------------------------------------------------------------------------- reader


def read_index(path: Path, name: str | None = None) -> list[dict]:
    """Parse and validate an ``index.json``; returns its shard entries."""
    name = name or str(path)
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{name}: not found (an MDS dataset folder has an index.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{name}: not a valid MDS index.json ({e})") from None
    if not isinstance(obj, dict) or obj.get("version") != 2 or not isinstance(obj.get("shards"), list):
        raise UserError(f"{name}: expected an MDS index with \"version\": 2 and a \"shards\" list")
    shards = obj["shards"]
    for i, s in enumerate(shards):
        ok = (
            isinstance(s, dict)
            and s.get("format") == "mds"
            and isinstance(s.get("samples"), int)
            and isinstance(s.get("raw_data"), dict)
            and isinstance(s.get("column_names"), list)
            and isinstance(s.get("column_encodings"), list)
            and len(s["column_names"]) == len(s["column_encodings"])
        )
        if not ok:
            raise UserError(f"{name}: shard entry {i} is not a valid MDS v2 shard (format 'mds' with "
                            "samples, raw_data, column_names and column_encodings)")
        for col, enc in zip(s["column_names"], s["column_encodings"]):
            _check_encoding(enc, f"{name}: shard {i} column {col!r}")
    if shards:
        cols = (shards[0]["column_names"], shards[0]["column_encodings"])
        for i, s in enumerate(shards):
            if (s["column_names"], s["column_encodings"]) != cols:
                raise UserError(f"{name}: shard {i} has different columns than shard 0")
    return shards


class MDSReader:
    """Random access to the samples of a local MDS folder.

    ``local_dir`` holds ``index.json`` and the shard files. With ``fetch`` (a callable that
    brings ``basename`` into ``local_dir``, used for remote datasets) shards are fetched on first
    use instead of being required up front. Compressed shards are decompressed once into
    ``cache_dir`` (default: under ``$LMFORGE_HOME/cache/mds``, keyed by the folder and its index).
    """

    def __init__(
        self,
        local_dir: str,
        *,
        cache_dir: str | None = None,
        fetch: Callable[[str], None] | None = None,
        name: str | None = None,
    ):
        self.local_dir = Path(local_dir)
        self.name = name or str(local_dir)  # how errors refer to the dataset (e.g. its URI)
        index_path = self.local_dir / INDEX
        if not self.local_dir.is_dir():
            raise UserError(f"{self.name}: MDS dataset folder not found")
        self.shards = read_index(index_path, f"{self.name}/{INDEX}")
        self._fetch = fetch
        if cache_dir is None:
            key = hashlib.sha256(str(self.local_dir.resolve()).encode() + index_path.read_bytes()).hexdigest()[:16]
            cache_dir = os.path.join(lmforge_cache("mds"), "raw", key)
        self.cache_dir = Path(cache_dir)
        s0 = self.shards[0] if self.shards else {"column_names": [], "column_encodings": []}
        self.columns: dict[str, str] = dict(zip(s0["column_names"], s0["column_encodings"]))
        self._names = list(s0["column_names"])
        self._encs = list(s0["column_encodings"])
        self._sizes = [encoded_size(e) for e in self._encs]
        self._ends = np.cumsum([s["samples"] for s in self.shards], dtype=np.int64)
        self._starts = self._ends - np.array([s["samples"] for s in self.shards], dtype=np.int64)
        self._maps: dict[int, np.ndarray] = {}
        self._tok = self._token_layout()
        if fetch is None:
            for s in self.shards:
                self._stored_file(s)  # every shard must be present with the right size

    # -- shard files

    def _check_size(self, path: Path, info: dict) -> bool:
        return path.is_file() and ("bytes" not in info or path.stat().st_size == info["bytes"])

    def _stored_file(self, shard: dict) -> tuple[Path, bool]:
        """(path of the shard as stored, is_raw). Prefer an already-raw copy."""
        raw, zipped = shard["raw_data"], shard.get("zip_data")
        for base, info, is_raw in ((self.local_dir, raw, True), (self.cache_dir, raw, True)):
            path = base / raw["basename"]
            if path.exists() and self._check_size(path, info):
                return path, is_raw
        want = zipped or raw
        path = self.local_dir / want["basename"]
        if not path.exists():
            raise UserError(f"{self.name}: MDS shard file {want['basename']} is missing")
        if not self._check_size(path, want):
            raise UserError(
                f"{self.name}: MDS shard file {want['basename']} is corrupt "
                f"({path.stat().st_size} bytes, index.json says {want['bytes']})"
            )
        return path, zipped is None

    def _verify(self, data, info: dict, basename: str) -> None:
        for algo, expected in (info.get("hashes") or {}).items():
            got = _hash(algo, data)
            if got is not None and got != expected:
                raise UserError(f"{self.name}: MDS shard file {basename} is corrupt ({algo} mismatch)")

    def _open_shard(self, j: int) -> np.ndarray:
        shard = self.shards[j]
        raw = shard["raw_data"]
        zipped = shard.get("zip_data")
        if self._fetch is not None:
            present = any(
                self._check_size(b / raw["basename"], raw) for b in (self.local_dir, self.cache_dir)
            )
            if not present:
                self._fetch((zipped or raw)["basename"])
        path, is_raw = self._stored_file(shard)
        if not is_raw:
            blob = path.read_bytes()
            self._verify(blob, zipped, zipped["basename"])
            try:
                data = _decompress(shard.get("compression") or _compression_ext(zipped["basename"]), blob, raw["bytes"])
            except UserError:
                raise
            except Exception as e:
                raise UserError(f"{self.name}: MDS shard file {zipped['basename']} is corrupt ({e})") from None
            self._verify(data, raw, zipped["basename"])
            # Remote datasets keep raw shards in their own cache folder (local_dir); local ones
            # decompress into cache_dir so a read-only dataset folder works.
            dest_dir = self.local_dir if self._fetch is not None else self.cache_dir
            dest_dir.mkdir(parents=True, exist_ok=True)
            path = dest_dir / raw["basename"]
            write_local_atomic(path, data)
            del blob, data
            mm = np.memmap(path, np.uint8, mode="r")
        else:
            mm = np.memmap(path, np.uint8, mode="r")
            self._verify(mm, raw, raw["basename"])
        n = int(mm[:4].view(np.uint32)[0]) if len(mm) >= 4 else -1
        bad = n != shard["samples"] or len(mm) < 4 * (n + 2)
        if not bad:
            offs = mm[4:4 * (n + 2)].view(np.uint32)
            bad = int(offs[-1]) != len(mm) or bool(np.any(np.diff(offs.astype(np.int64)) < 0))
        if bad:
            raise UserError(
                f"{self.name}: MDS shard file {raw['basename']} is corrupt "
                f"(header does not match {shard['samples']} samples of {len(mm)} bytes)"
            )
        return mm

    def _shard(self, j: int) -> np.ndarray:
        mm = self._maps.get(j)
        if mm is None:
            mm = self._maps[j] = self._open_shard(j)
        return mm

    def __getstate__(self):
        # Memory maps are reopened lazily in each DataLoader worker instead of being pickled.
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    # -- samples

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _locate(self, i: int) -> tuple[np.ndarray, int, int]:
        """(shard map, start byte, end byte) of sample ``i``."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {self.name} ({n} samples)")
        j = int(np.searchsorted(self._ends, i, side="right"))
        mm = self._shard(j)
        k = i - int(self._starts[j])
        lo, hi = mm[4 + 4 * k: 12 + 4 * k].view(np.uint32)
        return mm, int(lo), int(hi)

    def _column_spans(self, mm: np.ndarray, lo: int) -> list[tuple[int, int]]:
        nvar = sum(1 for s in self._sizes if s is None)
        var = mm[lo:lo + 4 * nvar].view(np.uint32) if nvar else ()
        spans, pos, v = [], lo + 4 * nvar, 0
        for size in self._sizes:
            if size is None:
                size = int(var[v])
                v += 1
            spans.append((pos, pos + size))
            pos += size
        return spans

    def __getitem__(self, i: int) -> dict[str, object]:
        mm, lo, _ = self._locate(i)
        out = {}
        for name, enc, (a, b) in zip(self._names, self._encs, self._column_spans(mm, lo)):
            out[name] = decode_value(enc, bytes(mm[a:b]))
        return out

    def _token_layout(self) -> tuple[int, str] | None:
        if "tokens" not in self.columns:
            return None
        k = self._names.index("tokens")
        enc = self._encs[k]
        if enc.split(":", 1)[0] not in ("ndarray", "bytes"):
            return None
        return k, enc

    def get_tokens(self, i: int) -> np.ndarray:
        """The ``tokens`` column of sample ``i`` as a 1-D integer array (a view, no copy).

        ``bytes`` token columns (older LLM Foundry datasets) hold int64 values.
        """
        if self._tok is None:
            raise UserError(
                f"{self.name}: MDS dataset has no integer 'tokens' column (columns: "
                f"{', '.join(f'{n}={e}' for n, e in self.columns.items())}); "
                "tokenize it with `lmforge data prepare`"
            )
        k, enc = self._tok
        mm, lo, _ = self._locate(i)
        if len(self._sizes) == 1 and self._sizes[0] is None:
            a, b = lo + 4, lo + 4 + int(mm[lo:lo + 4].view(np.uint32)[0])  # the common case
        else:
            a, b = self._column_spans(mm, lo)[k]
        if enc == "bytes":
            return np.frombuffer(mm, np.int64, count=(b - a) // 8, offset=a)
        dtype, _, pos = _ndarray_header(enc, mm, a)
        if dtype.kind not in "iu":
            raise UserError(f"{self.name}: MDS 'tokens' column has dtype {dtype.name}, expected integers")
        return np.frombuffer(mm, dtype, count=(b - pos) // dtype.itemsize, offset=pos)

    def sample_length(self, i: int = 0) -> int:
        """Number of tokens in sample ``i``."""
        return len(self.get_tokens(i))

    def close(self) -> None:
        self._maps.clear()
