"""MDS format: round trips, byte-level layout, Streaming interop, corruption errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from lmforge.data.mds import MDSReader, MDSWriter
from lmforge.errors import UserError


def _random_arrays(n: int, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    hi = np.iinfo(dtype).max
    return [rng.integers(0, hi, int(rng.integers(1, 400)), dtype=np.uint64).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("compression", ["zstd", None])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_round_trip(tmp_path, compression, dtype):
    arrays = _random_arrays(300, dtype)
    out = tmp_path / "ds"
    enc = f"ndarray:{np.dtype(dtype).name}"
    with MDSWriter(str(out), {"tokens": enc}, compression=compression, size_limit=8000) as w:
        for a in arrays:
            w.write({"tokens": a})
    index = json.loads((out / "index.json").read_text())
    assert index["version"] == 2 and len(index["shards"]) > 3  # small size_limit -> many shards
    for s in index["shards"]:
        assert s["raw_data"]["bytes"] <= 8000
        assert (s["zip_data"] is None) == (compression is None)
        stored = s["zip_data"] or s["raw_data"]
        assert (out / stored["basename"]).stat().st_size == stored["bytes"]
    r = MDSReader(str(out), cache_dir=str(tmp_path / "cache"))
    assert len(r) == len(arrays) and r.columns == {"tokens": enc}
    for i, a in enumerate(arrays):
        got = r.get_tokens(i)
        assert got.dtype == dtype and np.array_equal(got, a)
        assert np.array_equal(r[i]["tokens"], a)
    # a second reader reuses the decompressed cache rather than decompressing again
    if compression:
        cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
        assert cached == [s["raw_data"]["basename"] for s in index["shards"]]
        r2 = MDSReader(str(out), cache_dir=str(tmp_path / "cache"))
        assert np.array_equal(r2.get_tokens(len(arrays) - 1), arrays[-1])


def test_mixed_columns_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    samples = [
        {
            "id": i,
            "text": "é" * i,
            "tokens": rng.integers(0, 1000, size=(2, i + 1)).astype(np.int32),  # dynamic dtype+shape
            "fixed": np.arange(4, dtype=np.int16) + i,
            "raw": bytes([i % 256]) * 3,
            "meta": {"i": i},
        }
        for i in range(50)
    ]
    cols = {"id": "int", "text": "str", "tokens": "ndarray", "fixed": "ndarray:int16:4", "raw": "bytes", "meta": "json"}
    with MDSWriter(str(tmp_path), cols, compression=None, size_limit=1500) as w:
        for s in samples:
            w.write(s)
    r = MDSReader(str(tmp_path))
    for i, s in enumerate(samples):
        got = r[i]
        assert got["id"] == i and got["text"] == s["text"] and got["raw"] == s["raw"] and got["meta"] == {"i": i}
        assert np.array_equal(got["tokens"], s["tokens"]) and got["tokens"].dtype == np.int32
        assert np.array_equal(got["fixed"], s["fixed"])
        assert np.array_equal(r.get_tokens(i), s["tokens"].ravel())


# --- byte-level compatibility: a shard built by hand from the published Streaming layout ---


def _ndarray_dynamic(a: np.ndarray) -> bytes:
    codes = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "uint32": 32, "int32": 33, "int64": 65}
    shape_code = 0 if max(a.shape) < 256 else 1 if max(a.shape) < 65536 else 2
    shape_dt = ["<u1", "<u2", "<u4"][shape_code]
    return (bytes([codes[a.dtype.name], (a.ndim << 2) | shape_code])
            + np.array(a.shape, shape_dt).tobytes() + a.astype(a.dtype.newbyteorder("<")).tobytes())


def _hand_shard(samples: list[bytes], config: bytes) -> bytes:
    n = len(samples)
    head = 4 + 4 * (n + 1) + len(config)
    offsets = [head]
    for s in samples:
        offsets.append(offsets[-1] + len(s))
    return n.to_bytes(4, "little") + b"".join(o.to_bytes(4, "little") for o in offsets) + config + b"".join(samples)


def _hand_dataset(root: Path, compress: bool) -> list[dict]:
    """Columns id:int, text:str, tokens:ndarray (dynamic), in Streaming's sorted column order."""
    names, encs, sizes = ["id", "text", "tokens"], ["int", "str", "ndarray"], [8, None, None]
    config = {"column_encodings": encs, "column_names": names, "column_sizes": sizes,
              "compression": "zstd:7" if compress else None, "format": "mds", "hashes": [],
              "size_limit": 1 << 26, "version": 2}
    config_bytes = json.dumps(config, sort_keys=True).encode()
    truth, entries = [], []
    for shard_no, rows in enumerate([range(0, 3), range(3, 5)]):
        samples = []
        for i in rows:
            tokens = (np.arange(i + 2) * 300 + i).astype(np.uint16 if i % 2 else np.int32)
            text = f"doc {i}"
            tok_bytes = _ndarray_dynamic(tokens)
            body = (i.to_bytes(8, "little", signed=True) + text.encode())
            # variable-size columns (text, tokens) get a uint32 size each, in column order
            samples.append(len(text.encode()).to_bytes(4, "little") + len(tok_bytes).to_bytes(4, "little")
                           + body + tok_bytes)
            truth.append({"id": i, "text": text, "tokens": tokens})
        raw = _hand_shard(samples, config_bytes)
        raw_name = f"shard.{shard_no:05d}.mds"
        zip_info = None
        if compress:
            # no content size in the frame, as some zstd bindings write it
            zipped = zstandard.ZstdCompressor(level=7, write_content_size=False).compress(raw)
            zip_info = {"basename": raw_name + ".zstd", "bytes": len(zipped), "hashes": {}}
            (root / zip_info["basename"]).write_bytes(zipped)
        else:
            (root / raw_name).write_bytes(raw)
        entries.append({"raw_data": {"basename": raw_name, "bytes": len(raw), "hashes": {}},
                        "samples": len(rows), "zip_data": zip_info} | config)
    (root / "index.json").write_text(json.dumps({"shards": entries, "version": 2}, sort_keys=True))
    return truth


@pytest.mark.parametrize("compress", [False, True])
def test_reads_hand_built_streaming_layout(tmp_path, compress):
    truth = _hand_dataset(tmp_path, compress)
    r = MDSReader(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert len(r) == 5 and list(r.columns) == ["id", "text", "tokens"]
    for i, t in enumerate(truth):
        s = r[i]
        assert s["id"] == t["id"] and s["text"] == t["text"]
        assert s["tokens"].dtype == t["tokens"].dtype and np.array_equal(s["tokens"], t["tokens"])
        assert np.array_equal(r.get_tokens(i), t["tokens"])


def test_writer_output_is_byte_identical_to_hand_built(tmp_path):
    (tmp_path / "hand").mkdir()
    truth = _hand_dataset(tmp_path / "hand", compress=False)
    # Streaming writes one shard per size_limit; give ours the same 3+2 split by writing twice.
    ours = tmp_path / "ours"
    w = MDSWriter(str(ours), {"tokens": "ndarray", "text": "str", "id": "int"}, compression=None,
                  size_limit=1 << 26, hashes=[])
    for i, t in enumerate(truth):
        if i == 3:
            w._flush()  # force the shard boundary the hand-built dataset has
        w.write(t)
    w.finish()
    for name in ("shard.00000.mds", "shard.00001.mds"):
        assert (ours / name).read_bytes() == (tmp_path / "hand" / name).read_bytes()
    assert json.loads((ours / "index.json").read_text()) == json.loads((tmp_path / "hand" / "index.json").read_text())


def test_size_limit_matches_streaming_rule(tmp_path):
    """A shard never exceeds size_limit (the rule Streaming applies, counting offsets and config)."""
    arrays = _random_arrays(200, np.uint16, seed=3)
    with MDSWriter(str(tmp_path), {"tokens": "ndarray:uint16"}, compression=None, size_limit=3000) as w:
        for a in arrays:
            w.write({"tokens": a})
    shards = json.loads((tmp_path / "index.json").read_text())["shards"]
    assert all(s["raw_data"]["bytes"] <= 3000 for s in shards)
    assert sum(s["samples"] for s in shards) == 200


def test_bytes_token_column_is_int64(tmp_path):
    """Older LLM Foundry datasets store tokens as raw int64 bytes."""
    arrays = [np.arange(i, i + 10, dtype=np.int64) for i in range(5)]
    with MDSWriter(str(tmp_path), {"tokens": "bytes"}, compression=None) as w:
        for a in arrays:
            w.write({"tokens": a.tobytes()})
    r = MDSReader(str(tmp_path))
    assert all(np.array_equal(r.get_tokens(i), a) for i, a in enumerate(arrays))


def test_text_only_dataset_has_no_tokens(tmp_path):
    with MDSWriter(str(tmp_path), {"text": "str"}) as w:
        w.write({"text": "hello"})
    r = MDSReader(str(tmp_path), cache_dir=str(tmp_path / "c"))
    assert r[0] == {"text": "hello"}
    with pytest.raises(UserError, match="no integer 'tokens' column"):
        r.get_tokens(0)


# --- writer safety ---


def test_failed_write_leaves_no_index(tmp_path):
    with pytest.raises(RuntimeError):
        with MDSWriter(str(tmp_path), {"tokens": "ndarray:uint16"}, size_limit=500) as w:
            for a in _random_arrays(50, np.uint16):
                w.write({"tokens": a})
            raise RuntimeError("interrupted")
    assert not (tmp_path / "index.json").exists()
    assert list(tmp_path.glob("shard.*"))  # some shards were flushed, but no index claims them
    with pytest.raises(UserError, match="index.json"):
        MDSReader(str(tmp_path))


def test_rewriting_removes_stale_index(tmp_path):
    with MDSWriter(str(tmp_path), {"tokens": "ndarray:uint16"}) as w:
        w.write({"tokens": np.arange(3, dtype=np.uint16)})
    w2 = MDSWriter(str(tmp_path), {"tokens": "ndarray:uint16"})
    assert not (tmp_path / "index.json").exists()
    w2.finish()


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(UserError, match="'tokens'.*'ndarray:float128'"):
        MDSWriter(str(tmp_path), {"tokens": "ndarray:float128"})
    with pytest.raises(UserError, match="compression"):
        MDSWriter(str(tmp_path), {"tokens": "ndarray"}, compression="lz5")
    w = MDSWriter(str(tmp_path), {"tokens": "ndarray:uint16"})
    with pytest.raises(UserError, match="expected dtype uint16, got int64"):
        w.write({"tokens": np.arange(3)})
    with pytest.raises(UserError, match="lacks column 'tokens'"):
        w.write({"text": "x"})


# --- corrupt and missing shards ---


def _small(tmp_path, compression="zstd", hashes=("sha1",)) -> Path:
    out = tmp_path / "ds"
    with MDSWriter(str(out), {"tokens": "ndarray:uint16"}, compression=compression, size_limit=2000,
                   hashes=hashes) as w:
        for a in _random_arrays(60, np.uint16, seed=5):
            w.write({"tokens": a})
    return out


def test_missing_shard_is_named(tmp_path):
    out = _small(tmp_path)
    (out / "shard.00001.mds.zstd").unlink()
    with pytest.raises(UserError, match=r"shard file shard\.00001\.mds\.zstd is missing"):
        MDSReader(str(out), cache_dir=str(tmp_path / "c"))


def test_truncated_shard_is_named(tmp_path):
    out = _small(tmp_path, compression=None)
    p = out / "shard.00002.mds"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(UserError, match=r"shard\.00002\.mds is corrupt"):
        MDSReader(str(out))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_byte_is_caught_by_hash(tmp_path, compression):
    out = _small(tmp_path, compression=compression)
    name = "shard.00000.mds" + (".zstd" if compression else "")
    p = out / name
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    r = MDSReader(str(out), cache_dir=str(tmp_path / "c"))  # sizes still match: opens fine
    with pytest.raises(UserError, match=rf"{name.replace('.', '[.]')} is corrupt"):
        r.get_tokens(0)


def test_garbage_zstd_without_hashes_is_named(tmp_path):
    out = _small(tmp_path, hashes=())
    p = out / "shard.00000.mds.zstd"
    p.write_bytes(b"\0" * p.stat().st_size)
    r = MDSReader(str(out), cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError, match=r"shard\.00000\.mds\.zstd is corrupt"):
        r[0]


def test_bad_index(tmp_path):
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(UserError, match="index.json: not a valid MDS index.json"):
        MDSReader(str(tmp_path))
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "shards": []}))
    with pytest.raises(UserError, match='"version": 2'):
        MDSReader(str(tmp_path))


# --- interop with the real mosaicml-streaming, when it happens to be importable ---


def test_streaming_reads_ours_and_we_read_theirs(tmp_path):
    streaming = pytest.importorskip("streaming", reason="mosaicml-streaming is not installed (needs torchvision)")
    arrays = _random_arrays(40, np.uint16, seed=9)
    ours = tmp_path / "ours"
    with MDSWriter(str(ours), {"tokens": "ndarray:uint16"}, size_limit=2000) as w:
        for a in arrays:
            w.write({"tokens": a})
    ds = streaming.StreamingDataset(local=str(ours), shuffle=False, batch_size=1)
    assert [np.array_equal(ds[i]["tokens"], a) for i, a in enumerate(arrays)] == [True] * len(arrays)

    theirs = tmp_path / "theirs"
    with streaming.MDSWriter(out=str(theirs), columns={"tokens": "ndarray:uint32", "text": "str"},
                             compression="zstd", size_limit=2000) as w:
        for i, a in enumerate(arrays):
            w.write({"tokens": a.astype(np.uint32), "text": str(i)})
    r = MDSReader(str(theirs), cache_dir=str(tmp_path / "c"))
    for i, a in enumerate(arrays):
        assert np.array_equal(r.get_tokens(i), a) and r[i]["text"] == str(i)
