"""Runs: detached training, the registry, `lmforge runs ...`, retries and the SDK — all with real
processes (detached supervisors, trainers, kill -9) on tiny models."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import tiny_run_config
from train_helpers import REPO, assert_one_line_error, cli, env, metrics, train_losses, write_config

import lmforge as sdk
from lmforge.errors import UserError
from lmforge.runs.registry import process_alive, registry_path


def lmforge(*args, check=False, **extra_env) -> subprocess.CompletedProcess:
    """`lmforge ...` in a subprocess with no terminal on stdin (so nothing prompts)."""
    proc = subprocess.run([sys.executable, "-m", "lmforge", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env(**extra_env), cwd=REPO, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"lmforge {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def config(tmp_path, tiny_data, name, **overrides):
    folder = tmp_path / name
    return write_config(tmp_path / f"{name}.yaml", tiny_run_config(tiny_data, folder, name=name, **overrides)), folder


def wait_for(name, predicate, timeout=180, what="condition"):
    deadline = time.time() + timeout
    seen = []
    while time.time() < deadline:
        run = sdk.get_run(name)
        if not seen or seen[-1] != run.status:
            seen.append(run.status)
        if predicate(run):
            return run, seen
        assert not (run.is_terminal and not predicate(run)), (what, run, seen, run.logs()[-2000:])
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {seen}")


@pytest.fixture(autouse=True)
def _no_leftover_runs(monkeypatch):
    """Fast retries, one thread per process, and nothing left running after a test."""
    monkeypatch.setenv("LMFORGE_RETRY_DELAY", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = {r.name for r in sdk.get_runs() if not r.is_terminal}
    yield
    for run in sdk.get_runs():
        if not run.is_terminal and run.name not in before:
            run.stop(force=True)


def detach(cfg, *extra):
    proc = lmforge("train", "-f", cfg, "--detach", *extra, check=True)
    return proc.stdout.strip().splitlines()[0]


def test_detached_runs_side_by_side_complete(tmp_path, tiny_data):
    """Two detached runs at once: each reaches RUNNING then COMPLETED with its own files."""
    cfg_a, folder_a = config(tmp_path, tiny_data, "side-a", training_duration="40ba")
    cfg_b, folder_b = config(tmp_path, tiny_data, "side-b", training_duration="30ba",
                             **{"parameters.learning_rate": 1e-3})
    assert detach(cfg_a) == "side-a"
    assert not sdk.get_run("side-a").is_terminal  # returned once registered, not after training
    _, seen_a = wait_for("side-a", lambda r: r.status == "RUNNING", what="side-a running")
    assert detach(cfg_b, "--price-per-gpu-hour", "3") == "side-b"  # forwarded to the supervised trainer
    run_a, seen = wait_for("side-a", lambda r: r.status == "COMPLETED", what="side-a completed")
    run_b, _ = wait_for("side-b", lambda r: r.status == "COMPLETED", what="side-b completed")
    assert seen_a[-1] == "RUNNING" and seen[-1] == "COMPLETED", (seen_a, seen)
    assert max(train_losses(folder_a)) == 40 and max(train_losses(folder_b)) == 30
    assert train_losses(folder_a)[5] != train_losses(folder_b)[5]  # different learning rates, no mix-up
    for run, folder in ((run_a, folder_a), (run_b, folder_b)):
        assert run.save_folder == str(folder) and (folder / "final" / "model.safetensors").exists()
        assert [r["status"] for r in run.resumptions] == ["COMPLETED"]
        assert "completed after" in run.logs()
        assert run.latest_metrics["step"] == max(train_losses(folder))
        assert run.completed_at >= run.started_at >= run.created_at
    listing = lmforge("runs", "list", check=True).stdout
    row = next(ln for ln in listing.splitlines() if ln.startswith("side-a "))
    assert "COMPLETED" in row and "pretrain" in row and "100%" in row
    as_json = json.loads(lmforge("runs", "list", "--status", "completed", "--json", check=True).stdout)
    assert {"side-a", "side-b"} <= {r["name"] for r in as_json}
    described = lmforge("runs", "describe", "side-b", check=True).stdout
    assert "COMPLETED" in described and str(folder_b / "logs" / "resumption-0.log") in described
    # [report] live cost: the price reached the trainer; describe shows what the run cost
    last = [r for r in metrics(folder_b) if "train/loss" in r][-1]
    assert last["cost/per_hour"] == 3.0 and run_b.latest_metrics["cost"] == last["cost/so_far"] > 0
    assert re.search(r"^cost\s+\S+ so far .*at 3 per device-hour", described, re.M), described
    # every run leaves its report; `lmforge report` takes registry names
    assert (folder_a / "report.html").exists() and (folder_b / "report.html").exists()
    page = tmp_path / "ab.html"
    assert cli("report", "side-a", "side-b", "--out", page).returncode == 0  # in this process: no start-up
    assert "resumption 0: COMPLETED" in page.read_text()
    # a finished run cannot be stopped again: said so, exit 0
    again = lmforge("runs", "stop", "side-a", check=True)
    assert "already ended: COMPLETED" in again.stdout


def test_stop_restart_and_bad_input_on_a_live_run(tmp_path, tiny_data):
    cfg, folder = config(tmp_path, tiny_data, "stopper", training_duration="2000ba", save_interval="1000ba")
    detach(cfg)
    wait_for("stopper", lambda r: (r.latest_metrics.get("step") or 0) >= 2, what="training steps")

    # while it runs: collisions, deletion and unknown names are refused in one line
    assert_one_line_error(lmforge("train", "-f", cfg, "--detach"), "already RUNNING", "runs stop stopper")
    other, _ = config(tmp_path, tiny_data, "elsewhere")
    clash = lmforge("train", "-f", other, "--name", "stopper")
    assert_one_line_error(clash, "taken by an active run", "save_folder")
    assert_one_line_error(lmforge("runs", "delete", "stopper", "--yes"), "is RUNNING", "--force")
    assert_one_line_error(lmforge("runs", "describe", "stoper"), "no run named 'stoper'", "stopper")

    stop = lmforge("runs", "stop", "stopper", check=True)
    assert "STOPPED" in stop.stdout
    run = sdk.get_run("stopper")
    assert run.status == "STOPPED" and "with a checkpoint" in run.reason
    ckpts = list((folder / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and int(ckpts[0].name.split("_")[1]) >= 2
    assert [e["type"] for e in run.events][-2:] == ["stop", "end"]

    # restart: a new resumption continuing from that checkpoint, then stopped again
    restarted = lmforge("runs", "restart", "stopper", check=True)
    assert "restarted" in restarted.stdout
    run, _ = wait_for("stopper", lambda r: len(r.resumptions) == 2 and r.status == "RUNNING", what="restart")
    sdk.get_run("stopper").stop()
    run = sdk.get_run("stopper")
    assert run.status == "STOPPED"
    assert "resume: continuing from" in run.logs(resumption=1)
    assert "resume: continuing from" not in run.logs(resumption=0)
    assert lmforge("runs", "logs", "stopper", "--resumption", "1", check=True).stdout == run.logs(1)

    # delete needs --yes without a terminal; --purge removes the files
    assert_one_line_error(lmforge("runs", "delete", "stopper"), "--yes")
    lmforge("runs", "delete", "stopper", "--yes", "--purge", check=True)
    assert not folder.exists()
    assert_one_line_error(lmforge("runs", "describe", "stopper"), "no run named")


def test_kill9_of_the_trainer_is_retried_and_completes(tmp_path, tiny_data):
    cfg, folder = config(tmp_path, tiny_data, "retry", training_duration="60ba", save_interval="3ba")
    detach(cfg)
    run, _ = wait_for("retry", lambda r: max(train_losses(folder), default=0) >= 4 and r.child_pid,
                      what="a checkpoint")
    victim = run.child_pid
    os.kill(victim, signal.SIGKILL)
    run, _ = wait_for("retry", lambda r: r.status == "COMPLETED", what="completion after a retry")
    assert [r["status"] for r in run.resumptions] == ["FAILED", "COMPLETED"]
    assert run.resumptions[0]["reason"] == "killed by SIGKILL" and run.resumptions[0]["exit_code"] == -9
    kinds = [e["type"] for e in run.events]
    assert "failure" in kinds and "retry" in kinds
    failure = next(e for e in run.events if e["type"] == "failure")
    assert "last log lines" in failure["message"] and "step" in failure["message"]
    assert "resume: continuing from" in run.logs()
    assert max(train_losses(folder)) == 60 and (folder / "final" / "model.safetensors").exists()


def test_exceeding_max_retries_fails_with_the_reason(tmp_path, tiny_data):
    cfg, _ = config(tmp_path, tiny_data, "doomed", training_duration="2000ba", max_retries=1)
    detach(cfg)
    killed = set()
    for _ in range(2):
        run, _ = wait_for("doomed", lambda r: r.child_pid and r.child_pid not in killed, what="a trainer")
        killed.add(run.child_pid)
        os.kill(run.child_pid, signal.SIGKILL)
    run, _ = wait_for("doomed", lambda r: r.is_terminal, what="the end")
    assert run.status == "FAILED"
    assert "killed by SIGKILL" in run.reason and "max_retries=1" in run.reason
    assert [r["status"] for r in run.resumptions] == ["FAILED", "FAILED"]


def test_kill9_of_everything_is_detected_as_lost(tmp_path, tiny_data):
    cfg, folder = config(tmp_path, tiny_data, "vanish", training_duration="2000ba")
    detach(cfg)
    run, _ = wait_for("vanish", lambda r: r.status == "RUNNING" and r.child_pid, what="RUNNING")
    child, sup = run.child_pid, run.supervisor_pid
    os.kill(sup, signal.SIGKILL)
    deadline = time.time() + 30
    while process_alive(child, None) and time.time() < deadline:  # the kernel kills it (PDEATHSIG)
        time.sleep(0.05)
    assert not process_alive(child, None), "the trainer outlived its supervisor"
    row = next(ln for ln in lmforge("runs", "list", check=True).stdout.splitlines() if ln.startswith("vanish "))
    assert "FAILED (lost)" in row
    run = sdk.get_run("vanish")
    assert run.reason == "lost" and run.resumptions[-1]["status"] == "FAILED"
    assert run.events[-1]["type"] == "lost"
    # re-running the same command continues the same run as a new resumption
    again = lmforge("train", "-f", cfg, "--training-duration", "6ba", "--detach", check=True)
    assert again.stdout.strip() == "vanish"
    run, _ = wait_for("vanish", lambda r: r.is_terminal, what="the rerun")
    assert len(run.resumptions) == 2 and run.status in ("COMPLETED",), (run, run.logs()[-1500:])


def test_sdk_pretrain_wait_returns_a_completed_run_with_metrics(tmp_path, tiny_data):
    base = tiny_run_config(tiny_data, tmp_path / "sdk", name="sdk-run")
    run = sdk.pretrain(base, training_duration="6ba", parameters={"learning_rate": 2e-3})
    assert isinstance(run, sdk.Run) and run.name == "sdk-run"
    run.wait(timeout=180)
    assert run.status == "COMPLETED" and run.config["parameters"]["learning_rate"] == 2e-3
    rows = run.metrics()
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    assert sorted({r["step"] for r in rows if "train/loss" in r}) == list(range(1, 7))
    assert "sdk-run" in {r.name for r in sdk.get_runs(status="completed")}
    with pytest.raises(UserError, match="paramters"):
        sdk.pretrain(base, paramters={"learning_rate": 1.0})


def test_a_corrupt_or_locked_registry_is_one_clear_error(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    db = home / "runs.db"
    db.write_bytes(b"this is not a database, but someone's file" * 100)
    before = db.read_bytes()
    proc = lmforge("runs", "list", LMFORGE_HOME=str(home))
    assert_one_line_error(proc, "corrupt", str(db))
    assert db.read_bytes() == before  # never recreated over

    db.unlink()
    lmforge("runs", "list", LMFORGE_HOME=str(home), check=True)  # creates an empty registry
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("INSERT INTO events (run_name, time, type) VALUES ('x', 0, 'x')")
    try:
        proc = lmforge("runs", "list", LMFORGE_HOME=str(home), LMFORGE_REGISTRY_TIMEOUT="0.3")
        assert_one_line_error(proc, "locked")
    finally:
        holder.close()
    assert registry_path() != str(db)  # the session's registry was never touched
