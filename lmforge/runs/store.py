"""A remote ``save_folder`` (``s3://``, ``gs://``, any fsspec URI), mirrored by a local staging folder.

The trainer writes everything locally exactly as for a local ``save_folder`` (DCP checkpoints with
the ``.tmp`` → rename protocol, metrics, the final export), into
``$LMFORGE_HOME/cache/runs/<hash of the URI>``. A background thread uploads each completed
checkpoint with retries and backoff, its completion marker ``lmforge-complete.json`` (a manifest
of file sizes) LAST, then prunes remote checkpoints beyond ``save_num_checkpoints_to_keep``.
Training never waits for an upload, except at the end: a run is complete only once the store has
its last checkpoint and its export.

Remote layout (same as local, plus the markers)::

    run.json, metrics.jsonl, generations.jsonl, trackers.json, ...
    checkpoints/step_00000100/{.metadata, __0_0.distcp, rng_rank0.pt, lmforge-state.json, lmforge-complete.json}
    final/{model.safetensors, ..., lmforge-complete.json}

On a fresh machine (empty staging) :meth:`RunStore.restore` downloads ``run.json`` (so the run
identity check sees the remote run) and the latest *complete* remote checkpoint, verifying every
file's size against the marker. A remote checkpoint without its marker is an interrupted upload:
ignored, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass

from lmforge.data import remote
from lmforge.errors import UserError
from lmforge.home import cache_dir
from lmforge.secrets import redact
from lmforge.train.callbacks import Callback
from lmforge.run_files import RUN_FILE, checkpoints_dir, list_checkpoints

MARKER = "lmforge-complete.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_UPLOADS = ".uploads"  # hard-linked snapshots of checkpoints waiting for upload


def staging_dir(uri: str) -> str:
    """The local folder that mirrors the remote save_folder ``uri`` (stable across runs)."""
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(cache_dir("runs"), key)


def local_folder(save_folder: str) -> str:
    """Where the trainer writes: the staging folder for a remote save_folder, else the folder itself."""
    return staging_dir(save_folder) if remote.is_remote(save_folder) else save_folder


def open_store(cfg, log=print) -> "RunStore | None":
    """The store of a remote ``cfg.save_folder`` (None for a local one). Rank 0 only."""
    if not remote.is_remote(cfg.save_folder):
        return None
    store = RunStore(cfg.save_folder, staging_dir(cfg.save_folder), keep=cfg.save_num_checkpoints_to_keep,
                     retries=cfg.object_store.upload_retries, backoff=cfg.object_store.upload_backoff_s, log=log)
    log(f"save_folder {cfg.save_folder}: staged locally in {store.local}, uploaded in the background")
    return store


@dataclass
class RemoteCheckpoint:
    step: int
    path: str  # within the filesystem
    manifest: dict | None  # the completion marker; None = incomplete upload


class RunStore:
    def __init__(self, uri: str, local: str, *, keep: int, retries: int = 5, backoff: float = 0.5, log=print):
        self.uri, self.local, self.keep = uri.rstrip("/"), local, keep
        self.retries, self.backoff, self.log = retries, backoff, log
        # Our own retries (with backoff long enough to ride out a restart) replace the client's:
        # stacked on top of botocore's and s3fs's they would turn one failure into minutes.
        self.fs, self.root = remote.fs_and_path(self.uri, fast_fail=True)
        self.root = self.root.rstrip("/")
        os.makedirs(local, exist_ok=True)
        self._jobs: list[tuple] = []
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.errors: dict[str, str] = {}  # job kind → last failure (cleared by a later success)
        self.uploaded_steps: list[int] = []

    def _p(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # --- start of a run ------------------------------------------------------------------------

    def _call(self, what: str, fn):
        """``fn()`` with retries and exponential backoff; a UserError naming ``what`` when it gives up."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except PermissionError as e:
                raise UserError(redact(f"{what}: access denied ({e})")) from None
            except FileNotFoundError as e:
                raise UserError(redact(f"{what}: not found ({e})")) from None
            except Exception as e:  # noqa: BLE001 - network errors, throttling, server restarts
                if attempt == self.retries:
                    raise UserError(redact(f"{what}: failed after {attempt + 1} attempts "
                                           f"({type(e).__name__}: {str(e)[:200]})")) from None
                delay = self.backoff * 2**attempt * (1 + 0.25 * random.random())
                self.log(redact(f"warning: {what}: {type(e).__name__}; retrying in {delay:.1f}s"))
                time.sleep(delay)

    def _exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except FileNotFoundError:
            return False

    def fetch_run_file(self) -> None:
        """Bring the remote run.json into staging, so that the run-identity check sees the store."""
        self.fs.invalidate_cache()
        src = self._p(RUN_FILE)
        if self._call(f"{self.uri}: reading {RUN_FILE}", lambda: self._exists(src)):
            remote.download(f"{self.uri}/{RUN_FILE}", os.path.join(self.local, RUN_FILE),
                            retries=self.retries, backoff=self.backoff)

    def remote_checkpoints(self) -> list[RemoteCheckpoint]:
        """Every remote checkpoint folder, oldest first; ``manifest`` None when it has no marker."""
        root = self._p("checkpoints")
        self.fs.invalidate_cache(root)
        if not self._call(f"{self.uri}: looking for checkpoints", lambda: self._exists(root)):
            return []
        out = []
        for entry in self._call(f"{self.uri}: listing checkpoints", lambda: self.fs.ls(root, detail=False)):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_DIR.match(name)
            if not m:
                continue
            manifest = None
            marker = f"{root}/{name}/{MARKER}"
            if self._call(f"{self.uri}: reading {name}/{MARKER}", lambda: self._exists(marker)):
                try:
                    manifest = json.loads(self._call(f"{self.uri}: reading {name}/{MARKER}",
                                                     lambda: self.fs.cat_file(marker)))
                except ValueError:
                    manifest = None
            out.append(RemoteCheckpoint(int(m.group(1)), f"{root}/{name}", manifest))
        return sorted(out, key=lambda c: c.step)

    def restore(self, *, resume: bool, overwrite: bool) -> None:
        """Called after the identity check: clear the store (overwrite) or fetch what a resume needs."""
        if overwrite:
            self.clear()
            return
        if not resume:
            return
        ckpts = self.remote_checkpoints()
        complete = [c for c in ckpts if c.manifest is not None]
        newest = complete[-1].step if complete else -1
        for c in ckpts:
            if c.manifest is None and c.step > newest:
                self.log(f"warning: {self.uri}/checkpoints/step_{c.step:08d} has no completion marker "
                         f"({MARKER}: an interrupted upload); ignored")
        local = list_checkpoints(self.local)
        if not complete or (local and local[-1][0] >= newest):
            return
        c = complete[-1]
        name = f"step_{c.step:08d}"
        tmp = os.path.join(checkpoints_dir(self.local), f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        files = c.manifest.get("files") or {}
        t = time.monotonic()
        for rel, size in files.items():
            remote.download(f"{self.uri}/checkpoints/{name}/{rel}", os.path.join(tmp, rel), retries=self.retries,
                            backoff=self.backoff, size=int(size))
        final = os.path.join(checkpoints_dir(self.local), name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.log(f"resume: downloaded {self.uri}/checkpoints/{name} ({len(files)} files, "
                 f"{sum(files.values()) / 2**20:.1f} MiB, sizes verified) in {time.monotonic() - t:.1f}s")
        # The remote run is ahead of this staging folder: its metrics and tracker ids are the current ones.
        for rel in self._top_level_remote_files():
            if rel != RUN_FILE:
                remote.download(f"{self.uri}/{rel}", os.path.join(self.local, rel), retries=self.retries,
                                backoff=self.backoff)

    def _top_level_remote_files(self) -> list[str]:
        out = []
        for info in self._call(f"{self.uri}: listing", lambda: self.fs.ls(self.root, detail=True)):
            if info.get("type") == "file":
                out.append(info["name"].rstrip("/").rsplit("/", 1)[-1])
        return out

    def clear(self) -> None:
        """--overwrite: remove the store's checkpoints, export, logs and run files (markers first)."""
        for c in self.remote_checkpoints():
            self._delete_checkpoint(c.path)
        for rel in ("final", "logs"):
            if self._call(f"{self.uri}/{rel}: looking", lambda: self._exists(self._p(rel))):
                self._call(f"{self.uri}/{rel}: deleting", lambda: self.fs.rm(self._p(rel), recursive=True))
        for rel in self._top_level_remote_files():
            self._call(f"{self.uri}/{rel}: deleting", lambda: self.fs.rm_file(self._p(rel)))

    def _delete_checkpoint(self, path: str) -> None:
        # The marker goes first: a half-deleted checkpoint must never look complete.
        marker = f"{path}/{MARKER}"
        if self._call(f"looking for {marker}", lambda: self._exists(marker)):
            self._call(f"deleting {marker}", lambda: self.fs.rm_file(marker))
        self._call(f"deleting {path}", lambda: self.fs.rm(path, recursive=True))

    # --- during the run: the background uploader --------------------------------------------------

    def checkpoint_saved(self, path: str) -> None:
        """The ``on_complete`` hook of save_checkpoint (rank 0, right after the rename).

        Hard-links the checkpoint's files into a snapshot, so a later save pruning the local
        checkpoint cannot pull files from under a running upload; costs no copy.
        """
        name = os.path.basename(path.rstrip("/"))
        step = int(_STEP_DIR.match(name).group(1))
        snap = os.path.join(self.local, _UPLOADS, f"{name}-{time.time_ns()}")
        for dirpath, _, files in os.walk(path):
            for f in files:
                src = os.path.join(dirpath, f)
                dst = os.path.join(snap, os.path.relpath(src, path))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
        # run.json first: a checkpoint in the store is only resumable next to the run's identity.
        self._submit(("files",))
        self._submit(("checkpoint", step, snap))

    def _submit(self, job: tuple) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="lmforge-uploader", daemon=True)
                self._thread.start()
            self._jobs.append(job)
            self._cv.notify()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
                # Uploads lag behind saves: only the newest waiting checkpoint is worth uploading.
                superseded = job[0] == "checkpoint" and any(j[0] == "checkpoint" for j in self._jobs)
                duplicate = job[0] == "files" and ("files",) in self._jobs
            if superseded:
                shutil.rmtree(job[2], ignore_errors=True)
                continue
            if duplicate:
                continue
            try:
                if job[0] == "checkpoint":
                    self._upload_checkpoint(job[1], job[2])
                elif job[0] == "final":
                    self._upload_folder(os.path.join(self.local, "final"), self._p("final"), "final")
                else:
                    self._upload_top_level_files()
                self.errors.pop(job[0], None)
            except Exception as e:  # noqa: BLE001 - an upload failure never stops training
                msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
                self.errors[job[0]] = redact(msg)
                where = f"; the local copy is kept in {job[2] if job[0] == 'checkpoint' else self.local}"
                self.log(redact(f"warning: upload failed: {msg}{where}"))

    def _upload_folder(self, local_dir: str, dest: str, label: str, step: int | None = None) -> None:
        marker = f"{dest}/{MARKER}"
        # Re-uploading (the same step saved again): incomplete until the new marker. The check goes
        # through the retries too: a store that is down must not let an old marker stand.
        if self._call(f"{self.uri}/{label}: looking for an old marker", lambda: self._exists(marker)):
            self._call(f"{self.uri}/{label}: deleting the old marker", lambda: self.fs.rm_file(marker))
        files = {}
        for dirpath, _, names in os.walk(local_dir):
            for f in sorted(names):
                full = os.path.join(dirpath, f)
                files[os.path.relpath(full, local_dir).replace(os.sep, "/")] = os.path.getsize(full)
        for rel in sorted(files):
            src, dst = os.path.join(local_dir, rel), f"{dest}/{rel}"
            self._call(f"uploading {self.uri}/{label}/{rel}", lambda: self.fs.put_file(src, dst))
        manifest = {"files": files, "step": step, "time": time.time()}
        self._call(f"uploading {self.uri}/{label}/{MARKER}",
                   lambda: self.fs.pipe_file(marker, json.dumps(manifest, indent=1).encode()))

    def _upload_checkpoint(self, step: int, snap: str) -> None:
        name = f"step_{step:08d}"
        t = time.monotonic()
        self._upload_folder(snap, self._p("checkpoints", name), f"checkpoints/{name}", step)
        shutil.rmtree(snap, ignore_errors=True)
        self.uploaded_steps.append(step)
        self.log(f"upload: {self.uri}/checkpoints/{name} complete ({time.monotonic() - t:.1f}s)")
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; older ones (complete or not) go."""
        ckpts = self.remote_checkpoints()
        complete = [c for c in ckpts if c.manifest is not None]
        if not complete:
            return
        kept = {c.step for c in complete[-self.keep:]}
        for c in ckpts:
            if c.step not in kept and c.step < complete[-1].step:
                try:
                    self._delete_checkpoint(c.path)
                except UserError as e:  # the new checkpoint is safely up; pruning is retried next time
                    self.log(f"warning: could not prune {c.path}: {e}")

    def _upload_top_level_files(self) -> None:
        """run.json, metrics, generations, tracker ids, logs: small, re-uploaded whole each time."""
        for name in sorted(os.listdir(self.local)):
            full = os.path.join(self.local, name)
            if os.path.isfile(full) and not name.startswith(".") and not name.endswith((".tmp", ".part")):
                self._call(f"uploading {self.uri}/{name}", lambda: self.fs.put_file(full, self._p(name)))

    # --- end of the run --------------------------------------------------------------------------

    def finish(self) -> None:
        """Upload the export and run files, wait for every upload; a UserError if the store lacks any."""
        if os.path.isdir(os.path.join(self.local, "final")):
            self._submit(("final",))
        self._submit(("files",))
        self.log(f"upload: waiting for the last uploads to {self.uri}")
        self._close(wait=True)
        if self.errors:
            first = next(iter(self.errors.values()))
            raise UserError(f"the run finished but its upload to {self.uri} failed ({first}); everything is "
                            f"kept locally in {self.local}; re-run the same command to retry the upload")
        shutil.rmtree(os.path.join(self.local, _UPLOADS), ignore_errors=True)

    def abort(self) -> None:
        """A failed run: stop after the upload in progress (the thread is a daemon; nothing waits)."""
        with self._cv:
            self._jobs.clear()
        self._close(wait=False)

    def _close(self, wait: bool) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if wait and self._thread is not None:
            self._thread.join()


def upload_logs(uri: str, log_dir: str, *, retries: int = 5, backoff: float = 0.5) -> str | None:
    """Copy a remote run's log files (kept locally by the supervisor) to ``<uri>/logs/``.

    Called after each resumption, so the store has every attempt's output, crashes included.
    Returns what went wrong (the logs then stay only in ``log_dir``), or None."""
    if not os.path.isdir(log_dir):
        return None
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            try:
                remote.upload_file(os.path.join(log_dir, name), remote.join(uri, "logs", name),
                                   retries=retries, backoff=backoff)
            except UserError as e:
                return redact(f"could not upload the logs to {uri}/logs ({e}); they are in {log_dir}")
    return None


class MirrorCallback(Callback):
    """Keeps a remote save folder in step with the trainer's local staging folder (rank 0)."""

    def __init__(self, store: RunStore):
        self.store = store

    def before_resume(self, save_folder: str) -> None:
        self.store.fetch_run_file()  # the run identity check then sees the remote run

    def resume_decided(self, save_folder: str, resume: bool, overwrite: bool) -> None:
        self.store.restore(resume=resume, overwrite=overwrite)

    def on_checkpoint(self, path: str) -> None:
        self.store.checkpoint_saved(path)

    def on_end(self, status: str, final_dir: str | None, error: str | None = None) -> None:
        if status == "failed":
            self.store.abort()
        else:
            self.store.finish()  # the run is complete only once the store has its last checkpoint and export
