"""One training job: what a supervised child, each torchrun rank, or an unsupervised run executes.

A process whose launch plan (`runs.launch_plan`) says "train" runs `run_job`: it wires the operations
around the core trainer — the save folder's lock, credentials, the process group, the trackers
and the object-store mirror of a remote save folder — and trains:

    lock → secrets → process group → resolve (data, plan) → Trainer(callbacks=[trackers, store]) → fit

One whose plan says "launch" runs `runs.launcher.launch` instead: it becomes torchrun, whose ranks
come back here with plan "train". `lmforge train` and `lmforge finetune` (and so the SDK) end up here.
"""

from __future__ import annotations

import os
from functools import partial

from lmforge import secrets
from lmforge.config.schema import RunConfig
from lmforge.data.remote import join as remote_join
from lmforge.distributed.dist import destroy, init_distributed, peer_lost
from lmforge.distributed.elastic import restart_count
from lmforge.errors import UserError, environment_error
from lmforge.say import say
from lmforge.process import die_with_parent, mark, process_started_at
from lmforge.runs.launcher import hold_lock
from lmforge.runs.launch_plan import LaunchPlan
from lmforge.runs.store import MirrorCallback, local_folder, open_store
from lmforge.report import write_run_report
from lmforge.resolve import resolve
from lmforge.runs.registry import RegistryIndex
from lmforge.runs.supervisor import report_status
from lmforge.tracking import TrackingCallback, mlflow_ui_command
from lmforge.train.machine import process_machine
from lmforge.train.build import build_trainer
from lmforge.train.trainer import TrainResult


class PeerLost(RuntimeError):
    """This rank's collective failed because another rank ended: said in one line (`lost_peer_line`),
    its traceback kept in the run's log folder, and the restart left to torchrun or the supervisor."""


def lost_peer_line(e: BaseException, rank: int, folder: str) -> str:
    """One line for a rank whose peer ended; the traceback goes to ``<folder>/logs/rank<R>.traceback``."""
    import traceback

    first = (str(e).strip().splitlines() or [""])[0]
    where = os.path.join(folder, "logs", f"rank{rank}.traceback")
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with open(where, "w") as f:
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        where = "not kept (the log folder cannot be written)"
    return f"lmforge: rank {rank}: a peer rank ended ({type(e).__name__}: {first[:160]}); traceback: {where}"


def run_job(cfg: RunConfig, plan: LaunchPlan | None = None, *, overwrite: bool = False, log=print) -> TrainResult:
    """Role "train": train (pretraining, continued pretraining or fine-tuning, by ``cfg.task_type``) here."""
    mark("imported")
    plan = plan or LaunchPlan("train", lock="none")
    named = resolve(cfg, until="config")  # names filled (a config built in-process may leave them out)
    cfg = named.config  # the lock and the credentials come before the data (which they may need)
    if plan.parent_pid:
        die_with_parent(plan.parent_pid)  # a torchrun rank: die with torchrun
    lock = hold_lock(cfg, plan)
    if lock is not None and int(os.environ.get("RANK", "0")) == 0:
        lock.keep_fresh()
    report_status(plan, "started", attempt=restart_count(), started_at=process_started_at())
    secrets.apply(cfg)  # credentials named by `secrets:` → this process's environment
    log = secrets.redacting(log)
    dist = init_distributed(cfg.compute.device)
    mark("joined")
    store = None
    try:
        silent = lambda *_: None  # noqa: E731 - other ranks print nothing
        run = resolve(named, process_machine(dist), log=log if dist.is_main else silent)
        cfg = run.config  # from here on: the resolved run's
        mark("resolved")
        callbacks = []
        if dist.is_main:
            callbacks.append(TrackingCallback(cfg.experiment_tracker,
                                              render_report=partial(write_run_report, index=RegistryIndex())))
            store = open_store(cfg, log)  # None for a local save_folder
            if store is not None:
                callbacks.append(MirrorCallback(store))
        trainer = build_trainer(run, dist, save_folder=local_folder(cfg.save_folder), callbacks=callbacks,
                                overwrite=overwrite, log=log)
        mark("built")  # the model, its data and its checkpoint loaded
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
    except Exception as e:
        if not (dist.distributed and peer_lost(e)):
            raise
        line = lost_peer_line(e, dist.rank, local_folder(cfg.save_folder))
        raise PeerLost(line) from None
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
