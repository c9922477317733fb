"""One training job: what a supervised child, each torchrun rank, or an unsupervised run executes.

A process whose launch plan (`runs.plan`) says "train" runs `run_job`: it wires the operations
around the core trainer — the save folder's lock, credentials, the process group, the trackers
and the object-store mirror of a remote save folder — and trains:

    lock → secrets → process group → resolve (data, plan) → Trainer(callbacks=[trackers, store]) → fit

One whose plan says "launch" runs `launch`: it becomes torchrun (``exec``), whose ranks come
back here with plan "train". `lmforge train` and `lmforge finetune` (and so the SDK) end up here.
"""

from __future__ import annotations

import os
import sys
import tempfile
from functools import partial

from lmforge import secrets
from lmforge.config.schema import RunConfig
from lmforge.data.remote import join as remote_join
from lmforge.distributed.dist import destroy, init_distributed
from lmforge.distributed.elastic import restart_count
from lmforge.distributed.torchrun import torchrun_command, wait_for_endpoint
from lmforge.errors import UserError, environment_error
from lmforge.goodput.cordon import CORDON_FILE, read_cordon
from lmforge.say import say
from lmforge.process import die_with_parent, node_name
from lmforge.runs.lock import SaveFolderLock
from lmforge.runs.plan import LaunchPlan, with_plan
from lmforge.runs.store import MirrorCallback, local_folder, open_store
from lmforge.report import write_run_report
from lmforge.resolve import resolve
from lmforge.runs.registry import RegistryIndex
from lmforge.runs.supervisor import report_status
from lmforge.tracking import TrackingCallback, mlflow_ui_command
from lmforge.train.machine import process_machine
from lmforge.train.trainer import Trainer, TrainResult


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
                           rejoin=rejoin)
    if plan.nproc > 1:  # torchrun's own default for several ranks per node, set here without its 4-line banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if lock is not None:
        lock.inheritable()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 1  # not reached


def run_job(cfg: RunConfig, plan: LaunchPlan | None = None, *, overwrite: bool = False, log=print) -> TrainResult:
    """Role "train": train (pretraining, continued pretraining or fine-tuning, by ``cfg.task_type``) here."""
    plan = plan or LaunchPlan("train", lock="none")
    cfg = resolve(cfg, until="config").config  # names filled (a config built in-process may leave them out)
    if plan.parent_pid:
        die_with_parent(plan.parent_pid)  # a torchrun rank: die with torchrun
    lock = hold_lock(cfg, plan)
    if lock is not None and int(os.environ.get("RANK", "0")) == 0:
        lock.keep_fresh()
    report_status(plan, "started", attempt=restart_count())
    secrets.apply(cfg)  # credentials named by `secrets:` → this process's environment
    log = secrets.redacting(log)
    dist = init_distributed(cfg.compute.device)
    store = None
    try:
        silent = lambda *_: None  # noqa: E731 - other ranks print nothing
        run = resolve(cfg, process_machine(dist), log=log if dist.is_main else silent)
        callbacks = []
        if dist.is_main:
            callbacks.append(TrackingCallback(cfg.experiment_tracker,
                                              render_report=partial(write_run_report, index=RegistryIndex())))
            store = open_store(cfg, log)  # None for a local save_folder
            if store is not None:
                callbacks.append(MirrorCallback(store))
        trainer = Trainer(run, dist, save_folder=local_folder(cfg.save_folder), callbacks=callbacks,
                          overwrite=overwrite, log=log)
        result = trainer.fit()
    except (UserError, OSError) as e:
        # A full disk or a read-only / forbidden save folder is the user's to fix, like bad input:
        # reported as one line and never retried.
        err = e if isinstance(e, UserError) else environment_error(e, where=f"save_folder {cfg.save_folder}")
        if err is None:
            raise
        # Recorded and said now, not at exit after the teardown below: with several nodes, a node that
        # stops first can take the rendezvous with it, and this node's torchrun then stops this rank
        # mid-teardown. The status first (one small file): without it the supervisor sees only
        # torchrun's exit code and takes bad input for a crash.
        report_status(plan, "failed", error=secrets.redact(str(err)), exit_code=err.exit_code, attempt=restart_count(),
                      pid=os.getpid())
        say(err)
        if err is e:
            raise
        raise err from None
    finally:
        trainer = None  # its model holds the process group: dropped first (see `destroy`)
        destroy()  # (the lock is held until this process exits: the kernel lets it go then)
    if store is not None and result.final_dir:
        result.final_dir = remote_join(cfg.save_folder, "final")  # the store's copy, not the staging one
    result.mlflow_ui = mlflow_ui_command(cfg.experiment_tracker)
    if result.reshape is not None:  # a goodput condition: the supervisor resumes on the nodes left
        report_status(plan, "reshape", step=result.step, attempt=restart_count(), **result.reshape)
    else:
        report_status(plan, result.status, step=result.step, tokens=result.tokens, attempt=restart_count())
    return result
