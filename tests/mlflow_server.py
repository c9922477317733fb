"""A real `mlflow server` on loopback: sqlite backend store, local artifact root (proxied by the server).

Starting one costs tens of seconds of CPU (imports, the sqlite schema migrations, the uvicorn
worker's own imports), so a session starts at most one: ``launch`` returns at once and ``wait``
blocks until it answers, which lets conftest start it in the background as soon as it knows a
collected test needs it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log
        self.ready = False

    @classmethod
    def launch(cls, root: Path) -> "MlflowServer":
        """Start the server process; it is not answering yet (see ``wait``)."""
        root.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        log = root / "server.log"
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--artifacts-destination", str(root / "artifacts")]
        with open(log, "wb") as out:
            # Its own process group: the server starts uvicorn workers, stopped together below.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=os.environ | {
                                        "OMP_NUM_THREADS": "1",
                                        # No job runner: it starts seven huey consumer processes that
                                        # poll all session long (GenAI jobs; the registry needs none).
                                        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                                        # An experiment may name an artifact store of its own (the
                                        # registry-failure test names an FTP port where nothing listens).
                                        "MLFLOW_ALLOWED_HOST_ADDRESSED_ARTIFACT_SCHEMES": "ftp"})
        return cls(proc, f"http://127.0.0.1:{port}", log)

    def wait(self, timeout: float = 180.0) -> "MlflowServer":
        """Until ``/health`` answers; a server that exits or never answers is stopped and raised."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not answer within {timeout:.0f}s:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    self.ready = r.status == 200
            except OSError:
                time.sleep(0.25)
        return self

    @classmethod
    def start(cls, root: Path, timeout: float = 180.0) -> "MlflowServer":
        return cls.launch(root).wait(timeout)

    def stop(self) -> None:
        """Kill the server and its uvicorn worker (its group): a test store has nothing to flush, and the
        CLI parent does not end on SIGTERM while its worker shuts down gracefully."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
