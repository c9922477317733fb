"""How a CPU training process gets its memory back from the C allocator.

glibc's malloc hands large blocks back to the kernel as soon as they are freed (they come from
mmap, or the top of the heap is trimmed), so the next step's tensors of the same sizes fault in
fresh zeroed pages again, one 4 KiB page at a time. A training step frees and reallocates its
activations and gradients every step, so on the CPU that page-fault work cost a sixth to a quarter
of the step (llama-tiny, moe-tiny and their dense twin; BENCHMARKS.md). Keeping freed memory in
the heap for reuse removes it; the process's resident size then stays at its peak, which a
training step reaches every step anyway.
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap, not from mmap (a step's logits and embedding
# gradient included). Some glibc versions refuse more than 32 MiB (64-bit): then that; larger
# blocks are then still mapped afresh each time, which next to the compute of a model whose
# tensors are that big costs little.
MMAP_THRESHOLDS = (1 << 30, 32 << 20)


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed memory (no trimming; blocks ≤ 1 GiB from the heap).
    Returns False, changing nothing, where the C library is not glibc (macOS, musl)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting either one turns off glibc's own adaptive threshold, and
    # with only trimming turned off every block over 128 KiB would be mapped afresh (far worse).
    # A trim threshold of -1 turns trimming off (documented in mallopt(3)).
    if not any(mallopt(_M_MMAP_THRESHOLD, size) == 1 for size in MMAP_THRESHOLDS):
        return False
    return mallopt(_M_TRIM_THRESHOLD, -1) == 1
