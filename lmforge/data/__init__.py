"""Data: sources → tokenizer → packed MDS shards → a deterministic, resumable token stream.

``DatasetSpec``, ``TokenStream``, ``open_dataset`` (lmforge.data.stream) and ``MDSReader``,
``MDSWriter`` (lmforge.data.mds) are importable from here; they load on first use, so that
`data prepare` worker processes do not import torch.
"""

_EXPORTS = {"DatasetSpec": "stream", "TokenStream": "stream", "open_dataset": "stream",
            "MDSReader": "mds", "MDSWriter": "mds"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"lmforge.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lmforge.data' has no attribute {name!r}")
