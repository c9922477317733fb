"""Fault injection: ``LMFORGE_FAULT`` makes a healthy run fail in a chosen way (docs/goodput.md).

A list of faults separated by ``,``; each is a kind followed by ``:key=value`` options::

    LMFORGE_FAULT="slow:node=node1:local_rank=0:factor=2:from=5,xid:node=node1:step=12:code=79"

kinds (``step``: after which training step it fires; ``from``: from which step on):

- ``slow`` (``factor``, default 2; ``from``, default 1): the rank's forward and backward take
  ``factor`` × as long (it sleeps for the difference), as a throttled or degraded GPU does;
- ``stop`` (``step``): the rank freezes (SIGSTOP), as a process stuck in a driver call does;
- ``kill`` (``step``): the rank dies (SIGKILL);
- ``xid`` (``step``, ``code``, default 79): the node's health source reports that XID;
- ``diag`` (``factor``, default 4): the node's devices run the diagnostic matmul ``factor`` × slower;
- ``nan`` (``step``): the weights become NaN after that step (the next loss is NaN).

Targets: ``rank=R`` (a global rank), or ``node=NAME`` (`process.node_name`; its ranks, or the one
with ``local_rank=L``); none: rank 0. ``stop``, ``kill``, ``xid`` and ``nan`` fire once per run:
each firing is recorded in ``<save_folder>/faults.jsonl`` (with its time: the fault bench measures
detection from it), and a resumed run does not fire it again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass

from lmforge.errors import UserError
from lmforge.goodput.ledger import read_jsonl

FAULT_ENV = "LMFORGE_FAULT"
FAULTS_FILE = "faults.jsonl"
KINDS = {"slow": {"factor": 2.0, "from": 1}, "stop": {"step": 1}, "kill": {"step": 1},
         "xid": {"step": 1, "code": 79}, "diag": {"factor": 4.0}, "nan": {"step": 1}}
TARGETS = ("rank", "node", "local_rank")
ONCE = ("stop", "kill", "xid", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    options: tuple[tuple[str, float | int], ...]
    rank: int | None = None
    node: str | None = None
    local_rank: int | None = None

    def get(self, key: str) -> float:
        return dict(self.options).get(key, KINDS[self.kind][key])

    def hits(self, rank: int, local_rank: int, node: str) -> bool:
        if self.node is not None:
            return self.node == node and self.local_rank in (None, local_rank)
        return rank == (0 if self.rank is None else self.rank)

    def key(self) -> str:
        return ":".join([self.kind, *(f"{k}={v}" for k, v in self.options),
                         *(f"{t}={getattr(self, t)}" for t in TARGETS if getattr(self, t) is not None)])


INTEGER_KEYS = ("step", "from", "code")  # steps and XIDs are whole numbers ≥ 1; factors finite numbers ≥ 1


def parse_faults(text: str | None) -> list[Fault]:
    """The faults of an ``LMFORGE_FAULT`` value; UserError naming the part that is wrong. Steps,
    ranks and XIDs are whole numbers (``step=1.5`` is refused, not truncated), steps and XIDs ≥ 1,
    ranks ≥ 0; factors are finite and ≥ 1 (``nan`` would never slow, ``inf`` never end a step). That a
    rank exists is checked once the run's size is known (`check_faults`)."""
    out = []
    for spec in filter(None, (s.strip() for s in (text or "").split(","))):
        kind, *pairs = spec.split(":")
        if kind not in KINDS:
            raise UserError(f"{FAULT_ENV}: unknown fault {kind!r} in {spec!r}; expected one of {', '.join(KINDS)}")
        options, targets = {}, {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or (key not in KINDS[kind] and key not in TARGETS):
                allowed = ", ".join([*KINDS[kind], *TARGETS])
                raise UserError(f"{FAULT_ENV}: {pair!r} in {spec!r} is not KEY=VALUE with KEY one of {allowed}")
            if key in options or key in targets:
                raise UserError(f"{FAULT_ENV}: {key} given twice in {spec!r}")
            if key == "node":
                if not value:
                    raise UserError(f"{FAULT_ENV}: {pair!r} in {spec!r}: expected a node name")
                targets[key] = value
            elif key in TARGETS or key in INTEGER_KEYS:
                low = 0 if key in TARGETS else 1
                try:
                    number = int(value)
                except ValueError:
                    number = None
                if number is None or number < low:
                    what = "a rank (a whole number, 0 or more)" if key in TARGETS else \
                        f"a whole number, at least 1 ({'an XID' if key == 'code' else 'a training step'})"
                    raise UserError(f"{FAULT_ENV}: {pair!r} in {spec!r}: expected {what}")
                (targets if key in TARGETS else options)[key] = number
            else:  # factor
                try:
                    number = float(value)
                except ValueError:
                    number = math.nan
                if not math.isfinite(number) or number < 1:
                    raise UserError(f"{FAULT_ENV}: {pair!r} in {spec!r}: expected a finite number, at least 1 "
                                    "(how many times slower)")
                options[key] = number
        out.append(Fault(kind, tuple(sorted(options.items())), **targets))
    return out


def check_faults(faults: list[Fault], world_size: int) -> None:
    """Each fault's rank exists in a run of ``world_size`` ranks (a node's local rank too: a node has at
    most that many); a node name is only known once the run starts, and is not checked. Checked when
    the user's command starts the run (`runs.preflight`), not at each resumption: one that a cordon
    left with fewer ranks goes on without a fault whose rank is gone."""
    for f in faults:
        for key in ("rank", "local_rank"):
            value = getattr(f, key)
            if value is not None and value >= world_size:
                raise UserError(f"{FAULT_ENV}: {key}={value} in {f.key()!r}: the run has {world_size} rank"
                                f"{'' if world_size == 1 else 's'} (0 to {world_size - 1})")


class Injector:
    """The faults of ``LMFORGE_FAULT`` that hit this rank, fired from the training loop."""

    def __init__(self, faults: list[Fault], *, rank: int, local_rank: int, node: str, folder: str | None,
                 health=None):
        self.mine = [f for f in faults if f.hits(rank, local_rank, node)]
        self.rank, self.node, self.folder = rank, node, folder
        self.health = health  # the node's InjectedHealth (its first rank's), for xid faults
        self._fired = fired(folder)

    @property
    def active(self) -> bool:
        return bool(self.mine)

    def slow_factor(self, step: int) -> float:
        """How many times longer this rank's compute takes at ``step`` (1.0: not slowed)."""
        return max([f.get("factor") for f in self.mine if f.kind == "slow" and step >= f.get("from")], default=1.0)

    def diag_factor(self) -> float:
        return max([f.get("factor") for f in self.mine if f.kind == "diag"], default=1.0)

    def after_step(self, step: int) -> bool:
        """Fire what is due after ``step``; True when the weights are to become NaN now."""
        nan = False
        for f in self.mine:
            if f.kind not in ONCE or int(f.get("step")) != step or f.key() in self._fired:
                continue
            self._record(f, step)
            if f.kind == "xid" and self.health is not None:
                self.health.report(xid=int(f.get("code")))
            elif f.kind == "nan":
                nan = True
            elif f.kind in ("stop", "kill"):
                os.kill(os.getpid(), signal.SIGSTOP if f.kind == "stop" else signal.SIGKILL)
        return nan

    def _record(self, f: Fault, step: int) -> None:
        self._fired.add(f.key())
        if self.folder is None:
            return
        rec = {"time": round(time.time(), 3), "fault": f.key(), "kind": f.kind, "rank": self.rank, "node": self.node,
               "step": step}
        with open(os.path.join(self.folder, FAULTS_FILE), "a") as out:
            out.write(json.dumps(rec) + "\n")
            out.flush()


def fired(folder: str | None) -> set[str]:
    """The once-only faults already fired in this run."""
    return {r["fault"] for r in read_faults(folder)}


def read_faults(folder: str | None) -> list[dict]:
    return read_jsonl(os.path.join(folder, FAULTS_FILE)) if folder else []
