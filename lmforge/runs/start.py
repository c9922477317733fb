"""Start a run from `lmforge train`: name it, claim its save folder, register it, supervise it.

**Names** are unique in the registry, as in the managed product: a name taken by another run
gets a short suffix (``pretrain`` → ``pretrain-3fa2``), except when the same command runs again
on the same save folder — that continues the run (a new resumption, same ``run_uid``). A run
whose local save folder is gone no longer holds its name. The save folder a config leaves to
its default (``runs/<name>``) follows the name asked for, so re-running the same command keeps
finding the same folder, suffix or not.

``lmforge train -f X`` then claims the save folder's lock (`runs.lock`: refused while a process
of an earlier run of that folder is alive), registers the run and supervises the trainer in the
foreground. ``--detach`` checks the same things, starts the supervisor in its own session (output
in ``<logs>/supervisor.log``), waits until it has registered the run (so a bad config or a busy
folder is still reported here), prints the name and returns.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from functools import partial

from lmforge.config.schema import FINETUNE_TASKS
from lmforge.config.identity import default_name, run_identity
from lmforge.run_files import is_variant
from lmforge.data.remote import is_remote
from lmforge.distributed.torchrun import exit_now
from lmforge.errors import UserError
from lmforge.home import lmforge_home
from lmforge.process import process_start, this_host
from lmforge.runs.lock import SaveFolderLock, probe
from lmforge.runs.launch_plan import LaunchPlan, new_run_uid, with_plan
from lmforge.runs.registry import ACTIVE, Registry
from lmforge.runs.store import local_folder, upload_logs
from lmforge.runs.supervisor import EXIT_USER_ERROR, Supervisor
from lmforge.secrets import redact, redact_config
from lmforge.run_files import list_checkpoints, read_run_file


@dataclass
class RunSlot:
    """Where a starting run goes: its registry name, folders and id, and the entry it continues."""

    name: str
    save_folder: str
    log_dir: str
    run_uid: str
    existing: dict | None = None  # the registry entry of this same run (a new resumption), if any
    replaces: dict | None = None  # an entry of that name whose save folder is gone (dropped)


def run_paths(cfg, name: str) -> tuple[str, str]:
    """(save folder, log folder). Logs of a run saved to an object store are kept locally (and
    uploaded to ``<save_folder>/logs`` after each resumption)."""
    save = cfg.save_folder or os.path.join("runs", name)
    if is_remote(save):
        return save, os.path.join(lmforge_home(), "runs", name, "logs")
    save = os.path.abspath(save)
    return save, os.path.join(save, "logs")


def identity(cfg, name: str, save_folder: str) -> dict:
    """The run identity (`config.identity.run_identity`) and where the run is saved."""
    return run_identity(cfg.model_copy(update={"name": name})) | {"save_folder": save_folder}


def model_label(cfg) -> str:
    m = cfg.model
    if m == "auto":
        return "auto"
    if m.preset:
        return m.label()
    return f"custom {m.n_layers}×{m.d_model}" + (f" moe{m.n_experts}" if m.n_experts else "")


def child_argv(args, name: str, save_folder: str, *, first: bool) -> list[str]:
    """The `lmforge train` argv the supervisor runs. Retries and restarts leave out
    --overwrite and --no-autoresume: they must continue from this run's checkpoints."""
    argv = [getattr(args, "command", None) or "train"]  # `train` or `finetune`
    if args.file:
        argv += ["-f", os.path.abspath(args.file)]
    for flag, attr in (("--model", "model"), ("--weights", "weights"), ("--training-duration", "training_duration"),
                       ("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--rdzv-endpoint", "rdzv_endpoint"),
                       ("--max-retries", "max_retries"), ("--price-per-gpu-hour", "price_per_gpu_hour")):
        if getattr(args, attr, None) is not None:
            argv += [flag, str(getattr(args, attr))]
    for path in args.train_data or []:
        argv += ["--train-data", path]
    for item in args.set or []:
        argv += ["--set", item]
    argv += ["--name", name, "--save-folder", save_folder]
    if args.json:
        argv.append("--json")
    if first and args.overwrite:
        argv.append("--overwrite")
    if first and args.no_autoresume:
        argv.append("--no-autoresume")
    return argv


# --------------------------------------------------------------------------- names

def _name_in_folder(save_folder: str) -> str | None:
    """The run name recorded in a (local or staging) save folder's run.json, if any."""
    name = ((read_run_file(local_folder(save_folder)) or {}).get("identity") or {}).get("name")
    return name if isinstance(name, str) else None


def _folder_gone(save_folder: str | None) -> bool:
    return bool(save_folder) and not is_remote(save_folder) and not os.path.isdir(save_folder)


def resolve_run(reg: Registry, cfg, run_uid: str | None = None) -> RunSlot:
    """The name, folders and id of the run `cfg` starts (see the module docstring for the rules)."""
    requested = default_name(cfg)
    save, logs = run_paths(cfg, requested)
    # 1. This folder already holds a run of that name (maybe suffixed): the same run continues.
    for row in reg.saved_in(save):
        if is_variant(row["name"], requested):
            row = reg.mark_lost_if_dead(row)
            return RunSlot(row["name"], save, row["log_dir"] or logs, row["run_uid"] or new_run_uid(), existing=row)
    in_folder = _name_in_folder(save)
    name = in_folder if in_folder and is_variant(in_folder, requested) else requested
    if name != requested:
        logs = run_paths(cfg, name)[1]
    # 2. The name is free, or its run's save folder is gone: take it.
    row = reg.get(name, details=False)
    row = reg.mark_lost_if_dead(row) if row else None
    uid = run_uid or new_run_uid()
    if row is None:
        return RunSlot(name, save, logs, uid)
    if row["status"] not in ACTIVE and _folder_gone(row["save_folder"]):
        return RunSlot(name, save, logs, uid, replaces=row)
    # 3. The name belongs to another run: a unique variant (the save folder stays as given).
    while reg.get(name, details=False) is not None:
        name = f"{requested}-{secrets.token_hex(2)}"
    return RunSlot(name, save, run_paths(cfg, name)[1] if is_remote(save) else logs, uid)


def check_not_active(slot: RunSlot) -> None:
    run = slot.existing
    if run and run["status"] in ACTIVE:
        raise UserError(f"run {slot.name!r} is already {run['status']} (supervisor pid {run['supervisor_pid']} "
                        f"on {run['host']}); follow it with `lmforge runs logs {slot.name} --follow` or stop it "
                        f"with `lmforge runs stop {slot.name}`")


def register(reg: Registry, cfg, args, slot: RunSlot, plan: LaunchPlan) -> None:
    """Record the run for this process (the supervisor): a new entry or a new resumption."""
    compute = cfg.compute
    fields = {
        "run_uid": slot.run_uid,
        "run_type": "finetune" if cfg.task_type in FINETUNE_TASKS else "pretrain",
        "status": "STARTING", "reason": None, "started_at": time.time(),
        "completed_at": None, "model": model_label(cfg), "config": redact_config(cfg.model_dump(mode="json")),
        "identity": identity(cfg, slot.name, slot.save_folder), "save_folder": slot.save_folder,
        "log_dir": slot.log_dir, "command": [redact(a) for a in child_argv(args, slot.name, slot.save_folder, first=False)],
        "cwd": os.getcwd(), "host": this_host(), "supervisor_pid": os.getpid(),
        "supervisor_start": process_start(os.getpid()), "child_pid": None,
        "ranks": compute.ranks or (compute.gpus * compute.nodes if isinstance(compute.gpus, int) else None),
        "max_retries": cfg.max_retries,
    }
    how = plan.reason
    if slot.replaces:
        reg.replace(slot.name, fields | {"metrics": None}, event=(
            "created", f"registered by `lmforge {how}` (an earlier run of this name, saved in "
                       f"{slot.replaces['save_folder']}, has no save folder any more)"))
    elif slot.existing is None:
        reg.put(slot.name, fields | {"metrics": None}, event=("created", f"registered by `lmforge {how}`"))
    else:
        old = slot.existing
        reg.put(slot.name, fields, event=("resumed", f"started again by `lmforge {how}` (was {old['status']}"
                                          + (f": {old['reason']})" if old["reason"] else ")")))


# --------------------------------------------------------------------------- starting

def start(cfg, args, plan: LaunchPlan) -> int:
    """Role "supervise": register the run and supervise it here; role "detach": in the background."""
    reg = Registry()
    slot = resolve_run(reg, cfg, run_uid=plan.run_uid)
    check_not_active(slot)
    if plan.role == "detach":
        return detach(reg, args, slot, plan)
    local = local_folder(slot.save_folder)
    lock = SaveFolderLock.claim(local, run_uid=slot.run_uid, name=slot.name)
    try:
        register(reg, cfg, args, slot, plan)
        after = None
        if is_remote(slot.save_folder):
            store = cfg.object_store
            after = partial(upload_logs, slot.save_folder, slot.log_dir, retries=store.upload_retries,
                            backoff=store.upload_backoff_s)
        sup = Supervisor(reg, slot.name, plan=replace(plan, run_uid=slot.run_uid), lock=lock,
                         argv=child_argv(args, slot.name, slot.save_folder, first=True),
                         retry_argv=child_argv(args, slot.name, slot.save_folder, first=False), cwd=os.getcwd(),
                         save_folder=slot.save_folder, local_folder=local, log_dir=slot.log_dir,
                         max_retries=cfg.max_retries, config=redact_config(cfg.model_dump(mode="json")),
                         echo=not plan.detached, after_resumption=after)
        rc = sup.run()
        forget_if_rejected(reg, slot, plan)
        if rc == 0:
            _record_ladder_target(local)
    finally:
        lock.release()
    exit_now(rc)  # everything is recorded and closed: skip the interpreter's teardown of torch
    return rc


def _record_ladder_target(folder: str) -> None:
    """A ladder's target that just completed: its actual loss goes into the ladder's prediction
    and report (`runs.ladder.record_target`); a failure there is a warning, never the run's."""
    from lmforge.runs.ladder import record_target

    try:
        line = record_target(folder)
    except Exception as e:  # noqa: BLE001 - the run itself completed
        line = f"warning: the ladder's prediction.json and report.html were not updated ({type(e).__name__}: {e})"
    if line:
        print(line, flush=True)


def forget_if_rejected(reg: Registry, slot: RunSlot, plan: LaunchPlan) -> None:
    """A new run whose only attempt ended on bad input (exit 2) before its first training step was
    never a run: its entry goes (the user has just seen its one error line; a detached run keeps
    the entry, where `runs describe` shows the reason)."""
    if plan.detached or slot.existing is not None or slot.replaces is not None:
        return
    run = reg.get(slot.name)
    if not run or run["run_uid"] != slot.run_uid or run["status"] != "FAILED":
        return
    attempts = run.get("resumptions") or []
    if len(attempts) != 1 or attempts[0].get("exit_code") != EXIT_USER_ERROR:
        return
    if run.get("metrics") or list_checkpoints(local_folder(slot.save_folder)):
        return  # it trained: a failure later on (a full disk) is part of the run's record
    reg.delete(slot.name)


def detach(reg: Registry, args, slot: RunSlot, plan: LaunchPlan) -> int:
    probe(local_folder(slot.save_folder))  # a busy folder is reported here, not in a log file
    sup = LaunchPlan("supervise", run_uid=slot.run_uid, nproc=plan.nproc, detached=True, parent_pid=os.getpid())
    proc = spawn_supervisor(with_plan(child_argv(args, slot.name, slot.save_folder, first=True), sup),
                            cwd=os.getcwd(), log_dir=slot.log_dir)
    wait_registered(reg, slot.run_uid, proc, slot.log_dir)
    print(slot.name)
    if sys.stdout.isatty():
        print(f"  follow: lmforge runs logs {slot.name} --follow\n  status: lmforge runs describe {slot.name}\n"
              f"  stop:   lmforge runs stop {slot.name}")
    return 0


def spawn_supervisor(argv: list[str], *, cwd: str, log_dir: str) -> subprocess.Popen:
    """The supervisor in its own session (no terminal, survives this process and its group).
    ``argv`` carries its launch plan (role "supervise", detached)."""
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "supervisor.log"), "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "lmforge", *argv], cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_registered(reg: Registry, run_uid: str, proc: subprocess.Popen, log_dir: str, timeout: float = 120) -> None:
    """Until the detached supervisor has claimed the run, or report why it could not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = reg.get(run_uid, details=False)
        if run and run["supervisor_pid"] == proc.pid and run["run_uid"] == run_uid:
            return
        rc = proc.poll()
        if rc is not None and rc != 0:
            raise UserError(_last_error(os.path.join(log_dir, "supervisor.log"))
                            or f"the background supervisor of run {run_uid} exited with code {rc}; "
                            f"see {log_dir}/supervisor.log")
        time.sleep(0.1)
    raise UserError(f"the background supervisor of run {run_uid} did not start within {timeout:.0f}s; "
                    f"see {log_dir}/supervisor.log")


def _last_error(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()[-50:]
    except OSError:
        return None
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln[len("error: "):]
    return None
