"""`data prepare` / `data inspect`: packing round trip, split stability, workers, no-op re-run,
refusals, crash safety, uint32 vocabularies, S3 output, CLI bad input as real subprocesses."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from lmforge.data.prepare import packing
from lmforge.data.mds import MDSReader
from lmforge.data.prepare.prepare import MARKER, prepare, read_summary
from lmforge.data.text.tokenizer import EOS_TOKEN, train_tokenizer
from lmforge.errors import UserError

SEQ = 64


def _doc(rng: random.Random, i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "日本", "x=1;", "return", "\n"]
    return f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(5, 80)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three files of unique documents: a.txt (one document), b.jsonl, c.jsonl.gz."""
    d = tmp_path_factory.mktemp("raw")
    rng = random.Random(1)
    docs = [_doc(rng, i) for i in range(121)]
    (d / "a.txt").write_text(docs[0])
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[1:80]))
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[80:])
    return d, docs


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer([str(corpus[0])], 300, str(out))


def _stream(path) -> np.ndarray:
    r = MDSReader(str(path))
    return np.concatenate([r.get_tokens(i) for i in range(len(r))]) if len(r) else np.zeros(0, np.uint16)


def _complete_docs(tok, path) -> list[str]:
    """Documents that lie completely inside a split's samples (the ends may be cut)."""
    parts = tok.decode(_stream(path)).split(EOS_TOKEN)
    return parts[1:-1]


def test_round_trip(corpus, tok, tmp_path):
    d, docs = corpus
    s = prepare([str(d)], tok.path, str(tmp_path / "ds"), SEQ)
    expected = np.array([t for doc in docs for t in tok.encode(doc) + [tok.eos_id]], np.int64)
    got = _stream(tmp_path / "ds" / "train")
    train = s["splits"]["train"]
    assert sorted(os.listdir(tmp_path / "ds")) == [MARKER, "train"]  # no val/ without eval_fraction
    assert len(got) == train["samples"] * SEQ == len(expected) - train["dropped_tokens"]
    assert 0 <= train["dropped_tokens"] < SEQ
    np.testing.assert_array_equal(got, expected[: len(got)])
    assert tok.decode(got) == (EOS_TOKEN.join(docs) + EOS_TOKEN)[: len(tok.decode(got))]
    r = MDSReader(str(tmp_path / "ds" / "train"))
    assert r.columns == {"tokens": "ndarray:uint16"} and r.get_tokens(0).dtype == np.uint16
    assert all(len(r.get_tokens(i)) == SEQ for i in range(len(r)))
    nbytes = sum(len(x.encode()) for x in docs)
    assert (train["documents"], train["tokens"], train["bytes"]) == (len(docs), len(expected), nbytes)
    assert train["bytes_per_token"] == pytest.approx(nbytes / len(expected), abs=1e-5)
    assert s["tokenizer"]["fingerprint"] == tok.fingerprint and s["dtype"] == "uint16"
    assert read_summary(str(tmp_path / "ds")) == {k: v for k, v in s.items()}


def test_split_is_stable_when_a_file_is_added(corpus, tok, tmp_path):
    d, docs = corpus
    a = prepare([str(d / "a.txt"), str(d / "b.jsonl")], tok, str(tmp_path / "a"), 16, eval_fraction=0.3)
    b = prepare([str(d)], tok, str(tmp_path / "b"), 16, eval_fraction=0.3)
    assert 0 < a["splits"]["val"]["documents"] < b["splits"]["val"]["documents"]
    assert a["splits"]["val"]["documents"] + a["splits"]["train"]["documents"] == 80
    for split, other in (("val", "train"), ("train", "val")):
        in_a = set(_complete_docs(tok, tmp_path / "a" / split))
        in_b = set(_complete_docs(tok, tmp_path / "b" / split))
        assert len(in_a) > 3 and in_a <= set(docs)
        assert in_a <= in_b  # nothing moved to the other split
        assert not in_a & set(_complete_docs(tok, tmp_path / "b" / other))


@pytest.mark.integration
def test_workers_give_identical_output_and_rerun_is_noop(corpus, tok, tmp_path, monkeypatch):
    d, _ = corpus
    monkeypatch.setattr(packing, "CHUNK_DOCS", 7)  # many chunks, so both workers get work
    one = prepare([str(d)], tok, str(tmp_path / "w1"), SEQ, eval_fraction=0.2, workers=1)
    two = prepare([str(d)], tok, str(tmp_path / "w2"), SEQ, eval_fraction=0.2, workers=2)
    for split in ("train", "val"):
        files = sorted(os.listdir(tmp_path / "w1" / split))
        assert files == sorted(os.listdir(tmp_path / "w2" / split))
        for f in files:
            assert (tmp_path / "w1" / split / f).read_bytes() == (tmp_path / "w2" / split / f).read_bytes(), f
    assert one["splits"] == two["splits"]
    marker = tmp_path / "w1" / MARKER
    before = marker.stat().st_mtime_ns
    again = prepare([str(d)], tok, str(tmp_path / "w1"), SEQ, eval_fraction=0.2, workers=2)
    assert again["already_prepared"] and marker.stat().st_mtime_ns == before


def test_refusals_overwrite_and_crash_safety(corpus, tok, tmp_path):
    d, _ = corpus
    out = tmp_path / "ds"
    prepare([str(d)], tok, str(out), SEQ)
    with pytest.raises(UserError, match=r"--out .*ds: already holds a different prepared dataset.*--overwrite"):
        prepare([str(d)], tok, str(out), SEQ * 2)
    s = prepare([str(d)], tok, str(out), SEQ * 2, overwrite=True)
    assert read_summary(str(out))["args"]["seq_len"] == SEQ * 2 == len(MDSReader(str(out / "train")).get_tokens(0))
    assert not s.get("already_prepared")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for overwrite in (False, True):  # another folder: never replaced, --overwrite included (issue 59)
        with pytest.raises(UserError, match=r"holds files that are not lmforge output \(notes.txt\); `data prepare` "
                           "replaces only a prepared dataset"):
            prepare([str(d)], tok, str(tmp_path / "mine"), SEQ, overwrite=overwrite)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(UserError, match=r"--seq-len 100000: larger than the data"):
        prepare([str(d)], tok, str(tmp_path / "big"), 100_000)
    # A corrupt file after good ones is skipped and named; with on_bad_input="fail" it fails mid-run
    # and, no unit being done, nothing that looks complete is left behind.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text((d / "b.jsonl").read_text())
    (tmp_path / "bad" / "z.txt.gz").write_bytes(gzip.compress(b"hello " * 1000)[:40])
    s = prepare([str(tmp_path / "bad")], tok, str(tmp_path / "skipped"), 8)
    assert [(i["input"], i["reason"].split(" (")[0]) for i in s["skipped_inputs"]] == \
        [(str(tmp_path / "bad" / "z.txt.gz"), "corrupt or truncated gzip")]
    with pytest.raises(UserError, match=r"z\.txt\.gz: corrupt or truncated gzip"):
        prepare([str(tmp_path / "bad")], tok, str(tmp_path / "partial"), 8, on_bad_input="fail")
    assert not (tmp_path / "partial").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.integration
def test_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {EOS_TOKEN: 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(70_000)}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "in.txt").write_text(" ".join(f"w{i}" for i in range(69_990, 70_000)) + " w5")
    s = prepare([str(tmp_path / "in.txt")], str(tmp_path / "tok"), str(tmp_path / "ds"), 4)
    r = MDSReader(str(tmp_path / "ds" / "train"))
    assert s["dtype"] == "uint32" and r.columns == {"tokens": "ndarray:uint32"}
    assert r.get_tokens(0).tolist() == [69_992, 69_993, 69_994, 69_995]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, timeout=180,
                          env=env)


def _one_line_error(r, needle: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


@pytest.mark.e2e
def test_cli_prepare_inspect_and_bad_input(corpus, tok, tmp_path):
    d, docs = corpus
    out = tmp_path / "ds"
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "latin1.txt").write_bytes("café, naïve".encode("latin-1"))
    r = _cli("data", "prepare", "--input", str(d), str(tmp_path / "extra"), "--tokenizer", tok.path,
             "--out", str(out), "--seq-len", str(SEQ), "--eval-fraction", "0.2", "--workers", "1", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["invalid_utf8_replacements"] == 2 and summary["documents"] == len(docs) + 1
    assert set(summary["splits"]) == {"train", "val"}
    r = _cli("data", "prepare", "--input", str(d), str(tmp_path / "extra"), "--tokenizer", tok.path,
             "--out", str(out), "--seq-len", str(SEQ), "--eval-fraction", "0.2")
    assert r.returncode == 0 and "already prepared" in r.stdout, r.stderr
    r = _cli("data", "inspect", str(out), "--chars", "0")
    assert r.returncode == 0, r.stderr
    first = tok.decode(MDSReader(str(out / "train")).get_tokens(0))
    assert "train" in r.stdout and "val" in r.stdout and first in r.stdout
    r = _cli("data", "inspect", str(out), "--json")
    assert json.loads(r.stdout)["first_sample"]["text"] == first

    (tmp_path / "bad.jsonl").write_text("not json\n{\"body\": \"x\"}\n")
    base = ["data", "prepare", "--tokenizer", tok.path, "--seq-len", str(SEQ), "--out"]
    cases = [
        ([*base, str(tmp_path / "o1"), "--input", str(tmp_path / "missing.txt")], "no such file or folder"),
        ([*base, str(tmp_path / "o1"), "--input", str(tmp_path / "*.parquet")], "matches no files"),
        ([*base, str(tmp_path / "o1"), "--input", str(tmp_path / "bad.jsonl")], "no usable documents"),
        ([*base, str(out), "--input", str(d)], "already holds a different prepared dataset"),
        (["data", "prepare", "--tokenizer", tok.path, "--seq-len", "99999", "--out", str(tmp_path / "o2"),
          "--input", str(d)], "--seq-len 99999: larger than the data"),
        ([*base, str(tmp_path / "o3"), "--input", str(d), "--eval-fraction", "1.5"], "--eval-fraction: expected a number at least 0 and below 1"),
        (["data", "prepare", "--tokenizer", str(tmp_path / "nope"), "--seq-len", "8", "--out",
          str(tmp_path / "o4"), "--input", str(d)], "nope"),
        (["data", "inspect", str(tmp_path / "o1")], "not a prepared dataset"),
    ]
    for args, needle in cases:
        _one_line_error(_cli(*args), needle)
    # a missing shard: the error names it
    shard = next(p for p in (out / "train").iterdir() if p.name.startswith("shard."))
    shard.unlink()
    _one_line_error(_cli("data", "inspect", str(out)), shard.name)


@pytest.mark.e2e
def test_prepare_to_and_from_s3(corpus, tok, tmp_path, s3_env):
    d, docs = corpus
    import fsspec

    from lmforge.data import remote

    s3 = s3_env
    for name in ("b.jsonl", "c.jsonl.gz"):
        remote.upload_file(str(d / name), f"s3://{s3.bucket}/raw/{name}")
    dest = f"s3://{s3.bucket}/prepared/ds"
    # Units of 8 KiB: b.jsonl is read in byte ranges from the store; two tasks of datatrove's local
    # executor write their units' shards straight to the store.
    local = prepare([str(d / "b.jsonl"), str(d / "c.jsonl.gz")], tok, str(tmp_path / "local"), SEQ,
                    eval_fraction=0.2, unit_bytes=8192)
    assert local["units"] >= 3
    r = _cli("data", "prepare", "--input", f"s3://{s3.bucket}/raw/", "--tokenizer", tok.path, "--out", dest,
             "--seq-len", str(SEQ), "--eval-fraction", "0.2", "--unit-mb", str(8192 / (1 << 20)), "--tasks", "2",
             "--json", env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["splits"] == local["splits"]
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3.endpoint_url}, key=s3.key, secret=s3.secret)
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3.bucket}/prepared/ds"))
    assert names == [MARKER, "train", "val"]
    for split in ("train", "val"):
        got = tmp_path / "dl" / split
        fs.get(f"{s3.bucket}/prepared/ds/{split}/", str(got), recursive=True)
        np.testing.assert_array_equal(_stream(got), _stream(tmp_path / "local" / split))
    assert read_summary(dest)["splits"] == local["splits"]
    r = _cli("data", "inspect", dest, "--json", env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["first_sample"]["ids"] == MDSReader(str(tmp_path / "local" / "train")).get_tokens(0).tolist()
    again = prepare([f"s3://{s3.bucket}/raw/"], tok, dest, SEQ, eval_fraction=0.2, unit_bytes=8192)
    assert again["already_prepared"]  # the same units (another --unit-mb would be another dataset)
    # Dedup's work files in the store: every item reads its part of the others' files by ranged reads.
    dedup = dict(eval_fraction=0.2, unit_bytes=8192, curate={"dedup": {"exact": True, "near": True}})
    there = prepare([f"s3://{s3.bucket}/raw/"], tok, f"s3://{s3.bucket}/prepared/dd", SEQ, **dedup)
    here = prepare([str(d / "b.jsonl"), str(d / "c.jsonl.gz")], tok, str(tmp_path / "dd"), SEQ, **dedup)
    assert there["splits"] == here["splits"] and there["curation"]["by_reason"] == here["curation"]["by_reason"]
    with pytest.raises(UserError, match="already holds a different prepared dataset"):
        prepare([f"s3://{s3.bucket}/raw/"], tok, dest, SEQ * 2)
