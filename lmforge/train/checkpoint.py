"""Checkpoints: DCP shards + a small JSON state, made visible only when complete.

Layout of ``save_folder``::

    run.json                      identity of the run (name, model shape, data) — guards overwrites
    checkpoints/step_00000100/    one complete checkpoint
        .metadata, __*_*.distcp   model + optimizer (torch.distributed.checkpoint)
        rng_rank{R}.pt            per-rank RNG states
        lmforge-state.json        step, tokens, data-stream state, resolved config, and the size and
                                  sha256 of every other file (written last; verified on load)
    final/                        model.safetensors + lmforge-model.json + tokenizer (the export)
    reference-logps.safetensors   preference tuning: the reference log-probs (`train.reference`)

Every rank writes into ``checkpoints/.step_00000100.tmp``; after a barrier rank 0 writes
``lmforge-state.json`` and renames the folder. A crash mid-save leaves only a ``.tmp``
folder, which is never picked up as the latest checkpoint and is removed by the next save.
"""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import shutil
import time
import warnings
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as td
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lmforge.checksums import EXPORT_FILE, DamagedFile, file_digests, verify_export, verify_files
from lmforge.distributed.dist import barrier
from lmforge.errors import UserError
from lmforge.guard import check_run_owner, remove_inside
from lmforge.run_files import (DAMAGED, RUN_FILE, STATE_FILE, checkpoint_step, checkpoints_dir, damaged_checkpoints,
                            different_run_error, holds_saved_run, list_checkpoints, read_run_file, read_state)

# DCP warns on every single-process save/load that it "assumes the intent" — which it is.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class PendingSave:
    """At most one asynchronous checkpoint in flight (``dcp.async_save``).

    Training continues while DCP writes the shards from a CPU copy in a background thread.
    DCP's last step gathers every rank's write results on rank 0 (the coordinator), which then
    writes ``.metadata``: so once rank 0's future is done, every rank's shards are on disk, and
    rank 0 alone completes the checkpoint (``lmforge-state.json`` last, then the rename) —
    as soon as ``poll()`` sees it done, or at the latest in ``wait()`` (next save, end of run).
    """

    def __init__(self):
        """Collective when distributed: every rank creates it at the same point."""
        self._inflight = None  # (future of the write and rank 0's file digests, completion arguments)
        # Rank 0 hashes the written files (the state file's digests) here too, after the write:
        # reading a large checkpoint back takes seconds the training loop need not wait for.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-digests")
        # The background write coordinates ranks (plans, metadata) while the training thread
        # runs its own collectives: it gets a separate gloo group so the two never interleave.
        self.group = td.new_group(backend="gloo") if td.is_available() and td.is_initialized() else None

    def start(self, future, complete_args: tuple) -> None:
        tmp, rank = complete_args[1], complete_args[4]

        def written():
            future.result()  # raises the write's error, if any
            return file_digests(tmp, skip=(STATE_FILE,)) if rank == 0 else None

        self._inflight = (self._hasher.submit(written), complete_args)

    def poll(self) -> str | None:
        """Complete the in-flight checkpoint if its write finished (never blocks, not collective)."""
        if self._inflight is None or not self._inflight[0].done():
            return None
        return self._complete_inflight()

    def wait(self) -> str | None:
        """Block until the in-flight checkpoint is written and complete it. Collective."""
        path = self._complete_inflight() if self._inflight is not None else None
        barrier()
        return path

    def _complete_inflight(self) -> str:
        future, args = self._inflight
        self._inflight = None
        try:
            digests = future.result()
        except (Exception, CheckpointException) as e:
            err = _write_error(e, args[1])
            _discard(args[1], rank=args[4])
            raise err from None
        return _complete(*args, digests=digests)


def save_checkpoint(save_folder: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, *, rank: int, keep: int, on_complete=None, pending: PendingSave | None = None) -> str:
    """Write a checkpoint for ``step``; returns its folder. Collective: every rank calls it.

    ``on_complete(path)`` is called on rank 0 once the checkpoint is complete (visible under
    its final name). With ``pending`` the shards are written asynchronously and completion
    happens later (see ``PendingSave``); the previous in-flight checkpoint completes first.
    """
    if pending is not None:
        pending.wait()
    root = checkpoints_dir(save_folder)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = os.path.join(root, f".step_{step:08d}.tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of an interrupted save
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    except (OSError, RuntimeError) as e:
        err = _write_error(e, tmp)
        _discard(tmp, rank)
        raise err from None
    finish_args = (save_folder, tmp, final, state, rank, keep, on_complete)
    if pending is not None:
        # Returns once the state is staged (copied to CPU memory); the write continues in a thread.
        pending.start(dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp,
                                     process_group=pending.group), finish_args)
        return final
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    except (Exception, CheckpointException) as e:
        err = _write_error(e, tmp)
        _discard(tmp, rank)
        raise err from None
    return _finish(*finish_args)


def _discard(tmp: str, rank: int) -> None:
    """A checkpoint whose write failed: its half-written folder goes (rank 0), so that a full disk
    gets back what it held and nothing of it is left to look like a checkpoint being written."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


FULL_BYTES = 1 << 20  # a write that failed with less free space than this ran out of it


def _write_error(e: BaseException, folder: str) -> BaseException:
    """The OSError behind a failed checkpoint write (a full disk, a read-only folder), else ``e``.
    DCP wraps every rank's error in a CheckpointException (a BaseException, with a traceback text),
    and torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos"): the
    folder's free space tells that case apart."""
    cause = e
    if isinstance(e, CheckpointException) and e.failures:
        cause = next(iter(e.failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
    if isinstance(cause, OSError):
        return cause
    try:
        st = os.statvfs(folder)
    except OSError:
        return e
    if st.f_bavail * st.f_frsize < FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), folder)
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:  # `ulimit -f`: a short write
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), folder)
    return e


def _finish(*args) -> str:
    """Every rank's shards are written (synchronous save): complete the checkpoint. Collective."""
    barrier()
    final = _complete(*args)
    barrier()
    return final


def _complete(save_folder: str, tmp: str, final: str, state: dict, rank: int, keep: int, on_complete,
              digests: dict | None = None) -> str:
    """Rank 0 writes the state file last and renames (the checkpoint becomes visible); other ranks: no-op."""
    if rank == 0:
        state = state | {"files": digests if digests is not None else file_digests(tmp, skip=(STATE_FILE,))}
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # same step saved before (e.g. final save after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        # keep-N counts this checkpoint and those before it: one of a later step can only be left from
        # before a fallback to an earlier one (`intact_checkpoint`), never a reason to drop an intact one.
        step = checkpoint_step(final)
        for _, old in [c for c in list_checkpoints(save_folder) if c[0] <= step][:-keep]:
            remove_inside(old, checkpoints_dir(save_folder))
        # Damaged checkpoints set aside (`intact_checkpoint`) go once an intact one of their step or
        # later exists: this one. Kept until then for inspection, they are never resumed from.
        for bad_step, bad in damaged_checkpoints(save_folder):
            if bad_step <= step:
                remove_inside(bad, checkpoints_dir(save_folder))
        if on_complete is not None:
            on_complete(final)
    return final


class CorruptCheckpoint(UserError):
    """A checkpoint that cannot be used as written (its state file or a digest is wrong)."""


def verify_checkpoint(path: str, checked: Collection[str] = ()) -> dict:
    """The state of a checkpoint whose files are intact; CorruptCheckpoint (naming the file) if not.
    Checkpoints written before digests were recorded are taken as they are. ``checked``: files
    whose digests were verified already (`files_here` of another rank's check) and are skipped."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt ({STATE_FILE}: {e})") from None
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not isinstance(files or {}, dict) or \
            not all(isinstance(d, dict) for d in (files or {}).values()):
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt ({STATE_FILE} is not a checkpoint's state)")
    try:
        verify_files(path, {n: d for n, d in (state.get("files") or {}).items() if n not in checked}, "checkpoint")
    except DamagedFile as e:
        raise CorruptCheckpoint(str(e)) from None
    return state


def intact_checkpoint(save_folder: str, log=print) -> str | None:
    """The newest complete checkpoint whose files are intact. A corrupt newer one is skipped with a
    warning line and, once an intact one is found, set aside as ``step_N.damaged-<time>`` (on disk for
    inspection, but no longer a checkpoint: keep-N never counts it, a later resume never tries it);
    if none is intact, the newest one's error and nothing is moved."""
    found = list_checkpoints(save_folder)
    first_error = None
    damaged = []
    for _, path in reversed(found):
        try:
            verify_checkpoint(path)
        except CorruptCheckpoint as e:
            first_error = first_error or e
            damaged.append(path)
            log(f"warning: {e}; trying the previous checkpoint")
            continue
        if first_error is not None:
            log(f"warning: resuming from {path}, the newest intact checkpoint")
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for bad in damaged:
                try:
                    os.replace(bad, f"{bad}{DAMAGED}{stamp}")
                    log(f"warning: set the damaged {os.path.basename(bad)} aside as {bad}{DAMAGED}{stamp}")
                except OSError:  # left where it is: keep-N counts only checkpoints up to the newest one
                    pass
        return path
    if first_error is not None:
        raise UserError(f"{first_error}; no intact checkpoint is left: --no-autoresume starts fresh "
                        "(keeping them aside)")
    return None


def newest_checkpoint(save_folder: str, local_folder: str | None, log=print) -> str | None:
    """The checkpoint a run resumes from with a local tier (``local_checkpoints``): the newest intact one
    of either tier, the durable one on a tie. A local tier with none intact (a corrupt or half-written
    copy, a node's disk lost) is passed over with a warning: the durable tier covers it. UserError when
    neither tier has an intact checkpoint but one has damaged ones, as without a local tier."""
    if not local_folder:
        return intact_checkpoint(save_folder, log)
    try:
        durable, error = intact_checkpoint(save_folder, log), None
    except UserError as e:
        durable, error = None, e
    try:
        local = intact_checkpoint(local_folder, log)
    except UserError as e:
        log(f"warning: the local tier has no intact checkpoint ({e}); resuming from the save_folder's")
        local = None
    if local is not None and (durable is None or checkpoint_step(local) > checkpoint_step(durable)):
        return local
    if durable is None and error is not None:
        raise error
    return durable


def completed_final(save_folder: str, previous: dict | None, duration: str) -> str | None:
    """The intact ``final/`` of a run that already completed this very ``training_duration``
    (``previous``: the folder's run.json before this start), else None. Such a run is complete
    even when every checkpoint of it is damaged: only its final model was still to be used."""
    final = os.path.join(save_folder, "final")
    if not previous or (previous.get("config") or {}).get("training_duration") != duration:
        return None
    if not os.path.isfile(os.path.join(final, EXPORT_FILE)):
        return None
    try:
        verify_export(final)
    except (DamagedFile, UserError):
        return None
    return final


def files_here(path: str) -> list[str]:
    """The recorded files of checkpoint ``path`` that this machine holds: what `verify_checkpoint`
    checks here (on several nodes without a shared file system, each node's own shards)."""
    return sorted(n for n in read_state(path).get("files") or {} if os.path.exists(os.path.join(path, n)))


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, rank: int, checked: Collection[str] = ()) -> dict:
    """Load weights, optimizer and this rank's RNG states; returns the JSON state. ``checked``:
    files whose digests were verified already. A resuming run passes what rank 0 checked, so that
    ranks do not each read a large checkpoint back in full (on a shared file system they check
    nothing more; without one, the files only their node holds)."""
    state = verify_checkpoint(path, checked)
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer else (get_state_dict(model, [])[0], None)
    to_load = {"model": model_sd} | ({"optim": optim_sd} if optimizer else {})
    try:
        dcp.load(to_load, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        cause = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))  # the per-rank error, e.g. a truncated shard
            cause = cause[0] if isinstance(cause, tuple) else cause
        text = str(cause).strip()
        first = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        raise UserError(f"checkpoint {path} cannot be loaded into this model ({first[:300]}); "
                        "it may be corrupt or from a different model; --no-autoresume starts fresh (keeping it aside)") from None
    if optimizer:
        set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    else:
        set_state_dict(model, [], model_state_dict=to_load["model"], optim_state_dict={})
    # Each rank restores its own RNG file. On a different world size, ranks beyond the saving
    # world keep their freshly seeded state and extra files are ignored: the model code draws
    # no random numbers in training, so only sampling-based extras could differ.
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


# --- run identity: refuse to mix two different runs in one save folder -----------------------

def open_run_folder(save_folder: str, identity: dict, *, overwrite: bool, autoresume: bool,
                    all_local: bool = True) -> bool:
    """Returns True when the folder already holds this run's checkpoints (resume is possible).

    ``identity`` is `config.identity.run_identity`. A folder that holds a different run is refused
    unless ``overwrite``, in which case its checkpoints are removed (never silently mixed). A
    folder whose other run never completed a checkpoint (a start that failed) is taken over —
    when ``all_local``: a remote run's checkpoints are in the store, not in its staging folder.
    """
    existing = read_run_file(save_folder)
    if existing is None:
        return False
    same = existing.get("identity") == identity
    if overwrite:
        if not all_local or holds_saved_run(save_folder):  # never another run's (`guard.check_run_owner`)
            check_run_owner(save_folder, identity.get("name") or "", overwrite=True, existing=existing)
        for name in ("checkpoints", "final", "metrics.jsonl", "trackers.json", RUN_FILE):
            remove_inside(os.path.join(save_folder, name), save_folder)
        return False
    if not same and all_local and not holds_saved_run(save_folder):
        # An earlier start that failed before its first checkpoint: nothing of it to protect.
        return False
    if not same:
        raise different_run_error(save_folder, existing)
    if not autoresume and os.path.isdir(checkpoints_dir(save_folder)):
        # Start fresh without destroying anything: the old checkpoints are moved aside.
        aside = f"{checkpoints_dir(save_folder)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(checkpoints_dir(save_folder), aside)
        print(f"autoresume is off: moved the existing checkpoints to {aside}")
        return False
    return True


def write_run_file(save_folder: str, identity: dict, resolved: dict) -> None:
    os.makedirs(save_folder, exist_ok=True)
    tmp = os.path.join(save_folder, RUN_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"identity": identity, "config": resolved}, f, indent=1)
    os.replace(tmp, os.path.join(save_folder, RUN_FILE))
