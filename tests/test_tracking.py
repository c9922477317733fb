"""Trackers write what they should.

Real JSONL files, a real MLflow sqlite store, real W&B offline files.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
from pathlib import Path

import pytest

from lmforge.cli.main import build_parser
from lmforge.config.load import build_config
from lmforge.config.tracking import MLflowConfig, TrackerConfig, WandbConfig
from lmforge.errors import UserError
from lmforge.runs.launch_plan import LaunchPlan
from lmforge.runs.registry import Registry
from lmforge.runs.run import get_run
from lmforge.runs.start import RunSlot, register
from lmforge.tracking import (ConsoleTracker, Tracker, Trackers, build_trackers, flatten_params,
                              mlflow_ui_command, read_metrics, read_state)

PARAMS = {"model": {"name": "llama-tiny", "n_layers": 2}, "parameters": {"learning_rate": 3e-4},
          "train_data": ["a", "b"], "long": "x" * 7000}


def _train(step: int, loss: float) -> dict:
    return {"train/loss": loss, "train/lr": 1e-3, "train/tokens": step * 4096,
            "throughput/tokens_per_s": 12345.0, "throughput/mfu": 0.4}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Keep LMFORGE_HOME and every wandb directory inside the test's tmp dir."""
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path / "home"


def test_flatten_params():
    flat = flatten_params(PARAMS)
    assert flat["model.name"] == "llama-tiny"
    assert flat["parameters.learning_rate"] == 3e-4
    assert flat["train_data"] == ["a", "b"]


class Boom(Tracker):
    name = "boom"

    def __init__(self) -> None:
        self.calls = 0

    def log_metrics(self, metrics, step):
        self.calls += 1
        raise ConnectionError("server went away\nsecond line")


class Recorder(Tracker):
    def __init__(self) -> None:
        self.seen: list = []

    def log_metrics(self, metrics, step):
        self.seen.append((step, metrics))

    def finish(self, status="completed", error=None):
        self.seen.append(status)


def test_failing_tracker_is_disabled_with_one_warning():
    err = io.StringIO()
    boom, rec = Boom(), Recorder()
    with Trackers([boom, rec], warn_stream=err) as t:
        for step in range(3):
            t.log_metrics({"train/loss": 1.0}, step)
    lines = err.getvalue().splitlines()
    assert lines == ["warning: boom tracking disabled (ConnectionError: server went away)"]
    assert boom.calls == 1
    assert [s for s, _ in rec.seen[:3]] == [0, 1, 2] and rec.seen[-1] == "completed"


def test_context_manager_marks_failed_and_stopped():
    rec = Recorder()
    with pytest.raises(RuntimeError):
        with Trackers([rec]):
            raise RuntimeError("nan loss")
    assert rec.seen == ["failed"]
    rec2 = Recorder()
    with pytest.raises(KeyboardInterrupt):
        with Trackers([rec2]):
            raise KeyboardInterrupt
    assert rec2.seen == ["stopped"]


def test_non_main_rank_gets_nothing(tmp_path):
    t = build_trackers(TrackerConfig(), run_name="r", run_dir=str(tmp_path / "run"), is_main=False)
    assert len(t) == 0
    assert not (tmp_path / "run").exists()


def test_jsonl_written_and_appended_on_resume(tmp_path):
    cfg = TrackerConfig(mlflow=None, console=False, report=False)
    run_dir = tmp_path / "run"
    t = build_trackers(cfg, run_name="r", run_dir=str(run_dir))
    t.log_metrics(_train(1, 5.0), 1)
    # Flushed at once: another process tailing the file sees the record before finish().
    assert read_metrics(run_dir / "metrics.jsonl")[0]["train/loss"] == 5.0
    t.log_metrics({"train/loss": float("nan")}, 2)
    t.log_text("generations", "def f():", 2)
    t.finish()
    t = build_trackers(cfg, run_name="r", run_dir=str(run_dir), resume=True)
    t.log_metrics({"eval/loss": 4.0}, 3)
    t.finish()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: NaN written as null
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["throughput/mfu"] == 0.4 and isinstance(records[0]["time"], float)
    assert records[1]["train/loss"] is None
    assert records[2] == {"step": 3, "time": records[2]["time"], "eval/loss": 4.0}
    gen = json.loads((run_dir / "generations.jsonl").read_text())
    assert gen["text"] == "def f():" and gen["step"] == 2
    # A fresh (not resumed) run in the same folder starts a new history.
    build_trackers(cfg, run_name="r", run_dir=str(run_dir)).finish()
    assert read_metrics(run_dir / "metrics.jsonl") == []


@pytest.mark.e2e
def test_mlflow_sqlite_store_and_resume(tmp_path, home):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(console=False, report=False)
    run_dir = tmp_path / "run"
    t = build_trackers(cfg, run_name="tiny-run", run_dir=str(run_dir), total_steps=4)
    assert [x.name for x in t] == ["jsonl", "mlflow"]
    t.log_params(PARAMS)
    for step in (1, 2):
        t.log_metrics(_train(step, 5.0 - step), step)
    t.log_text("generations", "print('hello')", 2)
    t.finish("stopped")

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    assert mlflow_ui_command(cfg) == f"mlflow ui --backend-store-uri {uri}"
    state = read_state(run_dir)["mlflow"]
    assert state["tracking_uri"] == uri
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(state["run_id"])
    assert run.info.run_name == "tiny-run" and run.info.status == "KILLED"
    assert client.get_experiment(run.info.experiment_id).name == "lmforge"
    assert run.data.params["model.name"] == "llama-tiny"
    assert run.data.params["parameters.learning_rate"] == "0.0003"
    assert len(run.data.params["long"]) == 6000  # truncated to MLflow's limit
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in hist] == [(1, 4.0), (2, 3.0)]
    # Artifacts live under LMFORGE_HOME, not in the current directory.
    assert run.info.artifact_uri.startswith((home / "mlflow" / "artifacts").as_uri())
    local = client.download_artifacts(run.info.run_id, "generations/step_000002.txt", str(tmp_path))
    assert Path(local).read_text() == "print('hello')"

    # Resume: the same MLflow run continues, back in RUNNING state, with its history.
    t = build_trackers(cfg, run_name="tiny-run", run_dir=str(run_dir), resume=True)
    assert read_state(run_dir)["mlflow"]["run_id"] == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    t.log_params({**PARAMS, "parameters": {"learning_rate": 1.0}, "new": 1})  # no clash error
    t.log_metrics(_train(3, 1.5), 3)
    t.finish("completed")
    assert len(t) == 2  # nothing was disabled
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["parameters.learning_rate"] == "0.0003" and run.data.params["new"] == "1"
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in hist] == [1, 2, 3]

    # Not resuming: a new run.
    t = build_trackers(cfg, run_name="tiny-run", run_dir=str(run_dir))
    t.finish("failed")
    other = read_state(run_dir)["mlflow"]["run_id"]
    assert other != run.info.run_id and client.get_run(other).info.status == "FAILED"


@pytest.mark.integration
def test_unreachable_mlflow_degrades_to_warning(tmp_path, home, monkeypatch, capsys):
    # Registered so the timeouts the tracker sets do not leak into other tests.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # A password in the URI (issue 47: it was printed in the warning, and so kept in the run's log).
    cfg = TrackerConfig(mlflow=MLflowConfig(tracking_uri="http://user:hunter2pw@127.0.0.1:9"), console=False,
                        report=False)
    assert mlflow_ui_command(cfg) is None
    import mlflow  # noqa: F401 - imported before the clock starts: a cold import takes seconds on a busy machine

    start = time.monotonic()
    t = build_trackers(cfg, run_name="r", run_dir=str(tmp_path / "run"))
    assert time.monotonic() - start < 30  # no retry loop: MLflow's default retries would take minutes
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: mlflow tracking disabled (")
    assert "hunter2pw" not in err[0]
    assert [x.name for x in t] == ["jsonl"]
    t.log_metrics({"train/loss": 2.0}, 1)
    t.finish()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["train/loss"] == 2.0
    assert "mlflow" not in read_state(tmp_path / "run")
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and b"hunter2pw" in p.read_bytes()]


def test_one_redaction_masks_credentials_of_any_uri():
    from lmforge.secrets import redact

    assert redact("to http://u:pw@h:5000/api failed") == "to http://***@h:5000/api failed"
    assert redact("https://TOKEN@github.com/x") == "https://***@github.com/x"
    assert redact("https://s3/b/k?X-Amz-Signature=abc&X-Amz-Date=1") == "https://s3/b/k?X-Amz-Signature=***&X-Amz-Date=1"
    for kept in ("s3://bucket/key", "git@github.com:x.git", "sqlite:////root/mlflow.db", "a=b"):
        assert redact(kept) == kept


def _wandb_records(path: Path) -> list[bytes]:
    """Records of a .wandb file (LevelDB-log framing after a 7-byte W&B header)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, records, pos, partial = 32768, [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if kind == 0 and length == 0:
            break
        payload = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 1:            # full record
            records.append(payload)
        elif kind in (2, 3):     # first / middle
            partial += payload
        elif kind == 4:          # last
            records.append(partial + payload)
            partial = b""
    return records


def _children() -> list[int]:
    """Live child processes of this test process."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.integration
def test_wandb_offline_files_and_resume(tmp_path, home):
    from wandb.proto import wandb_internal_pb2 as pb

    cfg = TrackerConfig(mlflow=None, jsonl=False, console=False,
                        wandb=WandbConfig(project="lmforge-test", mode="offline"))
    run_dir = tmp_path / "run"
    before = set(_children())
    t = build_trackers(cfg, run_name="tiny", run_dir=str(run_dir))
    assert [x.name for x in t] == ["wandb"]
    t.log_params(PARAMS)
    t.log_metrics(_train(1, 4.25), 1)
    t.log_metrics({**_train(2, 3.5), "eval/bits_per_byte": 1.75}, 2)
    t.log_text("generations", "def hello():", 2)
    t.finish()
    assert set(_children()) <= before  # wandb's service did not outlive finish()

    wandb_id = read_state(run_dir)["wandb"]["id"]
    runs = list((run_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert len(runs) == 1
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    history = {}
    for raw in _wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            history[int(items["_step"])] = items
    assert json.loads(history[1]["train/loss"]) == 4.25
    assert json.loads(history[2]["train/loss"]) == 3.5
    assert json.loads(history[2]["eval/bits_per_byte"]) == 1.75
    assert json.loads(history[2]["generations/_type"]) == "table-file"
    tables = list(runs[0].glob("files/media/table/generations_*.table.json"))
    assert json.loads(tables[0].read_text())["data"] == [[2, "def hello():"]]

    # Resume continues the same W&B run id (a second offline folder for the same id).
    time.sleep(1.1)  # offline folders are named to the second
    t = build_trackers(cfg, run_name="tiny", run_dir=str(run_dir), resume=True)
    t.log_metrics(_train(3, 3.0), 3)
    t.finish("stopped")  # Ctrl-C: marked preempting, still closed cleanly
    assert len(t) == 1 and set(_children()) <= before
    assert read_state(run_dir)["wandb"]["id"] == wandb_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))) == 2


def test_console_plain_lines_when_not_a_tty():
    out = io.StringIO()
    c = ConsoleTracker(total_steps=20, total_tokens=20 * 4096, stream=out, log_every=5)
    assert not c.tty  # a StringIO is not a terminal
    for step in range(1, 21):
        c.log_metrics(_train(step, 5.0 - step / 10), step)
        if step == 10:
            c.log_metrics({"eval/loss": 3.5, "eval/perplexity": 33.1,
                           "eval/bits_per_byte": 1.2}, 10)
            c.log_text("generations", "def add(a, b):\n    return a + b [x]", 10)
    c.finish("completed")
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == [
        "step 1/20", "step 5/20", "step 10/20", "step 15/20", "step 20/20"]
    # counts in three significant digits (config.counts.human)
    assert "loss 4.0000" in steps[2] and "MFU 40.0%" in steps[2] and "12.3K tok/s" in steps[2]
    assert "tok 41K/81.9K" in steps[2] and "ETA " in steps[2]
    assert "eval step 10 | loss 3.5000 | ppl 33.10 | bpb 1.2000" in lines
    assert "    return a + b [x]" in lines  # texts verbatim


@pytest.mark.parametrize("log_interval, log_every, expected", [
    (5, 2, [1, 5, 10, 15, 20, 25, 30, 35, 40]),  # every logged step crosses a multiple of 2
    (30, 50, [1, 60, 120, 150, 210, 240]),  # about every 50 steps, not every lcm(30, 50) = 150
    (10, 10, [1, 10, 20, 30, 40]),
])
def test_console_plain_lines_follow_the_steps_the_trainer_logs(log_interval, log_every, expected):
    """The trainer logs every `log_interval` steps; the plain console thins those to about one line
    per `log_every` steps, whether or not the two intervals divide each other."""
    total = expected[-1]
    out = io.StringIO()
    c = ConsoleTracker(total_steps=total, stream=out, log_every=log_every)
    for step in [1, *range(log_interval, total + 1, log_interval)]:
        c.log_metrics(_train(step, 2.0), step)
    printed = [int(line.split(" | ")[0].split()[1].split("/")[0]) for line in out.getvalue().splitlines()]
    assert printed == expected


def test_console_bar_eta_follows_the_training_clock_and_its_lines_reach_a_log():
    """On a terminal: the bar's ETA comes from the trainer's clock (rich's own went blank when log
    updates were more than 30 s apart), the plain lines are printed above the bar, and what a
    terminal keeps of it all (`runs.terminal_text`, the supervisor's log) is those lines and the
    bar's last frame: no redraws, no escape codes."""
    import re

    from lmforge.runs.terminal_text import TerminalText

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    c = ConsoleTracker(total_steps=10, stream=out, width=100, log_every=5)
    assert c.tty
    frames = []
    for step in range(1, 11):  # a step a minute, on the trainer's clock; a moment on the wall clock
        c.log_metrics(_train(step, 2.0) | {"time/elapsed_s": 60.0 * step, "train/progress": step / 10}, step)
        frames.append(out.getvalue())
    text = frames[4]  # after step 5 of 10: 5 more steps at a minute each
    assert "ETA 0:05:00" in text and "-:--:--" not in text, text[-500:]
    c.finish("completed")
    kept = TerminalText()
    lines = kept.feed(out.getvalue().encode()) + kept.close()
    assert not any("\x1b" in ln or "\r" in ln for ln in lines), lines
    assert [ln.split(" | ")[0] for ln in lines if re.match(r"step \d+/10 \|", ln)] == [
        "step 1/10", "step 5/10", "step 10/10"]
    assert len(lines) <= 4, lines  # and the bar's last frame


def test_terminal_text_keeps_what_a_terminal_shows():
    from lmforge.runs.terminal_text import TerminalText

    t = TerminalText()
    # a redrawn line with colours, a line printed above a live line (rich's sequence), an escape (a
    # hyperlink) and a UTF-8 character cut by the ends of reads; a last line without its newline
    got = t.feed(b"50%\r\x1b[2K\x1b[32m100%\x1b[0m\nbar 1\r\x1b[2Kabove\nbar 2\r\x1b[2Kbar 3\r\x1b")
    got += t.feed(b"[2K\x1b]8;;http://x\x1b\\done \xc3")
    got += t.feed(b"\xa9t\xc3\xa9\n\nlast")
    assert got == ["100%", "above", "done été", ""], got
    assert t.close() == ["last"]
    # erase to the cursor (ESC[1K) blanks up to and including the cursor's column; the rest stays put
    t = TerminalText()
    assert t.feed(b"abcdef\x1b[3D\x1b[1K\n") == ["    ef"]


def test_console_progress_bar_on_a_tty():
    out = io.StringIO()
    c = ConsoleTracker(total_steps=10, stream=out, tty=True, width=160)
    for step in range(5, 11):  # starts mid-way, as after a resume
        c.log_metrics(_train(step, 2.0), step)
    c.log_metrics({"eval/loss": 1.9}, 10)
    c.finish("completed")
    text = out.getvalue()
    assert "10/10" in text and "loss 2.0000" in text and "MFU 40.0%" in text
    assert "eval step 10 | loss 1.9000" in text
    assert c._progress is None  # the refresh thread was stopped


def test_console_progress_bar_of_a_wall_clock_run_has_no_total():
    """A run bounded by time knows neither its steps nor its tokens: the bar counts tokens alone."""
    out = io.StringIO()
    c = ConsoleTracker(stream=out, tty=True, width=160)
    for step in range(1, 4):
        c.log_metrics(_train(step, 2.0), step)
    c.finish("completed")
    assert "tokens" in out.getvalue() and "loss 2.0000" in out.getvalue()


def test_a_wall_clock_budget_shows_the_time_left_in_its_bar_and_lines():
    """A run bounded by time (the quickstart's kind) knows neither its steps nor its tokens: its bar
    is the share of the budget done with the time left of it as ETA (not `2048/? ETA ?`), and so are
    its plain lines — what a terminal and a log show."""
    import re

    from lmforge.runs.terminal_text import TerminalText

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    c = ConsoleTracker(stream=out, width=140, log_every=1)
    frames = []
    for step in range(1, 5):  # a 4-minute budget, a minute a step on the trainer's clock
        c.log_metrics(_train(step, 2.0) | {"time/elapsed_s": 60.0 * step, "train/progress": step / 4}, step)
        frames.append(out.getvalue())
    c.finish("completed")
    lines = TerminalText().feed(out.getvalue().encode())
    bar = TerminalText().feed(frames[0].encode() + b"\n")[-1]  # the live bar after step 1
    assert re.match(r"time [━ ╸╺]+ +25% ETA 0:03:00 ", bar) and "?" not in bar, bar
    heads = [ln.split(" | ")[0] for ln in lines if ln.startswith("step ")]
    assert heads == [f"step {s} ({25 * s}% of the time)" for s in range(1, 5)], lines
    assert [ln.rsplit(" | ", 1)[1] for ln in lines if ln.startswith("step ")] == [
        "ETA 0:03:00", "ETA 0:02:00", "ETA 0:01:00", "ETA 0:00:00"]


@pytest.mark.integration  # trains a tiny model for 4 steps in this process
def test_a_runs_last_eval_and_generations_are_printed_once(tmp_path, tiny_data):
    """What `lmforge train` prints at its end: the last evaluation and its generations once (at the
    last step, as every eval before them), not again in the closing summary as "sample"s. (With a
    warmup of none, `0ba`, accepted and said so.)"""
    from conftest import tiny_run_config
    from train_helpers import cli, metrics, write_config

    raw = tiny_run_config(tiny_data, tmp_path / "run", training_duration="4ba", log_interval=10,
                          **{"eval.interval": "2ba", "eval.prompts": ["def main(", "class A"],
                             "parameters.warmup": "0ba"})
    out = cli("train", "-f", write_config(tmp_path / "run.yaml", raw), "--no-supervisor", check=True).stdout
    # (and `warmup: 0ba` is a warmup of none: said so, the first step at the peak LR)
    assert "lr 0.003, warmup none, wsd" in out and "step 1/4 | tok 512/2.05K | loss " in out
    assert next(m for m in metrics(tmp_path / "run") if m.get("step") == 1)["train/lr"] == pytest.approx(3e-3)
    for step in (2, 4):
        assert out.count(f"eval step {step} | loss ") == 1, out
        assert [out.count(f"--- generation_{i} at step {step} ---") for i in (0, 1)] == [1, 1], out
    assert "sample" not in out and out.count("eval step") == 2, out
    end = out[out.index("completed after 4 steps (2,048 tokens)"):]
    assert "eval/" not in end and "final model:" in end, end


def test_the_registry_keeps_no_secret_from_the_command_line_and_restart_says_why(tmp_path):
    """A password in a --set value: runs.db stores the command masked, and `runs restart`
    (which reruns that command) names what to do instead of running it without the secret."""

    uri = "experiment_tracker.mlflow.tracking_uri=http://me:hunter2pw@mlflow.internal/"
    args = build_parser().parse_args(["train", "--model", "llama-tiny", "--set", uri])
    cfg = build_config({"model": "llama-tiny", "train_data": ["x.txt"], "training_duration": "2ba",
                        "save_folder": str(tmp_path / "run")})
    reg = Registry()  # this test's own LMFORGE_HOME (conftest)
    slot = RunSlot("secret-in-argv", str(tmp_path / "run"), str(tmp_path / "logs"), "uid-secret-in-argv")
    register(reg, cfg, args, slot, LaunchPlan("supervise"))
    assert b"hunter2pw" not in Path(reg.path).read_bytes()
    command = reg.get("secret-in-argv")["command"]
    assert "--set" in command and any("http://***@mlflow.internal/" in a for a in command)
    reg.put("secret-in-argv", {"status": "FAILED"})
    with pytest.raises(UserError, match="secret on its command line.*same command"):
        get_run("secret-in-argv").restart()
