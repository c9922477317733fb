"""The process that runs a job's stages on datatrove's local or Ray executor, apart from the command.

`data prepare` / `data dedup` never wait on an executor in their own process. A process pool
cannot survive a task process that dies: the pool waits forever for the lost task's result, and
tearing it down can block for good on a queue lock the dead process held. So the command starts
``main(PAYLOAD, RESULT)`` in a child process, in a session of its own, and watches it; whatever
happens, what runs below it is killed as a whole tree (``process.kill_tree``), never waited on:

* every item of a stage has its marker: the stage is done, whatever the executor still does;
* a task process of the local executor dies (killed, out of memory; also before it took any work):
  the stage stops and the result names it (``died``);
* a task leaves a line in ``work/errors`` (bad input, a failing store, a crash): the stage stops;
* the command itself dies (its end of this process's stdin closes): everything here is killed.

The local executor's task processes announce themselves as the pool forks them (``taskpool``).

This process is a child subreaper, so processes below it stay below it when their parent dies
(Ray's agents among them) and are found and killed too. A stage of one item runs here directly,
without an executor (the task it would start would do the same). The result is one JSON object
written to RESULT: ``{"ok": true, "cores": N}``, ``{"died": {...}}`` or ``{"failed": {...}}``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import traceback

from lmforge.data import remote
from lmforge.data.prepare.job import Job, Stage, StageTask, WorkDir, settle
from lmforge.process import become_subreaper, die_with_parent, kill_tree, process_start


def main(payload: str, result: str) -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack into the executor log
    become_subreaper()
    os.environ[RUNNER] = str(os.getpid())
    _forks_die_with_me()
    # The lifeline moves off stdin: processes forked below close their stdin, which must not wait
    # for a reader's lock held by the thread that watches it.
    lifeline = os.dup(0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    threading.Thread(target=_lifeline, args=(lifeline,), daemon=True).start()
    try:
        with open(payload, "rb") as f:
            job, stages, spec = pickle.load(f)
        if spec.kind == "ray":
            _start_ray(result)
        out = run_stages(job, stages, spec)
    except BaseException as e:  # noqa: BLE001 - reported to the command, which prints it
        out = {"failed": {"stage": None, "message": _one_line(e), "traceback": traceback.format_exc()}}
    _write(result, out)
    _end(0)


def _write(result: str, out: dict) -> None:
    with open(result + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(result + ".tmp", result)


class _Anchor:
    """What the after-fork hook hangs on (multiprocess keeps its hooks by a weak reference to an object)."""


_ANCHOR = _Anchor()


def _forks_die_with_me() -> None:
    """Processes this one forks (a pool's manager) die with it: one forked while ``_end`` takes the
    tree down, after its last look, would otherwise outlive it (the fork server and the task
    processes see to themselves: ``taskpool``)."""
    from multiprocess import util

    runner = os.getpid()
    util.register_after_fork(_ANCHOR, lambda _: die_with_parent(runner))


def _lifeline(fd: int) -> None:
    """Read the command's pipe to its end: the command holds the other end, so EOF means it is gone."""
    try:
        while os.read(fd, 1 << 16):
            pass
    finally:
        _end(1)


_TREE = threading.Lock()  # one thread at a time takes the tree down: a second would stop what the first then leaves


def _end(code: int) -> None:
    """Kill everything below this process and exit at once (no interpreter shutdown: exit handlers
    of a process pool left behind would wait for it). A second caller waits for the first's exit."""
    _TREE.acquire()
    kill_tree(os.getpid(), include_root=False)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:  # the orphans re-parented to us
            pass
    except ChildProcessError:
        pass
    if os.environ.get(ANNOUNCE):
        shutil.rmtree(os.environ[ANNOUNCE], ignore_errors=True)
    os._exit(code)


def run_stages(job: Job, stages: list[Stage], spec) -> dict:
    wd = WorkDir(job.out)
    cores = _cores(spec)
    for stage in stages:
        if stage.items - len(wd.done(stage.name)) <= 0 or settle(job, stage):
            continue
        outcome = _run_stage(job, stage, spec, wd)
        if spec.kind == "local":  # the stage's pool, its manager and fork server (Ray's cluster stays)
            with _TREE:
                kill_tree(os.getpid(), include_root=False)
        if outcome is not None:
            return outcome
    return {"ok": True, "cores": cores}


def _run_stage(job: Job, stage: Stage, spec, wd: WorkDir) -> dict | None:
    tasks = min(spec.tasks, stage.items)
    ended = threading.Event()
    raised: list[BaseException] = []

    def work() -> None:
        try:
            _executor(job, stage, spec, tasks)
        except BaseException as e:  # noqa: BLE001 - the markers and work/errors say what happened
            raised.append(e)
        finally:
            ended.set()

    watch = _PoolWatch() if spec.kind == "local" and tasks > 1 else None  # before the pool forks
    threading.Thread(target=work, daemon=True).start()
    interval = 2.0 if remote.is_remote(job.out) else 0.2
    while True:
        finished = ended.wait(interval)
        if stage.items - len(wd.done(stage.name)) <= 0:
            return None
        if wd.names("errors"):
            return {"failed": {"stage": stage.name}}
        if finished:
            return {"failed": {"stage": stage.name, "message": _one_line(raised[0]) if raised else None}}
        dead = watch.dead() if watch is not None else None
        if dead is not None:
            return {"died": {"stage": stage.name, "pid": dead}}


def _executor(job: Job, stage: Stage, spec, tasks: int) -> None:
    logs = remote.datatrove_folder(WorkDir(job.out).uri("logs", stage.name))
    if tasks == 1:
        StageTask(job, stage, os.cpu_count() or 1)(None, 0, 1)
    elif spec.kind == "local":
        import multiprocess
        from datatrove.executor import LocalPipelineExecutor

        _announced()  # before the fork server starts: it inherits the folder's name
        multiprocess.get_context("forkserver").set_forkserver_preload(["lmforge.data.prepare.job", "lmforge.data.prepare.taskpool"])

        threads = max(1, (os.cpu_count() or 1) // tasks)
        # skip_completed off: the items' own markers say what is done, whatever the task count was
        LocalPipelineExecutor([StageTask(job, stage, threads)], tasks=tasks, workers=tasks, logging_dir=logs,
                              skip_completed=False).run()
    else:
        from datatrove.executor import RayPipelineExecutor

        RayPipelineExecutor([StageTask(job, stage, spec.cpus_per_task)], tasks=tasks, workers=tasks,
                            logging_dir=logs, skip_completed=False, cpus_per_task=spec.cpus_per_task,
                            mem_per_cpu_gb=1).run()


class _PoolWatch:
    """The local executor's task processes, each announced by itself as its pool forks it (before it
    can take any work: ``taskpool``). One that ends while the stage runs is a lost task: the pool
    retires none of its processes meanwhile, and a task killed a moment after it took its work
    leaves no other trace."""

    def __init__(self):
        self.old = set(os.listdir(_announced()))  # an earlier stage's

    def dead(self) -> int | None:
        folder = _announced()
        for name in sorted(set(os.listdir(folder)) - self.old):
            try:
                with open(os.path.join(folder, name)) as f:
                    start = f.read()
            except OSError:
                continue
            if start and process_start(int(name)) != start:
                return int(name)
        return None


ANNOUNCE = "LMFORGE_TASK_PROCESSES"  # the folder where the local executor's task processes announce themselves
RUNNER = "LMFORGE_RUNNER_PID"  # this process, which the pool's fork server dies with


def _announced() -> str:
    folder = os.environ.get(ANNOUNCE)
    if folder is None:
        import tempfile

        folder = os.environ[ANNOUNCE] = tempfile.mkdtemp(prefix="lmforge-tasks-")
    return folder


RAY_START_SECONDS = 180


def _start_ray(result: str) -> None:
    """Join the cluster ``RAY_ADDRESS`` names, or start a local Ray instance (below this process),
    within a bounded time: a cluster that accepts connections but never answers is one line too.
    In the main thread: Ray's processes die with the thread that started them."""
    import ray

    def give_up() -> None:
        where = os.environ.get("RAY_ADDRESS") or "a local instance"
        _write(result, {"failed": {"stage": None, "message": f"Ray did not start or answer within "
                                                             f"{RAY_START_SECONDS} s ({where})"}})
        _end(1)

    timer = threading.Timer(RAY_START_SECONDS, give_up)
    timer.daemon = True
    timer.start()
    try:
        ray.init(log_to_driver=False, include_dashboard=False)
    finally:
        timer.cancel()


def _cores(spec) -> int:
    """The cores the job ran on: this machine's (the tokenizer's threads fill every core, whatever the
    number of tasks), or on Ray the tasks' share of the cluster."""
    machine = os.cpu_count() or 1
    if spec.kind == "ray":
        import ray

        return int(min(spec.tasks * spec.cpus_per_task, ray.cluster_resources().get("CPU", machine)))
    return machine


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__

