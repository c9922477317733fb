"""Headless Chromium driven over the DevTools protocol on a pipe (no websocket library, no driver).

``--remote-debugging-pipe`` makes Chromium read protocol messages on fd 3 and write them on
fd 4, each a JSON text ended by a NUL byte. That is all a test needs to open a page, collect
console messages and uncaught exceptions, evaluate JavaScript and take a screenshot.

The network flags keep a sandboxed machine from waiting on connections it cannot make.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio", "--hide-scrollbars"]


def find_chromium(wait_s: float = 900) -> str | None:
    """The Chromium binary ($LMFORGE_CHROMIUM, or the usual names on PATH), or None.

    When scripts/test.sh is installing Chromium alongside the tests ($LMFORGE_BROWSER_SETUP), wait
    for that to end first (a half-unpacked package is no browser)."""
    setup = os.environ.get("LMFORGE_BROWSER_SETUP")
    if setup and os.path.isdir(setup):
        deadline = time.monotonic() + wait_s
        while not os.path.exists(os.path.join(setup, "done")) and time.monotonic() < deadline:
            time.sleep(1)
    candidates = [os.environ.get("LMFORGE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]
    for c in candidates:
        path = c and shutil.which(c)
        if path:
            return path
    return None


def browser_setup_note() -> str:
    """The last line of scripts/install-browser.sh's output in this test run, if any (for a skip reason)."""
    try:
        with open(os.path.join(os.environ["LMFORGE_BROWSER_SETUP"], "log")) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except (KeyError, OSError):
        return ""
    return lines[-1] if lines else ""


class Browser:
    def __init__(self, binary: str, width: int = 1400, height: int = 1000):
        self.profile = tempfile.mkdtemp(prefix="lmforge-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def wire_fds():  # in the child: the protocol pipes become fds 3 (in) and 4 (out)
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(os.dup2(a, 100), 3)
            os.dup2(os.dup2(b, 101), 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire_fds, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    # --- protocol
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        return self._id

    def _recv(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise EOFError(f"Chromium exited ({self.proc.poll()})")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, *, page: bool = True, timeout: float = 60) -> dict:
        mid = self._send(method, params, self.session if page else None)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(deadline)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            msg = self._recv(deadline)
            if msg.get("method") == method:
                return msg
            self.events.append(msg)

    # --- what a test uses
    def open(self, url: str, timeout: float = 60) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, page=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 page=False)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", timeout)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and failed loads seen so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                              for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                details = p.get("exceptionDetails", {})
                out.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                entry = p["entry"]
                out.append(f"log.{entry['level']}: {entry.get('text')} {entry.get('url', '')}".strip())
        return out

    def screenshot(self, full_page: bool = True) -> bytes:
        params: dict = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        return base64.b64decode(self.call("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._send("Browser.close")
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for fd in (self._w, self._r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
