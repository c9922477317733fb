"""Built-in corpora that need no download.

``builtin:python-stdlib`` is the running interpreter's standard library: every ``.py`` file
under the stdlib folder (sorted by relative path), then every ``pydoc_data.topics`` entry
(sorted by topic name); one document per file/topic.

What is left out, and why: ``site-packages`` (third-party code differs per machine), the test
folders (``test``, ``tests``, ``idle_test``: ~60% of the bytes, and they hold deliberately
mis-encoded files), ``__pycache__`` and the ``_sysconfigdata*`` build record (machine paths).
The result is deterministic for a given Python version (about 12 MB on CPython 3.11).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator

from lmforge.errors import UserError

BUILTIN_CORPORA = ("python-stdlib",)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    """Absolute paths of the stdlib ``.py`` files in the corpus, in corpus order."""
    root = stdlib_dir()
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in files:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.join(folder, name))
    # Sort by the path relative to the root so the order does not depend on os.walk.
    return sorted(found, key=lambda p: os.path.relpath(p, root).split(os.sep))


def pydoc_topics() -> list[tuple[str, str]]:
    """``(topic, text)`` pairs from ``pydoc_data.topics``, sorted by topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; the .py files still make a corpus
        return []
    return sorted(topics.items())


def iter_builtin(name: str) -> Iterator[tuple[str, bytes | str]]:
    """Yield ``(document name, raw bytes or text)`` for the builtin corpus ``name``."""
    if name not in BUILTIN_CORPORA:
        raise UserError(
            f"builtin:{name}: unknown built-in corpus (expected one of: "
            + ", ".join(f"builtin:{n}" for n in BUILTIN_CORPORA)
            + ")"
        )
    for path in stdlib_files():
        with open(path, "rb") as f:
            yield path, f.read()
    for topic, text in pydoc_topics():
        yield f"pydoc_data.topics[{topic}]", text
