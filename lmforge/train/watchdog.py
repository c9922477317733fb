"""The hang watchdog: a rank that completes no training step for too long dumps its stacks and exits.

A run can hang without failing: a collective waiting for a rank that is stuck (a deadlock, a
wedged GPU or network, a data read that never returns) blocks every rank forever. Each rank
runs a small thread that the training loop feeds after every step (`beat`). When no step
completes for ``compute.hang_timeout`` seconds, the thread writes one line naming the rank and
the Python stacks of every thread to stderr — the run's log — and ends the process with
`EXIT_HUNG`. Every rank shares one log, and every rank dumps at about the same moment, so each
stack line is written whole by one `write` (a pipe keeps writes up to PIPE_BUF together) and
starts with ``[rank R]``: lines of two ranks may alternate, but never mix. Every rank's loop
stops at the same collective, so every rank's watchdog fires within moments of the others and
each dumps its own stacks. The supervisor (or
torchrun) then restarts the run from its latest checkpoint, as a failure that counts against
``max_retries``.

The timeout is ``compute.hang_timeout`` when set, else `STEP_MULTIPLE` × the median step time
of this attempt, at least `DEFAULT_FLOOR_S`. The clock starts at the first completed step (the
first one compiles and warms up) and stops during evaluation and checkpoint writes, which are
not steps (the process group's collective timeout still bounds those).

Test hook: ``LMFORGE_TEST_HANG=RANK:STEP[:ATTEMPT[:stop]]`` (several, comma-separated) makes rank
RANK sleep for good right after it completes step STEP (in torchrun attempt ATTEMPT only, when
given) — the only way to show a real hang end to end, and how tests hold a run at a known step
before killing it; with ``stop`` the rank freezes instead (SIGSTOP to itself), as a process stuck in
a driver call does: it can neither dump its stacks nor obey a SIGTERM. Nothing else reads it.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager

from lmforge.distributed.elastic import restart_count
from lmforge.process import sibling_workers

EXIT_HUNG = 4
STEP_MULTIPLE = 20
DEFAULT_FLOOR_S = 300.0
GRACE_S = 2.0  # after dumping, before exiting: the other ranks' watchdogs dump theirs meanwhile
TEST_HOOK = "LMFORGE_TEST_HANG"


def stack_lines(rank: int) -> list[str]:
    """Every thread's Python stack, one line each, prefixed with the rank."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {names.get(ident, ident)} (most recent call last):")
        for entry in traceback.format_stack(frame):
            lines.extend(entry.rstrip("\n").splitlines())
    return [f"[rank {rank}] {ln}\n" for ln in lines]


def hang_line(rank: int, silent_s: float, timeout_s: float, restarts: bool = True) -> str:
    """The one line a hang starts with; it promises a restart only where ``max_retries`` allows one."""
    then = ("exiting so that the run restarts from its latest checkpoint (as max_retries allows)" if restarts else
            "exiting; max_retries is 0, so the run is not restarted (the same command resumes it from its latest "
            "checkpoint)")
    return (f"lmforge: hang detected on rank {rank}: no training step completed for {silent_s:.0f}s "
            f"(compute.hang_timeout {timeout_s:.0f}s); Python stacks of its threads follow; {then}\n")


def dump_and_exit(rank: int, silent_s: float, timeout_s: float, restarts: bool = True) -> None:
    """What a hang does by default: one line, every thread's stack, then exit for a restart.

    The other ranks of this node get `GRACE_S` to dump theirs, then this one kills them (each
    torchrun worker's process group: the rank and its data workers). The run is declared hung: a
    rank still there cannot finish a step, and one stuck in the kernel or a driver call (no Python
    runs, a SIGTERM waits) would otherwise hold torchrun's restart for its 30 s grace and SIGKILL."""
    fd = sys.__stderr__.fileno()
    sys.__stderr__.flush()
    for line in [hang_line(rank, silent_s, timeout_s, restarts), *stack_lines(rank)]:
        os.write(fd, line.encode(errors="replace")[:4000])  # whole, even when another rank writes too
    time.sleep(GRACE_S)
    for pid in sibling_workers():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:  # exited meanwhile (its own watchdog)
            pass
    os._exit(EXIT_HUNG)


class HangWatchdog:
    def __init__(self, timeout_s: float | None, *, rank: int = 0, floor_s: float = DEFAULT_FLOOR_S,
                 multiple: float = STEP_MULTIPLE, on_hang=dump_and_exit):
        self.fixed, self.rank, self.floor_s, self.multiple = timeout_s, rank, floor_s, multiple
        self.on_hang = on_hang
        self._cv = threading.Condition()
        self._last: float | None = None  # when the last step completed (None: not armed yet)
        self._skip_next = False  # the next interval is not a whole step (after a pause)
        self._paused = 0
        self._closed = False
        self._steps: deque[float] = deque(maxlen=100)
        self._thread: threading.Thread | None = None
        self._hang_at = _test_hang(rank)

    def timeout(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if not self._steps:
            return self.floor_s
        return max(self.floor_s, self.multiple * statistics.median(self._steps))

    def beat(self, step: int) -> None:
        """A training step completed (every rank calls it after every step)."""
        now = time.monotonic()
        with self._cv:
            if self._last is not None and not self._skip_next:
                self._steps.append(now - self._last)
            self._last, self._skip_next = now, False
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._watch, name="lmforge-hang-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()
        if self._hang_at is not None and self._hang_at[0] == step:  # the test hook: this rank hangs here
            if self._hang_at[1]:
                os.kill(os.getpid(), signal.SIGSTOP)
            threading.Event().wait()

    @contextmanager
    def paused(self):
        """Evaluation, checkpoint writes: not steps, not timed."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                if self._last is not None:
                    self._last, self._skip_next = time.monotonic(), True
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _watch(self) -> None:
        with self._cv:
            while True:
                if self._closed:
                    return
                if self._last is None or self._paused:
                    self._cv.wait()
                    continue
                remaining = self._last + self.timeout() - time.monotonic()
                if remaining > 0:
                    self._cv.wait(remaining)
                    continue
                silent, timeout = time.monotonic() - self._last, self.timeout()
                break
        self.on_hang(self.rank, silent, timeout)


def _test_hang(rank: int) -> tuple[int, bool] | None:
    """(step, frozen) of the test hook for this rank in this attempt, or None."""
    for spec in filter(None, os.environ.get(TEST_HOOK, "").split(",")):
        r, step, *rest = spec.split(":")
        if int(r) == rank and (not rest or int(rest[0]) == restart_count()):
            return int(step), rest[1:] == ["stop"]
    return None
