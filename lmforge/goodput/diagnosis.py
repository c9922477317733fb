"""The verdict of a diagnostic sweep: which nodes fail, and why, from the sweep's numbers.

`distributed.diagnose` measures; this decides. A node fails

- its **matmul** test when one of its devices reaches less than ``matmul_fraction`` of the median
  device of the run (its peers) or, where the device's expected rate is known (GPUs), of that;
- its **links** when the all-reduce bus bandwidth of every link to its neighbouring nodes is below
  ``bandwidth_fraction`` of the median link. With two nodes there is one link: a slow one is
  reported, but it names no node (either end may be at fault).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lmforge.config.goodput import DiagnoseRule


def neighbour_links(nodes: list[str]) -> list[tuple[str, str]]:
    """Each node with the next one, in a ring when there are more than two."""
    pairs = [(nodes[i], nodes[i + 1]) for i in range(len(nodes) - 1)]
    return pairs + ([(nodes[-1], nodes[0])] if len(nodes) > 2 else [])


@dataclass
class Sweep:
    """What a sweep measured: each node's devices' matmul TFLOP/s, each link's bus bandwidth (GB/s)."""

    tflops: dict[str, list[float]]
    links: dict[tuple[str, str], float] = field(default_factory=dict)
    expected_tflops: float | None = None  # the device's expected rate (None on CPUs: peers only)

    def summary(self) -> dict:
        return {"tflops": {n: [round(v, 4) for v in vs] for n, vs in self.tflops.items()},
                "links_gbps": {f"{a}-{b}": round(v, 4) for (a, b), v in self.links.items()},
                "expected_tflops": self.expected_tflops}


def verdict(sweep: Sweep, rule: DiagnoseRule) -> tuple[dict[str, str], list[str]]:
    """(failing node → why, notes on what failed without naming a node)."""
    failing: dict[str, str] = {}
    every = [v for vs in sweep.tflops.values() for v in vs]
    median = statistics.median(every) if every else 0.0
    for node, values in sweep.tflops.items():
        worst = min(values)
        if median > 0 and worst < rule.matmul_fraction * median:
            failing[node] = f"matmul {worst:.3g} TFLOP/s, {worst / median:.0%} of its peers' median {median:.3g}"
        elif sweep.expected_tflops and worst < rule.matmul_fraction * sweep.expected_tflops:
            failing[node] = (f"matmul {worst:.3g} TFLOP/s, {worst / sweep.expected_tflops:.0%} of the device's "
                             f"expected {sweep.expected_tflops:.3g}")
    notes = []
    if sweep.links:
        link_median = statistics.median(sweep.links.values())
        slow = {pair for pair, bw in sweep.links.items() if bw < rule.bandwidth_fraction * link_median}
        for node in sweep.tflops:
            mine = [pair for pair in sweep.links if node in pair]
            if len(mine) > 1 and all(pair in slow for pair in mine) and node not in failing:
                failing[node] = f"all-reduce bandwidth of all its links below {rule.bandwidth_fraction:.0%} of the median"
        notes = [f"link {a}–{b} slow ({sweep.links[(a, b)]:.3g} GB/s)" for a, b in sorted(slow)
                 if a not in failing and b not in failing]
    return failing, notes
