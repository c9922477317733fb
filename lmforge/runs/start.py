"""Start a run from `lmforge train`: register it, then supervise it here or in the background.

``lmforge train -f X`` registers the run (or a new resumption of the run already registered
under that name and save folder) and supervises the trainer in the foreground.
``--detach`` starts the same command as a supervisor in its own session, with its output in
``<save_folder>/logs/supervisor.log``, waits until it has registered the run (so a bad
config or a name collision is still reported here), prints the name and returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from lmforge.config.identity import default_name, run_identity
from lmforge.errors import UserError
from lmforge.runs.registry import ACTIVE, Registry, process_start, this_host


def should_supervise() -> bool:
    """No supervisor inside torchrun ranks, inside a supervised child, or when turned off."""
    return not any(os.environ.get(k) for k in ("WORLD_SIZE", "LMFORGE_SUPERVISED_CHILD", "LMFORGE_NO_SUPERVISOR"))


def run_paths(cfg, name: str) -> tuple[str, str]:
    """(save folder, log folder). Logs of a run saved to an object store stay local."""
    save = cfg.save_folder or os.path.join("runs", name)
    if "://" in save:
        from lmforge.home import lmforge_home

        return save, os.path.join(lmforge_home(), "runs", name, "logs")
    save = os.path.abspath(save)
    return save, os.path.join(save, "logs")


def identity(cfg, name: str, save_folder: str) -> dict:
    """The run identity (`config.identity.run_identity`) and where the run is saved."""
    return run_identity(cfg.model_copy(update={"name": name})) | {"save_folder": save_folder}


def model_label(cfg) -> str:
    m = cfg.model
    return m.preset or f"custom {m.n_layers}×{m.d_model}" + (f" moe{m.n_experts}" if m.n_experts else "")


def child_argv(args, name: str, save_folder: str, *, first: bool) -> list[str]:
    """The `lmforge train` argv the supervisor runs. Retries and restarts leave out
    --overwrite and --no-autoresume: they must continue from this run's checkpoints."""
    argv = [getattr(args, "command", None) or "train"]  # `train` or `finetune`
    if args.file:
        argv += ["-f", os.path.abspath(args.file)]
    for flag, attr in (("--model", "model"), ("--weights", "weights"), ("--training-duration", "training_duration"),
                       ("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--rdzv-endpoint", "rdzv_endpoint"),
                       ("--max-restarts", "max_restarts"), ("--price-per-gpu-hour", "price_per_gpu_hour")):
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


def check_collision(reg: Registry, name: str, ident: dict) -> dict | None:
    """The existing registry entry of ``name`` (after lost detection), or an error when that
    name belongs to a run that is active, or to another run (other save folder/model/data)."""
    existing = reg.get(name, details=False)
    if existing is None:
        return None
    existing = reg.mark_lost_if_dead(existing)
    old = existing.get("identity") or {}
    differs = [k for k in ("save_folder", "model", "train_data") if old.get(k) != ident.get(k)]
    if existing["status"] in ACTIVE:
        if not differs:
            raise UserError(f"run {name!r} is already {existing['status']} (supervisor pid "
                            f"{existing['supervisor_pid']} on {existing['host']}); follow it with `lmforge runs logs "
                            f"{name} --follow` or stop it with `lmforge runs stop {name}`")
        what = "; ".join(_difference(k, old.get(k), ident.get(k)) for k in differs)
        raise UserError(f"run name {name!r} is taken by an active run that differs ({what}); "
                        "choose another --name or stop that run first")
    return existing


def _difference(key: str, a, b) -> str:
    if key == "save_folder":
        return f"save_folder {a} vs {b}"
    if key == "model" and isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return "model " + ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in keys[:4])
    return f"{key} differs"


def register(reg: Registry, cfg, args, *, name: str, save_folder: str, log_dir: str) -> None:
    """Claim the run for this process (the supervisor): a new entry or a new resumption."""
    ident = identity(cfg, name, save_folder)
    existing = check_collision(reg, name, ident)
    compute = cfg.compute
    fields = {
        "run_type": "finetune" if cfg.task_type in ("instruction_finetune", "chat_completion") else "pretrain",
        "status": "STARTING", "reason": None, "started_at": time.time(),
        "completed_at": None, "model": model_label(cfg), "config": cfg.model_dump(mode="json"),
        "identity": ident, "save_folder": save_folder, "log_dir": log_dir,
        "command": child_argv(args, name, save_folder, first=False), "cwd": os.getcwd(), "host": this_host(),
        "supervisor_pid": os.getpid(), "supervisor_start": process_start(os.getpid()), "child_pid": None,
        "ranks": compute.ranks or (compute.gpus * compute.nodes if isinstance(compute.gpus, int) else None),
        "max_retries": cfg.max_retries,
    }
    how = "restart" if os.environ.get("LMFORGE_RESTART") else "train"
    if existing is None:
        reg.put(name, fields | {"metrics": None}, event=("created", f"registered by `lmforge {how}`"))
    elif existing.get("identity", {}).get("save_folder") == save_folder:
        reg.put(name, fields, event=("resumed", f"started again by `lmforge {how}` (was {existing['status']}"
                                     + (f": {existing['reason']})" if existing["reason"] else ")")))
    else:
        # A name is one run: never silently re-point it at another save folder.
        raise UserError(f"run name {name!r} is already used by the run saved in {existing.get('save_folder')} "
                        f"({existing['status']}); choose another --name, or forget that run with "
                        f"`lmforge runs delete {name}`")


def start(cfg, args) -> int:
    """`lmforge train` outside torchrun: register the run and supervise it (here, or detached)."""
    name = default_name(cfg)
    save_folder, log_dir = run_paths(cfg, name)
    if args.detach and not os.environ.get("LMFORGE_DETACHED"):
        return detach(cfg, args, name, save_folder, log_dir)
    from lmforge.runs.supervisor import Supervisor

    reg = Registry()
    register(reg, cfg, args, name=name, save_folder=save_folder, log_dir=log_dir)
    sup = Supervisor(reg, name, argv=child_argv(args, name, save_folder, first=True),
                     retry_argv=child_argv(args, name, save_folder, first=False), cwd=os.getcwd(),
                     save_folder=save_folder, log_dir=log_dir, max_retries=cfg.max_retries,
                     config=cfg.model_dump(mode="json"), echo=not os.environ.get("LMFORGE_DETACHED"))
    return sup.run()


def detach(cfg, args, name: str, save_folder: str, log_dir: str) -> int:
    reg = Registry()
    check_collision(reg, name, identity(cfg, name, save_folder))  # fail here, not in a log file
    proc = spawn_supervisor(child_argv(args, name, save_folder, first=True), cwd=os.getcwd(), log_dir=log_dir)
    wait_registered(reg, name, proc, log_dir)
    print(name)
    if sys.stdout.isatty():
        print(f"  follow: lmforge runs logs {name} --follow\n  status: lmforge runs describe {name}\n"
              f"  stop:   lmforge runs stop {name}")
    return 0


def spawn_supervisor(argv: list[str], *, cwd: str, log_dir: str, restart: bool = False) -> subprocess.Popen:
    """The supervisor in its own session (no terminal, survives this process and its group)."""
    os.makedirs(log_dir, exist_ok=True)
    env = os.environ | {"LMFORGE_DETACHED": "1"}
    if restart:
        env["LMFORGE_RESTART"] = "1"
    with open(os.path.join(log_dir, "supervisor.log"), "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "lmforge", *argv], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_registered(reg: Registry, name: str, proc: subprocess.Popen, log_dir: str, timeout: float = 120) -> None:
    """Until the detached supervisor has claimed the run, or report why it could not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = reg.get(name, details=False)
        if run and run["supervisor_pid"] == proc.pid:
            return
        rc = proc.poll()
        if rc is not None and rc != 0:
            raise UserError(_last_error(os.path.join(log_dir, "supervisor.log"))
                            or f"the background supervisor of run {name!r} exited with code {rc}; "
                            f"see {log_dir}/supervisor.log")
        time.sleep(0.1)
    raise UserError(f"the background supervisor of run {name!r} did not start within {timeout:.0f}s; "
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
