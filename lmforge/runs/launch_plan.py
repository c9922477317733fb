"""What this `lmforge train` / `finetune` process is, decided once: the launch plan.

One run is a small tree of processes, all running the same command line::

    lmforge train -f run.yaml          role "supervise": registers the run, claims its save folder,
    │                                  restarts the trainer after a crash (``runs.supervisor``)
    └─ lmforge train … --plan {…}      role "train": trains here (one process), or
       │                               role "launch": becomes torchrun (several ranks, exec)
       └─ lmforge train … --plan {…}   role "train", one per rank (torchrun's workers)

``--detach`` adds a first process with role "detach": it starts the supervisor in the background
and returns. ``--no-supervisor`` (and every node but node 0 of a multi-node run) skips the
supervisor: the first process launches or trains itself.

A parent tells its child what it is with the hidden ``--plan JSON`` option (a `LaunchPlan`), which
torchrun passes on to every rank untouched. Nothing else travels between the processes:
no environment variables, except those torchrun itself sets (``RANK``, ``WORLD_SIZE``, …).
A command the user types has no ``--plan``: `launch_plan` decides from the arguments and the
config (and ``WORLD_SIZE``, for a torchrun the user started by hand).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, fields, replace

from lmforge.distributed.torchrun import needs_launch  # (imports torch only when called)
from lmforge.errors import UserError

ROLES = ("detach", "supervise", "launch", "train")
LOCKS = ("claim", "join", "none")
PLAN_FLAG = "--plan"


def new_run_uid() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class LaunchPlan:
    role: str  # detach | supervise | launch | train (see the module docstring)
    run_uid: str | None = None  # the run this process belongs to
    lock: str = "claim"  # the save folder's lock: claim it (first process), join the run's, or none (other nodes)
    nproc: int | None = None  # ranks per node: None = train in one process, N = start torchrun with N
    max_restarts: int | None = None  # launch: torchrun --max-restarts (what is left of max_retries)
    status_file: str | None = None  # where each node's first rank reports how training ended: to the
    # supervisor, or (a rank of an unsupervised run) to the torchrun wrapper; a launcher's is its supervisor's
    parent_pid: int | None = None  # who started this process (it dies with it)
    detached: bool = False  # supervise: in the background (no terminal; output in supervisor.log)
    reason: str = "train"  # supervise: train | restart — what the registry records as the cause

    def to_arg(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v != _DEFAULTS[k]}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_arg(cls, text: str) -> "LaunchPlan":
        try:
            d = json.loads(text)
            plan = cls(**d)
        except (ValueError, TypeError) as e:
            raise UserError(f"{PLAN_FLAG}: not a launch plan ({e}); it is set by lmforge for the processes it "
                            "starts, not by hand") from None
        if plan.role not in ROLES or plan.lock not in LOCKS:
            raise UserError(f"{PLAN_FLAG}: unknown role {plan.role!r} or lock {plan.lock!r}")
        return plan

    def child(self, role: str, **changes) -> "LaunchPlan":
        """The plan of a process this one starts (the same run)."""
        return replace(self, role=role, parent_pid=os.getpid(), **changes)

    @property
    def supervised(self) -> bool:
        """For a launcher (before it hands its ranks a status file of their own)."""
        return self.status_file is not None


_DEFAULTS = {f.name: f.default for f in fields(LaunchPlan)}


def started_by_user(args, environ=os.environ) -> bool:
    """This process is the one the user started (no plan from a parent; rank 0 of a hand-made torchrun)."""
    return not getattr(args, "plan", None) and environ.get("RANK", "0") == "0"


def launch_plan(args, cfg, environ=os.environ) -> LaunchPlan:
    """The plan of this process: the one its parent gave it, or the one a user's command implies."""
    if getattr(args, "plan", None):
        plan = LaunchPlan.from_arg(args.plan)
        # A supervisor (detached, or restarted later) sizes the run itself: the machine may have changed.
        return replace(plan, nproc=needs_launch(cfg)) if plan.role == "supervise" else plan
    if "WORLD_SIZE" in environ:  # a worker of a torchrun the user started by hand
        rank0 = started_by_user(args, environ) and cfg.compute.node_rank == 0
        return LaunchPlan("train", run_uid=new_run_uid() if rank0 else None, lock="claim" if rank0 else "none")
    nproc = needs_launch(cfg)  # several GPUs, compute.ranks or several nodes → torchrun (mesh checked here)
    no_supervisor = bool(getattr(args, "no_supervisor", False) or environ.get("LMFORGE_NO_SUPERVISOR"))
    other_node = cfg.compute.node_rank > 0  # node 0's supervisor counts restarts; torchrun's agents follow
    if getattr(args, "detach", False) and (no_supervisor or other_node):
        raise UserError("--detach runs the supervisor in the background; it cannot be combined with "
                        "--no-supervisor or a node rank other than 0")
    if not (no_supervisor or other_node):
        return LaunchPlan("detach" if getattr(args, "detach", False) else "supervise", nproc=nproc)
    return LaunchPlan("launch" if nproc else "train", run_uid=new_run_uid(), lock="none" if other_node else "claim",
                      nproc=nproc, max_restarts=cfg.max_retries if nproc else None)


def with_plan(argv: list[str], plan: LaunchPlan) -> list[str]:
    """``argv`` with its ``--plan`` (if any) replaced by ``plan``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == PLAN_FLAG:
            skip = True
            continue
        if a.startswith(PLAN_FLAG + "="):
            continue
        out.append(a)
    return out + [PLAN_FLAG, plan.to_arg()]
