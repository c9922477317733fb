"""A prepared dataset as its marker describes it, read without opening the dataset (and without
torch: planning reads it, `plan`'s callers included, before any process trains)."""

from __future__ import annotations

import os

from lmforge.data import remote
from lmforge.data.pieces import epoch_tokens
from lmforge.data.prepare.prepare import MARKER, read_summary, summary_seq_len
from lmforge.errors import UserError

SUMMARY_FILE = MARKER  # the done-marker `data prepare` writes last


def join(*parts: str) -> str:
    """A path or an object-store URI under ``parts[0]``."""
    return "/".join(p.rstrip("/") for p in parts)


def exists_at(path: str) -> bool:
    """A local path or an object in a store."""
    return remote.exists(path) if remote.is_remote(path) else os.path.exists(path)


def is_prepared(path: str) -> bool:
    """A prepared dataset (ours, with its marker, or any MDS folder); a `data prepare` / `data dedup`
    that has not written its marker yet (a kill before it) is refused, never half-read."""
    from lmforge.data.prepare.dest import unfinished

    if exists_at(join(path, SUMMARY_FILE)):
        return True
    if unfinished(path):
        raise UserError(f"{path}: an unfinished `lmforge data prepare` (or `data dedup`): it has no {SUMMARY_FILE} "
                        "yet; run the same command again to finish it")
    return any(exists_at(join(path, f)) for f in ("index.json", "train/index.json"))


def prepared_summary(path: str) -> dict:
    """The marker of a prepared dataset ({} where there is none: an MDS folder of another tool)."""
    if exists_at(join(path, SUMMARY_FILE)):
        return read_summary(path)
    return {}


def prepared_epoch_tokens(paths: list[str], ctx: int) -> int | None:
    """Tokens one epoch of these prepared datasets trains at a context of ``ctx``, from their
    markers alone (nothing is opened); None where a path is not prepared, its marker does not say,
    or a sample is shorter than the context (the plan reports that)."""
    shapes = []
    for path in paths:
        summary = prepared_summary(path) if is_prepared(path) else {}
        samples = ((summary.get("splits") or {}).get("train") or {}).get("samples")
        length = summary_seq_len(summary)
        if not samples or not length or length < ctx:
            return None
        shapes.append((int(samples), int(length)))
    return epoch_tokens(shapes, ctx) if shapes else None
