"""The pieces that keep a run's processes honest, in-process and in seconds: the launch plan
(which process is what), the save folder's lock, the hang watchdog, run names and ids, the
registry's lifecycle, and how the supervisor reads failures. The end-to-end behaviour with real
supervisors, torchrun and kills is in test_runs.py and bench/faults.py."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from argparse import Namespace

import pytest

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.errors import UserError
from lmforge.runs.lock import REMOTE_STALE_S, SaveFolderLock, lock_path, probe, read_holder
from lmforge.runs.launch_plan import LaunchPlan, launch_plan, started_by_user, with_plan
from lmforge.process import read_status, this_host
from lmforge.runs.registry import TORCHRUN_RESTART, Registry, status_file
from lmforge.runs.start import check_not_active, register, resolve_run
from lmforge.runs.supervisor import failure_reason, report_status
from lmforge.train.watchdog import HangWatchdog, stack_lines


def cfg_for(tiny_data, folder, **overrides):
    return build_config(tiny_run_config(tiny_data, folder, **overrides))


def args(**kw) -> Namespace:
    base = {"plan": None, "detach": False, "no_supervisor": False, "command": "train", "file": None, "model": None,
            "weights": None, "training_duration": None, "nnodes": None, "node_rank": None, "rdzv_endpoint": None,
            "max_retries": None, "train_data": None, "set": [], "json": False, "overwrite": False,
            "no_autoresume": False}
    return Namespace(**(base | kw))


# --------------------------------------------------------------------------- the launch plan

def test_launch_plan_decides_each_process_role(tiny_data, tmp_path):
    one = cfg_for(tiny_data, tmp_path / "r")
    two = cfg_for(tiny_data, tmp_path / "r", **{"compute.ranks": 2})
    assert launch_plan(args(), one, {}) == LaunchPlan("supervise")
    assert launch_plan(args(detach=True), two, {}) == LaunchPlan("detach", nproc=2)
    plan = launch_plan(args(no_supervisor=True), two, {})
    assert (plan.role, plan.lock, plan.nproc, plan.max_restarts) == ("launch", "claim", 2, 2)
    assert started_by_user(args(), {}) and not started_by_user(args(plan=plan.to_arg()), {})
    assert not started_by_user(args(), {"WORLD_SIZE": "2", "RANK": "1"})  # credentials: checked by rank 0
    assert launch_plan(args(no_supervisor=True), one, {}).role == "train"
    assert launch_plan(args(), one, {"LMFORGE_NO_SUPERVISOR": "1"}).role == "train"
    # a torchrun the user started by hand: every worker trains; rank 0 alone claims the folder
    assert launch_plan(args(), one, {"WORLD_SIZE": "2", "RANK": "0"}).lock == "claim"
    assert launch_plan(args(), one, {"WORLD_SIZE": "2", "RANK": "1"}).lock == "none"
    # node 1 of a multi-node run: no supervisor and no lock (node 0 has both)
    node1 = cfg_for(tiny_data, tmp_path / "r", **{"compute.nodes": 2, "compute.node_rank": 1,
                                                 "compute.rdzv_endpoint": "127.0.0.1:1"})
    assert launch_plan(args(), node1, {}).role == "launch" and launch_plan(args(), node1, {}).lock == "none"
    with pytest.raises(UserError, match="--detach"):
        launch_plan(args(detach=True, no_supervisor=True), one, {})


def test_a_plan_travels_as_one_argument_and_replaces_the_old_one(tiny_data, tmp_path):
    parent = LaunchPlan("supervise", run_uid="abc", nproc=2)
    child = parent.child("launch", lock="join", status_file="/x/s.json", max_restarts=1)
    assert child.parent_pid == os.getpid() and child.run_uid == "abc"
    argv = with_plan(["train", "-f", "x.yaml", "--plan", parent.to_arg()], child)
    assert argv[:3] == ["train", "-f", "x.yaml"] and argv.count("--plan") == 1
    assert LaunchPlan.from_arg(argv[-1]) == child
    # the plan given to a process is the one it runs (a supervisor re-sizes the run itself)
    one = cfg_for(tiny_data, tmp_path / "r")
    assert launch_plan(args(plan=child.to_arg()), one, {}) == child
    assert launch_plan(args(plan=parent.to_arg()), one, {}).nproc is None
    for bad in ("{", '{"role": "boss"}', '{"role": "train", "colour": 1}'):
        with pytest.raises(UserError, match="--plan"):
            LaunchPlan.from_arg(bad)


@pytest.mark.parametrize("argv,needle", [
    (["--max-retries", "-1"], "--max-retries"),  # refused by the flag's own bound
    (["--set", "compute.hang_timeout=2"], "hang_timeout: 2s is below the floor of 5s"),
    (["--set", "compute.hang_timeout=10ba"], "hang_timeout"),
])
def test_bad_retry_and_hang_settings_are_one_line(tiny_data, tmp_path, capsys, argv, needle):
    from lmforge.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_run_config(tiny_data, tmp_path / "r")))
    try:
        code = main(["train", "-f", str(cfg), *argv])
    except SystemExit as e:  # argparse refuses a flag's value (`cli.common.OneLineParser`)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- the save folder's lock

def test_one_run_per_save_folder(tmp_path):
    folder = str(tmp_path / "run")
    a = SaveFolderLock.claim(folder, run_uid="uid-a", name="a")
    assert read_holder(folder)["run_uid"] == "uid-a"
    with pytest.raises(UserError, match=r"in use: a process of run 'a' is still running"):
        SaveFolderLock.claim(folder, run_uid="uid-b", name="b", wait_s=0.2)
    with pytest.raises(UserError, match="in use"):
        probe(folder)
    rank = SaveFolderLock.join(folder, "uid-a")  # a process of the same run
    with pytest.raises(UserError, match="now belongs to run 'a'"):
        SaveFolderLock.join(folder, "uid-other")
    assert not a.alone()  # the claimer sees its run's other processes ...
    rank.release()
    assert a.alone()  # ... until they have exited
    a.release()
    b = SaveFolderLock.claim(folder, run_uid="uid-b", name="b", wait_s=0.2)  # free once every process left
    b.release()


@pytest.mark.e2e
def test_a_lock_held_by_another_process_until_it_dies(tmp_path):
    folder = tmp_path / "run"
    SaveFolderLock.claim(str(folder), run_uid="u", name="old").release()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_SH); "
        "print('held', flush=True); time.sleep(120)"), lock_path(str(folder))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="run 'old' is still running"):
            SaveFolderLock.claim(str(folder), run_uid="new", name="new", wait_s=0.2)
    finally:
        holder.kill()
        holder.wait()
    SaveFolderLock.claim(str(folder), run_uid="new", name="new", wait_s=0.2).release()  # the kernel let go


@pytest.mark.e2e
def test_stale_locks_are_taken_over_and_live_remote_ones_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = lock_path(str(folder))
    with open(path, "w") as f:  # written by a process of this host that is gone
        json.dump({"run_uid": "old", "name": "old", "host": os.uname().nodename, "pid": dead.pid,
                   "pid_start": "x"}, f)
    SaveFolderLock.claim(str(folder), run_uid="new", name="new", wait_s=0.1).release()
    with open(path, "w") as f:  # another host, refreshed just now: presumed alive there
        json.dump({"run_uid": "far", "name": "far", "host": "elsewhere.example", "pid": 1}, f)
    with pytest.raises(UserError, match="locked by run 'far' .* on elsewhere.example.*taken over once it has not"):
        SaveFolderLock.claim(str(folder), run_uid="new", name="new", wait_s=0.1)
    old = time.time() - REMOTE_STALE_S - 1
    os.utime(path, (old, old))  # not refreshed for longer than the rule allows: stale
    SaveFolderLock.claim(str(folder), run_uid="new", name="new", wait_s=0.1).release()
    assert read_holder(str(folder))["run_uid"] == "new"


# --------------------------------------------------------------------------- the hang watchdog

@pytest.mark.integration
def test_watchdog_fires_after_the_timeout_not_while_paused():
    fired = threading.Event()
    got = []
    # A timeout far above any stall of a loaded machine between the last beat and the pause.
    dog = HangWatchdog(2.0, rank=3, on_hang=lambda *a: (got.append(a), fired.set()))
    for step in range(1, 4):
        dog.beat(step)
    with dog.paused():  # an evaluation or a checkpoint write: not timed
        assert not fired.wait(2.5)
    assert fired.wait(30)
    rank, silent, timeout = got[0]
    assert rank == 3 and silent >= 2.0 and timeout == 2.0
    dog.close()


def test_the_hang_line_promises_a_restart_only_when_one_is_allowed():
    from lmforge.runs.supervisor import HANG_MARK
    from lmforge.train.watchdog import hang_line

    assert HANG_MARK in hang_line(0, 400, 300) and "restarts from its latest checkpoint" in hang_line(0, 400, 300)
    line = hang_line(1, 400, 300, restarts=False)
    assert "max_retries is 0" in line and "not restarted" in line and "restarts from" not in line


def test_watchdog_default_is_a_multiple_of_the_median_step_with_a_floor():
    dog = HangWatchdog(None, floor_s=0.01, multiple=10, on_hang=lambda *a: None)
    assert dog.timeout() == 0.01  # before any step: the floor
    for step in range(1, 6):
        dog.beat(step)
        time.sleep(0.02)
    assert 0.2 <= dog.timeout() < 1.0
    assert HangWatchdog(None, floor_s=300, on_hang=None).timeout() == 300
    dog.close()


def test_a_hang_dump_names_the_rank_on_every_line_and_shows_where_each_thread_waits():
    """Two ranks dump into one log at once: every line carries its rank, and a blocked thread's
    stack ends in the function it waits in."""
    release = threading.Event()

    def stuck_in_here():
        release.wait()

    t = threading.Thread(target=stuck_in_here, name="stuck")
    t.start()
    try:
        lines = stack_lines(7)
    finally:
        release.set()
        t.join()
    assert lines and all(ln.startswith("[rank 7] ") and ln.endswith("\n") and ln.count("\n") == 1 for ln in lines)
    stuck = lines.index("[rank 7] Thread stuck (most recent call last):\n")
    assert any("in stuck_in_here" in ln for ln in lines[stuck:])
    assert any("Thread MainThread" in ln for ln in lines)


# --------------------------------------------------------------------------- names, ids, lifecycle

def test_names_are_unique_and_the_same_command_continues_its_run(tiny_data, tmp_path):
    reg = Registry(str(tmp_path / "runs.db"))
    base = {"name": "exp"}
    cfg = cfg_for(tiny_data, tmp_path / "a", **base)
    first = resolve_run(reg, cfg)
    assert (first.name, first.existing) == ("exp", None)
    register(reg, cfg, args(), first, LaunchPlan("supervise"))
    (tmp_path / "a").mkdir()
    again = resolve_run(reg, cfg)  # the same command, the same folder: the same run
    assert again.name == "exp" and again.run_uid == first.run_uid and again.existing is not None
    with pytest.raises(UserError, match="already STARTING"):
        check_not_active(again)  # (the supervisor that registered it is this live process)
    reg.put("exp", {"status": "COMPLETED"})
    # the same name in another folder: a short suffix, the folder as given
    other = cfg_for(tiny_data, tmp_path / "b", **base)
    second = resolve_run(reg, other)
    assert second.name.startswith("exp-") and len(second.name) == 8 and second.save_folder == str(tmp_path / "b")
    assert second.run_uid != first.run_uid
    register(reg, build_config(tiny_run_config(tiny_data, tmp_path / "b", name=second.name)), args(), second,
             LaunchPlan("supervise"))
    reg.put(second.name, {"status": "FAILED"})
    assert resolve_run(reg, other).name == second.name  # re-running that command finds its suffixed run
    # a run whose save folder is gone does not hold its name
    (tmp_path / "a").rmdir()
    reborn = resolve_run(reg, cfg_for(tiny_data, tmp_path / "c", **base))
    assert reborn.name == "exp" and reborn.replaces is not None and reborn.run_uid != first.run_uid


def test_registry_keeps_the_lifecycle_and_finds_runs_by_uid(tmp_path):
    reg = Registry(str(tmp_path / "runs.db"))
    reg.put("r", {"run_uid": "u1", "run_type": "pretrain", "status": "STARTING"})
    reg.put("r", {"status": "RUNNING"})
    reg.put("r", {"metrics": {"step": 3}})  # no status change: nothing added
    reg.put("r", {"status": "COMPLETED"})
    row = reg.get("u1")
    assert row["name"] == "r" and [s["status"] for s in row["lifecycle"]] == ["STARTING", "RUNNING", "COMPLETED"]
    times = [s["time"] for s in row["lifecycle"]]
    assert times == sorted(times)


@pytest.mark.e2e
def test_restarts_a_lost_supervisor_never_saw_become_resumptions(tmp_path):
    """The supervisor was SIGKILLed after torchrun restarted the ranks twice but before it looked
    at the status file: whoever finds the run lost records those restarts from that file."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reg = Registry(str(tmp_path / "runs.db"))
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    reg.put("r", {"run_type": "pretrain", "status": "RUNNING", "host": this_host(), "supervisor_pid": gone.pid,
                  "log_dir": logs})
    for _ in range(2):  # the first start, then a supervisor retry, both recorded
        idx, _ = reg.start_resumption("r", logs)
    reg.set_resumption("r", 0, status="FAILED", reason="killed by SIGKILL", ended_at=time.time())
    with open(status_file(logs, 0), "w") as f:  # the old training process's file: not the open one's
        json.dump({"status": "started", "attempt": 0}, f)
    with open(status_file(logs, 1), "w") as f:
        json.dump({"status": "started", "attempt": 2}, f)
    row = reg.mark_lost_if_dead(reg.get("r"))
    assert row["status"] == "FAILED" and row["reason"] == "lost"
    got = [(r["idx"], r["status"], r["reason"]) for r in row["resumptions"]]
    assert got == [(0, "FAILED", "killed by SIGKILL"), (1, "FAILED", TORCHRUN_RESTART), (2, "FAILED", TORCHRUN_RESTART),
                   (3, "FAILED", "lost")]
    assert row["resumptions"][3]["log_path"] == row["resumptions"][1]["log_path"]  # they wrote to one log
    # nothing to add when the supervisor had seen them all (or no status file was written yet)
    reg.put("q", {"run_type": "pretrain", "status": "RUNNING", "host": this_host(), "supervisor_pid": gone.pid,
                  "log_dir": str(tmp_path / "none")})
    reg.start_resumption("q", str(tmp_path / "none"))
    assert [r["reason"] for r in reg.mark_lost_if_dead(reg.get("q"))["resumptions"]] == ["lost"]


def test_a_registry_of_the_previous_schema_is_upgraded_in_place(tmp_path):
    path = tmp_path / "runs.db"
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE runs (name TEXT PRIMARY KEY, run_type TEXT NOT NULL, status TEXT NOT NULL, reason TEXT,
            created_at REAL NOT NULL, started_at REAL, updated_at REAL NOT NULL, completed_at REAL, model TEXT,
            config TEXT, identity TEXT, save_folder TEXT, log_dir TEXT, command TEXT, cwd TEXT, host TEXT,
            supervisor_pid INTEGER, supervisor_start TEXT, child_pid INTEGER, ranks INTEGER, max_retries INTEGER,
            metrics TEXT);
        CREATE TABLE resumptions (run_name TEXT NOT NULL, idx INTEGER NOT NULL, started_at REAL NOT NULL,
            ended_at REAL, status TEXT NOT NULL, reason TEXT, exit_code INTEGER, log_path TEXT,
            PRIMARY KEY (run_name, idx));
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, run_name TEXT NOT NULL, time REAL NOT NULL,
            type TEXT NOT NULL, message TEXT);
        INSERT INTO runs (name, run_type, status, created_at, updated_at) VALUES ('old', 'pretrain', 'COMPLETED', 1, 1);
        PRAGMA user_version=1;""")
    con.close()
    row = Registry(str(path)).get("old")
    assert row["status"] == "COMPLETED" and len(row["run_uid"]) == 12


# --------------------------------------------------------------------------- what the supervisor reads

@pytest.mark.e2e
def test_status_file_and_failure_reasons(tmp_path):
    plan = LaunchPlan("train", status_file=str(tmp_path / "s.json"))
    report_status(plan, "started", attempt=0)
    assert read_status(plan.status_file) == {"status": "started", "attempt": 0}
    report_status(plan, "failed", error="bad", exit_code=2)
    report_status(plan, "started", attempt=1)  # a later start never hides a failure that must not be retried
    assert read_status(plan.status_file)["status"] == "failed"
    report_status(LaunchPlan("train"), "completed")  # not supervised: nothing to write
    torchrun = ["[rank0]: RuntimeError: Connection reset by peer",
                "E1123 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 "
                "(pid: 9888) of binary: python"]
    assert failure_reason(1, torchrun) == "rank 1 killed by SIGKILL"
    # the survivor's broken collective is not the killed rank's reason
    broken = ["Traceback (most recent call last):", '  File "t.py", line 9, in step',
              "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:32172", *torchrun[1:]]
    assert failure_reason(1, broken) == "rank 1 killed by SIGKILL"
    summary = ["  time      : 2026-11-23_02:51:26", "  rank      : 0 (local_rank: 0)", "  exitcode  : 4 (pid: 1)"]
    assert failure_reason(1, summary) == "rank 0 exit code 4"
    hang = ["lmforge: hang detected on rank 1: no training step completed for 5s (compute.hang_timeout 5s); "
            "Python stacks of its threads follow", 'File "x.py", line 3 in beat']
    assert failure_reason(4, hang) == ("hang detected on rank 1: no training step completed for 5s "
                                       "(compute.hang_timeout 5s)")
    assert failure_reason(-9, []) == "killed by SIGKILL"
    # A crash: the exception's own line, not only "exit code 1" (the last of a chained traceback)
    crash = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "KeyError: 'x'", "",
             "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", '  File "a.py", line 3, in <module>',
             "    torch.optim.AdamW(params, betas=(1.5, 0.95))",
             "ValueError: Invalid beta parameter at index 0: 1.5", "lmforge: something after it"]
    assert failure_reason(1, crash) == "exit code 1: ValueError: Invalid beta parameter at index 0: 1.5"
    ranked = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "a.py", line 3, in f',
              "[rank1]: RuntimeError: CUDA error: out of memory", *torchrun]
    assert failure_reason(1, ranked) == "rank 1 killed by SIGKILL: RuntimeError: CUDA error: out of memory"


def test_runs_list_shows_why_a_run_failed(tmp_path, monkeypatch):
    from train_helpers import cli

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    error = ("gradient norm became nan at step 4 (loss 7.625); stopped without saving. Last good checkpoint: "
             "none. Try a lower parameters.learning_rate (0.003 now)")
    reg = Registry()
    reg.put("broken", {"run_type": "pretrain", "status": "FAILED", "reason": error})
    reg.put("fine", {"run_type": "pretrain", "status": "COMPLETED"})
    out = cli("runs", "list", check=True).stdout.splitlines()
    assert out[0].split()[-1] == "REASON"
    row = next(ln for ln in out if ln.startswith("broken "))
    assert "gradient norm became nan at step 4" in row and row.endswith("…") and len(row) < 180, row
    assert next(ln for ln in out if ln.startswith("fine ")).split()[-1] != "…"


@pytest.mark.e2e
def test_torchrun_wrapper_returns_the_ranks_code_when_torchrun_gives_up_first(tmp_path):
    """The torchrun wrapper of an unsupervised run with no restart left: the rank reported a final
    failure and exited 3, and torchrun ends in its own ChildFailedError before the wrapper's
    watcher stops it (here: the reported process is still alive, so the watcher waits). The
    wrapper returns the rank's code, quietly (torchrun's traceback and exit 1 otherwise)."""
    status = tmp_path / "status.json"
    script = tmp_path / "rank.py"
    record = {"status": "failed", "exit_code": 3, "pid": os.getpid()}
    script.write_text(f"import json, sys\njson.dump({record!r}, open({str(status)!r}, 'w'))\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-m", "lmforge.distributed.torchrun", f"--status-file={status}",
                           "--nproc-per-node=1", "--max-restarts=0", "--standalone", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert not status.exists()  # the wrapper removes its status file


def test_an_unknown_run_name_lists_some_known_runs_and_counts_the_rest():
    """`no run named X`: up to ten known names, then how many more there are (not a silent cut)."""
    from lmforge.runs.run import known_runs

    names = [f"run-{i:02d}" for i in range(13)]
    hint = known_runs(names)
    assert hint.startswith("; known runs: run-00, run-01") and "run-09" in hint and "run-10" not in hint
    assert hint.endswith("and 3 more (`lmforge runs list` shows them all)")
    assert known_runs(names[:10]) == "; known runs: " + ", ".join(names[:10])
    assert known_runs([]) == "; the registry has no runs yet"


def test_runs_list_shows_the_share_done_of_epoch_and_time_budgets():
    """An epoch- or time-bounded run has no total in its config that `runs list` could divide by: the
    share the trainer logs (`train/progress`) gives its percentage and ETA, as `ba`/`tok` runs get."""
    from lmforge.cli.runs import progress_text
    from lmforge.runs.progress import summarize

    record = {"step": 3, "train/loss": 2.0, "train/tokens": 1536, "time/elapsed_s": 30.0, "train/progress": 0.5}
    for duration in ("2ep", "30min", "4000sp"):
        m = summarize(record, {"training_duration": duration})
        assert (m["progress"], m["eta_s"], progress_text(m)) == (0.5, 30.0, "50% step 3"), duration
    old = summarize({k: v for k, v in record.items() if k != "train/progress"}, {"training_duration": "2ep"})
    assert (old["progress"], progress_text(old)) == (None, "step 3")  # a record of an older version
    assert summarize(record, {"training_duration": "6ba"})["progress"] == 0.5
