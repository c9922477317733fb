"""Imported by the fork server of the local executor's process pool, and by nothing else (``runner``
names it as the server's preload module).

Every task process the server forks announces itself before it can take any work: a file named by
its pid in the folder ``runner`` watches, holding its start time, so that a task that dies at any
moment, even a moment after it took its work, is noticed. The server dies with the runner and
each task process with the server: a pool still repopulating itself while the runner ends leaves
nothing behind.
"""

from __future__ import annotations

import os

from multiprocess import util

from lmforge.data.prepare.runner import ANNOUNCE, RUNNER
from lmforge.process import die_with_parent, process_start

_SERVER = os.getpid()


class _Announcer:
    """What the after-fork hook hangs on (multiprocess keeps its hooks by a weak reference to an object)."""


_ANNOUNCER = _Announcer()


def _announce(_) -> None:
    die_with_parent(_SERVER)
    with open(os.path.join(os.environ[ANNOUNCE], str(os.getpid())), "w") as f:
        f.write(process_start(os.getpid()) or "")


die_with_parent(int(os.environ[RUNNER]))
util.register_after_fork(_ANNOUNCER, _announce)
