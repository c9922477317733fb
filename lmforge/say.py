"""How a user's error reaches the terminal: one line, once, with no secret in it.

The edges that print call it — the CLI for every command, and a training rank before its
teardown (`runs.job`). `errors` only defines the exception; masking secrets is done here, at
the edge, so that the lowest layer knows nothing of them.
"""

from __future__ import annotations

import sys

from lmforge.errors import PeerUserError, UserError
from lmforge.process import speaks_for_node
from lmforge.secrets import redact


def say(e: UserError) -> None:
    """The error's one line on stderr, once (a training rank says it before its teardown, the CLI
    otherwise), with no secret in it, whatever raised it; rank 0's error raised on other ranks
    only by the process that speaks for a node."""
    if not e.said and (not isinstance(e, PeerUserError) or speaks_for_node()):
        sys.stderr.write(f"error: {redact(str(e))}\n")
        sys.stderr.flush()
    e.said = True
