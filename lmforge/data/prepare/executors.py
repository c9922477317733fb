"""Where a job's tasks run: this process (the plain command), or datatrove's executors.

* no executor: every item in this process, the per-document work in ``--workers`` processes;
* ``local``: ``LocalPipelineExecutor``, N task processes on this machine;
* ``ray``: ``RayPipelineExecutor`` on the Ray cluster ``RAY_ADDRESS`` names, or a local instance;
* ``slurm``: ``SlurmPipelineExecutor``, one job array per stage, each depending on the last, and
  a one-task job for the last step; the command submits them and returns.

The stages of a job run one after the other; a stage runs as ``min(N, its items)`` tasks. Local
and Ray executors run in a process of their own (``runner``) that this one watches and kills
with everything below it when it must stop, so the command never hangs on a lost task. The
command shows units done / total, tokens/s and the time left while it waits, and checks that
every item of every stage is done: a task that failed on bad input has left its one line in
``work/errors``, which the command prints at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from lmforge.data import remote
from lmforge.data.prepare.job import BadInput, Job, Stage, StageTask, TaskDied, WorkDir, run_items
from lmforge.errors import UserError
from lmforge.process import kill_tree

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
        check_ray_address(os.environ.get("RAY_ADDRESS"))
    if spec.kind == "slurm" and not spec.partition:
        raise UserError("--executor slurm: needs --partition NAME (the Slurm partition the tasks run on)")
    if spec.kind == "slurm" and shutil.which("sbatch") is None:
        raise UserError("--executor slurm: no `sbatch` on PATH (submit from a machine of the Slurm cluster, "
                        "a login node, or use --executor local or ray)")


RAY_CONNECT_SECONDS = 10
RUNNER_END_SECONDS = 60  # the runner, its lifeline closed, kills its tree and ends; past this it is killed


def check_ray_address(address: str | None) -> None:
    """A cluster ``RAY_ADDRESS`` names (``host:port`` or ``ray://host:port``) answers on its port
    within 10 s; otherwise one line now, instead of Ray retrying for minutes in silence. Unset (a
    local instance), ``auto`` and ``local`` are Ray's to resolve."""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"RAY_ADDRESS={address}: expected HOST:PORT or ray://HOST:PORT (or unset it for a local "
                        "Ray instance)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_SECONDS).close()
    except OSError as e:
        raise UserError(f"RAY_ADDRESS={address}: cannot reach the Ray cluster ({e.strerror or e}); start it "
                        "(`ray start --head`) or unset RAY_ADDRESS for a local Ray instance") from None


@dataclass
class JobRun:
    seconds: float
    cores: int  # the cores the job could use (this machine's, or its Ray tasks' share of the cluster)
    new_units: list[int]  # units done by this run (the others were done by an earlier one)
    submitted: list[dict] | None = None  # slurm: the jobs submitted, nothing run here
    cpu_seconds: float | None = None  # CPU time of this process and the processes it waited for (None: Ray's)


def run_job(job: Job, spec: ExecutorSpec | None, workers: int = 1, progress: bool = False) -> JobRun:
    """Run every stage of ``job`` (without its last step, except on Slurm, where it is a job too)."""
    stages = job.stages()
    wd = WorkDir(job.out)
    if spec is not None and spec.kind == "slurm":
        _say_earlier_errors(wd)
        if all(len(wd.done(s.name)) >= s.items for s in stages):
            return JobRun(0.0, os.cpu_count() or 1, [])  # only the last step is left: it runs here, saying how it ends
        return JobRun(0.0, 0, [], submitted=_submit_slurm(job, stages, spec))
    before = wd.done("units")
    remote.remove_tree(wd.uri("errors"))  # an earlier run's
    start, cpu0 = time.perf_counter(), cpu_seconds()
    cores = os.cpu_count() or 1  # in this process the tokenizer's threads fill every core, whatever --workers
    with _Progress(job, stages, progress):
        if spec is None:
            for stage in stages:
                run_items(job, stage, range(stage.items), workers)
                _check_done(job, stage)
        else:
            cores = _run_in_runner(job, stages, spec)
    for stage in stages:
        _check_done(job, stage)
    # The work's CPU time, where its processes are ours (Ray's run in the cluster's own workers).
    cpu = None if spec is not None and spec.kind == "ray" else cpu_seconds() - cpu0
    return JobRun(time.perf_counter() - start, cores, sorted(wd.done("units") - before), cpu_seconds=cpu)


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of every process it waited for (the task pool's,
    the runner's and theirs, which each wait for their own)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _check_done(job: Job, stage: Stage) -> None:
    wd = WorkDir(job.out)
    missing = stage.items - len(wd.done(stage.name))
    if missing <= 0:
        return
    _raise_task_error(wd)
    raise TaskDied(f"{missing} of {stage.items} items of the {stage.name} stage did not finish (task logs in "
                   f"{wd.uri('logs', stage.name)}); run the same command again: it redoes only those")


def _say_earlier_errors(wd: WorkDir) -> None:
    """What the tasks of an earlier submission stopped on (in ``work/errors``, on no terminal), said
    before this run goes on from them."""
    for name in wd.names("errors"):
        err = wd.read_json(f"errors/{name}") or {}
        if err.get("message"):
            print(f"note: a task of the earlier jobs ({err.get('stage')} stage) stopped: {err['message']}",
                  file=sys.stderr, flush=True)
    remote.remove_tree(wd.uri("errors"))


def _raise_task_error(wd: WorkDir) -> None:
    """A task's one line in ``work/errors`` (bad data, a failing store, a crash), raised here."""
    for name in wd.names("errors"):
        err = wd.read_json(f"errors/{name}") or {}
        if err.get("crash"):
            raise TaskCrashed(f"a task of the {err.get('stage')} stage crashed: {err['message']} (its traceback: "
                              f"{wd.uri('errors', name)}); this is a bug, not the data's fault: running the same "
                              "command again fails the same way, please report it")
        if err.get("message"):
            raise (remote.StoreError if err.get("store") else TaskDied if err.get("died") else BadInput)(err["message"])


class TaskCrashed(UserError):
    """A task raised an exception that is not bad input (a bug): not retryable. What the job wrote stays."""

    exit_code = 1


# ----------------------------------------------------------------------------- datatrove


def _run_in_runner(job: Job, stages: list[Stage], spec: ExecutorSpec) -> int:
    """Run the stages on the local or Ray executor in a process of their own (``runner``), watched
    from here; returns the cores the job ran on. Whatever ends the wait (the stages done, a task's
    line in ``work/errors``, a dead task, this process interrupted), that process and everything
    below it are killed, never waited on."""
    wd = WorkDir(job.out)
    with tempfile.TemporaryDirectory(prefix="lmforge-job-") as tmp, _runner_log(job) as log:
        payload, result = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.json")
        with open(payload, "wb") as f:
            pickle.dump((job, stages, spec), f)
        with open(log, "ab") as log_file:
            # Its own session: a Ctrl-C at the terminal reaches this process, which takes the tree down.
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from lmforge.data.prepare.runner import main; "
                                     "main(*sys.argv[1:])", payload, result],
                                    stdin=subprocess.PIPE, stdout=log_file, stderr=log_file, start_new_session=True)
        try:
            interval = 2.0 if remote.is_remote(job.out) else 0.2
            while proc.poll() is None and not wd.names("errors"):
                time.sleep(interval)
        finally:
            proc.stdin.close()  # its lifeline: it kills what runs below it, and ends
            try:
                proc.wait(timeout=RUNNER_END_SECONDS)
            except subprocess.TimeoutExpired:  # stuck: taken down from here (its pid is its own until waited)
                kill_tree(proc.pid)
                proc.wait()
        outcome = _read_json(result)
        if not outcome:  # it died on its own (out of memory?): what is left of its process group
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
    _raise_task_error(wd)
    if "died" in outcome:
        d = outcome["died"]
        raise TaskDied(f"a task of the {d['stage']} stage (process {d['pid']}) ended before its work was done "
                       "(killed? out of memory?); run the same command again: it redoes only what did not finish")
    if "failed" in outcome:
        f = outcome["failed"]
        if f.get("stage") is None:  # before any stage: the executor could not start
            raise UserError(f"--executor {spec.kind}: {f.get('message')} (log: {log})")
        raise TaskDied(f"the {f['stage']} stage stopped ({f.get('message') or 'its executor ended'}; task logs in "
                       f"{wd.uri('logs', f['stage'])}); run the same command again: it redoes only what did not finish")
    if "ok" not in outcome:
        raise TaskDied(f"the process running the job's tasks ended (killed? out of memory?; log: {log}); run the same "
                       "command again: it redoes only what did not finish")
    return int(outcome["cores"])


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _runner_log(job: Job):
    """Where the executors' output goes: ``DEST/work/logs/executor.log``, or for an object-store DEST
    a temporary file kept only when something fails."""
    if remote.is_remote(job.out):
        fd, path = tempfile.mkstemp(prefix="lmforge-executor-", suffix=".log")
        os.close(fd)
    else:
        path = remote.local_path(WorkDir(job.out).uri("logs", "executor.log"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and remote.is_remote(job.out):
            os.remove(path)


@contextlib.contextmanager
def _stderr_to(path: str):
    """This process's stderr (file descriptor 2) into ``path`` meanwhile: datatrove's submission logs."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


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
    with _runner_log(job) as log:
        try:
            with _stderr_to(log):
                chain[-1][1].run()  # submits the whole chain: each job waits for the one before (afterok)
        except (subprocess.CalledProcessError, OSError) as e:
            done = [f"{stage.name} {ex.job_id}" for stage, ex in chain if getattr(ex, "job_id", None)]
            raise UserError(f"--executor slurm: sbatch failed ({e}; its output is in {log})"
                            + (f"; already submitted: {', '.join(done)}" if done else "")) from None
    return [{"stage": stage.name, "tasks": ex.tasks, "job_id": ex.job_id,
             "script": ex.logging_dir.resolve_paths("launch_script.slurm")} for stage, ex in chain]


# ----------------------------------------------------------------------------- progress


class _Progress:
    """While the stages run: the current stage's items done / total, tokens/s (or MB/s before
    tokenizing) and the time left, read from the items' markers (whichever process writes them).
    A terminal only."""

    def __init__(self, job: Job, stages: list[Stage], enabled: bool):
        self.job, self.stages, self.enabled = job, stages, enabled and bool(stages)
        self.stop = threading.Event()

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        # The time left, and the time spent labelled as such: a bare clock reads as either.
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
                            TextColumn("{task.fields[elapsed]}"), console=Console(file=sys.stderr), transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task(self.stages[0].name, total=self.stages[0].items, rate="", eta="", elapsed="")
        self.bar.start()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        wd = WorkDir(self.job.out)
        interval = 2.0 if remote.is_remote(self.job.out) else 0.5
        stage = seen = None
        while not self.stop.wait(interval):
            now = next(((s, d) for s in self.stages if len(d := wd.done(s.name)) < s.items), None)
            if now is None:
                continue
            if now[0] != stage:  # the next stage started: its own counts and clock
                stage, seen = now[0], now[1]
                start, tokens, nbytes, done_now = time.perf_counter(), 0, 0, 0
                self.bar.reset(self.task, total=stage.items, description=stage.name, rate="", eta="", elapsed="")
            done = now[1]
            for i in sorted(done - seen):
                m = wd.read_json(f"{stage.name}/{i:06d}.json") or {}
                tokens += m.get("tokens") or 0
                nbytes += m.get("bytes") or 0
                done_now += 1
            seen |= done
            seconds = time.perf_counter() - start
            self.bar.update(self.task, completed=len(done), elapsed=f"{format_duration(seconds)} elapsed",
                            **progress_fields(self.job, stage, done, tokens, nbytes, done_now, seconds))

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.stop.set()
        self.thread.join()
        self.bar.stop()


def progress_fields(job: Job, stage: Stage, done: set[int], tokens: int, nbytes: int, done_now: int,
                    seconds: float) -> dict:
    """The rate and the time left: from what this run did (items done by an earlier run do not count).
    Tokens/s once tokenizing, input MB/s before, items/s for the dedup stages that read no input."""
    if not done_now or seconds <= 0:
        return {"rate": "", "eta": "ETA after the first item"}
    if tokens:
        rate = f"{tokens / seconds:,.0f} tokens/s"
    elif nbytes:
        rate = f"{nbytes / seconds / 1e6:,.1f} MB/s"
    else:
        rate = f"{done_now / seconds:,.2f} items/s"
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


PROJECTION_SECONDS = 60  # less work than this (start-up, a tail of idle tasks) says little about 1T tokens


def throughput_line(tokens: int, seconds: float, cores: int, cpu_seconds: float | None = None) -> str:
    """tokens/s per core, and what 1T tokens would take on 1, 10 and 100 such machines: only from a
    run of at least a minute (a few seconds are mostly start-up). Per core is per CPU-second the
    work used (``cpu_seconds``: one task on a 2-core machine is one core's work, not two), else per
    core it could use (``cores``)."""
    if tokens <= 0 or seconds <= 0:
        return ""
    if cpu_seconds:
        per_core = tokens / cpu_seconds
        used = f"{cpu_seconds / seconds:.2g} of {cores} cores busy on average: {cpu_seconds:,.1f} CPU-seconds"
    else:
        per_core = tokens / seconds / max(1, cores)
        used = f"{cores} cores"
    rate = f"{tokens / seconds:,.0f} tokens/s, {per_core:,.0f} tokens/s per core ({used})"
    if seconds < PROJECTION_SECONDS:
        return (f"{rate} over {seconds:.1f} s: too little work to project 1T tokens from (it takes a run of "
                f"{PROJECTION_SECONDS} s or more)")
    machine = os.cpu_count() or cores
    times = ", ".join(f"{format_duration(TRILLION / (per_core * machine * n))} on {n}" for n in (1, 10, 100))
    return f"{rate}; 1T tokens: {times} machines like this one ({machine} cores)"


def idle_tasks_note(units: int, spec: ExecutorSpec | None, unit_bytes: int) -> str | None:
    """Said when there are fewer units than tasks: the others would have nothing to do."""
    if spec is None or spec.tasks <= units:
        return None
    return (f"{units} unit{'s' if units != 1 else ''} of --unit-mb {unit_bytes / (1 << 20):g} for {spec.tasks} "
            f"tasks: {units} task{'s' if units != 1 else ''} run, {spec.tasks - units} would have nothing to do "
            "(a smaller --unit-mb makes more units)")
