"""The diagnostic sweep: a short matmul test on every rank and an all-reduce test between
neighbouring nodes, run by every rank together after a condition stopped training.

Each rank multiplies square matrices for about ``seconds`` (bf16 on GPUs, fp32 on CPUs) and
reports its TFLOP/s; the first ranks of each pair of neighbouring nodes (`goodput.diagnosis.
neighbour_links`) all-reduce a buffer for about ``seconds`` over a group of their own (NCCL on
GPUs, gloo on CPUs) and report the bus bandwidth (2·(n−1)/n · bytes / time, n = 2). Every rank
gets every number (two all-gathers), so each reaches the same `goodput.diagnosis.verdict`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as td

from lmforge.goodput.diagnosis import Sweep, neighbour_links

# Sizes: big enough to reach a device's rate, small enough for a test of a few seconds.
MATMUL_N = {"cuda": 8192, "cpu": 512}
ALLREDUCE_ELEMENTS = {"cuda": 64 * 2**20, "cpu": 2**20}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, seconds: float, slow_factor: float = 1.0) -> float:
    """TFLOP/s of square matmuls run for about ``seconds``; ``slow_factor``: fault injection's `diag`."""
    n = MATMUL_N.get(device.type, MATMUL_N["cpu"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up (kernel selection, allocation)
    _sync(device)
    count, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        _sync(device)
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    if slow_factor > 1:  # a degraded device: as slow as the fault says
        time.sleep((slow_factor - 1) * elapsed)
        elapsed *= slow_factor
    return 2 * n**3 * count / elapsed / 1e12


def allreduce_gbps(device: torch.device, group, seconds: float) -> float:
    """Bus bandwidth (GB/s) of all-reduces over ``group`` for about ``seconds`` (both ends agree on the
    count: rank-local clocks decide nothing)."""
    x = torch.ones(ALLREDUCE_ELEMENTS.get(device.type, ALLREDUCE_ELEMENTS["cpu"]), device=device)
    td.all_reduce(x, group=group)  # warm-up (connection set-up)
    _sync(device)
    t0, count = time.perf_counter(), 0
    while True:
        td.all_reduce(x, group=group)
        count += 1
        _sync(device)
        done = torch.tensor([float(time.perf_counter() - t0 >= seconds)], device=device)
        td.all_reduce(done, op=td.ReduceOp.MAX, group=group)
        if done.item():
            break
    elapsed = time.perf_counter() - t0
    return x.numel() * x.element_size() * count / elapsed / 1e9  # 2·(n−1)/n = 1 for two ranks


def sweep(nodes: list[str], rank: int, device: torch.device, seconds: float, *, slow_factor: float = 1.0,
          expected_tflops: float | None = None) -> Sweep:
    """Every rank calls it (``nodes``: the node of each rank) and gets the whole sweep back."""
    world = len(nodes)
    mine = matmul_tflops(device, seconds, slow_factor)
    flops = [torch.zeros(1, device=device, dtype=torch.float64) for _ in range(world)]
    td.all_gather(flops, torch.tensor([mine], device=device, dtype=torch.float64))
    tflops: dict[str, list[float]] = {}
    for r, v in enumerate(flops):
        tflops.setdefault(nodes[r], []).append(float(v.item()))
    order = list(tflops)  # nodes in the order of their first rank
    first = {n: nodes.index(n) for n in order}
    pairs = neighbour_links(order)
    found = torch.zeros(len(pairs), device=device, dtype=torch.float64)
    for i, (a, b) in enumerate(pairs):
        group = td.new_group([first[a], first[b]])  # every rank creates every group, in the same order
        if rank in (first[a], first[b]):
            found[i] = allreduce_gbps(device, group, seconds)
    td.all_reduce(found, op=td.ReduceOp.MAX)
    links = {pair: float(v) for pair, v in zip(pairs, found.tolist())}
    return Sweep(tflops=tflops, links=links, expected_tflops=expected_tflops)
