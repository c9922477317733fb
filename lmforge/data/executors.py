"""Where a job's tasks run: this process (the plain command), or datatrove's executors.

* no executor: every item in this process, the per-document work in ``--workers`` processes;
* ``local``: ``LocalPipelineExecutor``, N task processes on this machine;
* ``ray``: ``RayPipelineExecutor`` on the Ray cluster this process joins (``RAY_ADDRESS``, or a
  local instance it starts);
* ``slurm``: ``SlurmPipelineExecutor``, one job array per stage, each depending on the last, and
  a one-task job for the last step; the command submits them and returns.

The stages of a job run one after the other; a stage runs as ``min(N, its items)`` tasks. The
command shows units done / total, tokens/s and the time left while it waits, and checks that
every item of a stage is done before the next one starts: a task that failed on bad input has
left its one line in ``work/errors``, which the command prints.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from lmforge.data import remote
from lmforge.data.job import Job, Stage, StageTask, TaskDied, WorkDir, run_items
from lmforge.errors import UserError

EXECUTORS = ("local", "slurm", "ray")
TRILLION = 10**12


@dataclass(frozen=True)
class ExecutorSpec:
    kind: str = "local"
    tasks: int = 1
    partition: str | None = None  # slurm
    time: str = "24:00:00"  # slurm: a task's time limit
    cpus_per_task: int = 1  # slurm and ray


def check_executor(spec: ExecutorSpec | None) -> None:
    """Bad settings and missing packages, before anything is read or written."""
    if spec is None:
        return
    if spec.kind not in EXECUTORS:
        raise UserError(f"--executor {spec.kind}: unknown executor (expected local, slurm or ray)")
    if not isinstance(spec.tasks, int) or isinstance(spec.tasks, bool) or spec.tasks < 1:
        raise UserError(f"--tasks {spec.tasks}: expected a positive integer (how many tasks the job runs as)")
    if not isinstance(spec.cpus_per_task, int) or spec.cpus_per_task < 1:
        raise UserError(f"--cpus-per-task {spec.cpus_per_task}: expected a positive integer")
    try:
        import datatrove.executor  # noqa: F401
    except ImportError:
        raise UserError(f"--executor {spec.kind}: needs datatrove: pip install 'lmforge[curate]'") from None
    if spec.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UserError("--executor ray: needs ray: pip install 'lmforge[ray]'") from None
    if spec.kind == "slurm" and not spec.partition:
        raise UserError("--executor slurm: needs --partition NAME (the Slurm partition the tasks run on)")


@dataclass
class JobRun:
    seconds: float
    cores: int
    new_units: list[int]  # units done by this run (the others were done by an earlier one)
    submitted: list[dict] | None = None  # slurm: the jobs submitted, nothing run here


def run_job(job: Job, spec: ExecutorSpec | None, workers: int = 1, progress: bool = False) -> JobRun:
    """Run every stage of ``job`` (without its last step, except on Slurm, where it is a job too)."""
    stages = job.stages()
    if spec is not None and spec.kind == "slurm":
        return JobRun(0.0, 0, [], submitted=_submit_slurm(job, stages, spec))
    wd = WorkDir(job.out)
    before = wd.done("units")
    remote.remove_tree(wd.uri("errors"))  # an earlier run's
    if spec is not None and spec.kind == "ray":
        _start_ray(job)
    start = time.perf_counter()
    cores = _cores(spec)
    for stage in stages:
        with _Progress(job, stage, progress):
            if spec is None:
                run_items(job, stage, range(stage.items), workers)
            else:
                _run_on_executor(job, stage, spec)
        _check_done(job, stage)
    return JobRun(time.perf_counter() - start, cores, sorted(wd.done("units") - before))


def _cores(spec: ExecutorSpec | None) -> int:
    """The cores the job ran on: this machine's (in this process and on the local executor the
    tokenizer's threads fill every core, whatever the number of workers or tasks), or on Ray the
    tasks' share of the cluster."""
    machine = os.cpu_count() or 1
    if spec is not None and spec.kind == "ray":
        import ray

        return int(min(spec.tasks * spec.cpus_per_task, ray.cluster_resources().get("CPU", machine)))
    return machine


def _check_done(job: Job, stage: Stage) -> None:
    wd = WorkDir(job.out)
    missing = stage.items - len(wd.done(stage.name))
    if missing <= 0:
        return
    for name in wd.names("errors"):  # a task's one line (bad data, or a failing store)
        err = wd.read_json(f"errors/{name}") or {}
        if err.get("message"):
            raise (remote.StoreError if err.get("store") else UserError)(err["message"])
    raise TaskDied(f"{missing} of {stage.items} items of the {stage.name} stage did not finish (task logs in "
                   f"{wd.uri('logs', stage.name)}); run the same command again: it redoes only those")


# ----------------------------------------------------------------------------- datatrove


@contextlib.contextmanager
def _task_output_to_file(job: Job):
    """The executors' tasks log to their log files and to stderr; on this command's stderr that
    would drown its own lines, so stderr (file descriptor 2: the task processes inherit it) goes
    to ``DEST/work/logs/executor.log`` meanwhile, or for an object-store DEST to a temporary file
    kept only when something fails."""
    if remote.is_remote(job.out):
        fd, path = tempfile.mkstemp(prefix="lmforge-executor-", suffix=".log")
        os.close(fd)
    else:
        path = remote.local_path(WorkDir(job.out).uri("logs", "executor.log"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if ok and remote.is_remote(job.out):
            os.remove(path)


def _run_on_executor(job: Job, stage: Stage, spec: ExecutorSpec) -> None:
    tasks = min(spec.tasks, stage.items)
    logs = remote.datatrove_folder(WorkDir(job.out).uri("logs", stage.name))
    with _task_output_to_file(job):
        if spec.kind == "local":
            from datatrove.executor import LocalPipelineExecutor

            threads = max(1, (os.cpu_count() or 1) // tasks)
            with _TaskWatch(job, stage) as watch:
                try:
                    # skip_completed off: the items' own markers say what is done, whatever the task count was
                    LocalPipelineExecutor([StageTask(job, stage, threads)], tasks=tasks, workers=tasks,
                                          logging_dir=logs, skip_completed=False).run()
                except KeyboardInterrupt:
                    if watch.dead is None:
                        raise
                    raise TaskDied(f"a task of the {stage.name} stage (process {watch.dead['pid']}) ended before its "
                                   "work was done (killed? out of memory?); run the same command again: it redoes "
                                   "only what did not finish") from None
        else:
            from datatrove.executor import RayPipelineExecutor

            RayPipelineExecutor([StageTask(job, stage, spec.cpus_per_task)], tasks=tasks, workers=tasks,
                                logging_dir=logs, skip_completed=False, cpus_per_task=spec.cpus_per_task,
                                mem_per_cpu_gb=1).run()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended too
    except OSError:
        return True


class _TaskWatch:
    """The local executor does not notice a task process that dies (its pool would wait for it
    forever): this thread does, from the task's claim (``StageTask``), and interrupts the command."""

    def __init__(self, job: Job, stage: Stage):
        self.job, self.stage = job, stage
        self.dead: dict | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import signal
        import socket

        wd, host = WorkDir(self.job.out), socket.gethostname()
        while not self.stop.wait(0.5):
            for name in wd.names("running"):
                claim = wd.read_json(f"running/{name}") if name.startswith(f"{self.stage.name}-") else None
                if claim and claim["host"] == host and not _alive(claim["pid"]) and wd.read_json(f"running/{name}"):
                    self.dead = claim
                    # A real signal: it also wakes the main thread out of the pool's wait.
                    os.kill(os.getpid(), signal.SIGINT)
                    return

    def __enter__(self) -> "_TaskWatch":
        remote.remove_tree(WorkDir(self.job.out).uri("running"))  # the claims of an earlier run's dead tasks
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _start_ray(job: Job) -> None:
    """Join the cluster ``RAY_ADDRESS`` names, or start a local Ray instance."""
    import ray

    if not ray.is_initialized():
        with _task_output_to_file(job):
            ray.init(log_to_driver=False, include_dashboard=False)


def slurm_executors(job: Job, stages: list[Stage], spec: ExecutorSpec) -> list:
    """One ``SlurmPipelineExecutor`` per stage and one for the last step, each depending on the one before."""
    from datatrove.executor import SlurmPipelineExecutor

    activate = os.path.join(sys.prefix, "bin", "activate")
    chain, prev = [], None
    for stage in [*stages, Stage("finalize", 1)]:
        prev = SlurmPipelineExecutor(
            [StageTask(job, stage, spec.cpus_per_task)], tasks=min(spec.tasks, stage.items), time=spec.time,
            partition=spec.partition, cpus_per_task=spec.cpus_per_task, job_name=f"lmforge-{stage.name}",
            logging_dir=remote.datatrove_folder(WorkDir(job.out).uri("logs", stage.name)), depends=prev, skip_completed=False,
            venv_path=activate if os.path.exists(activate) else None, qos="")
        chain.append((stage, prev))
    return chain


def _submit_slurm(job: Job, stages: list[Stage], spec: ExecutorSpec) -> list[dict]:
    chain = slurm_executors(job, stages, spec)
    with _task_output_to_file(job):
        chain[-1][1].run()  # submits the whole chain: each job waits for the one before (afterok)
    return [{"stage": stage.name, "tasks": ex.tasks, "job_id": ex.job_id,
             "script": ex.logging_dir.resolve_paths("launch_script.slurm")} for stage, ex in chain]


# ----------------------------------------------------------------------------- progress


class _Progress:
    """While a stage runs: items done / total, tokens/s (or MB/s before tokenizing) and the time
    left, read from the items' markers (whichever process writes them). A terminal only."""

    def __init__(self, job: Job, stage: Stage, enabled: bool):
        self.job, self.stage, self.enabled = job, stage, enabled and stage.name != "finalize"
        self.stop = threading.Event()

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # Its own copy of stderr: the executors' task output is sent elsewhere meanwhile.
        self.out = os.fdopen(os.dup(2), "w")
        self.bar = Progress(TextColumn(f"[bold]{self.stage.name}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"), TimeElapsedColumn(),
                            console=Console(file=self.out), transient=True, redirect_stdout=False,
                            redirect_stderr=False)
        self.task = self.bar.add_task(self.stage.name, total=self.stage.items, rate="", eta="")
        self.bar.start()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        wd = WorkDir(self.job.out)
        seen = wd.done(self.stage.name)
        start, tokens, nbytes, done_now = time.perf_counter(), 0, 0, 0
        interval = 2.0 if remote.is_remote(self.job.out) else 0.5
        while not self.stop.wait(interval):
            done = wd.done(self.stage.name)
            for i in sorted(done - seen):
                m = wd.read_json(f"{self.stage.name}/{i:06d}.json") or {}
                tokens += m.get("tokens") or 0
                nbytes += m.get("bytes") or 0
                done_now += 1
            seen |= done
            self.bar.update(self.task, completed=len(done), **progress_fields(
                self.job, self.stage, done, tokens, nbytes, done_now, time.perf_counter() - start))

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.stop.set()
        self.thread.join()
        self.bar.stop()
        self.out.close()


def progress_fields(job: Job, stage: Stage, done: set[int], tokens: int, nbytes: int, done_now: int,
                    seconds: float) -> dict:
    """The rate and the time left: from what this run did (items done by an earlier run do not count)."""
    if not done_now or seconds <= 0:
        return {"rate": "", "eta": ""}
    rate = f"{tokens / seconds:,.0f} tokens/s" if tokens else f"{nbytes / seconds / 1e6:,.1f} MB/s"
    left_items = [u for u in range(stage.items) if u not in done]
    if stage.name in ("signatures", "units") and nbytes:
        left = sum(job.units[u].bytes or 0 for u in left_items) / (nbytes / seconds)
    else:
        left = len(left_items) * seconds / done_now
    return {"rate": rate, "eta": f"ETA {format_duration(left)}"}


def format_duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def throughput_line(tokens: int, seconds: float, cores: int) -> str:
    """tokens/s per core, and what 1T tokens would take on 1, 10 and 100 such machines."""
    if tokens <= 0 or seconds <= 0:
        return ""
    per_core = tokens / seconds / max(1, cores)
    machine = os.cpu_count() or cores
    times = ", ".join(f"{format_duration(TRILLION / (per_core * machine * n))} on {n}" for n in (1, 10, 100))
    return (f"{tokens / seconds:,.0f} tokens/s, {per_core:,.0f} tokens/s per core ({cores} cores); "
            f"1T tokens: {times} machines like this one ({machine} cores)")
