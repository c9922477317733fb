"""TokenStream: order, ranks, mixing, epochs, resume, workers, errors."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.batch import IGNORE, Batch, BatchStream
from lmforge.data.mds import MDSWriter
from lmforge.data.stream.tokens import DatasetSpec, TokenStream, open_dataset
from lmforge.errors import UserError
from train_helpers import stream_sizes

SEQ = 8


def make_dataset(root: Path, n: int, tag: int, seq: int = SEQ, compression: str | None = "zstd") -> str:
    """n samples of `seq` tokens; token 0 = sample index, token 1 = dataset tag (identifies a sample)."""
    with MDSWriter(str(root), {"tokens": "ndarray:uint32"}, compression=compression, size_limit=2048) as w:
        for i in range(n):
            t = np.full(seq, 7, np.uint32)
            t[0], t[1] = i, tag
            w.write({"tokens": t})
    return str(root)


@pytest.fixture
def ds(tmp_path) -> str:
    return make_dataset(tmp_path / "a", 200, tag=1)


def ids(batch: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(r[1]), int(r[0])) for r in batch]


def take(stream: TokenStream, n: int) -> list[torch.Tensor]:
    """The token ids of the next n micro-batches."""
    return [b.input_ids for b in islice(iter(stream), n)]


def same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    """The same micro-batches, as many of them (a resumed stream that yields nothing is not "equal")."""
    return len(got) == len(expected) and all(torch.equal(x, y) for x, y in zip(got, expected))


def stream(path, tmp_path, **kw) -> TokenStream:
    kw = {"seq_len": SEQ, "micro_batch_size": 2, "global_batch_size": 8, "seed": 3,
          "cache_dir": str(tmp_path / "cache")} | kw
    return TokenStream(path, **stream_sizes(kw))


def test_batches_shape_and_truncation(ds, tmp_path):
    s = stream(ds, tmp_path, seq_len=5)
    batch = next(iter(s))
    assert isinstance(batch, Batch) and isinstance(s, BatchStream)
    b = batch.input_ids
    assert b.dtype == torch.long and b.shape == (2, 5)
    assert torch.all(b[:, 2:] == 7)
    # targets: each position's next token; the last position predicts nothing
    assert torch.equal(batch.targets[:, :-1], b[:, 1:]) and torch.all(batch.targets[:, -1] == IGNORE)
    assert batch.doc_ids is None


def test_seq_len_longer_than_samples_is_an_error(ds, tmp_path):
    with pytest.raises(UserError, match=r"samples have 8 tokens, shorter than seq_len 9"):
        stream([DatasetSpec("web", ds)], tmp_path, seq_len=9)


def test_order_is_deterministic_and_seeded(ds, tmp_path):
    a = take(stream(ds, tmp_path), 12)
    b = take(stream(ds, tmp_path), 12)
    c = take(stream(ds, tmp_path, seed=4), 12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.integration
def test_workers_do_not_change_order(ds, tmp_path):
    ref = take(stream(ds, tmp_path), 30)
    s2 = stream(ds, tmp_path, num_workers=2)
    got = take(s2, 30)
    assert s2.state_dict()["samples_seen"] == 30 // 4 * 8  # counted in the main process
    s2.close()
    assert len(got) == 30 and all(torch.equal(x, y) for x, y in zip(ref, got))


def test_epoch_is_a_permutation_and_reshuffles(ds, tmp_path):
    s = stream(ds, tmp_path)
    assert s.samples_per_epoch == 200
    batches = take(s, 200)  # 400 samples = 2 epochs, continuing past the end
    samples = [x for b in batches for x in ids(b)]
    e0, e1 = samples[:200], samples[200:]
    assert sorted(e0) == sorted(e1) == [(1, i) for i in range(200)]
    assert e0 != e1  # reshuffled
    assert s.epoch == 2 and s.samples_seen == 400
    more = take(s, 1)  # and keeps going into epoch 2
    assert len(more) == 1 and s.epoch == 2


def _global_batches(path, tmp_path, world: int, mb: int, gb: int, n: int, state=None) -> list[torch.Tensor]:
    """n global batches, assembled from every rank's micro-batches in rank order."""
    per_rank = []
    for r in range(world):
        s = stream(path, tmp_path, rank=r, world_size=world, micro_batch_size=mb, global_batch_size=gb)
        if state is not None:
            s.load_state_dict(state)
        per_rank.append(take(s, n * gb // (world * mb)))
    accum = gb // (world * mb)
    return [torch.cat([torch.cat(per_rank[r][t * accum:(t + 1) * accum]) for r in range(world)])
            for t in range(n)]


def test_global_batch_independent_of_world_and_micro_batch(ds, tmp_path):
    ref = _global_batches(ds, tmp_path, world=1, mb=8, gb=8, n=6)
    for world, mb in ((2, 2), (4, 1), (2, 4)):
        got = _global_batches(ds, tmp_path, world=world, mb=mb, gb=8, n=6)
        assert same(got, ref), (world, mb)


def test_ranks_partition_each_epoch(ds, tmp_path):
    world, mb, gb = 4, 2, 8
    seen = []
    for r in range(world):
        s = stream(ds, tmp_path, rank=r, world_size=world, micro_batch_size=mb, global_batch_size=gb)
        for b in take(s, 200 // (world * mb)):  # one epoch across ranks
            seen += ids(b)
    assert Counter(seen) == Counter((1, i) for i in range(200))


def test_resume_equals_uninterrupted(ds, tmp_path):
    full = take(stream(ds, tmp_path), 40)
    for k in (0, 4, 7, 25):  # 7 and 25: in the middle of a global batch (4 micro-batches each)
        s = stream(ds, tmp_path)
        head = take(s, k)
        state = json.loads(json.dumps(s.state_dict()))  # plain JSON
        fresh = stream(ds, tmp_path)
        fresh.load_state_dict(state)
        nxt = take(fresh, 15)
        assert same(head, full[:k]) and len(full) == 40
        assert same(nxt, full[k:k + 15]), k


@pytest.mark.integration
def test_resume_across_epoch_boundary_with_workers(ds, tmp_path):
    full = take(stream(ds, tmp_path), 130)  # 260 samples: into epoch 1
    s = stream(ds, tmp_path)
    take(s, 96)
    state = s.state_dict()
    fresh = stream(ds, tmp_path, num_workers=2)
    fresh.load_state_dict(state)
    nxt = take(fresh, 34)
    fresh.close()
    assert same(nxt, full[96:130])


def test_resume_with_different_world_size(ds, tmp_path):
    gb = 8
    ref = _global_batches(ds, tmp_path, world=1, mb=2, gb=gb, n=9)
    # train 3 global batches on 2 ranks, save rank 0's state
    s = stream(ds, tmp_path, rank=0, world_size=2, micro_batch_size=2, global_batch_size=gb)
    take(s, 3 * 2)
    state = s.state_dict()
    assert state["samples_seen"] == 3 * gb
    for world, mb in ((1, 2), (4, 2), (4, 1)):
        got = _global_batches(ds, tmp_path, world=world, mb=mb, gb=gb, n=6, state=state)
        assert same(got, ref[3:]), (world, mb)


def test_state_mismatch_is_an_error(ds, tmp_path):
    state = stream(ds, tmp_path, seed=1).state_dict()
    with pytest.raises(UserError, match="does not match"):
        stream(ds, tmp_path, seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="state dict"):
        stream(ds, tmp_path).load_state_dict({"bogus": 1})


def test_mixture_proportions(tmp_path):
    a = make_dataset(tmp_path / "a", 300, tag=1)
    b = make_dataset(tmp_path / "b", 60, tag=2)
    c = make_dataset(tmp_path / "c", 140, tag=3)
    specs = [DatasetSpec("a", a, 0.5), DatasetSpec("b", b, 0.3), DatasetSpec("c", c, 0.2)]
    s = stream(specs, tmp_path, micro_batch_size=4, global_batch_size=4)
    n = s.samples_per_epoch
    assert n == 500 and s.counts == [250, 150, 100]
    samples = [x for bt in take(s, n // 4) for x in ids(bt)]
    by = Counter(tag for tag, _ in samples)
    for tag, p in ((1, 0.5), (2, 0.3), (3, 0.2)):
        assert abs(by[tag] / n - p) < 0.01
    per = Counter(samples)
    # b (60 samples, asked for 150) cycles: every sample 2 or 3 times; a and c: a prefix, no repeats
    assert {per[(2, i)] for i in range(60)} <= {2, 3}
    assert max(v for (tag, _), v in per.items() if tag != 2) == 1
    # the mix is interleaved, not concatenated: the first 100 samples hold all three datasets
    assert {tag for tag, _ in samples[:100]} == {1, 2, 3}


def test_mixture_without_proportions_concatenates_sizes(tmp_path):
    a = make_dataset(tmp_path / "a", 30, tag=1)
    b = make_dataset(tmp_path / "b", 10, tag=2)
    s = stream([DatasetSpec("a", a), DatasetSpec("b", b)], tmp_path, micro_batch_size=4, global_batch_size=4)
    assert s.samples_per_epoch == 40
    assert Counter(x for bt in take(s, 10) for x in ids(bt)) == Counter(
        [(1, i) for i in range(30)] + [(2, i) for i in range(10)])


def test_bad_configuration(ds, tmp_path):
    with pytest.raises(ValueError, match="an unchecked split"):  # the planner refuses it first (test_plan_rules)
        stream(ds, tmp_path, global_batch_size=10, world_size=2)
    with pytest.raises(UserError, match="proportion for every dataset"):
        stream([DatasetSpec("a", ds, 0.5), DatasetSpec("b", ds)], tmp_path)
    with pytest.raises(UserError, match="names must be unique"):
        stream([DatasetSpec("a", ds), DatasetSpec("a", ds)], tmp_path)
    with pytest.raises(UserError, match="nowhere: dataset path not found"):
        stream(str(tmp_path / "nowhere"), tmp_path)


def test_prepared_folder_splits(tmp_path):
    make_dataset(tmp_path / "prep" / "train", 20, tag=1)
    make_dataset(tmp_path / "prep" / "val", 6, tag=2)
    assert len(open_dataset(str(tmp_path / "prep"), cache_dir=str(tmp_path / "c1"))) == 20
    assert len(open_dataset(str(tmp_path / "prep"), split="val", cache_dir=str(tmp_path / "c2"))) == 6
    s = stream(f"file://{tmp_path / 'prep'}", tmp_path, split="val", global_batch_size=2)
    assert {t for b in take(s, 3) for t, _ in ids(b)} == {2}


def test_missing_shard_through_stream(tmp_path):
    path = make_dataset(tmp_path / "a", 200, tag=1)
    Path(path, "shard.00002.mds.zstd").unlink()
    with pytest.raises(UserError, match=r"shard\.00002\.mds\.zstd is missing"):
        stream(path, tmp_path)
