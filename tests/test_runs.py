"""Runs: detached training, the registry, `lmforge runs ...`, stops, restarts, hangs, orphans and the
SDK — with real processes (detached supervisors, torchrun, gloo ranks, kill -9) on tiny models. The
in-process pieces (plan, lock, watchdog, names) are in test_launch.py; random SIGKILLs are
bench/faults.py, run here with a small count."""

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
from lmforge.cli.main import main
from lmforge.errors import UserError
from lmforge.process import descendants, process_alive, process_start
from lmforge.runs.registry import registry_path



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
    proc = cli("train", "-f", cfg, "--detach", *extra, check=True)
    return proc.stdout.strip().splitlines()[0]


@pytest.mark.e2e
def test_detached_runs_side_by_side_complete(tmp_path, tiny_data):
    """Two detached runs at once: each reaches RUNNING then COMPLETED with its own files."""
    cfg_a, folder_a = config(tmp_path, tiny_data, "side-a", training_duration="24ba")
    # side-b logs less often than it has steps (log_interval 20 > 16): its last step still reaches the registry
    cfg_b, folder_b = config(tmp_path, tiny_data, "side-b", training_duration="16ba", log_interval=20,
                             **{"parameters.learning_rate": 1e-3})
    assert detach(cfg_a) == "side-a"
    assert not sdk.get_run("side-a").is_terminal  # returned once registered, not after training
    _, seen_a = wait_for("side-a", lambda r: r.status == "RUNNING", what="side-a running")
    assert detach(cfg_b, "--price-per-gpu-hour", "3") == "side-b"  # forwarded to the supervised trainer
    run_a, seen = wait_for("side-a", lambda r: r.status == "COMPLETED", what="side-a completed")
    run_b, _ = wait_for("side-b", lambda r: r.status == "COMPLETED", what="side-b completed")
    assert seen_a[-1] == "RUNNING" and seen[-1] == "COMPLETED", (seen_a, seen)
    assert max(train_losses(folder_a)) == 24 and max(train_losses(folder_b)) == 16
    assert sorted(train_losses(folder_b)) == [1, 16]
    assert train_losses(folder_a)[16] != train_losses(folder_b)[16]  # different learning rates, no mix-up
    for run, folder in ((run_a, folder_a), (run_b, folder_b)):
        assert run.save_folder == str(folder) and (folder / "final" / "model.safetensors").exists()
        assert [r["status"] for r in run.resumptions] == ["COMPLETED"]
        assert "completed after" in run.logs()
        assert run.latest_metrics["step"] == max(train_losses(folder))
        assert run.completed_at >= run.started_at >= run.created_at
        assert [s["status"] for s in run.lifecycle] == ["STARTING", "RUNNING", "COMPLETED"]
    assert run_a.run_uid != run_b.run_uid and sdk.get_run(run_a.run_uid).name == "side-a"
    listing = cli("runs", "list", check=True).stdout
    row = next(ln for ln in listing.splitlines() if ln.startswith("side-a "))
    assert "COMPLETED" in row and "pretrain" in row and "100%" in row
    as_json = json.loads(cli("runs", "list", "--status", "completed", "--json", check=True).stdout)
    assert {"side-a", "side-b"} <= {r["name"] for r in as_json}
    described = cli("runs", "describe", "side-b", check=True).stdout
    assert "COMPLETED" in described and str(folder_b / "logs" / "resumption-0.log") in described
    held_out = [r for r in metrics(folder_b) if "eval/loss" in r][-1]
    assert re.search(r"^metrics +step 16 .* progress 100% step 16 ", described, re.M), described
    assert re.search(rf"^held-out +step 16  loss {held_out['eval/loss']:.4f}  ppl ", described, re.M), described
    assert run_b.run_uid in described and "STARTING" in described.split("lifecycle")[1]
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
    again = cli("runs", "stop", "side-a", check=True)
    assert "already ended: COMPLETED" in again.stdout
    # nor restarted: it has nothing left to train, and its goodput stays as it was (issue 59)
    ledger = (folder_a / "goodput.jsonl").read_bytes()
    assert_one_line_error(cli("runs", "restart", "side-a"), "side-a is COMPLETED: nothing to restart",
                          "raise training_duration")
    assert [r["status"] for r in sdk.get_run("side-a").resumptions] == ["COMPLETED"]
    assert (folder_a / "goodput.jsonl").read_bytes() == ledger


@pytest.mark.e2e
def test_a_foreground_run_on_a_terminal_logs_plain_lines(tmp_path, tiny_data):
    """`lmforge train` on a terminal: the supervisor gives the trainer a terminal too (the live bar),
    and the run's log — as `lmforge runs logs` prints it — holds what a terminal keeps: the plain
    step lines, no redraw of the bar and no escape code."""
    import pty
    import threading

    cfg, _ = config(tmp_path, tiny_data, "on-a-tty", training_duration="12ba", **{"eval.prompts": []})
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=env(), cwd=REPO)
    os.close(slave)
    shown = bytearray()

    def read():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed its end
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=300) == 0, bytes(shown[-3000:])
    finally:
        reader.join(timeout=10)
        os.close(master)
    assert b"\x1b[" in shown  # the terminal had the live bar
    log = lmforge("runs", "logs", "on-a-tty", check=True).stdout
    assert "\x1b" not in log and "\r" not in log, log[-2000:]
    lines = log.splitlines()
    steps = [int(m.group(1)) for ln in lines if (m := re.match(r"step (\d+)/12 \| ", ln))]
    assert steps == list(range(1, 13)), log[-3000:]  # default_log_every(12): every step
    assert len(lines) < len(steps) + 25, log  # the step lines, the run's head and its summary


def _tree(pid: int) -> dict[int, str | None]:
    return {p: process_start(p) for p in [pid, *descendants(pid)]}


def _wait_gone(procs: dict, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while any(process_alive(p, s) for p, s in procs.items()):
        assert time.time() < deadline, [p for p, s in procs.items() if process_alive(p, s)]
        time.sleep(0.05)


@pytest.mark.e2e
def test_two_rank_run_stops_on_every_rank_and_dies_with_its_supervisor(tmp_path, tiny_data):
    """`runs stop` of a 2-rank run: every rank checkpoints at the same step and exits, and the run
    is STOPPED only once every process of it is gone. A restart resumes; a `kill -9` of the
    supervisor then takes torchrun and both ranks with it (the registry says lost)."""
    cfg, folder = config(tmp_path, tiny_data, "stopper", training_duration="2000ba", save_interval="1000ba",
                         **{"compute.ranks": 2, "parameters.micro_batch_size": 2, "eval.prompts": [],
                            "eval.interval": "1000ba"})
    detach(cfg)
    run, _ = wait_for("stopper", lambda r: (r.latest_metrics.get("step") or 0) >= 2, what="training steps")

    # while it runs: a second start in any form, deletion and unknown names are refused in one line
    assert_one_line_error(cli("train", "-f", cfg, "--detach"), "already RUNNING", "runs stop stopper")
    assert_one_line_error(cli("train", "-f", cfg, "--no-supervisor"), f"save_folder {folder} is in use",
                          "run 'stopper'")
    assert_one_line_error(cli("runs", "delete", "stopper", "--yes"), "is RUNNING", "--force")
    assert_one_line_error(cli("runs", "describe", "stoper"), "no run named 'stoper'", "stopper")

    procs = _tree(run.supervisor_pid)
    assert len(procs) >= 4, procs  # supervisor, torchrun, 2 ranks
    stop = cli("runs", "stop", "stopper", check=True)
    assert "STOPPED" in stop.stdout
    # STOPPED is written once every process of the run below the supervisor is gone
    assert not [p for p, s in procs.items() if p != run.supervisor_pid and process_alive(p, s)]
    _wait_gone(procs)  # and the supervisor exits right after writing it
    run = sdk.get_run("stopper")
    assert run.status == "STOPPED" and "with a checkpoint" in run.reason
    ckpts = list((folder / "checkpoints").glob("step_*"))
    step = int(ckpts[0].name.split("_")[1])
    assert len(ckpts) == 1 and f"stopped at step {step} " in run.reason
    assert sorted(p.name for p in ckpts[0].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= {p.name for p in ckpts[0].iterdir()}
    assert [e["type"] for e in run.events][-2:] == ["stop", "end"]
    assert [s["status"] for s in run.lifecycle][-2:] == ["TERMINATING", "STOPPED"]
    assert "Traceback" not in run.logs()

    # restart: a new resumption continuing from that checkpoint; then its supervisor is killed
    restarted = cli("runs", "restart", "stopper", check=True)
    assert "restarted as resumption 1" in restarted.stdout
    run, _ = wait_for("stopper", lambda r: len(r.resumptions) == 2 and (r.latest_metrics.get("step") or 0) > step,
                      what="the restart training")
    assert f"resume: continuing from {ckpts[0]}" in run.logs(resumption=1) and "2 rank(s)" in run.logs(resumption=1)
    procs = _tree(run.supervisor_pid)
    assert len(procs) >= 4, procs
    os.kill(run.supervisor_pid, signal.SIGKILL)
    _wait_gone(procs)  # the kernel takes torchrun and the ranks down with it
    row = next(ln for ln in cli("runs", "list", check=True).stdout.splitlines() if ln.startswith("stopper "))
    assert "FAILED (lost)" in row
    run = sdk.get_run("stopper")
    assert run.reason == "lost" and run.resumptions[-1]["status"] == "FAILED" and run.events[-1]["type"] == "lost"

    # delete needs --yes without a terminal; --purge removes the files
    assert_one_line_error(cli("runs", "delete", "stopper"), "--yes")
    cli("runs", "delete", "stopper", "--yes", "--purge", check=True)
    assert not folder.exists()
    assert_one_line_error(cli("runs", "describe", "stopper"), "no run named")


@pytest.mark.e2e
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
    assert run.resumptions[0]["reason"] == "killed by SIGKILL" and run.resumptions[0]["exit_code"] == -9
    assert "last log lines" in next(e for e in run.events if e["type"] == "failure")["message"]


@pytest.mark.e2e
def test_a_hang_on_one_rank_dumps_every_rank_and_counts_as_a_restart(tmp_path, tiny_data):
    """Rank 1 stops after its first step (the test hook) in both attempts: in the first it waits
    for good, and both ranks' watchdogs dump their stacks after compute.hang_timeout; torchrun
    restarts them once (max_retries: 1 is the total, not per layer). In the second, rank 1 is
    frozen (SIGSTOP: as a rank stuck in a driver, it can neither dump nor obey a SIGTERM): rank 0
    declares the hang and kills it, so torchrun needs no 30 s grace and no SIGKILL of its own. Then
    the run fails with the hang as its reason."""
    cfg, _ = config(tmp_path, tiny_data, "hang", training_duration="8ba", max_retries=1,
                    **{"compute.ranks": 2, "compute.hang_timeout": 5, "parameters.micro_batch_size": 2,
                       "eval.prompts": []})
    proc = lmforge("train", "-f", cfg, LMFORGE_TEST_HANG="1:1:0,1:1:1:stop")
    assert proc.returncode == 1, proc.stderr[-3000:]
    run = sdk.get_run("hang")
    assert run.status == "FAILED" and "gave up after 1 restart; max_retries=1" in run.reason, run.reason
    assert [r["status"] for r in run.resumptions] == ["FAILED", "FAILED"]
    for r in run.resumptions:
        assert r["reason"].startswith("hang detected on rank "), r
    for idx, ranks in ((0, (0, 1)), (1, (0,))):
        log = run.logs(idx)
        for rank in ranks:
            assert f"hang detected on rank {rank}: no training step completed" in log, log[-3000:]
    assert "forcefully exiting" not in run.logs(1), run.logs(1)[-3000:]  # torchrun's SIGKILL after its grace
    # The hung rank's stack shows where it stopped, on lines of its own. The supervisor splits the
    # log where it sees torchrun's restart (it polls every 0.5 s), so the first attempt's last
    # stack lines may land at the start of the second attempt's log: look in both.
    both = (run.logs(0) + run.logs(1)).splitlines()
    assert sum(ln.startswith("[rank 1] ") and ln.endswith(", in beat") for ln in both) >= 1, both[-80:]
    assert "torchrun" in next(e["message"] for e in run.events if e["type"] == "retry")


@pytest.mark.e2e
def test_data_workers_die_with_their_trainer(tmp_path, tiny_data):
    """DataLoader workers of a trainer stopped with SIGTERM, then killed with SIGKILL, and the
    tokenizing workers of a killed `data prepare`: none is left behind."""
    cfg, folder = config(tmp_path, tiny_data, "workers", training_duration="2000ba", save_interval="1000ba",
                         **{"compute.num_workers": 2, "eval.prompts": [], "eval.interval": "1000ba"})
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--no-supervisor"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), cwd=REPO)
        steps = max(train_losses(folder), default=0)
        deadline = time.time() + 180
        while max(train_losses(folder), default=0) < steps + 2:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        procs = _tree(proc.pid)
        assert len(procs) >= 3, procs  # the trainer and its 2 workers
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == (0 if sig == signal.SIGTERM else -9)
        _wait_gone(procs)
    big = tmp_path / "big.txt"
    big.write_text((tiny_data.raw / "argparse.py.txt").read_text() * 150)  # ~15 MB: seconds of tokenizing
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "data", "prepare", "--input", str(big), "--tokenizer",
                             str(tiny_data.tokenizer), "--out", str(tmp_path / "prepared"), "--seq-len", "64",
                             "--workers", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    deadline = time.time() + 120
    while len(descendants(proc.pid)) < 2:
        assert proc.poll() is None and time.time() < deadline, "prepare ended before its workers were seen"
        time.sleep(0.01)
    procs = _tree(proc.pid)
    proc.kill()
    proc.wait()
    _wait_gone(procs)


@pytest.mark.e2e
def test_random_sigkills_resume_bitwise_without_orphans(tiny_data, tmp_path):
    """bench/faults.py with a small count: the trainer killed at a random step, the supervisor
    killed inside a checkpoint write; each time the run resumes, and it ends with the
    uninterrupted run's weights, no process left behind and no half-written checkpoint visible."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "faults.py"), "--kills", "2", "--ranks", "1",
                           "--steps", "18", "--data", str(tiny_data.dataset), "--tokenizer", str(tiny_data.tokenizer),
                           "--workdir", str(tmp_path), "--json"], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout)["results"]
    assert result["kills"] == 2 and result["exit"] == 0, result
    assert result["bitwise_equal"] and result["orphans"] == 0 and result["half_written_visible"] == 0, result
    assert result["restarts_recorded"] == 2, result  # one resumption per kill, whoever restarted
    assert [r["status"] for r in result["resumptions"]] == ["FAILED", "FAILED", "COMPLETED"]
    assert [r["reason"] for r in result["resumptions"][:2]] == ["killed by SIGKILL", "lost"]


@pytest.mark.e2e
def test_sdk_pretrain_wait_returns_a_completed_run_with_metrics(tmp_path, tiny_data):
    base = tiny_run_config(tiny_data, tmp_path / "sdk", name="sdk-run")
    run = sdk.pretrain(base, training_duration="6ba", parameters={"learning_rate": 2e-3})
    assert isinstance(run, sdk.Run) and run.name == "sdk-run" and run.run_uid
    run.wait(timeout=180)
    assert run.status == "COMPLETED" and run.config["parameters"]["learning_rate"] == 2e-3
    assert [s["status"] for s in run.lifecycle][-1] == "COMPLETED"
    rows = run.metrics()
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    assert sorted({r["step"] for r in rows if "train/loss" in r}) == list(range(1, 7))
    assert "sdk-run" in {r.name for r in sdk.get_runs(status="completed")}
    with pytest.raises(UserError, match="paramters"):
        sdk.pretrain(base, paramters={"learning_rate": 1.0})


@pytest.mark.integration
def test_a_corrupt_or_locked_registry_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """In-process through the CLI's entry point (nothing here needs another process)."""
    home = tmp_path / "home"
    home.mkdir()
    db = home / "runs.db"
    session_db = registry_path()
    monkeypatch.setenv("LMFORGE_HOME", str(home))

    def one_line_error(*needles):
        assert main(["runs", "list"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:"), err
        for n in needles:
            assert n in err[0], (n, err)

    db.write_bytes(b"this is not a database, but someone's file" * 100)
    before = db.read_bytes()
    one_line_error("corrupt", str(db))
    assert db.read_bytes() == before  # never recreated over

    db.unlink()
    assert main(["runs", "list"]) == 0  # creates an empty registry
    assert "no runs" in capsys.readouterr().out
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("INSERT INTO events (run_name, time, type) VALUES ('x', 0, 'x')")
    monkeypatch.setenv("LMFORGE_REGISTRY_TIMEOUT", "0.3")
    try:
        one_line_error("locked")
    finally:
        holder.close()
    assert session_db != str(db)  # the session's registry was never touched
