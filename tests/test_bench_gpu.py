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


def test_the_muon_overhead_config_times_both_optimizers_on_one_model():
    rows = {r["name"]: r for r in _config("1b-muon-overhead")}
    adamw, muon = rows["1b-muon-overhead/adamw"], rows["1b-muon-overhead/muon"]
    assert 0 < adamw["opt_ms"] < muon["opt_ms"] and 0 < muon["opt_share"] < 1  # Newton–Schulz costs more
    assert muon["mfu"] > 0 and "optimizer step" in muon["note"]
