"""The one guard of every destructive step: overwrite, prune, delete, export.

A command that writes, replaces or removes a folder or a file asks here first, before it writes.

**Places** (`check_target`): a target is refused, as one line, when it is, contains or lies inside
what the command reads (an input, a tokenizer, a checkpoint or the run it belongs to), and when it
is or contains the filesystem root (a bucket's root in an object store), your home folder, the
working directory or the lmforge home folder (``$LMFORGE_HOME``: the run registry, the MLflow store,
the caches).

**Replacing** (`check_output`, the one rule of ``--overwrite``): a command writes a *kind* of output
— a tokenizer folder, a prepared dataset, a `data dedup` output, an export, a run. Its target
must be new, empty, or hold an output of that same kind that lmforge made (known by its marker
file; a run: of the same name); ``--overwrite`` replaces only that, and never a folder that holds
something else: the home folder, a run of another name, a folder of someone else's files, or an
output with a run, a dataset or another output inside it. A target that is part of another
output (a run's ``final/``, a dataset's ``train/``) is refused too. The refusal names what the
target holds. A file target (`check_output_file`: a report, a job script, a plot, a GGUF file)
may replace the same command's earlier file, any other file only with ``--overwrite``, never a
file that is part of an lmforge output or of the home folder, and is written beside the target
and renamed over it.

**A run's save folder** (`check_run_place`, `check_run_owner`): the places above, not a folder of
files lmforge did not write, and never a run of another name (``--overwrite`` included).
Pruning removes only what lies inside the folder it prunes (`remove_inside`).

Paths are compared as the operating system resolves them (``realpath``: ``..``, symlinks), URIs of
an object store by scheme, bucket and key, so `s3://b/x/` and `s3://b/x` are one target.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from lmforge.checksums import EXPORT_FILE
from lmforge.errors import UserError
from lmforge.home import lmforge_home
from lmforge.run_files import (DATASET_MARKER, DEDUP_MARKER, MODEL_CONFIG_FILE, RUN_FILE, RUN_FOLDER_NAMES,
                            TOKENIZER_MARKER, holds_saved_run, is_variant,
                            read_run_file)
from lmforge.uri import is_remote, local_path

# What a read is, as a refusal names it: ("the input", "data/raw"), ("the tokenizer", "tok/").
Read = tuple[str, "str | None"]

HOME_WORDS = "the lmforge home folder"
# The kinds of output a command writes, in words: what `--overwrite` may replace for each.
KINDS = {"tokenizer": "a tokenizer folder", "dataset": "a prepared dataset", "dedup": "a `data dedup` output",
         "export": "an export", "run": "a run"}
WORK_PLAN = ("work", "plan.json")  # an unfinished `data prepare` / `data dedup` (`data.dest`)
_SHOWN = 3  # names a refusal lists


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


def _home() -> str:
    return os.path.realpath(lmforge_home())


def _places(target: tuple[str, str]) -> Iterable[tuple[str, tuple[str, str], str]]:
    """(what, key, shown) of the places no destructive step may take, for a target of this kind."""
    if target[0]:
        bucket = target[1].split("/", 1)[0]
        yield f"the root of bucket {bucket!r}", (target[0], bucket), f"{target[0]}://{bucket}"
        return
    yield "the filesystem root", ("", os.path.realpath(os.sep)), os.sep
    yield "your home folder", ("", os.path.realpath(os.path.expanduser("~"))), "~"
    yield "the working directory", ("", os.path.realpath(os.getcwd())), "."
    yield HOME_WORDS, ("", _home()), "$LMFORGE_HOME"


def check_target(target: str, flag: str, reads: Iterable[Read] = ()) -> None:
    """Refuse, as one line naming ``flag``, a target that a destructive step must not take: one that
    is, contains or lies inside something in ``reads``; one that is or contains the root, your home
    folder, the working directory or the lmforge home folder. Checked before anything is written or
    removed."""
    key = _key(target)
    if key is None:
        return
    if str(target).strip().startswith("~"):  # the shell left it (quoted, or --flag=~/…): the write would
        # land in a folder named "~" here while its check looked at the home folder
        raise UserError(f"{flag} {target}: '~' is not expanded here; expected the full path "
                        f"({os.path.expanduser(str(target).strip())})")
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


# --------------------------------------------------------------------------- what a folder holds


@dataclass(frozen=True)
class Held:
    """What a local folder holds, as the rule judges it: ``kind`` one of `KINDS` (or "home"), None
    for files lmforge did not write; ``what`` in words; ``name`` a run's name."""
    kind: str | None
    what: str
    name: str | None = None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


_MARKERS = (RUN_FILE, DATASET_MARKER, DEDUP_MARKER, EXPORT_FILE, MODEL_CONFIG_FILE, TOKENIZER_MARKER,
            WORK_PLAN[0])


def _marked(folder: str, names: Iterable[str] | None = None) -> Held | None:
    """The kind of lmforge output ``folder`` is by its marker, or None; ``names``: what it holds
    (None: its markers are looked up one by one, for a folder that may be large)."""
    if os.path.realpath(folder) == _home():
        return Held("home", HOME_WORDS)
    if names is None:
        names = {n for n in _MARKERS if os.path.lexists(os.path.join(folder, n))}
    names = set(names)
    if RUN_FILE in names:
        name = ((read_run_file(folder) or {}).get("identity") or {}).get("name")
        return Held("run", f"run {name!r}" if name else "a run", name)
    if DATASET_MARKER in names:
        return Held("dataset", KINDS["dataset"])
    if DEDUP_MARKER in names and _read_json(os.path.join(folder, DEDUP_MARKER)).get("format") == "lmforge-curation":
        return Held("dedup", KINDS["dedup"])
    if EXPORT_FILE in names or MODEL_CONFIG_FILE in names:
        return Held("export", "an export (a model lmforge wrote)")
    if TOKENIZER_MARKER in names:  # only what lmforge wrote: a downloaded tokenizer has the same other files
        return Held("tokenizer", KINDS["tokenizer"])
    if WORK_PLAN[0] in names and os.path.isfile(os.path.join(folder, *WORK_PLAN)):
        plan = _read_json(os.path.join(folder, *WORK_PLAN))
        prepare = "tokenizer" in (plan.get("identity") or {})
        return Held("dataset" if prepare else "dedup", f"an unfinished `data {'prepare' if prepare else 'dedup'}`")
    return None


def held_by(folder: str) -> Held | None:
    """What a local folder holds; None when it is missing or empty."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not names:
        return None
    marked = _marked(folder, names)
    if marked is not None:
        return marked
    if set(names) <= RUN_FOLDER_NAMES:  # a run's start that failed before its run.json (logs, a lock)
        return Held("run", "the start of a run (its logs)")
    return Held(None, f"files that are not lmforge output ({_shown(names)})")


def _part_of(path: str, *, file: bool = False) -> tuple[str, Held] | None:
    """(folder, what it is) of the lmforge output (or home folder) that local ``path`` is part of:
    anything inside a tokenizer, dataset, dedup output or export folder, and a run's own files and
    folders (``final/``, ``checkpoints/``, ``metrics.jsonl``, …; not other names a user put in a run's
    folder); a ``file`` inside the home folder (the registry, the MLflow store); None otherwise. A
    folder inside the home folder is judged by what it holds (the caches are outputs of their own)."""
    home, here = _home(), path
    while True:
        parent = os.path.dirname(here)
        if parent == home and file:
            return home, Held("home", HOME_WORDS)
        if parent == here or parent == home:
            return None
        held = _marked(parent)
        if held is not None:
            if held.kind != "run" or os.path.relpath(path, parent).split(os.sep)[0] in RUN_FOLDER_NAMES:
                return parent, held
            return None  # a folder of the user's own, inside a run's folder
        here = parent


def _nested(folder: str) -> tuple[str, Held] | None:
    """The first lmforge output (a run, a dataset, another output) or the home folder found below
    ``folder`` (not ``folder`` itself): what removing ``folder`` would take with it."""
    home = _home()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        if root == folder:
            continue
        if os.path.realpath(root) == home:
            return root, Held("home", HOME_WORDS)
        held = _marked(root, [*dirs, *files])
        if held is not None:
            return root, held
    return None


# --------------------------------------------------------------------------- the rule of --overwrite


def check_output(target: str, flag: str, kind: str, *, overwrite: bool, reads: Iterable[Read] = (),
                 command: str | None = None) -> bool:
    """The one rule of a command that writes a folder of ``kind`` (one of `KINDS`): refuse, as one line,
    a place `check_target` refuses, a target that is part of another output or is a file, and a
    folder holding anything but an output of the same kind lmforge made (with ``overwrite`` or not);
    without ``overwrite``, a folder of the same kind is refused only by the caller (a `data prepare`
    of the same inputs resumes). Returns whether the target holds an output to replace. An
    object store's target is judged by its listing (`check_replace`, from `data.dest`)."""
    check_target(target, flag, reads)
    if is_remote(target):
        return False
    path = os.path.realpath(os.path.expanduser(local_path(target)))
    part = _part_of(path)
    if part is not None:
        folder, held = part
        raise UserError(f"{flag} {target}: is part of {held.what} ({folder}); refusing to write or remove "
                        f"there, choose another {flag}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {target}: exists and is not a folder; choose another {flag}")
    held = held_by(path)
    if held is None:
        return False
    check_replace(target, flag, kind, held, overwrite=overwrite, command=command)
    nested = _nested(path)
    if nested is not None:
        sub, inner = nested
        raise UserError(f"{flag} {target}: holds {inner.what} in {sub}; replacing the folder would remove it, "
                        f"choose another {flag}")
    return True


def check_replace(target: str, flag: str, kind: str, held: Held, *, overwrite: bool,
                  command: str | None = None) -> None:
    """``held`` (what a non-empty target holds) may be replaced by an output of ``kind`` only when it is
    that kind (with ``overwrite``, or when the caller resumes it); anything else never."""
    if held.kind != kind:
        by = f"`{command}`" if command else "this command"
        raise UserError(f"{flag} {target}: holds {held.what}; {by} replaces only {KINDS[kind]} lmforge made, "
                        f"--overwrite or not; choose another {flag}")
    if not overwrite and kind in ("tokenizer", "export"):
        raise UserError(f"{flag} {target}: already holds {held.what}; pass --overwrite to replace it, or choose "
                        f"another {flag}")


def check_output_file(target: str, flag: str, overwrite: bool, *, same_kind, reads: Iterable[Read] = (),
                      strict: bool = False, writes: str = "a file") -> None:
    """A command that writes one file: refuse a place `check_target` refuses, a folder, a missing parent
    folder (nothing is created above the file), and a file that is part of an lmforge output or of the
    home folder (a run's metrics, the registry), unless it is this command's own kind. ``same_kind``
    (the file's first bytes → bool) tells the command's earlier file ("``writes``"): it is replaced
    as is, and any other file only with ``overwrite`` (a report, a job script, a plot). ``strict`` (a
    model file): the same kind only, and with ``overwrite``. The caller writes beside the target and
    renames over it."""
    check_target(target, flag, reads)
    path = os.path.abspath(os.path.expanduser(target))
    if os.path.isdir(path):
        raise UserError(f"{flag} {target}: is a folder; give a file name")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        what = "is a file" if os.path.exists(parent) else "does not exist"
        raise UserError(f"{flag} {target}: the folder {parent} {what}; create it first or choose another {flag}")
    if not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError as e:
        raise UserError(f"{flag} {target}: cannot be read ({e.strerror or e}); choose another {flag}") from None
    ours = bool(head) and same_kind(head)
    part = None if ours else _part_of(os.path.realpath(path), file=True)
    if part is not None:
        folder, held = part
        raise UserError(f"{flag} {target}: is part of {held.what} ({folder}); refusing to replace it, choose "
                        f"another {flag}")
    if strict and not ours:
        raise UserError(f"{flag} {target}: the file exists and is not {writes}; --overwrite replaces only {writes} "
                        f"lmforge could have written, choose another {flag}")
    if overwrite or (ours and not strict):
        return
    if ours:
        raise UserError(f"{flag} {target}: already holds {writes}; pass --overwrite to replace it, or choose "
                        f"another {flag}")
    raise UserError(f"{flag} {target}: the file exists and was not written by this command; choose another "
                    f"{flag} or pass --overwrite to replace it")


def replace_folder(tmp: str, out: str) -> None:
    """Move the complete folder ``tmp`` to ``out``, replacing what `check_output` allowed there: the
    old folder is renamed aside first, so ``out`` is at every moment the old output or the new one."""
    aside = None
    if os.path.lexists(out):
        aside = f"{out}.old-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is not None:
        if os.path.islink(aside):  # a link to the old output: the link goes, never what it points to
            os.remove(aside)
        else:
            shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------- a run's save folder


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


def check_run_place(save_folder: str, key: str = "save_folder", reads: Iterable[Read] = ()) -> None:
    """A run writes, resumes and prunes in its save folder: not the root, your home folder, the
    working directory or the lmforge home folder, nothing the run reads, not part of another output
    (a run's ``checkpoints/``, a dataset), and not a folder of someone else's files or of another
    kind of output (an empty one is fine)."""
    check_target(save_folder, key, reads)
    if is_remote(save_folder):
        return  # its staging folder is checked where it is claimed; listing a store here costs a round trip
    path = os.path.realpath(os.path.expanduser(local_path(save_folder)))
    part = _part_of(path)
    if part is not None:
        raise UserError(f"{key} {save_folder}: is part of {part[1].what} ({part[0]}); choose a folder of its own")
    other = foreign_files(path)
    if other:
        held = _marked(path, other)
        what = held.what if held is not None else f"files that are not an lmforge run ({_shown(other)})"
        raise UserError(f"{key} {save_folder}: holds {what}; choose a new or empty folder")


def check_run_owner(save_folder: str, name: str, *, overwrite: bool, existing: dict | None = None,
                    key: str = "save_folder") -> None:
    """A save folder holding a run of another name is refused, with ``overwrite`` too: ``--overwrite``
    replaces a run of the same name only (another model or data under it; `train.checkpoint` compares
    the whole identity). ``existing``: the folder's run.json as read (an object store's, by the
    trainer); else a local folder's is read, and counts only once it holds a checkpoint or a final
    model (an earlier start that failed before its first checkpoint holds nothing to protect)."""
    if existing is None:
        if not save_folder or is_remote(save_folder) or not os.path.isdir(save_folder):
            return
        existing = read_run_file(save_folder)
        if existing is None or not holds_saved_run(save_folder):
            return
    other = (existing.get("identity") or {}).get("name")
    if other and is_variant(other, name):
        return
    shown = f"run {other!r}" if other else "a run of unknown name"
    remedy = "--overwrite replaces only a run of the same name" if overwrite else "or give this run that name"
    raise UserError(f"{key} {save_folder}: holds {shown}, not {name!r}; choose another --save-folder ({remedy})")


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
