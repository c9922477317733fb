"""bench/digests.py at toy size: its table must not rot between the sessions that record it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train_helpers import REPO, env


@pytest.mark.e2e
def test_the_digests_bench_times_one_worker_against_several():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "digests.py"), "--files", "3", "--mb", "2",
                           "--rounds", "1"], capture_output=True, text=True, env=env(), timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# ") and "3 files × 2 MB" in lines[0]
    rows = [line.split() for line in lines[2:4]]
    assert rows[0][0] == "1" and rows[1][0] == "default" and all(float(r[-1]) > 0 for r in rows)
    assert lines[4].startswith("speed-up: ")
