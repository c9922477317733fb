"""The `Run` object and the SDK functions (`lmforge.pretrain`, `get_run`, `get_runs`).

`lmforge runs ...` uses the same functions, so the CLI and the SDK behave the same way.
A `Run` is a snapshot of its registry entry; `refresh()` reads it again (and notices a run
whose supervisor vanished: FAILED, reason "lost"). ``run_uid`` identifies a run for good (a name
can pass to a new run once the old one's save folder is gone); ``lifecycle`` is every status the
run went through, with its time; ``resumptions`` are its attempts (the first start, each restart
by the supervisor or by torchrun, ``restart()``), each with its status and reason.
"""

from __future__ import annotations

import copy
import difflib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from lmforge.config.load import read_yaml
from lmforge.errors import UserError
from lmforge.guard import check_run_folder, check_target
from lmforge.home import lmforge_home
from lmforge.process import process_alive, this_host
from lmforge.secrets import MASK
from lmforge.uri import is_remote
from lmforge.resolve import resolve
from lmforge.resolve.request import RunRequest
from lmforge.runs.lock import probe
from lmforge.runs.launch_plan import LaunchPlan, with_plan
from lmforge.runs.progress import read_history
from lmforge.runs.registry import ACTIVE, STATUSES, TERMINAL, Registry


@dataclass
class Run:
    name: str
    run_uid: str | None
    run_type: str
    status: str
    reason: str | None
    created_at: float
    started_at: float | None
    updated_at: float
    completed_at: float | None
    model: str | None
    config: dict
    save_folder: str
    log_dir: str
    command: list[str]
    cwd: str
    host: str
    supervisor_pid: int | None
    child_pid: int | None
    ranks: int | None
    max_retries: int | None
    latest_metrics: dict = field(default_factory=dict)
    lifecycle: list[dict] = field(default_factory=list)  # [{"status": ..., "time": ...}], oldest first
    resumptions: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @classmethod
    def _from_row(cls, row: dict) -> "Run":
        return cls(name=row["name"], run_uid=row.get("run_uid"), run_type=row["run_type"], status=row["status"],
                   reason=row["reason"],
                   created_at=row["created_at"], started_at=row["started_at"], updated_at=row["updated_at"],
                   completed_at=row["completed_at"], model=row["model"], config=row["config"] or {},
                   save_folder=row["save_folder"], log_dir=row["log_dir"], command=row["command"] or [],
                   cwd=row["cwd"], host=row["host"], supervisor_pid=row["supervisor_pid"],
                   child_pid=row["child_pid"], ranks=row["ranks"], max_retries=row["max_retries"],
                   latest_metrics=row["metrics"] or {}, lifecycle=row.get("lifecycle") or [],
                   resumptions=row.get("resumptions", []),
                   events=row.get("events", []))

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def checkpoints_dir(self) -> str:
        return os.path.join(self.save_folder, "checkpoints")

    def refresh(self) -> "Run":
        fresh = get_run(self.run_uid or self.name)
        self.__dict__.update(fresh.__dict__)
        return self

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> "Run":
        """Block until the run is COMPLETED, FAILED or STOPPED; TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.refresh().is_terminal:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.name} is still {self.status} after {timeout}s")
            time.sleep(poll)
        return self

    def stop(self, force: bool = False, wait: bool = True, timeout: float | None = 600) -> "Run":
        """Graceful: the trainer checkpoints at the next step and exits (STOPPED). ``force`` kills it.
        A run that already ended is left as it is."""
        self.refresh()
        if self.is_terminal:
            return self
        if self.host != this_host():
            raise UserError(f"run {self.name} runs on host {self.host}; stop it there")
        reg = Registry()
        if force:
            _signal(self.supervisor_pid, self._sup_start(reg), signal.SIGUSR1)
            try:
                self.wait(timeout=10)
            except TimeoutError:  # supervisor not responding: kill it and the trainer, record it here
                _killpg(self.child_pid)
                _signal(self.supervisor_pid, self._sup_start(reg), signal.SIGKILL)
                reg.put(self.name, {"status": "STOPPED", "reason": "killed (stop --force)",
                                    "completed_at": time.time()}, event=("stop", "killed by `runs stop --force`"))
            return self.refresh()
        _signal(self.supervisor_pid, self._sup_start(reg), signal.SIGTERM)
        return self.wait(timeout=timeout) if wait else self.refresh()

    def _sup_start(self, reg: Registry) -> str | None:
        return (reg.get(self.name, details=False) or {}).get("supervisor_start")

    def restart(self) -> "Run":
        """A new resumption that continues from the latest checkpoint, supervised in the background.
        Refused while any process of the run (or of another run in its save folder) is alive, and for a
        COMPLETED run: it has nothing left to train (a restart would only re-export it, and its wait
        would read as recovery time in its goodput)."""
        from lmforge.runs.start import spawn_supervisor, wait_registered  # torch (through the trainer)
        from lmforge.runs.store import local_folder  # (same: lazy, `import lmforge` stays free of torch)

        self.refresh()
        if not self.is_terminal:
            raise UserError(f"run {self.name} is {self.status}; it cannot be restarted until it ends "
                            f"(`lmforge runs stop {self.name}`)")
        if self.status == "COMPLETED":
            raise UserError(f"run {self.name} is COMPLETED: nothing to restart, it trained its whole "
                            f"training_duration; to train further, raise training_duration and run its command "
                            f"again (it resumes from its last checkpoint)")
        if not self.command:
            raise UserError(f"run {self.name} has no recorded command to restart")
        if any(MASK in a for a in self.command):  # the registry never keeps a secret (`register`)
            raise UserError(f"run {self.name} was started with a secret on its command line, which lmforge does not "
                            "store: start it again with the same command (it resumes), or pass the secret through "
                            "the environment or a secrets file")
        probe(local_folder(self.save_folder))
        plan = LaunchPlan("supervise", run_uid=self.run_uid, detached=True, reason="restart", parent_pid=os.getpid())
        proc = spawn_supervisor(with_plan(self.command, plan), cwd=self.cwd or os.getcwd(), log_dir=self.log_dir)
        wait_registered(Registry(), self.run_uid, proc, self.log_dir)
        return self.refresh()

    def delete(self, force: bool = False, purge: bool = False) -> None:
        """Remove the registry entry (``purge``: also the local save folder and logs)."""
        self.refresh()
        if not self.is_terminal:
            if not force:
                raise UserError(f"run {self.name} is {self.status}; stop it first (`lmforge runs stop {self.name}`) "
                                "or delete with --force")
            self.stop(force=True)
        doomed = [p for p in (self.save_folder, self.log_dir) if purge and p and not is_remote(p) and os.path.isdir(p)]
        flag = f"runs delete {self.name} --purge"
        for path in doomed:  # before anything goes: a refused folder leaves the run registered
            if path == self.save_folder:
                check_run_folder(path, flag)
            else:
                check_target(path, flag)
        Registry().delete(self.name)
        for path in doomed:
            if os.path.isdir(path):  # the logs of a local run went with its save folder
                shutil.rmtree(path)

    def log_path(self, resumption: int | None = None) -> str:
        if not self.resumptions:
            raise UserError(f"run {self.name} has no logs yet (status {self.status})")
        if resumption is None:
            return self.resumptions[-1]["log_path"]
        for r in self.resumptions:
            if r["idx"] == resumption:
                return r["log_path"]
        have = ", ".join(str(r["idx"]) for r in self.resumptions)
        raise UserError(f"run {self.name} has no resumption {resumption}; it has: {have}")

    def logs(self, resumption: int | None = None) -> str:
        """The output of the latest resumption (or of resumption N)."""
        path = self.log_path(resumption)
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def metrics(self):
        """The metrics.jsonl history: a pandas DataFrame if pandas is installed, else a list of dicts."""
        rows = read_history(self.save_folder) if "://" not in self.save_folder else []
        try:
            import pandas as pd  # optional, and heavy: only when asked for
        except ImportError:
            return rows
        return pd.DataFrame(rows)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"Run(name={self.name!r}, status={self.status!r}{why}, model={self.model!r})"


# --------------------------------------------------------------------------- SDK functions

def get_run(name: str) -> Run:
    """The run called ``name`` (or whose ``run_uid`` is ``name``)."""
    reg = Registry()
    row = reg.get(name)
    if row is None:
        names = reg.names()
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else known_runs(names)
        raise UserError(f"no run named {name!r}{hint}")
    return Run._from_row(reg.mark_lost_if_dead(row))


def known_runs(names: list[str], shown: int = 10) -> str:
    """The end of a "no run named X" line: the first ``shown`` names, and how many more there are."""
    if not names:
        return "; the registry has no runs yet"
    more = len(names) - shown
    return f"; known runs: {', '.join(sorted(names)[:shown])}" + \
        (f" and {more} more (`lmforge runs list` shows them all)" if more > 0 else "")


def get_runs(status: str | None = None) -> list[Run]:
    if status is not None:
        status = status.upper()
        if status not in STATUSES:
            raise UserError(f"unknown status {status!r}; expected one of {', '.join(STATUSES)}")
    reg = Registry()
    rows = [reg.mark_lost_if_dead(r) for r in reg.list()]
    return [Run._from_row(r) for r in rows if status is None or r["status"] == status]


def pretrain(config_path_or_dict: str | os.PathLike | dict | None = None, **overrides: Any) -> Run:
    """Start a pretraining run in the background; returns its `Run` (use ``.wait()``).

    ``overrides`` are config keys (``training_duration="10000tok"``); a dict value is merged
    into the section (``parameters={"learning_rate": 3e-4}``); ``a__b=v`` sets ``a.b``.
    """
    return _start("train", config_path_or_dict, overrides)


def finetune(config_path_or_dict: str | os.PathLike | dict | None = None, **overrides: Any) -> Run:
    """Start a fine-tuning run (``task_type`` defaults to instruction_finetune) in the background.

    ``model`` and ``tokenizer`` may be left out: they come from ``custom_weights_path``.
    Overrides as for `pretrain`.
    """
    return _start("finetune", config_path_or_dict, overrides)


def _start(command: str, config_path_or_dict, overrides: dict) -> Run:
    """Validate in-process (bad input raises here), write the config, `lmforge <command> --detach`."""
    if config_path_or_dict is None:
        raw: dict = {}
    elif isinstance(config_path_or_dict, dict):
        raw = copy.deepcopy(config_path_or_dict)
    else:
        path = os.fspath(config_path_or_dict)
        raw = read_yaml(path)
        raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    for key, value in overrides.items():
        _merge(raw, key.replace("__", ".").split("."), value)
    source = f"{'pretrain' if command == 'train' else 'finetune'}()"
    raw["name"] = resolve(RunRequest.from_mapping(command, raw, source), until="config").config.name
    folder = os.path.join(lmforge_home(), "sdk-configs")
    os.makedirs(folder, exist_ok=True)
    cfg_file = os.path.join(folder, f"{raw['name']}.yaml")
    with open(cfg_file, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    proc = subprocess.run([sys.executable, "-m", "lmforge", command, "-f", cfg_file, "--detach"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln[len("error: "):] for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        raise UserError(errors[-1] if errors else f"lmforge {command} --detach failed ({proc.returncode}): "
                        f"{proc.stderr.strip()[-500:]}")
    return get_run(proc.stdout.split()[0])  # the name it got (unique: maybe with a suffix)


def _merge(node: dict, keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    last = keys[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _merge(node[last], [k], v)
    else:
        node[last] = value


def _signal(pid: int | None, start: str | None, sig: int) -> None:
    if pid and process_alive(pid, start):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _killpg(pid: int | None) -> None:
    if pid:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


__all__ = ["Run", "get_run", "get_runs", "pretrain", "ACTIVE", "TERMINAL"]
