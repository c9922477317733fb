"""Where lmforge keeps its own state: ``$LMFORGE_HOME`` (default ``~/.lmforge``).

Holds the caches of prepared data and trained tokenizers, the local MLflow store and (later)
the run registry. Tests point it at a temporary folder.
"""

from __future__ import annotations

import os


def lmforge_home() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("LMFORGE_HOME", "~/.lmforge")))


def cache_dir(kind: str) -> str:
    path = os.path.join(lmforge_home(), "cache", kind)
    os.makedirs(path, exist_ok=True)
    return path
