"""Process lifetime: who is alive, dying together with the process that started us, and what
a training attempt reported about how it ended (its status file).

Every process a run starts asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``): the supervisor's child, each torchrun rank, DataLoader workers and the
tokenizing workers of data preparation. A ``kill -9`` anywhere in the tree then takes everything
below it down, so nothing keeps writing into a save folder that a new run may already own.
The core (``data``, ``train``) and the operations (``runs``) both use this module; it imports
nothing of lmforge.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import socket
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def this_host() -> str:
    return socket.gethostname()


NODE_ENV = "LMFORGE_NODE"


def node_name() -> str:
    """This machine's name in a run's cordon list (`goodput.cordon`): ``$LMFORGE_NODE`` when set — the
    k8s job sets it to the Kubernetes node, and two "nodes" on one machine (tests, the fault bench)
    each get their own — else the host name (Slurm's node names)."""
    return os.environ.get(NODE_ENV) or this_host()


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; no-op elsewhere).

    The death signal follows the parent *thread* that forked us, so call this in processes
    forked from a main thread. ``expected_parent``: when the parent already died before the
    call (we were re-parented), exit now instead of living on as an orphan. Safe between fork
    and exec (a ``preexec_fn``) once `_libc` was called in the parent: it then imports nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    _libc().prctl(_PR_SET_PDEATHSIG, int(sig))
    # (a rank forked by torchrun's fork server is a grandchild: the server dies with torchrun)
    if expected_parent is not None and expected_parent not in (os.getppid(), parent_of(os.getppid())):
        os._exit(1)


def name_process(name: str) -> None:
    """This process's name as `ps` and /proc/<pid>/comm show it (Linux; 15 characters)."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def child_dies_with_me():
    """A ``preexec_fn`` for `subprocess.Popen`: the child gets SIGKILL when this process dies."""
    if sys.platform.startswith("linux"):
        _libc()  # loaded here, in the parent: nothing may be imported between fork and exec
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def process_start(pid: int | None) -> str | None:
    """An identifier of when ``pid`` started (Linux: jiffies since boot + boot id), or None if
    no such live process. Stored next to a pid so that a reused pid is not taken for ours."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        if os.path.isdir("/proc/self"):
            return None
        try:  # no procfs (macOS): existence is all we can check
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}:{fields[19]}"


def process_started_at(pid: int | None = None) -> float | None:
    """When ``pid`` (default: this process) started, as a Unix time (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:  # (centiseconds; /proc/stat's btime is whole seconds)
            boot = time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


_MARKS: dict[str, float] = {}  # when this process reached each stage of its start (`mark`)


def mark(stage: str) -> None:
    """Record when this process reached ``stage`` of its start (the first time): a training attempt's
    ledger keeps them, so that its start-up can be taken apart (imports, process group, resolution,
    build and checkpoint load)."""
    _MARKS.setdefault(stage, time.time())


def marks() -> dict[str, float]:
    return dict(_MARKS)


def attempt_started_at() -> float | None:
    """When this training attempt's process began: this process's start — or, for a rank that torchrun
    forked from its fork server on the node's first attempt, the fork server's start, whose imports
    were this rank's start-up (on a restart the fork server was already warm: the fork is the start)."""
    own = process_started_at()
    server = os.environ.get("LMFORGE_FORKSERVER_AT")  # (`distributed.torchrun.start_fork_server`)
    if server and own is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return min(own, float(server))
    return own


def process_alive(pid: int | None, start: str | None) -> bool:
    now = process_start(pid)
    return now is not None and (start in (None, "?") or now == "?" or now == start)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def become_subreaper() -> None:
    """Make this process the one orphans below it are re-parented to (Linux; no-op elsewhere):
    a child that dies leaves its own children under us, so `descendants` still finds all of them."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1)


def kill_tree(pid: int, include_root: bool = True, timeout: float = 10.0) -> None:
    """SIGKILL every process below ``pid`` (and ``pid`` itself with ``include_root``).

    They are all stopped first, until no new one appears, so that none forks a replacement (a
    process pool repopulating itself) while the tree is taken down; it returns once they have
    ended, and without ``include_root`` once none is left below ``pid`` (one forked meanwhile by
    another thread of ``pid`` is taken too), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stopped: set[int] = set()
        while True:
            tree = set(descendants(pid)) | ({pid} if include_root else set())
            new = tree - stopped
            if not new:
                break
            for p in new:
                _signal(p, signal.SIGSTOP)
            stopped |= new
        starts = {p: process_start(p) for p in stopped}
        for p in stopped:
            _signal(p, signal.SIGKILL)
        while time.monotonic() < deadline and any(process_alive(p, t) for p, t in starts.items() if t):
            time.sleep(0.01)  # a killed process takes a moment to end: none is left when this returns
        if include_root or time.monotonic() >= deadline or not any(process_start(p) for p in descendants(pid)):
            return


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # gone meanwhile
        pass


def sibling_workers() -> list[int]:
    """The other torchrun workers of this node: processes below our parent (the torchrun agent)
    that lead a session of their own, as torchrun starts each worker (their data workers do not);
    [] in a process torchrun did not start."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return []
    me = os.getpid()
    out = []
    for pid in descendants(os.getppid()):
        try:
            if pid != me and os.getsid(pid) == pid:
                out.append(pid)
        except OSError:  # gone meanwhile
            continue
    return out


def speaks_for_node() -> bool:
    """Whether this process speaks for its machine: the first torchrun rank of each node
    (LOCAL_RANK 0), or a process started without torchrun. It reports to the node's status file
    and prints rank 0's bad-input error there: with several nodes, rank 0 may be on another one,
    and this node's supervisor and user must learn it too (else: retries, then a rendezvous timeout)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def read_status(path: str) -> dict:
    """A status file's contents (what a node's first rank reports about a training attempt, see
    `runs.supervisor.report_status`); {} when it is missing or half-written."""
    try:
        with open(path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}
