"""Where the test suite's time goes: the CPU and wall seconds of each test, from a run with
LMFORGE_TEST_COSTS set (tests/conftest.py appends one JSON line per test), summed by file.

    LMFORGE_TEST_COSTS=/tmp/costs.jsonl bash scripts/test.sh
    python bench/suite.py /tmp/costs.jsonl [--top 30]

CPU seconds count the test's process and the children it waited for (a run's supervisor, torchrun,
its ranks); a session fixture's cost is not in any test's (pytest --durations shows setups).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("costs")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.costs) if line.strip()]
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = by_file[r["test"].split("::")[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    total_cpu, total_wall = sum(r["cpu_s"] for r in rows), sum(r["wall_s"] for r in rows)
    print(f"{len(rows)} tests: {total_cpu:.0f} CPU-s, {total_wall:.0f} test-wall-s\n")
    print(f"| file | tests | CPU s | wall s |\n|---|---:|---:|---:|")
    for name, (cpu, wall, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {name} | {n} | {cpu:.0f} | {wall:.0f} |")
    print(f"\n| test | CPU s | wall s |\n|---|---:|---:|")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:args.top]:
        print(f"| {r['test']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} |")


if __name__ == "__main__":
    main()
