"""What a run costs before its first step: `lmforge train` of a tiny model, start to end.

A tiny run trains for a fraction of a second; everything else is start-up and shut-down: the
command the user started (parse, preflight plan, register, supervise), the training process
(imports, resolution, model, data) and the end (final checkpoint, report). This times the whole
command and reads, from the run's own output, when its first step was logged, over ``--runs``
runs after one warm-up (which fills the tokenizer and data caches). CPU seconds are those of
every process of the run (``RUSAGE_CHILDREN``): on a shared machine they move less than wall time.

    python bench/startup.py --runs 5
    python bench/startup.py --runs 3 --ranks 2
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def tiny_config(folder: Path, ranks: int) -> Path:
    """A ~100K-parameter model on a few KB of text, 12 steps, on ``ranks`` CPU ranks (2+: torchrun)."""
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    cfg = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "max_seq_len": 64},
           "tokenizer": {"train": {"vocab_size": 300}}, "train_data": [str(corpus)], "training_duration": "12ba",
           "save_interval": "12ba", "log_interval": 1,
           "parameters": {"global_batch_size": 8, "micro_batch_size": 4, "context_length": 64, "precision": "fp32",
                          "optimizer": "adamw"},
           "eval": {"interval": "12ba", "max_batches": 1, "prompts": []},
           "experiment_tracker": {"mlflow": None, "console": True}, "compute": {"ranks": ranks}}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def one_run(cfg: Path, folder: Path, i: int, env: dict) -> tuple[float, float, float]:
    """(seconds to the first step's line, seconds to the end, CPU seconds of every process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    first = None
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--save-folder",
                             str(folder / f"run{i}"), "--name", f"startup-{i}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    for line in proc.stdout:
        if first is None and line.startswith(("step 1/", "[rank 0] step 1/")):
            first = time.perf_counter() - start
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"run {i} failed (exit {proc.returncode})")
    end = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first, end, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1, help="CPU ranks (2: the supervisor, the launcher, torchrun)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="lmforge-startup-"))
    env = os.environ | {"LMFORGE_HOME": str(folder / "home"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        cfg = tiny_config(folder, args.ranks)
        one_run(cfg, folder, 0, env)  # warm-up: tokenizer and data prepared into the cache
        rows = [one_run(cfg, folder, i, env) for i in range(1, args.runs + 1)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"| `lmforge train`, tiny model, 12 steps, {args.ranks} rank(s) ({args.runs} runs) | median | min |")
    print("|---|---|---|")
    for name, k in (("first step logged (s)", 0), ("command ends (s)", 1), ("CPU, all processes (s)", 2)):
        values = [r[k] for r in rows]
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} |")


if __name__ == "__main__":
    main()
