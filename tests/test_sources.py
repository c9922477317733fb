"""Raw-text sources: formats, compression, folders/globs, bad input, builtin corpus, HF offline."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lmforge.data.text.builtin import stdlib_dir, stdlib_files
from lmforge.data.text.sources import SourceStats, iter_documents, list_files
from lmforge.errors import UserError


def _docs(inputs, **kw):
    stats = SourceStats()
    return list(iter_documents(inputs, stats=stats, **kw)), stats


def test_all_formats_and_compressions(tmp_path):
    (tmp_path / "a.txt").write_text("plain text\nsecond line\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "json one"}) + "\n\n" + json.dumps({"text": "json two"}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"text": "array one"}, "array two"]))
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "gz other", "text": "gz one"}) + "\n")
    (tmp_path / "e.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("zst text é".encode()))
    pq.write_table(pa.table({"text": ["pq one", None, "pq two"], "n": [1, 2, 3]}), tmp_path / "f.parquet")
    docs, stats = _docs([str(tmp_path)])
    assert docs == ["plain text\nsecond line\n", "json one", "json two", "array one", "array two", "gz one",
                    "zst text é", "pq one", "pq two"]
    assert stats.documents == 9 and stats.files == 6
    assert stats.skipped_lines == 1  # the parquet null
    # --text-field picks another field; records without it are skipped and counted
    docs, stats = _docs([str(tmp_path / "d.jsonl.gz"), str(tmp_path / "b.jsonl")], text_field="body")
    assert docs == ["gz other"] and stats.skipped_lines == 2


def test_folder_order_skips_and_globs(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "2.txt").write_text("two")
    (tmp_path / "1.txt").write_text("one")
    (tmp_path / "z.txt").write_text("zed")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.txt").write_text("hidden")
    stats = SourceStats()
    files = list_files([str(tmp_path)], stats)
    assert [os.path.relpath(f.uri, tmp_path) for f in files] == ["1.txt", "sub/2.txt", "z.txt"]  # sorted paths
    assert stats.skipped_inputs == [{"input": str(tmp_path / "image.png"),
                                     "reason": stats.skipped_inputs[0]["reason"]}]
    assert "unsupported extension" in stats.skipped_inputs[0]["reason"]
    assert [os.path.basename(f.uri) for f in list_files([str(tmp_path / "**" / "*.txt")])] == ["1.txt", "2.txt", "z.txt"]
    assert [f.uri for f in list_files([f"file://{tmp_path}/1.txt"])] == [str(tmp_path / "1.txt")]
    # an explicitly named file with an unknown extension is read as text
    (tmp_path / "notes.log").write_text("log text")
    assert _docs([str(tmp_path / "notes.log")])[0] == ["log text"]


def test_missing_path_and_empty_glob(tmp_path):
    with pytest.raises(UserError, match=r"input .*nope\.txt: no such file or folder"):
        list_files([str(tmp_path / "nope.txt")])
    with pytest.raises(UserError, match="matches no files"):
        list_files([str(tmp_path / "*.jsonl")])
    (tmp_path / "only.png").write_bytes(b"x")
    with pytest.raises(UserError, match="no readable files"):
        list_files([str(tmp_path)])


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    raw = "ok ".encode() + b"\xff\xfe bad " + "\ufffd legit".encode()
    (tmp_path / "bad.txt").write_bytes(raw)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "x\xc3"}\n')
    docs, stats = _docs([str(tmp_path / "bad.txt"), str(tmp_path / "bad.jsonl")])
    assert docs[0] == "ok \ufffd\ufffd bad \ufffd legit"
    assert docs[1] == "x\ufffd"
    assert stats.invalid_utf8 == 3  # the legitimate U+FFFD is not counted
    assert stats.invalid_utf8_files == [str(tmp_path / "bad.txt"), f"{tmp_path / 'bad.jsonl'}:1"]


def test_bad_jsonl_lines_skipped_then_fatal_when_nothing_left(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text('{"text": "good"}\nnot json\n{"other": 1}\n{"text": 5}\n[1, 2]\n')
    docs, stats = _docs([str(p)])
    assert docs == ["good"] and stats.skipped_lines == 4
    assert stats.skipped_line_examples[0] == f"{p}:2: not valid JSON (Expecting value at column 1)"
    assert stats.skipped_line_examples[3] == f'{p}:5: an array, expected an object with a "text" field'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n{\"x\": 1}\n")
    with pytest.raises(UserError, match=r"no usable documents \(2 records skipped, e\.g\. .*bad\.jsonl:1: not valid JSON"):
        _docs([str(bad)])


@pytest.mark.integration
def test_parquet_missing_column_and_corrupt_gzip(tmp_path):
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(UserError, match=r'x\.parquet: no column "text" \(columns: content\); use --text-field'):
        _docs([str(tmp_path / "x.parquet")])
    assert _docs([str(tmp_path / "x.parquet")], text_field="content")[0] == ["a"]
    (tmp_path / "broken.txt.gz").write_bytes(gzip.compress(b"hello world" * 100)[:30])
    with pytest.raises(UserError, match=r"broken\.txt\.gz: corrupt or truncated gzip"):
        _docs([str(tmp_path / "broken.txt.gz")])


def test_builtin_corpus_is_deterministic_and_clean():
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: os.path.relpath(p, stdlib_dir()).split(os.sep))
    assert not any(f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}test{os.sep}" in f for f in files)
    assert os.path.join(stdlib_dir(), "argparse.py") in files
    stats = SourceStats()
    docs = iter_documents(["builtin:python-stdlib"], stats=stats)
    first = [next(docs) for _ in range(3)]
    with open(files[0], encoding="utf-8") as f:
        assert first[0] == f.read()
    rest = list(docs)
    assert stats.documents == len(first) + len(rest) > len(files)  # files plus pydoc topics
    with pytest.raises(UserError, match="unknown built-in corpus"):
        list_files(["builtin:nope"])


@pytest.mark.e2e
def test_hf_dataset_offline_is_one_clear_line(tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "lmforge", "tokenizer", "train", "--input",
                        "hf://wikitext/wikitext-103-raw-v1:train", "--vocab-size", "300", "--out", str(tmp_path / "t")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf://wikitext/wikitext-103-raw-v1:train" in lines[0] and "offline" in lines[0], lines
