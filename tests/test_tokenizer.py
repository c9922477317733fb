"""Byte-level BPE training, save/load, transformers parity, bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from lmforge.data.text.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, load_tokenizer, train_tokenizer
from lmforge.errors import UserError

SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "Le café coûte 3€ — naïve façade. 日本語のテキスト。 emoji 🙂\n\ttabs  and   spaces",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    syllables = ["ka", "to", "ri", "mu", "sen", "el", "or", "pa", "qui", "dé", "ß", "日本"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(400)]
    texts = SAMPLES * 10 + [" ".join(rng.choices(words, k=60)) for _ in range(200)]
    lines = [json.dumps({"text": t}) for t in texts]
    (d / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(corpus)], 400, str(out))
    return out


def test_train_save_load_round_trip(tok_dir, corpus, tmp_path):
    assert sorted(os.listdir(tok_dir)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    tok = load_tokenizer(str(tok_dir))
    assert tok.vocab_size == 400
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (0, 1, None)
    assert tok.path == str(tok_dir)
    for text in SAMPLES + ["unseen ∑ ⊕ bytes \x00\x7f"]:
        ids = tok.encode(text)
        assert max(ids) < 400 and tok.eos_id not in ids
        assert tok.decode(ids) == text  # byte-level: every string round-trips
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert tok.decode([*tok.encode("a"), tok.eos_id]) == "a" + EOS_TOKEN
    seen = json.loads((corpus / "docs.jsonl").read_text().splitlines()[-1])["text"]
    assert len(tok.encode(seen)) < len(seen.encode()) / 2  # merges were learned
    # the fingerprint identifies the token ids, not the folder
    shutil.copytree(tok_dir, tmp_path / "copy")
    assert load_tokenizer(str(tmp_path / "copy")).fingerprint == tok.fingerprint
    alone = load_tokenizer(str(tok_dir / "tokenizer.json"))  # no config: pad falls back to eos
    assert (alone.eos_id, alone.pad_id) == (0, 0) and alone.fingerprint != tok.fingerprint


def test_transformers_loads_it_with_identical_ids(tok_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = load_tokenizer(str(tok_dir))
    auto = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN)
    for hf in (auto, fast):
        assert hf.eos_token_id == ours.eos_id and hf.pad_token_id == ours.pad_id
        for text in SAMPLES:
            ids = hf(text)["input_ids"]
            assert ids == ours.encode(text)
            assert hf.decode(ids) == ours.decode(ids) == text
    assert len(auto) == ours.vocab_size


def test_bos_is_prepended_everywhere(corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer([str(corpus)], 300, str(tmp_path), add_bos=True)
    assert tok.bos_id == 2 and tok.vocab_size == 300
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == "hello"
    again = load_tokenizer(str(tmp_path))
    assert again.bos_id == 2 and again.encode("hello") == ids
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.bos_token == BOS_TOKEN and hf("hello")["input_ids"] == ids


def test_foreign_tokenizer_json_guesses_eos(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"</s>": 0, "<unk>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id, tok.encode("hi yo")) == (0, 0, [2, 1])


def test_bad_input(corpus, tmp_path):
    with pytest.raises(UserError, match=r"--vocab-size 257: too small, need at least 258"):
        train_tokenizer([str(corpus)], 257, str(tmp_path / "t"))
    with pytest.raises(UserError, match=r"--vocab-size 258: too small, need at least 259"):
        train_tokenizer([str(corpus)], 258, str(tmp_path / "t"), add_bos=True)
    with pytest.raises(UserError, match=r"no such folder"):
        load_tokenizer(str(tmp_path / "missing" / "dir"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=r"broken/tokenizer\.json: not a valid tokenizer file"):
        load_tokenizer(str(tmp_path / "broken"))


@pytest.mark.e2e
def test_cli_train_and_bad_input(corpus, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "lmforge", "tokenizer", "train", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("--input", str(corpus / "docs.jsonl"), "--vocab-size", "320", "--out", str(tmp_path / "t"), "--bos")
    assert r.returncode == 0, r.stderr
    assert "320 tokens" in r.stdout and load_tokenizer(str(tmp_path / "t")).bos_id == 2
    for args, needle in [
        (["--input", str(corpus), "--vocab-size", "10", "--out", str(tmp_path / "x")], "--vocab-size 10: too small"),
        (["--input", str(tmp_path / "nope"), "--vocab-size", "300", "--out", str(tmp_path / "x")], "no such file"),
        (["--input", str(tmp_path / "*.txt"), "--vocab-size", "300", "--out", str(tmp_path / "x")], "matches no files"),
        (["--input", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "x"), "--text-field", "body"],
         "no usable documents"),
    ]:
        r = run(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
        assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
