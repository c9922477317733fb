"""What a path or URI names: a local path, or a place in an object store (no fsspec needed to tell)."""

from __future__ import annotations


def is_remote(uri: str) -> bool:
    """True for object-store URIs; plain paths and ``file://`` are local, and ``hf://`` names a
    Hugging Face dataset (`data.sources` loads it with `datasets`), not a store to list or write."""
    scheme, sep, _ = str(uri).partition("://")
    return bool(sep) and scheme not in ("file", "local", "hf", "")


def local_path(uri: str) -> str:
    """A local path for a plain path or ``file://`` URI."""
    uri = str(uri)
    return uri[len("file://"):] if uri.startswith("file://") else uri
