"""The one guard of every destructive step: overwrite, prune, delete, export.

A command that replaces or removes a folder asks here first. The target is refused, as one
line, when it is, contains or lies inside what the command reads (an input, a tokenizer, a
checkpoint or the run it belongs to), and when it is or contains the filesystem root (a bucket's
root in an object store), the home folder or the working directory. A run's ``save_folder`` that
holds files lmforge did not write is refused unless it is empty (`check_save_folder`), and
pruning removes only what lies inside the folder it prunes (`remove_inside`).

Paths are compared as the operating system resolves them (``realpath``: ``..``, symlinks), URIs of
an object store by scheme, bucket and key, so `s3://b/x/` and `s3://b/x` are one target.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterable

from lmforge.errors import UserError
from lmforge.layout import RUN_FILE, RUN_FOLDER_NAMES
from lmforge.uri import is_remote, local_path

# What a read is, as a refusal names it: ("the input", "data/raw"), ("the tokenizer", "tok/").
Read = tuple[str, "str | None"]


def _key(target: str) -> tuple[str, str] | None:
    """(scheme, normalized path) of a local path or an object-store URI; None for what names no
    place that could be written (``builtin:…``, ``hf://…``, an empty string)."""
    text = str(target or "").strip()
    if not text or text.startswith(("builtin:", "hf://")):
        return None
    text = text[len("hf:"):] if text.startswith("hf:") else text  # weights named hf:/path are at /path
    if is_remote(text):
        scheme, _, rest = text.partition("://")
        return scheme.lower(), "/".join(p for p in rest.split("/") if p and p != ".")
    return "", os.path.realpath(os.path.expanduser(local_path(text)))


def _inside(path: str, folder: str, sep: str) -> bool:
    """``path`` is ``folder`` or lies under it."""
    return path == folder or path.startswith(folder.rstrip(sep) + sep)


def _relation(target: tuple[str, str], other: tuple[str, str]) -> str | None:
    if target[0] != other[0]:
        return None
    sep = os.sep if not target[0] else "/"
    if target[1] == other[1]:
        return "is"
    if _inside(other[1], target[1], sep):
        return "contains"
    if _inside(target[1], other[1], sep):
        return "lies inside"
    return None


def _fixed_prefix(pattern: str) -> str:
    """The folder a glob pattern starts from (``data/*.txt`` → ``data``)."""
    parts = pattern.split("/")
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]]
    return "/".join(fixed) or "."


def checkpoint_reads(path: str | None) -> list[Read]:
    """What reading a checkpoint reads: the checkpoint, and the run folder it lies in (a local
    ``final/`` or ``checkpoints/step_N`` has its run's run.json one or two levels up)."""
    if not path:
        return []
    reads: list[Read] = [("the checkpoint", path)]
    if not is_remote(path):
        here = os.path.realpath(local_path(path))
        for _ in range(3):
            if os.path.isfile(os.path.join(here, RUN_FILE)):
                reads.append(("the run", here))
                break
            here = os.path.dirname(here)
    return reads


def _places(target: tuple[str, str]) -> Iterable[tuple[str, tuple[str, str], str]]:
    """(what, key, shown) of the places no destructive step may take, for a target of this kind."""
    if target[0]:
        bucket = target[1].split("/", 1)[0]
        yield f"the root of bucket {bucket!r}", (target[0], bucket), f"{target[0]}://{bucket}"
        return
    yield "the filesystem root", ("", os.path.realpath(os.sep)), os.sep
    yield "your home folder", ("", os.path.realpath(os.path.expanduser("~"))), "~"
    yield "the working directory", ("", os.path.realpath(os.getcwd())), "."


def check_target(target: str, flag: str, reads: Iterable[Read] = ()) -> None:
    """Refuse, as one line naming ``flag``, a target that a destructive step must not take: one that
    is, contains or lies inside something in ``reads``; one that is or contains the root, the home
    folder or the working directory. Checked before anything is written or removed."""
    key = _key(target)
    if key is None:
        return
    for what, place, shown in _places(key):
        rel = _relation(key, place)
        if rel in ("is", "contains"):
            raise UserError(f"{flag} {target}: {rel} {what} ({shown}); refusing to write or remove there, "
                            f"choose a folder of its own")
    for what, path in reads:
        if not path:
            continue
        path = str(path)
        rel = None
        if not is_remote(path) and glob.has_magic(path):  # a glob reads files in its folder, not the folder
            other = _key(_fixed_prefix(path))
            rel = "contains" if other and _relation(key, other) in ("is", "contains") else None
        elif (other := _key(path)) is not None:
            rel = _relation(key, other)
        if rel is not None:
            raise UserError(f"{flag} {target}: {rel} {what} {path}, which this command reads; "
                            f"choose another {flag}")


def foreign_files(folder: str) -> list[str]:
    """What a local folder holds that no lmforge run wrote ([] for a run's folder, an empty or a
    missing one). A folder with a run.json is a run's, whatever else the user put beside it."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    if RUN_FILE in names:
        return []
    return [n for n in names if n not in RUN_FOLDER_NAMES and not n.startswith(("checkpoints.old-", ".tmp"))]


def check_save_folder(save_folder: str, key: str = "save_folder", reads: Iterable[Read] = ()) -> None:
    """A run writes, resumes and prunes in its save folder: not the root, the home folder or the
    working directory, nothing the run reads, and not a folder of someone else's files (an empty
    one is fine)."""
    check_target(save_folder, key, reads)
    if is_remote(save_folder):
        return  # its staging folder is checked where it is claimed; listing a store here costs a round trip
    other = foreign_files(local_path(save_folder))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise UserError(f"{key} {save_folder}: holds files that are not an lmforge run ({shown}); "
                        "choose a new or empty folder")


def check_run_folder(folder: str, flag: str) -> None:
    """A folder about to be deleted as a run's (``runs delete --purge``): a run's, and nowhere the
    guard refuses."""
    check_target(folder, flag)
    other = foreign_files(folder)
    if other:
        raise UserError(f"{flag}: {folder} holds files that are not an lmforge run ({', '.join(other[:3])}); "
                        "not deleting it (remove it yourself if it is no longer needed)")


def remove_inside(path: str, parent: str) -> None:
    """Remove the file or folder ``path`` (pruning a checkpoint, clearing a run's files) only if it
    lies strictly inside ``parent``, both resolved (``..``, links): a link is removed, never what
    it points to, and no name can lead a removal out of the folder it prunes."""
    entry = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    top = os.path.realpath(parent)
    if entry == top or not _inside(entry, top, os.sep):
        raise UserError(f"refusing to remove {path}: it is not inside {parent}")
    if os.path.islink(entry) or os.path.isfile(entry):
        os.remove(entry)
    elif os.path.isdir(entry):
        shutil.rmtree(entry, ignore_errors=True)
