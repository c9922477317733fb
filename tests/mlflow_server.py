"""A real `mlflow server` on loopback: sqlite backend store, local artifact root (proxied by the server)."""

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

    @classmethod
    def start(cls, root: Path, timeout: float = 120.0) -> "MlflowServer":
        port = _free_port()
        log = root / "server.log"
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--artifacts-destination", str(root / "artifacts")]
        with open(log, "wb") as out:
            # Its own process group: the server starts uvicorn workers, stopped together below.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        server = cls(proc, f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                time.sleep(0.25)
        server.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout:.0f}s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        """Kill the server and its uvicorn worker (its group): a test store has nothing to flush, and the
        CLI parent does not end on SIGTERM while its worker shuts down gracefully."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
