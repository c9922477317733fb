"""Samples longer than the context: split into pieces that are all trained (data.pieces, the stream,
the plan's epochs, a 1-epoch run)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.mds import MDSWriter
from lmforge.data.pieces import epoch_pieces, epoch_tokens, pieces_per_sample, split_lines
from lmforge.plan.batch import training_context
from lmforge.data.stream.tokens import DatasetSpec, TokenStream
from lmforge.errors import UserError
from train_helpers import stream_sizes

SEQ = 8


def unique_dataset(root: Path, n: int, length: int, offset: int = 0) -> str:
    """n stored samples of `length` tokens; every token id is unique: offset + sample * length + position."""
    with MDSWriter(str(root), {"tokens": "ndarray:uint32"}, compression=None, size_limit=1024) as w:
        for i in range(n):
            w.write({"tokens": np.arange(offset + i * length, offset + (i + 1) * length, dtype=np.uint32)})
    return str(root)


def stream(specs, tmp_path, **kw) -> TokenStream:
    kw = {"seq_len": SEQ, "micro_batch_size": 2, "global_batch_size": 8, "seed": 5,
          "cache_dir": str(tmp_path / "cache")} | kw
    return TokenStream(specs, **stream_sizes(kw))


def rows(s: TokenStream, micro_batches: int) -> list[torch.Tensor]:
    return [row for b in islice(iter(s), micro_batches) for row in b.input_ids]


def test_rules():
    assert [pieces_per_sample(n, 256) for n in (256, 511, 512, 1024, 1000)] == [1, 1, 2, 4, 3]
    assert epoch_pieces([(10, 1024), (3, 512)], 256) == 46 and epoch_tokens([(10, 1024), (3, 512)], 256) == 46 * 256
    assert training_context(None, 2048, 512) == 512 and training_context(128, 2048, 512) == 128
    assert training_context(None, 2048, None) == 2048
    assert split_lines([("web", 1024)], 256) == ["data: samples of 1,024 tokens split into 4 pieces of 256"]
    assert split_lines([("web", 256)], 256) == []
    web, code = split_lines([("web", 1000), ("code", 512), ("hq", 256)], 256)
    assert web == "data: samples of 512 tokens (code) split into 2 pieces of 256"
    assert code.startswith("data: samples of 1,000 tokens (web) split into 3 pieces of 256; the last 232 tokens of "
                           "each (23%) are not trained")
    assert split_lines([("web", 300)], 256)[0].startswith(
        "data: samples of 300 tokens are longer than the context: trained as their first 256; the last 44")


def test_one_epoch_trains_every_token_once(tmp_path):
    """A mix of samples of 32 tokens (4 pieces of 8) and of 20 (2 pieces; the last 4 tokens of each are not
    trained): one epoch is every piece once, each piece a contiguous stretch of its sample."""
    a = unique_dataset(tmp_path / "a", 30, 32)
    b = unique_dataset(tmp_path / "b", 30, 20, offset=10_000)
    s = stream([DatasetSpec("a", a), DatasetSpec("b", b)], tmp_path)
    assert s.samples_per_epoch == 30 * 4 + 30 * 2 and s.pieces == [4, 2]
    got = rows(s, s.samples_per_epoch // 2)
    assert all(torch.equal(r, torch.arange(int(r[0]), int(r[0]) + SEQ)) for r in got)
    assert all(int(r[0]) % 32 % SEQ == 0 if int(r[0]) < 10_000 else (int(r[0]) - 10_000) % 20 % SEQ == 0 for r in got)
    tokens = torch.cat(got).tolist()
    want = list(range(30 * 32)) + [10_000 + i * 20 + j for i in range(30) for j in range(16)]
    assert sorted(tokens) == sorted(want)  # every trained token exactly once; no token of a tail
    assert s.epoch == 1
    # The pieces of one stored sample are shuffled like any samples, not kept together.
    together = sum(int(y[0]) == int(x[0]) + SEQ and int(x[0]) < 10_000 and int(x[0]) % 32 < 24
                   for x, y in zip(got, got[1:]))
    assert together < 10, together
    # Proportions are shares of pieces, i.e. of trained tokens.
    half = stream([DatasetSpec("a", a, 1.0), DatasetSpec("b", b, 1.0)], tmp_path)
    assert half.counts == [90, 90]
    assert half.fingerprint()["datasets"][0]["pieces_per_sample"] == 4


def test_resume_in_the_middle_of_a_split_sample_is_exact(tmp_path):
    a = unique_dataset(tmp_path / "a", 30, 32)
    s = stream(a, tmp_path)
    before = rows(s, 7)  # one global batch and 3 micro-batches of the next
    state = s.state_dict()
    after = rows(s, 20)
    seen = {int(r[0]) // 32 for r in before}
    left = {int(r[0]) // 32 for r in after}
    assert seen & left, "the cut should fall between pieces of one stored sample"
    resumed = stream(a, tmp_path)
    resumed.load_state_dict(state)
    again = rows(resumed, 20)
    assert len(again) == len(after) == 20 * 2 and all(torch.equal(x, y) for x, y in zip(again, after))
    # A stream split differently (another context) does not take this state, nor one saved when the
    # samples were cut to their head (before they were split), which says so.
    with pytest.raises(UserError, match="does not match the data"):
        stream(a, tmp_path, seq_len=16).load_state_dict(state)
    heads = state | {"fingerprint": state["fingerprint"] | {"datasets": [{"name": a, "samples": 30, "proportion": 1.0}]}}
    with pytest.raises(UserError, match="saved when samples longer than seq_len 8 were cut to their head"):
        resumed.load_state_dict(heads)


def test_two_ranks_see_the_same_pieces_as_one(tmp_path):
    a = unique_dataset(tmp_path / "a", 30, 32)
    one = rows(stream(a, tmp_path, micro_batch_size=8), 15)  # one epoch: 15 global batches of 8 pieces
    ranks = [rows(stream(a, tmp_path, rank=r, world_size=2, micro_batch_size=2, num_workers=w), 30)
             for r, w in ((0, 0), (1, 2))]
    two = [row for t in range(15) for r in (0, 1) for row in ranks[r][t * 4:(t + 1) * 4]]
    assert len(one) == len(two) == 120 and all(torch.equal(x, y) for x, y in zip(one, two))


@pytest.fixture(scope="module")
def split_data(tmp_path_factory, tiny_data):
    """The head of one file of the tiny corpus (≈9 samples) prepared at 128 tokens per sample."""
    from lmforge.data.prepare.prepare import prepare

    root = tmp_path_factory.mktemp("split")
    (root / "head.txt").write_text((tiny_data.raw / "textwrap.py.txt").read_text()[:2500])
    summary = prepare([str(root / "head.txt")], str(tiny_data.tokenizer), str(root / "data"), 128)
    return root / "data", summary


def test_prepared_epoch_tokens_count_pieces(split_data):
    from lmforge.data.prepare.prepared import prepared_epoch_tokens

    path, summary = split_data
    n = summary["splits"]["train"]["samples"]
    assert prepared_epoch_tokens([str(path)], 32) == n * 128
    assert prepared_epoch_tokens([str(path)], 48) == n * 2 * 48  # 32 tokens of each sample are not trained
    assert prepared_epoch_tokens([str(path)], 256) is None  # longer than the samples: the plan says so


@pytest.mark.integration
def test_one_epoch_of_data_prepared_longer_trains_all_its_tokens(tmp_path, tiny_data, split_data):
    """Prepared at 128, trained at 32 for 1ep: the run says it splits, and trains every token of the
    dataset once (within one sample), not the quarter that is each sample's head."""
    from conftest import tiny_run_config
    from train_helpers import metrics, train_in_process

    path, summary = split_data
    cfg = tiny_run_config(tiny_data, tmp_path / "run", **{
        "train_data": str(path), "training_duration": "1ep", "model.max_seq_len": 32, "save_interval": "1000ba",
        "parameters.context_length": 32, "parameters.global_batch_size": 4, "parameters.micro_batch_size": 4,
        "eval.prompts": []})
    lines: list[str] = []
    train_in_process(cfg, log=lines.append)
    assert "data: samples of 128 tokens split into 4 pieces of 32" in lines
    trained = [r["train/tokens"] for r in metrics(tmp_path / "run") if "train/tokens" in r][-1]
    train = summary["splits"]["train"]  # its tokens: every token of the split, its dropped tail included
    assert trained == train["samples"] * 128 and abs(trained - train["tokens"]) < 128, (trained, train)
