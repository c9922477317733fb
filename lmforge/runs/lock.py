"""One lock per save folder, held by every process of the run that writes into it.

The file is ``<save folder>/.lmforge.lock`` (for a remote save folder: its local staging
folder). Two things make it up:

- a kernel lock (``flock``). Every process of a run holds it *shared*: the supervisor, the
  trainer or torchrun, each rank (forked DataLoader workers inherit it). The kernel drops it
  when a process dies, however it dies, so a killed run never leaves it behind on this host;
- the file's content: which run claimed it (``run_uid``, name, host, pid and its start time,
  when). The claiming process refreshes the file's mtime every minute.

**Claiming** (a new run, a second ``train`` on the same folder, ``runs restart``, a resume)
takes the kernel lock *exclusively* without waiting, which succeeds only when no process of
any earlier run still holds it. Otherwise it is refused with one line naming the run — at once
while the process that claimed it lives, else after a few seconds' grace (the processes of a
run killed a moment ago take that long to go). Once exclusive, the content decides:

- written on this host: the processes it names are gone (a *stale* lock) — taken over;
- written on **another host** (a shared filesystem, whose locks may not reach across hosts):
  that run is presumed alive while the file was refreshed within ``REMOTE_STALE_S`` (5 min)
  and the claim is refused; an older one is stale and taken over.

The content is then rewritten and the lock turned shared. (Turning a lock from exclusive to
shared is not atomic; a claimer that slipped in between sees the content naming a live
process and backs off, and each claimer re-reads the content after the switch.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time

from lmforge.errors import UserError
from lmforge.process import process_alive, process_start, this_host

LOCK_FILE = ".lmforge.lock"
REMOTE_STALE_S = 300.0  # a lock from another host not refreshed for this long is stale
REFRESH_S = 60.0
CLAIM_WAIT_S = 5.0


def lock_path(folder: str) -> str:
    return os.path.join(folder, LOCK_FILE)


def read_holder(folder: str) -> dict | None:
    """The run that claimed the folder last (the file's content), or None."""
    try:
        with open(lock_path(folder)) as f:
            holder = json.load(f)
        holder["refreshed"] = os.path.getmtime(lock_path(folder))
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


class SaveFolderLock:
    def __init__(self, folder: str, fd: int, run_uid: str | None):
        self.folder, self.path, self.fd, self.run_uid = folder, lock_path(folder), fd, run_uid
        self._stop = threading.Event()

    # --- taking it

    @classmethod
    def claim(cls, folder: str, *, run_uid: str, name: str, wait_s: float = CLAIM_WAIT_S) -> "SaveFolderLock":
        """The lock for a run starting (or starting again) in ``folder``; UserError when another
        run's process still holds it."""
        fd = _open(folder)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise UserError(f"save_folder {folder}: cannot lock {LOCK_FILE} ({e.strerror})") from None
                # Grace only for a run whose claimer is gone: its other processes are on their way out.
                if time.monotonic() < deadline and not _claimer_alive(read_holder(folder)):
                    time.sleep(0.1)
                    continue
                os.close(fd)
                raise UserError(_in_use(folder, read_holder(folder))) from None
            break
        holder = read_holder(folder)
        why = _still_live(folder, holder)
        if why:
            os.close(fd)  # drops the exclusive lock
            raise UserError(why)
        me = {"run_uid": run_uid, "name": name, "host": this_host(), "pid": os.getpid(),
              "pid_start": process_start(os.getpid()), "time": time.time()}
        data = json.dumps(me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        lock = cls(folder, fd, run_uid)
        lock._share()
        if (read_holder(folder) or {}).get("pid") != os.getpid():  # another claimer slipped in
            lock.release()
            raise UserError(_in_use(folder, read_holder(folder)))
        return lock

    @classmethod
    def join(cls, folder: str, run_uid: str | None) -> "SaveFolderLock":
        """Hold the lock of the run this process belongs to (a trainer, torchrun or a rank):
        refused if the folder was claimed by another run in the meantime."""
        fd = _open(folder)
        lock = cls(folder, fd, run_uid)
        try:
            lock._share(wait_s=CLAIM_WAIT_S)
        except UserError:
            os.close(fd)
            raise
        holder = read_holder(folder) or {}
        if run_uid is not None and holder.get("run_uid") != run_uid:
            lock.release()
            raise UserError(f"save_folder {folder} now belongs to run {holder.get('name')!r} "
                            f"(run_uid {holder.get('run_uid')}), not to this process's run ({run_uid})")
        return lock

    def _share(self, wait_s: float = 30.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(_in_use(self.folder, read_holder(self.folder))) from None
                time.sleep(0.02)

    # --- while the run lives

    def alone(self) -> bool:
        """True when no other process holds the lock (every other process of the run has exited)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            alone = False
        else:
            alone = True
        # A failed upgrade may have dropped our shared lock (Linux removes it first): take it again.
        self._share()
        return alone

    def wait_alone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.alone():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def refresh(self) -> None:
        try:
            os.utime(self.path)
        except OSError:
            pass

    def keep_fresh(self, interval: float = REFRESH_S) -> None:
        """Refresh the file's mtime in the background (what other hosts judge liveness by)."""
        def loop():
            while not self._stop.wait(interval):
                self.refresh()

        threading.Thread(target=loop, name="lmforge-lock-refresh", daemon=True).start()

    def inheritable(self) -> int:
        """The descriptor, kept open across exec (torchrun then holds the lock)."""
        os.set_inheritable(self.fd, True)
        return self.fd

    def release(self) -> None:
        self._stop.set()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def probe(folder: str) -> None:
    """Fail now (UserError) when ``folder`` is in use by a live run; nothing is written."""
    if not os.path.exists(lock_path(folder)):
        return
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(_in_use(folder, read_holder(folder))) from None
    finally:
        os.close(fd)
    why = _still_live(folder, read_holder(folder))
    if why:
        raise UserError(why)


def _open(folder: str) -> int:
    try:
        os.makedirs(folder, exist_ok=True)
        return os.open(lock_path(folder), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"save_folder {folder}: cannot create {LOCK_FILE} ({e.strerror})") from None


def _still_live(folder: str, holder: dict | None) -> str | None:
    """Why a lock whose kernel lock is free must still be respected (None: take it over)."""
    if not holder:
        return None
    who = f"run {holder.get('name')!r} (pid {holder.get('pid')} on {holder.get('host')})"
    if holder.get("host") != this_host():
        age = time.time() - holder.get("refreshed", 0)
        if age < REMOTE_STALE_S:
            return (f"save_folder {folder} is locked by {who}, refreshed {age:.0f}s ago; stop that "
                    f"run on its host, or wait: a lock from another host is taken over once it has not been "
                    f"refreshed for {REMOTE_STALE_S / 60:.0f} minutes")
        return None
    if holder.get("pid") != os.getpid() and process_alive(holder.get("pid"), holder.get("pid_start")):
        return f"save_folder {folder} is in use by {who}, which is still running"
    return None


def _claimer_alive(holder: dict | None) -> bool:
    return bool(holder) and holder.get("host") == this_host() and \
        process_alive(holder.get("pid"), holder.get("pid_start"))


def _in_use(folder: str, holder: dict | None) -> str:
    name = (holder or {}).get("name")
    who = f"run {name!r}" if name else "another run"
    return (f"save_folder {folder} is in use: a process of {who} is still running"
            + (f" (started by pid {holder.get('pid')} on {holder.get('host')})" if holder else "")
            + (f"; stop it with `lmforge runs stop {name}` or wait for it to exit" if name else ""))
