"""bench/moe.py at toy size on the CPU: its MoE-vs-dense table and one-block timing must not rot
between the sessions that record its figures (the GPU run, `bench/gpu.sh 4`, has no CPU test)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train_helpers import REPO, env


@pytest.mark.e2e
def test_the_moe_bench_compares_whole_steps_and_one_block():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "moe.py"), "--batch", "1", "--seq", "32",
                           "--rounds", "1", "--iters", "1", "--warmup", "1", "--block-calls", "2"],
                          capture_output=True, text=True, env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# ") and "micro-batch 1 × seq 32" in lines[0]  # one shape when --batch is given
    rows = {w[0]: w for w in map(str.split, lines) if len(w) > 1 and w[0] in ("moe", "dense") and w[1].isdigit()}
    assert set(rows) == {"moe", "dense"} and rows["moe"][2] == rows["dense"][2]  # the same active parameters
    assert any(line.startswith("moe / dense tokens/s, whole steps: median of 1 rounds") for line in lines)
    assert any(line.startswith("moe / dense tokens/s, forward + backward") for line in lines)
    assert any(line.startswith("one block, eager fp32, forward + backward: moe ") and "2 interleaved pairs" in line
               for line in lines)
