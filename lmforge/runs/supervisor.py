"""The supervisor: starts the trainer as a child process, watches it, restarts it.

``lmforge train`` (foreground or ``--detach``) runs this; the child is the same command with a
launch plan (``runs.launch_plan``) saying "train" (one process) or "launch" (it becomes torchrun, whose
ranks train). The supervisor

- copies the child's output to its own (foreground) and, as a terminal keeps it (lines, no redraws of
  the live bar: `runs.terminal_text`), to ``<logs>/resumption-<N>.log``;
- forwards SIGTERM/SIGINT to the child: the trainer, or torchrun, which passes the signal to
  every rank; each rank checkpoints at the same step and exits. The run is STOPPED once every
  process of it has exited (none holds the save folder's lock any more, `runs.lock`);
- reads how training ended from a small JSON status file that rank 0 writes (torchrun folds
  the ranks' exit codes into its own). Rank 0 also writes it when it starts, with torchelastic's
  attempt number: that is how a restart done by torchrun is seen here;
- counts restarts once, whoever does them: ``max_retries`` is the total. torchrun gets
  ``--max-restarts`` = what is left; each restart, by torchrun or by the supervisor after an
  abnormal exit, is a new resumption with its reason. Bad input (exit 2) and divergence
  (exit 3) are never retried (the supervisor ends torchrun rather than let it restart them);
  a hang (`train.watchdog`, exit 4) is;
- keeps the registry's status, heartbeat and latest metrics current.

The child dies with the supervisor (``PR_SET_PDEATHSIG``), each rank with torchrun, each data
worker with its rank: a ``kill -9`` of the supervisor takes the whole run down.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from collections import deque

from lmforge.distributed.elastic import EVENTS_FILE
from lmforge.errors import environment_error
from lmforge.goodput.ledger import add_cause, read_jsonl, read_ledger
from lmforge.run_files import read_run_file
from lmforge.process import child_dies_with_me, read_status, speaks_for_node
from lmforge.runs.launch_plan import LaunchPlan, with_plan
from lmforge.runs.progress import MetricsTail, metrics_path, resolved_model_label, summarize
from lmforge.runs.registry import Registry
from lmforge.runs.registry import status_file as status_path
from lmforge.runs.terminal_text import TerminalText

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 4  # train.watchdog.EXIT_HUNG
HEARTBEAT_S = 5.0  # registry updated_at while the run is alive
METRICS_S = 1.0  # at most this often, new latest metrics are written to the registry
EXITED_WAIT_S = 60.0  # after the child exits, how long the run's other processes may take to go


def report_status(plan: LaunchPlan | None, status: str, **info) -> None:
    """The first rank of each node (`process.speaks_for_node`) tells whoever watches the plan's
    status file how training went: the supervisor, or the torchrun wrapper of an unsupervised run
    (no-op without a status file).

    ``started`` (with torchelastic's ``attempt``) at the start of each attempt; the final status
    at the end. A failure that must not be retried is never overwritten by a later start."""
    if plan is None or not plan.status_file or not speaks_for_node():
        return
    if status == "started" and read_status(plan.status_file).get("status") == "failed":
        return
    tmp = plan.status_file + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"status": status} | info, f)
        os.replace(tmp, plan.status_file)
    except OSError:  # a full disk: the supervisor reads the exit code and the "error:" line instead
        pass


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


# torchrun's line for a failed worker: "… failed (exitcode: -9) local_rank: 1 (pid: 123) of binary: …",
# and its final summary: "  rank      : 1 (local_rank: 1)" … "  exitcode  : -9 (pid: 123)".
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_WORKER_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_WORKER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
HANG_MARK = "lmforge: hang detected"


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")  # torchrun's prefix of a rank's lines


def last_exception(tail: list[str]) -> str | None:
    """The exception line of the last Python traceback in ``tail`` (the first unindented line after
    its "Traceback" header), or None."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in tail]
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Traceback (most recent")), None)
    if start is None:
        return None
    return next((ln.strip() for ln in lines[start + 1:] if ln.strip() and not ln[0].isspace()), None)


def failure_reason(rc: int, tail: list[str]) -> str:
    """What went wrong, from the output's last lines: a detected hang, or the failed rank (or the
    exit) with the exception it raised."""
    hang = next((ln for ln in reversed(tail) if HANG_MARK in ln), None)
    if hang:
        return hang[hang.index(HANG_MARK) + len("lmforge: "):].split(";")[0]
    exc = last_exception(tail)
    why = f": {exc}" if exc else ""
    rank = code = None
    for ln in tail:
        if m := _WORKER_FAILED.search(ln):
            code, rank = int(m.group(1)), m.group(2)
        elif m := _WORKER_RANK.match(ln):
            rank = m.group(1)
        elif (m := _WORKER_EXIT.match(ln)) and rank is not None:
            code = int(m.group(1))
    if rank is not None and code is not None:
        if code < 0 and not any(ln.startswith((f"[rank{rank}]:", f"[default{rank}]:")) for ln in tail):
            # Killed by a signal, and no line of its own: the last traceback is another rank's, whose
            # collective broke when this one died (a consequence, not the cause).
            why = ""
        return f"rank {rank} {describe_exit(code)}{why}"
    return describe_exit(rc) + why


def rank_failure(events: list[dict], since: float) -> str | None:
    """The rank death that ended an attempt, as a node's torchrun recorded it (``rank_failed``, written by
    `distributed.torchrun` on every node) since ``since``: a rank killed by a signal or hung, before one
    that only exited (a rank whose peer ended exits with 1). None when no node recorded one."""
    found = [e for e in events if e.get("event") == "rank_failed" and e.get("time", 0) >= since]
    found.sort(key=lambda e: (0 if e.get("exit_code") == EXIT_HUNG else 1 if e.get("exit_code", 1) < 0 else 2,
                              e.get("time", 0)))
    if not found:
        return None
    e = found[0]
    what = "hung (the watchdog ended it)" if e.get("exit_code") == EXIT_HUNG else describe_exit(int(e.get("exit_code", 1)))
    rank = f"rank {e['rank']}" if e.get("rank") is not None else f"local rank {e.get('local_rank')}"
    return f"{rank} on {e.get('node')} {what}"


class Supervisor:
    def __init__(self, registry: Registry, name: str, *, plan: LaunchPlan, lock, argv: list[str],
                 retry_argv: list[str], cwd: str, save_folder: str, local_folder: str, log_dir: str,
                 max_retries: int, config: dict, echo: bool, after_resumption=None):
        self.reg, self.name, self.plan, self.lock = registry, name, plan, lock
        self.argv, self.retry_argv, self.cwd = argv, retry_argv, cwd
        self.save_folder, self.local_folder, self.log_dir = save_folder, local_folder, log_dir
        self.max_retries, self.config, self.echo = max_retries, config, echo
        self.after_resumption = after_resumption  # e.g. upload the logs to the store; returns a warning or None
        self.proc: subprocess.Popen | None = None
        self.stop_signal: int | None = None  # first stop signal received
        self.force = False
        self.restarts = 0  # by torchrun or by us: together at most max_retries
        self._stop_recorded = False
        self._fatal_seen = False
        self.idx = -1  # the current resumption
        self.actions = 0  # goodput actions taken (resumptions they asked for): at most goodput.max_actions
        self._log = None
        self._log_lock = threading.Lock()
        self._log_error: OSError | None = None  # the log file could not be written (e.g. disk full)

    # --- signals: forwarded to the child, recorded in the registry by the main loop

    def _on_signal(self, signum, frame):
        if signum == signal.SIGUSR1:  # `lmforge runs stop --force`
            self.force = True
            self._kill_child(signal.SIGKILL)
            return
        if self.stop_signal is None:
            self.stop_signal = signum
        self._kill_child(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def _kill_child(self, sig: int) -> None:
        """The child is the trainer or torchrun, which forwards SIGTERM/SIGINT to every rank.
        SIGKILL goes to its whole process group (its data workers too); ranks die with torchrun."""
        if self.proc and self.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def run(self) -> int:
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            return self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _loop(self) -> int:
        argv = self.argv
        while True:
            if self.stop_signal is not None or self.force:
                self._finish("STOPPED", "stopped before the training process started")
                return 0
            self.idx, log_path = self.reg.start_resumption(self.name, self.log_dir)
            try:
                rc, status, tail = self._run_child(argv, log_path)
            except OSError as e:  # the log folder cannot be written (full, read-only): not retried
                err = environment_error(e, where=self.log_dir)
                if err is None:
                    raise
                self.reg.set_resumption(self.name, self.idx, status="FAILED", reason=str(err), ended_at=time.time())
                self._finish("FAILED", str(err))
                raise err from None
            state, reason, retry = self._classify(rc, status, tail)
            reshaped = status.get("status") == "reshape"
            if reshaped:  # a goodput condition: resume on the nodes left, or stop
                argv, reason = self._reshaped(status)
                state, retry = ("STOPPED", True) if argv else ("FAILED", False)
            idx, log_path = self.idx, self._log_path()
            self.reg.set_resumption(self.name, idx, status=state if reshaped or not retry else "FAILED", reason=reason,
                                    exit_code=rc, ended_at=time.time())
            trouble = self.after_resumption() if self.after_resumption is not None else None
            if trouble:  # recorded for `runs describe`, not printed over the run's own last line
                self.reg.event(self.name, "warning", trouble)
            last = "\n".join(tail[-20:])
            if not retry:
                self.reg.event(self.name, "end", f"resumption {idx}: {state.lower()}" + (f" ({reason})" if reason else ""))
                self._finish(state, reason)
                line = f"error: {status.get('error')}"
                if state == "FAILED" and self.plan.nproc and status.get("error") and line not in tail[-3:]:
                    sys.stderr.write(line + "\n")  # last, after torchrun's own lines (if rank 0's is not)
                if state == "FAILED":
                    return status.get("exit_code") or (rc if rc > 0 else 1)
                return 130 if self.stop_signal == signal.SIGINT and rc == 130 else 0
            if reshaped:  # a goodput action: bounded by goodput.max_actions (`_reshaped`), not max_retries
                _note(f"run {self.name}: goodput {reason}; resuming from this step's checkpoint")
                continue
            reason = self._cause(reason)
            self.reg.event(self.name, "failure", f"resumption {idx}: {reason}; last log lines:\n{last}")
            if self.restarts >= self.max_retries:
                n = self.restarts
                why = f"{reason} (gave up after {n} restart{'' if n == 1 else 's'}; max_retries={self.max_retries})"
                self._finish("FAILED", why)
                _note(f"run {self.name} failed: {why}; log: {log_path}")
                return rc if rc > 0 else 1
            self.restarts += 1
            argv = self.retry_argv
            _note(f"run {self.name}: the training process {reason}; restart {self.restarts} of {self.max_retries} "
                  "from the latest checkpoint")
            self.reg.event(self.name, "retry", f"restart {self.restarts} of {self.max_retries} (by the supervisor) "
                           "from the latest checkpoint")
            time.sleep(min(2.0 * self.restarts, 10.0) if os.environ.get("LMFORGE_RETRY_DELAY") is None
                       else float(os.environ["LMFORGE_RETRY_DELAY"]))

    def _reshaped(self, status: dict) -> tuple[list[str] | None, str]:
        """After a goodput action (`train.telemetry`): the command that resumes on the layout its ranks
        decided (`goodput.cordon.resume_layout`: ``--nnodes``, the resolution re-plans the same global
        batch on fewer ranks; the other nodes left rejoin by themselves), or None and why not."""
        cordoned, cause = status.get("cordon") or [], status.get("cause") or "a goodput condition"
        where = f"; cordoned {', '.join(cordoned)}" if cordoned else ""
        max_actions = int(self.config["goodput"]["max_actions"])  # (the config as resolved: defaults filled)
        if not status.get("nodes"):
            return None, f"{cause}{where}; {status.get('stop') or 'no node left to resume on'}"
        if self.actions >= max_actions:
            return None, (f"{cause}{where}; the run stops with its checkpoint after {self.actions} goodput "
                          f"action(s) (goodput.max_actions={max_actions})")
        self.actions += 1
        self.reg.event(self.name, "goodput", f"{status.get('action')} at step {status.get('step')}: {cause}{where}; "
                       f"resuming on {status['nodes']} node(s) from the checkpoint (action {self.actions} of "
                       f"{max_actions})")
        return self.retry_argv + ["--nnodes", str(status["nodes"])], f"{status.get('action')}: {cause}{where}"

    def _cause(self, reason: str, started_before: float | None = None) -> str:
        """Why the attempt before ``started_before`` (the newest: None) ended — what a node's torchrun
        saw die, else ``reason`` (this node's view) — recorded in the goodput ledger beside it."""
        starts = [r["process_start"] for r in read_ledger(self.local_folder, progress=False)
                  if r["kind"] == "start" and (started_before is None or r["process_start"] < started_before)]
        if starts:
            if not ("killed by" in reason or reason.startswith("hang")):  # this node saw only a consequence
                reason = rank_failure(read_jsonl(os.path.join(self.local_folder, EVENTS_FILE)), starts[-1]) or reason
            add_cause(self.local_folder, reason, started_before=started_before)
        return reason

    def _log_path(self) -> str:
        return os.path.join(self.log_dir, f"resumption-{self.idx}.log")

    def _classify(self, rc: int, status: dict, tail: list[str]) -> tuple[str, str | None, bool]:
        """(final state, reason, retry?) for one finished child."""
        s = status.get("status")
        if s == "completed" or (rc == 0 and s in (None, "started") and self.stop_signal is None):
            return "COMPLETED", None, False
        if s == "stopped":
            return "STOPPED", f"stopped at step {status.get('step')} with a checkpoint", False
        if self.force:
            return "STOPPED", "killed (stop --force)", False
        if self.stop_signal is not None:
            return "STOPPED", f"stopped without a checkpoint ({describe_exit(rc)})", False
        code = status.get("exit_code", rc)
        if s == "failed" or code in (EXIT_USER_ERROR, EXIT_DIVERGED):
            err = status.get("error") or next((ln[len("error: "):] for ln in reversed(tail)
                                               if ln.startswith("error: ")), describe_exit(rc))
            return "FAILED", err, False
        return "FAILED", failure_reason(rc, tail), True

    def _finish(self, state: str, reason: str | None) -> None:
        self.reg.put(self.name, {"status": state, "reason": reason, "completed_at": time.time(), "child_pid": None})

    # --- one resumption (and the torchrun restarts inside it)

    def _run_child(self, argv: list[str], log_path: str) -> tuple[int, dict, list[str]]:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        status_file = status_path(self.log_dir, self.idx)
        if os.path.exists(status_file):
            os.remove(status_file)
        nproc = self.plan.nproc
        child = self.plan.child("launch" if nproc else "train", lock="join", status_file=status_file,
                                max_restarts=self.max_retries - self.restarts if nproc else None, detached=False)
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        tail: deque[str] = deque(maxlen=300)  # room for every rank's stacks after a hang
        self._log = open(log_path, "ab")
        use_pty = self.echo and sys.stdout.isatty() and sys.platform.startswith("linux")
        if use_pty:  # keep the live progress bar: the child sees a terminal
            master, slave = pty.openpty()
            _copy_winsize(sys.stdout.fileno(), slave)
            outs = {"stdout": slave, "stderr": slave}
        else:
            outs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        # Its own process group (Ctrl-C in the terminal reaches only us; we forward it), and the
        # kernel kills it when we die.
        self.proc = subprocess.Popen([sys.executable, "-m", "lmforge", *with_plan(argv, child)], cwd=self.cwd,
                                     env=env, stdin=subprocess.DEVNULL, process_group=0,
                                     preexec_fn=child_dies_with_me(), **outs)
        if self.stop_signal is not None:  # a signal that arrived while we were starting it
            self._kill_child(self.stop_signal)
        if use_pty:
            os.close(slave)
            streams = [(master, sys.stdout)]
        else:
            streams = [(self.proc.stdout.fileno(), sys.stdout), (self.proc.stderr.fileno(), sys.stderr)]
        # Two pipes to one terminal: each hands on whole lines only, or the trainer's last line, still
        # without its newline, would get the other stream's error line glued to it (`EchoLines`).
        threads = [threading.Thread(target=self._tee, args=(fd, EchoLines(out, whole_lines=not use_pty)
                                                            if self.echo else None, tail), daemon=True)
                   for fd, out in streams]
        for t in threads:
            t.start()
        self.reg.put(self.name, {"status": "STARTING", "child_pid": self.proc.pid},
                     event=("start", f"resumption {self.idx} started (pid {self.proc.pid}); log: {log_path}"))
        self._watch(status_file, tail)
        # Every process of the run (ranks, their data workers) gone before anything is recorded:
        # they hold the save folder's lock until they exit.
        if not self.lock.wait_alone(EXITED_WAIT_S):
            self.reg.event(self.name, "warning", f"some processes of the run still hold {self.lock.path} "
                           f"{EXITED_WAIT_S:.0f}s after the training process exited")
        for t in threads:
            t.join(timeout=10)
        if use_pty:
            os.close(master)
        with self._log_lock:
            try:
                self._log.close()
            except OSError:  # its buffer could not be written: the error is recorded above
                pass
        return self.proc.returncode, read_status(status_file), list(tail)

    def _watch(self, status_file: str, tail: deque) -> None:
        """Wait for the child; meanwhile record stop requests, torchrun restarts, heartbeat and metrics."""
        metrics = MetricsTail(metrics_path(self.local_folder))
        metrics.poll()  # records from earlier resumptions are not this one's progress
        metrics.latest = {}
        running = False
        attempt = 0
        last_beat = 0.0
        last_written = None
        while True:
            try:
                self.proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            fields = {}
            status = read_status(status_file)
            if status.get("status") == "failed" and self.plan.nproc and not self._fatal_seen:
                # Bad input or divergence on a rank: torchrun would restart it; end it instead.
                self._fatal_seen = True
                self._kill_child(signal.SIGTERM)
            if status.get("attempt", 0) > attempt:
                self._torchrun_restarted(status["attempt"] - attempt, list(tail), status.get("started_at"))
                tail.clear()  # what follows is the new attempt's output
                attempt, running = status["attempt"], False
                metrics.latest, fields["status"] = {}, "STARTING"
                self.reg.set_resumption(self.name, self.idx, status="STARTING")
            if self._record_stop():
                fields["status"] = "TERMINATING"
            latest = metrics.poll()
            if latest and not running and not self._stop_recorded:
                running = True
                fields["status"] = "RUNNING"
                label = resolved_model_label(read_run_file(self.local_folder), auto=self.config.get("model") == "auto")
                if label:
                    fields["model"] = label
                self.reg.set_resumption(self.name, self.idx, status="RUNNING")
            now = time.time()
            fresh = latest and latest is not last_written and now - last_beat >= METRICS_S
            if fields or fresh or now - last_beat >= HEARTBEAT_S:
                if now - last_beat >= HEARTBEAT_S:
                    self.lock.refresh()
                last_beat, last_written = now, latest
                if latest:
                    fields["metrics"] = summarize(latest, self.config, metrics.latest_eval)
                self.reg.put(self.name, fields)
        status = read_status(status_file)
        if status.get("attempt", 0) > attempt:  # restarted, then ended before we looked
            self._torchrun_restarted(status["attempt"] - attempt, list(tail), status.get("started_at"))
        if self._record_stop():  # a stop the trainer obeyed within the same half second
            self.reg.put(self.name, {"status": "TERMINATING"})
        latest = metrics.poll()
        if latest:
            self.reg.put(self.name, {"metrics": summarize(latest, self.config, metrics.latest_eval)})

    def _record_stop(self) -> bool:
        """Record a requested stop once (an event); True the first time."""
        if (self.stop_signal is None and not self.force) or self._stop_recorded:
            return False
        self._stop_recorded = True
        self.reg.event(self.name, "stop", "stop requested: checkpointing at the next step")
        return True

    def _torchrun_restarted(self, count: int, tail: list[str], started_at: float | None = None) -> None:
        """torchrun restarted the ranks (``count`` times since we last looked): each restart ends
        the current resumption as a failure and starts a new one, with its own log file."""
        reason = first = self._cause(failure_reason(1, tail), started_at)
        for _ in range(count):
            self.restarts += 1
            self.reg.set_resumption(self.name, self.idx, status="FAILED", reason=reason, ended_at=time.time())
            self.reg.event(self.name, "failure", f"resumption {self.idx}: {reason}; last log lines:\n"
                           + "\n".join(tail[-20:]))
            self.idx, log_path = self.reg.start_resumption(self.name, self.log_dir)
            self.reg.event(self.name, "retry", f"restart {self.restarts} of {self.max_retries} (by torchrun) from "
                           f"the latest checkpoint; log: {log_path}")
            with self._log_lock:  # the output from here on belongs to the new resumption
                self._log.close()
                self._log = open(log_path, "ab")
            reason = "failed while starting"
        _note(f"run {self.name}: {first}; torchrun restarted the ranks ({self.restarts} of {self.max_retries} restarts "
              "used)")

    def _tee(self, fd: int, out: EchoLines | None, tail: deque) -> None:
        """The child's output as it comes to the terminal (`out`), and as a terminal keeps it — its
        lines, without the redraws and escape codes of a live bar — to the log file and the tail."""
        text = TerminalText()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's master reads EIO once the child side is closed
                break
            if not chunk:
                break
            if out is not None:
                out.write(chunk)
            self._keep(text.feed(chunk), tail)
        if out is not None:
            out.close()
        self._keep(text.close(), tail)

    def _keep(self, lines: list[str], tail: deque) -> None:
        if not lines:
            return
        with self._log_lock:
            if self._log_error is None:
                try:
                    self._log.write("".join(ln + "\n" for ln in lines).encode())
                    self._log.flush()
                except OSError as e:  # a full disk must not hide the trainer's own error line
                    self._log_error = e
                    self.reg.event(self.name, "warning", f"writing the log stopped: "
                                   f"{environment_error(e, where=self._log.name) or e}")
        tail.extend(lines)


class EchoLines:
    """The child's bytes to one of our streams. With ``whole_lines`` (its stdout and stderr are two
    pipes that meet again in one terminal or file) only up to the last line end (``\n``, or ``\r``
    of a bar redrawn in place) is handed on; the rest waits for its end, or for the stream's close.
    An unbuffered ``print`` writes its text and its newline apart: without this, an error written to
    the other stream between the two is glued to the end of the line before it."""

    def __init__(self, out, *, whole_lines: bool):
        self.out, self.whole_lines, self.pending = out, whole_lines, b""

    def write(self, chunk: bytes) -> None:
        data = self.pending + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1 if self.whole_lines else len(data)
        self.pending = data[cut:]
        self._put(data[:cut])

    def close(self) -> None:
        self._put(self.pending)
        self.pending = b""

    def _put(self, data: bytes) -> None:
        if not data:
            return
        try:
            self.out.buffer.write(data)
            self.out.flush()
        except (OSError, ValueError):
            pass


def _copy_winsize(src: int, dst: int) -> None:
    try:
        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass


def _note(msg: str) -> None:
    sys.stderr.write(f"lmforge: {msg}\n")
    sys.stderr.flush()
