"""Remote datasets on a real S3 server (SeaweedFS on loopback): upload, lazy cache, stream."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import islice

import pytest
import torch

from lmforge.data import remote
from lmforge.data.stream.tokens import TokenStream, open_dataset
from lmforge.errors import UserError
from lmforge.plan.layout import Layout
from test_stream import SEQ, make_dataset


def _stream(path, cache, **kw):
    return TokenStream(path, seq_len=SEQ, layout=Layout(global_batch=4, micro_batch=2), seed=5, cache_dir=cache, **kw)


@pytest.mark.integration
def test_stream_from_s3_equals_local(s3_env, tmp_path):
    local = make_dataset(tmp_path / "prep" / "train", 150, tag=1)
    uri = f"s3://{s3_env.bucket}/datasets/prep"
    remote.upload_dir(str(tmp_path / "prep"), uri)
    assert remote.exists(f"{uri}/train/index.json")

    cache = tmp_path / "s3cache"
    reader = open_dataset(uri, cache_dir=str(cache / "probe"))  # the prepared folder's train/ split
    n_shards = len(reader.shards)
    assert n_shards > 2 and len(reader) == 150
    # lazy: only the index so far; one shard after reading one sample
    assert sorted(p.name for p in (cache / "probe").iterdir()) == ["index.json"]
    reader.get_tokens(0)
    assert len(list((cache / "probe").glob("shard.*"))) == 2  # shard 0: the .zstd and its raw copy

    ref = [b.input_ids for b in islice(iter(_stream(local, str(tmp_path / "lc"))), 80)]  # > 1 epoch
    got = [b.input_ids for b in islice(iter(_stream(uri, str(cache / "stream"), num_workers=2)), 80)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and len(got) == 80

    # a second open reuses the cache (no refetch needed: works with the server unreachable too)
    again = [b.input_ids for b in islice(iter(_stream(uri, str(cache / "stream"))), 80)]
    assert all(torch.equal(a, b) for a, b in zip(ref, again))


def test_remote_errors_name_the_uri(s3_env, tmp_path):
    with pytest.raises(UserError, match=r"s3://no-such-bucket-x/data: no index\.json"):
        open_dataset("s3://no-such-bucket-x/data", cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError, match=rf"s3://{s3_env.bucket}/missing/ds: no index\.json"):
        open_dataset(f"s3://{s3_env.bucket}/missing/ds", cache_dir=str(tmp_path / "c"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("x")
    with pytest.raises(UserError, match="bucket 'no-such-bucket-x' does not exist"):
        remote.upload_dir(str(tmp_path / "d"), "s3://no-such-bucket-x/d")
    with pytest.raises(UserError, match="not found"):
        remote.download(f"s3://{s3_env.bucket}/missing.bin", str(tmp_path / "m.bin"), retries=1, backoff=0.01)


def test_missing_remote_shard_is_named(s3_env, tmp_path):
    make_dataset(tmp_path / "ds", 150, tag=1)
    uri = f"s3://{s3_env.bucket}/broken"
    remote.upload_dir(str(tmp_path / "ds"), uri)
    fs, path = remote.fs_and_path(uri)
    fs.rm(f"{path}/shard.00001.mds.zstd")
    reader = open_dataset(uri, cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError, match=r"broken/shard\.00001\.mds\.zstd: not found"):
        for i in range(len(reader)):
            reader.get_tokens(i)


@pytest.mark.e2e
def test_server_env_works_in_a_subprocess(s3_server, tmp_path):
    """Other tests run `lmforge ... s3://` in subprocesses with the fixture's env."""
    code = (
        "import sys; from lmforge.data import remote; "
        f"remote.upload_dir(sys.argv[1], 's3://{s3_server.bucket}/sub'); "
        f"print(remote.exists('s3://{s3_server.bucket}/sub/f.txt'))"
    )
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "f.txt").write_text("hello")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3_server.env
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "up")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
