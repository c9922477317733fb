"""The supervisor: starts the trainer as a child process, watches it, retries it.

``lmforge train`` (foreground or ``--detach``) runs this; the child is the same
``python -m lmforge train ...`` command with ``LMFORGE_SUPERVISED_CHILD=1`` ("just train").
The supervisor

- copies the child's stdout/stderr to its own (foreground) and to
  ``<logs>/resumption-<N>.log``;
- forwards SIGTERM/SIGINT to the child, whose trainer then checkpoints at the next step and
  exits with status "stopped";
- reads the child's final status from a small JSON file (``LMFORGE_STATUS_FILE``), which also
  works under torchrun where exit codes of ranks are folded into torchrun's own;
- after an abnormal exit (non-zero code, a signal) records the failure and starts a new
  resumption that autoresumes from the latest checkpoint, up to ``max_retries`` times. Bad
  input (exit 2) and divergence (exit 3) fail at once: a retry would fail the same way;
- keeps the registry's status, heartbeat and latest metrics current.

The child is killed by the kernel if the supervisor dies (``PR_SET_PDEATHSIG``), so a
``kill -9`` of ``lmforge train`` never leaves a trainer running on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from lmforge.runs.progress import MetricsTail, metrics_path, summarize
from lmforge.runs.registry import Registry

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
HEARTBEAT_S = 5.0  # registry updated_at while the run is alive
METRICS_S = 1.0  # at most this often, new latest metrics are written to the registry


def report_status(status: str, **info) -> None:
    """Called in the child (rank 0) with its final status; no-op when not supervised."""
    path = os.environ.get("LMFORGE_STATUS_FILE")
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"status": status} | info, f)
    os.replace(tmp, path)


def _pdeathsig_preexec(parent: int):
    """Runs in the child between fork and exec: die with SIGKILL when the supervisor dies."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)

    return preexec


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class Supervisor:
    def __init__(self, registry: Registry, name: str, *, argv: list[str], retry_argv: list[str], cwd: str,
                 save_folder: str, log_dir: str, max_retries: int, config: dict, echo: bool):
        self.reg, self.name = registry, name
        self.argv, self.retry_argv, self.cwd = argv, retry_argv, cwd
        self.save_folder, self.log_dir = save_folder, log_dir
        self.max_retries, self.config, self.echo = max_retries, config, echo
        self.proc: subprocess.Popen | None = None
        self.stop_signal: int | None = None  # first stop signal received
        self.force = False
        self._stop_recorded = False

    # --- signals: forwarded to the child, recorded in the registry by the main loop

    def _on_signal(self, signum, frame):
        if signum == signal.SIGUSR1:  # `lmforge runs stop --force`
            self.force = True
            if self.proc and self.proc.poll() is None:
                _killpg(self.proc.pid, signal.SIGKILL)
            return
        if self.stop_signal is None:
            self.stop_signal = signum
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    def run(self) -> int:
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            return self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _loop(self) -> int:
        retries = 0
        argv = self.argv
        while True:
            if self.stop_signal is not None or self.force:
                self._finish("STOPPED", "stopped before the training process started")
                return 0
            idx, log_path = self.reg.start_resumption(self.name, self.log_dir)
            rc, status, tail = self._run_child(idx, argv, log_path)
            state, reason, retry = self._classify(rc, status, tail)
            self.reg.set_resumption(self.name, idx, status="FAILED" if retry else state, reason=reason,
                                    exit_code=rc, ended_at=time.time())
            last = "\n".join(tail[-20:])
            if not retry:
                self.reg.event(self.name, "end", f"resumption {idx}: {state.lower()}" + (f" ({reason})" if reason else ""))
                self._finish(state, reason)
                if state == "FAILED":
                    return rc if rc > 0 else 1
                return 130 if self.stop_signal == signal.SIGINT and rc == 130 else 0
            self.reg.event(self.name, "failure", f"resumption {idx}: {reason}; last log lines:\n{last}")
            if retries >= self.max_retries:
                why = f"{reason} (gave up after {retries} retr{'y' if retries == 1 else 'ies'}; max_retries={self.max_retries})"
                self._finish("FAILED", why)
                _note(f"run {self.name} failed: {why}; log: {log_path}")
                return rc if rc > 0 else 1
            retries += 1
            argv = self.retry_argv
            _note(f"run {self.name}: the training process {reason}; retry {retries} of {self.max_retries} "
                  "from the latest checkpoint")
            self.reg.event(self.name, "retry", f"retry {retries} of {self.max_retries} from the latest checkpoint")
            time.sleep(min(2.0 * retries, 10.0) if os.environ.get("LMFORGE_RETRY_DELAY") is None
                       else float(os.environ["LMFORGE_RETRY_DELAY"]))

    def _classify(self, rc: int, status: dict, tail: list[str]) -> tuple[str, str | None, bool]:
        """(final state, reason, retry?) for one finished child."""
        s = status.get("status")
        if s == "completed" or (rc == 0 and not s and self.stop_signal is None):
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
        return "FAILED", describe_exit(rc), True

    def _finish(self, state: str, reason: str | None) -> None:
        self.reg.put(self.name, {"status": state, "reason": reason, "completed_at": time.time(), "child_pid": None})

    # --- one resumption

    def _run_child(self, idx: int, argv: list[str], log_path: str) -> tuple[int, dict, list[str]]:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        status_file = os.path.join(self.log_dir, f"resumption-{idx}.status.json")
        if os.path.exists(status_file):
            os.remove(status_file)
        env = {k: v for k, v in os.environ.items() if k != "LMFORGE_DETACHED"}
        env |= {"LMFORGE_SUPERVISED_CHILD": "1", "LMFORGE_STATUS_FILE": status_file,
                "LMFORGE_RESUMPTION": str(idx), "PYTHONUNBUFFERED": "1"}
        tail: deque[str] = deque(maxlen=50)
        log = open(log_path, "ab")
        lock = threading.Lock()
        use_pty = self.echo and sys.stdout.isatty() and sys.platform.startswith("linux")
        if use_pty:  # keep the live progress bar: the child sees a terminal
            import pty

            master, slave = pty.openpty()
            _copy_winsize(sys.stdout.fileno(), slave)
            outs = {"stdout": slave, "stderr": slave}
        else:
            outs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        self.proc = subprocess.Popen([sys.executable, "-m", "lmforge", *argv], cwd=self.cwd, env=env,
                                     stdin=subprocess.DEVNULL, process_group=0,
                                     preexec_fn=_pdeathsig_preexec(os.getpid()), **outs)
        if self.stop_signal is not None:  # a signal that arrived while we were starting it
            os.kill(self.proc.pid, self.stop_signal)
        if use_pty:
            os.close(slave)
            streams = [(master, sys.stdout)]
        else:
            streams = [(self.proc.stdout.fileno(), sys.stdout), (self.proc.stderr.fileno(), sys.stderr)]
        threads = [threading.Thread(target=_tee, args=(fd, out if self.echo else None, log, lock, tail), daemon=True)
                   for fd, out in streams]
        for t in threads:
            t.start()
        self.reg.put(self.name, {"status": "STARTING", "child_pid": self.proc.pid},
                     event=("start", f"resumption {idx} started (pid {self.proc.pid}); log: {log_path}"))
        self._watch(idx)
        for t in threads:
            t.join(timeout=10)
        if use_pty:
            os.close(master)
        log.close()
        rc = self.proc.returncode
        status = {}
        try:
            with open(status_file) as f:
                status = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
        return rc, status, list(tail)

    def _watch(self, idx: int) -> None:
        """Wait for the child; meanwhile record stop requests, heartbeat and latest metrics."""
        metrics = MetricsTail(metrics_path(self.save_folder))
        metrics.poll()  # records from earlier resumptions are not this one's progress
        metrics.latest = {}
        running = False
        last_beat = 0.0
        last_written = None
        while True:
            try:
                self.proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            fields = {}
            if (self.stop_signal is not None or self.force) and not self._stop_recorded:
                self._stop_recorded = True
                fields["status"] = "TERMINATING"
                self.reg.event(self.name, "stop", "stop requested: checkpointing at the next step")
            latest = metrics.poll()
            if latest and not running and not self._stop_recorded:
                running = True
                fields["status"] = "RUNNING"
                self.reg.set_resumption(self.name, idx, status="RUNNING")
            now = time.time()
            fresh = latest and latest is not last_written and now - last_beat >= METRICS_S
            if fields or fresh or now - last_beat >= HEARTBEAT_S:
                last_beat, last_written = now, latest
                if latest:
                    fields["metrics"] = summarize(latest, self.config)
                self.reg.put(self.name, fields)
        latest = metrics.poll()
        if latest:
            self.reg.put(self.name, {"metrics": summarize(latest, self.config)})


def _tee(fd: int, out, log, lock: threading.Lock, tail: deque) -> None:
    partial = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty's master reads EIO once the child side is closed
            break
        if not chunk:
            break
        with lock:
            log.write(chunk)
            log.flush()
        if out is not None:
            try:
                out.buffer.write(chunk)
                out.flush()
            except (OSError, ValueError):
                pass
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        tail.extend(ln.decode(errors="replace").rstrip("\r") for ln in lines)
    if partial:
        tail.append(partial.decode(errors="replace"))


def _copy_winsize(src: int, dst: int) -> None:
    try:
        import fcntl
        import termios

        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _note(msg: str) -> None:
    sys.stderr.write(f"lmforge: {msg}\n")
    sys.stderr.flush()
