"""Per-file digests of what lmforge writes (checkpoints, exported model folders), checked on load.

A bit flip or a truncated copy then fails with one line naming the damaged file, instead of
training on (or serving) silently wrong weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

from lmforge.errors import UserError

EXPORT_FILE = "lmforge-checksums.json"  # in an exported model folder: {"files": {name: {bytes, sha256}}}


class DamagedFile(UserError):
    """A file whose size or sha256 is not what was recorded when it was written."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hash_workers(files: int, workers: int | None = None) -> int:
    """Threads that hash ``files`` files: ``workers``, by default one per core, at most 8 (beyond
    that the disk is the limit); never more than the files."""
    return min(files, workers or min(os.cpu_count() or 1, 8))


def sha256_files(paths: list[str], workers: int | None = None) -> list[str]:
    """sha256 of each file, several files at once (`hash_workers`): hashlib and file reads release
    the GIL, so threads hash in parallel (a checkpoint has a shard file per rank; rank 0 hashes
    them all)."""
    workers = hash_workers(len(paths), workers)
    if workers <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmforge-sha256") as pool:
        return list(pool.map(sha256_file, paths))


def file_digests(folder: str, skip: tuple[str, ...] = (), workers: int | None = None) -> dict[str, dict]:
    """name → {bytes, sha256} of every file directly in ``folder``, except ``skip``."""
    names = [name for name in sorted(os.listdir(folder))
             if name not in skip and os.path.isfile(os.path.join(folder, name))]
    paths = [os.path.join(folder, name) for name in names]
    return {name: {"bytes": os.path.getsize(path), "sha256": digest}
            for name, path, digest in zip(names, paths, sha256_files(paths, workers))}


def verify_files(folder: str, digests: dict, what: str) -> None:
    """Every file of ``digests`` that is present has its recorded size and sha256; the first that
    does not (by name; sizes are checked before any file is read) is named. A missing file is left
    to the loader, which reports it (on a multi-node run without a shared file system each node
    holds only its own shards)."""
    present = {name: want for name, want in sorted(digests.items()) if os.path.exists(os.path.join(folder, name))}
    for name, want in present.items():  # sizes first: a truncated file is found without reading
        size = os.path.getsize(os.path.join(folder, name))
        if size != want.get("bytes", size):
            raise DamagedFile(f"{what} {folder}: {name} has {size} bytes, {want['bytes']} were written "
                              "(truncated or damaged)")
    hashed = [name for name, want in present.items() if "sha256" in want]
    for name, got in zip(hashed, sha256_files([os.path.join(folder, name) for name in hashed])):
        if got != present[name]["sha256"]:
            raise DamagedFile(f"{what} {folder}: {name} does not match the sha256 recorded when it was "
                              "written (damaged)")


def write_export_digests(folder: str) -> None:
    """Record the digests of an exported model folder's files (call it last)."""
    digests = file_digests(folder, skip=(EXPORT_FILE,))
    with open(os.path.join(folder, EXPORT_FILE), "w") as f:
        json.dump({"files": digests}, f, indent=1)
        f.write("\n")


def verify_export(folder: str) -> None:
    """Check an exported model folder against its recorded digests (folders without them pass)."""
    path = os.path.join(folder, EXPORT_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            digests = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedFile(f"{path}: unreadable ({e})") from None
    # The weights and the model's config are held to their digests; tokenizer files may be
    # edited after the export on purpose (a chat template added to tokenizer_config.json).
    verify_files(folder, {k: v for k, v in digests.items()
                          if k.endswith(".safetensors") or k in ("lmforge-model.json", "config.json")}, "model folder")
