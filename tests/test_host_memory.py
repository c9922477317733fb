"""The CPU training process keeps freed memory for reuse (distributed.host_memory): a step that
frees and reallocates the same tensors no longer faults in fresh pages from the kernel."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from train_helpers import REPO

SIZES = [1 << 20, 1 << 18, 1 << 19, 3 << 18, 1 << 20, 1 << 17]  # float32 elements

# A step's allocation pattern in miniature: tensors of 0.5–4 MiB, some freed at once, others
# kept to the end of the "step". Prints the page faults of the last 20 steps (after 3 warm-ups).
_STEPS = """
import resource, sys, torch
from lmforge.distributed.dist import init_distributed
if sys.argv[1] == "trainer":
    init_distributed("cpu")  # how a training process starts
sizes = SIZES
def step():
    kept = []
    for i, n in enumerate(sizes * 3):
        t = torch.ones(n)
        if i % 2:
            kept.append(t)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 20 * 3 * sum(SIZES) * 4 // 4096  # what the 20 measured steps allocate, in 4 KiB pages


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS.replace("SIZES", repr(SIZES)), mode], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.e2e
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_training_process_reuses_freed_memory():
    plain, trainer = _faults("plain"), _faults("trainer")
    # The 20 steps allocate PAGES pages. glibc's defaults return many of these blocks to the kernel
    # every step (how many depends on its adaptive mmap threshold: 10–50% of them here); kept for
    # reuse, the steps after warm-up fault in (almost) nothing new. (Not a ratio of the two: the
    # plain count moves with glibc's adaptation, the kept one with other processes' load.)
    assert plain > PAGES / 20, plain
    assert trainer < PAGES / 50, (trainer, plain)
