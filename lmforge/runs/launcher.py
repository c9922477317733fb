"""Role "launch": the process that becomes torchrun for a run's ranks on this node.

It runs between the supervisor and the ranks (and again after each supervised restart), so it
stays light: no torch, no trainer — those load in the ranks, which come back to `runs.job` with
plan "train".
"""

from __future__ import annotations

import os
import sys
import tempfile

from lmforge.config.schema import RunConfig
from lmforge.distributed.elastic import EVENTS_FILE
from lmforge.distributed.torchrun import torchrun_command, wait_for_endpoint
from lmforge.errors import UserError
from lmforge.goodput.cordon import CORDON_FILE, read_cordon
from lmforge.process import die_with_parent, node_name
from lmforge.runs.lock import SaveFolderLock
from lmforge.runs.launch_plan import LaunchPlan, with_plan
from lmforge.runs.store import local_folder


# What a rank imports before it trains: a node's fork server imports them once, and torchrun forks the
# node's ranks from it — at the first start and at every restart (`distributed.torchrun.start_fork_server`).
# torch._dynamo too: lmforge imports it lazily, but building the model imports it (torch's `normal_` under
# a device context is dynamo-disabled): 1.5-2 s of every rank's start on an idle core.
RANK_MODULES = ("lmforge.cli.main", "lmforge.cli.train", "lmforge.runs.job", "lmforge.train.build",
                "lmforge.resolve.steps", "lmforge.train.machine", "torch._dynamo")


def hold_lock(cfg: RunConfig, plan: LaunchPlan) -> SaveFolderLock | None:
    """Claim (first process of an unsupervised run) or join (the supervisor claimed it) the lock."""
    if plan.lock == "none":
        return None
    folder = local_folder(cfg.save_folder)
    if plan.lock == "claim":
        return SaveFolderLock.claim(folder, run_uid=plan.run_uid, name=cfg.name)
    return SaveFolderLock.join(folder, plan.run_uid)


def launch(cfg: RunConfig, plan: LaunchPlan, argv: list[str]) -> int:
    """Role "launch": become torchrun for ``plan.nproc`` ranks per node (never returns on success).

    exec keeps this process's pid, its death signal and the save folder's lock: torchrun holds
    the lock, dies with the supervisor, and passes SIGTERM / SIGINT on to every rank."""
    if plan.parent_pid:
        die_with_parent(plan.parent_pid)
    cordoned = read_cordon(local_folder(cfg.save_folder)).get(node_name())
    if cordoned and cfg.compute.nodes > 1:
        raise UserError(f"this node ({node_name()}) is cordoned for run {cfg.name} since step {cordoned.get('step')}: "
                        f"{cordoned.get('reason')}; it does not join (remove it from "
                        f"{os.path.join(local_folder(cfg.save_folder), CORDON_FILE)} once it is serviced)")
    if cfg.compute.nodes > 1 and cfg.compute.node_rank > 0:
        wait_for_endpoint(cfg.compute.rdzv_endpoint, cfg.compute.rdzv_timeout_s)
    lock = hold_lock(cfg, plan)
    watch = None
    if not plan.supervised:  # no supervisor to stop torchrun's restarts at bad input: its wrapper does
        fd, watch = tempfile.mkstemp(prefix="lmforge-status-", suffix=".json")
        os.close(fd)
    rank = plan.child("train", lock="none" if lock is None else "join", status_file=plan.status_file or watch)
    max_restarts = cfg.max_retries if plan.max_restarts is None else plan.max_restarts
    # A node other than node 0 rejoins the run after a goodput action by itself (its supervisor is node 0's);
    # never with --overwrite: rank 0 may be on this node, and the run's checkpoints are what it resumes from.
    rejoin = [a for a in argv if a != "--overwrite"] if watch and cfg.compute.node_rank > 0 else None
    cmd = torchrun_command(cfg, plan.nproc, with_plan(argv, rank), max_restarts=max_restarts, status_file=watch,
                           rejoin=rejoin, events_file=os.path.join(local_folder(cfg.save_folder), EVENTS_FILE),
                           preload=RANK_MODULES)
    if plan.nproc > 1:  # torchrun's own default for several ranks per node, set here without its 4-line banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if lock is not None:
        lock.inheritable()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 1  # not reached
