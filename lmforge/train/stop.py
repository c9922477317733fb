"""A graceful stop: SIGTERM (what `runs stop` and schedulers send) or a first Ctrl-C asks the run to
checkpoint at the end of its step and stop; a second Ctrl-C aborts at once. Across ranks a stop
asked on any rank stops them all, agreed on by an all-reduce (which waits for the device): at log
steps, and at least every STOP_CHECK_STEPS steps — the same steps on every rank."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import torch

from lmforge.distributed.dist import DistInfo, any_rank

STOP_CHECK_STEPS = 10


class GracefulStop:
    def __init__(self, dist: DistInfo, log_interval: int, log):
        self.dist, self.log = dist, log
        self.every = min(log_interval, STOP_CHECK_STEPS)
        self.asked = False

    @contextmanager
    def handling_signals(self):
        """While the run trains (and finishes: the final evaluation and export complete)."""
        def ask(signum, frame):
            if self.asked:
                raise KeyboardInterrupt
            self.asked = True
            self.log("stop requested: saving a checkpoint after this step (Ctrl-C again to abort)")

        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        old = {s: signal.signal(s, ask) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def requested(self, step: int, device: torch.device) -> bool:
        """Whether to stop after ``step``: one process, its own flag every step; several ranks, any
        rank's, at the agreed steps."""
        if not self.dist.distributed:
            return self.asked
        if step % self.every:
            return False
        return any_rank(self.asked, device)
