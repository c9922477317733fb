"""Data, split by what flows through it, in one direction:

- ``text/``    raw sources (files, the built-in corpus, remote objects) and the tokenizer;
- ``curate/``  document rules (filters, language, dedup signatures, decontamination): pure functions
               over text, imported by the prepare job and never importing it;
- ``prepare/`` the `data prepare` job (units, executors, packing, dedup and stats jobs) that writes MDS;
- ``stream/``  the training stream over prepared MDS: which data a run reads and its per-rank tokens;
- ``rows/``    fine-tuning rows (SFT, preference pairs, RL prompts).

Shared leaves at this level: ``mds`` (the shard format), ``remote`` (fsspec paths), ``batch``,
``chat``, ``pieces``. ``DatasetSpec``, ``TokenStream``, ``open_dataset``, ``MDSReader`` and
``MDSWriter`` are importable from here; they load on first use, so that `data prepare` worker
processes do not import torch.
"""

_EXPORTS = {"DatasetSpec": "stream.tokens", "TokenStream": "stream.tokens", "open_dataset": "stream.tokens",
            "MDSReader": "mds", "MDSWriter": "mds"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"lmforge.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lmforge.data' has no attribute {name!r}")
