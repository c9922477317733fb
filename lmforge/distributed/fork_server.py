"""Imported first by a node's fork server (`distributed.torchrun.start_fork_server`), in that process:
the server dies with torchrun, which started it.

multiprocessing's fork server lives while any process it forked lives (each holds its end of the
server's "alive" pipe), and a forked rank dies with its parent, the server: without this, a SIGKILL of
torchrun (or of the supervisor above it) would leave the server and the ranks running. The kernel ends
the server when torchrun ends; each rank then ends with the server (`process.die_with_parent`).
"""

import os

from lmforge.process import die_with_parent, name_process

die_with_parent(int(os.environ.get("LMFORGE_FORKSERVER_PARENT", "0")) or None)
name_process("lmforge-forks")
