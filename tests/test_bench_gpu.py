"""bench/gpu.py, the GPU speed benchmark, at toy size on the CPU: it must not rot before a GPU
session runs it, and its import path must not need the tracker back-ends or the object-store
client (the GPU machine has none of them)."""

from __future__ import annotations

import json
import subprocess
import sys

from train_helpers import REPO, env

BENCH = str(REPO / "bench" / "gpu.py")


def _config(name: str) -> list[dict]:
    proc = subprocess.run([sys.executable, BENCH, "config", name, "--smoke"], capture_output=True, text=True,
                          env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def test_a_bench_config_runs_the_training_step_and_reports_standard_mfu():
    (row,) = _config("1b-fsdp2-1-rank")  # meta init → parallelize → materialize, as the trainer does
    assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
    assert row["mfu"] > row["mfu_6n"] > 0  # the standard basis adds the attention term
    assert row["heavy_imports"] == []  # no mlflow / wandb / s3fs on the bench's path


def test_the_table_compares_each_row_with_its_baseline(tmp_path):
    results = tmp_path / "gpu.jsonl"
    rows = [{"name": "3b-bf16", "part": 2, "tokens_per_s": 1000.0, "mfu": 0.4, "mfu_6n": 0.35, "step_ms": 8.0},
            {"name": "3b-fp8-tensorwise", "part": 2, "tokens_per_s": 1400.0, "mfu": 0.56, "mfu_6n": 0.49,
             "step_ms": 5.7, "peak_gb": 60.0},
            {"name": "3b-fp8-rowwise", "part": 2, "error": "skipped: out of this call's time budget"}]
    results.write_text("".join(json.dumps(r | {"gpu": "H100", "torch": "2.11", "commit": "abc"}) + "\n"
                               for r in rows))
    proc = subprocess.run([sys.executable, BENCH, "table", str(results)], capture_output=True, text=True,
                          env=env(), timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert "| 2 | 3b-fp8-tensorwise | 1,400 | 56.0% | 49.0% | 6 | 60.0 | 1.40× 3b-bf16 |" in table
    assert "skipped: out of this call's time budget" in table and table.startswith("# H100")


def test_long_context_rows_checkpoint_as_the_estimate_says():
    """[long-context] Part 5's rows use the checkpointing `lmforge estimate` picks for one 80 GB GPU."""
    import importlib.util

    from lmforge.config.model import get_preset
    from lmforge.estimate.context import checkpointing_mode, context_plan

    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    assert sorted(c["seq"] for c in gpu.LONG_CONTEXT.values()) == [8192, 16384, 32768]
    for c in gpu.LONG_CONTEXT.values():
        shape = get_preset(c["preset"]).model_copy(update={"vocab_size": c["vocab"]})
        choice = context_plan(shape, c["seq"], 1, 80e9, micro_batch=c["mb"])["choice"]
        assert (choice["context_parallel"], choice["checkpointing"]) == (1, checkpointing_mode(c["ac"]))
