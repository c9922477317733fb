"""bench/gpu.py, the GPU speed benchmark, at toy size on the CPU: it must not rot before a GPU
session runs it, and its import path must not need the tracker back-ends or the object-store
client (the GPU machine has none of them)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time

import pytest

from train_helpers import REPO, env

BENCH = str(REPO / "bench" / "gpu.py")
# bench/gpu.py as a module (a script, not a package): its config names and its process guard.
_spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _config(name: str) -> list[dict]:
    proc = subprocess.run([sys.executable, BENCH, "config", name, "--smoke"], capture_output=True, text=True,
                          env=env(), timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.e2e
def test_a_bench_config_runs_the_training_step_and_reports_standard_mfu():
    (row,) = _config("1b-fsdp2-1-rank")  # meta init → parallelize → materialize, as the trainer does
    assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
    assert row["mfu"] > row["mfu_6n"] > 0  # the standard basis adds the attention term
    assert row["heavy_imports"] == []  # no mlflow / wandb / s3fs on the bench's path


@pytest.mark.e2e
def test_the_table_compares_each_row_with_its_baseline(tmp_path):
    results = tmp_path / "gpu.jsonl"
    rows = [{"name": "3b-bf16", "part": 2, "tokens_per_s": 1000.0, "mfu": 0.4, "mfu_6n": 0.35, "step_ms": 8.0},
            {"name": "3b-fp8-tensorwise", "part": 2, "tokens_per_s": 1400.0, "mfu": 0.56, "mfu_6n": 0.49,
             "step_ms": 5.7, "peak_gb": 60.0, "model_gb": 58.1, "mb": 2, "accum": 8, "ac": "selective"},
            {"name": "3b-fp8-rowwise", "part": 2, "error": "skipped: out of this call's time budget"},
            {"name": "gpu-tests", "part": 0, "passed": 20, "failed": 1, "note": "20 passed, 1 failed: test_x"}]
    results.write_text("".join(json.dumps(r | {"gpu": "H100", "torch": "2.11", "commit": "abc"}) + "\n"
                               for r in rows))
    proc = subprocess.run([sys.executable, BENCH, "table", str(results)], capture_output=True, text=True,
                          env=env(), timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert "| 2 | 3b-fp8-tensorwise | 1,400 | 56.0% | 49.0% | 6 | 2 × 8 | selective | 60.0 | 58.1 | 1.40× 3b-bf16 |" \
        in table
    assert "skipped: out of this call's time budget" in table and table.startswith("# H100")
    assert table.index("| gpu-tests |") < table.index("| 3b-bf16 |")  # the headline (part 0) first
    assert "20 passed, 1 failed: test_x" in table


@pytest.mark.e2e
def test_the_headline_configs_run_at_toy_size():
    """Every headline model config (and the FP8-experts MoE pair) at toy size in one process: the
    auto micro-batch and checkpointing chosen for the whole model and recorded with the memory
    model's figure; MoE rows with their auxiliary loss; FP8 rows refused on the CPU; the GPU tests'
    runner counts a real pytest run."""
    names = [n for n in bench.HEADLINE if bench.CONFIGS[n]["kind"] != "trainer"] + ["moe-stack-fp8-experts",
                                                                                       "moe-twin-fp8"]
    rows = {r["name"]: r for r in _config(",".join(names))}
    assert set(rows) == set(names)
    for name in ("3b-bf16-auto", "8b-slice-bf16"):
        r = rows[name]
        assert r["tokens_per_s"] > 0 and r["mb"] == 2 and r["accum"] == 2 and r["model_gb"] > 0
        assert r["choice"].startswith("parameters.micro_batch_size: auto → ")
        # a mode, or a granularity over a range of blocks (`plan.activations`: "selective first-2")
        assert re.fullmatch(r"none|full|selective|every \d+|(block|attention|mlp|experts|selective) "
                            r"(all|first-\d+|range\(\d+,\d+\))", r["ac"]), r["ac"]
    assert "8 × h100-sxm" in rows["8b-slice-bf16"]["choice"]  # chosen for the whole llama-8b on 8 GPUs
    assert rows["moe-stack"]["tokens_per_s"] > 0 and rows["moe-twin"]["tokens_per_s"] > 0
    assert all(rows[n]["error"] == "needs CUDA" for n in names if "fp8" in n)
    assert rows["gpu-tests"]["passed"] == 1 and rows["gpu-tests"]["failed"] == 0


@pytest.mark.e2e
def test_a_config_past_its_budget_is_stopped_with_its_subprocesses(tmp_path):
    """run_part's guard: the config's whole process group is killed (a trainer or pytest below it
    would otherwise hold the GPU into the next config)."""
    pid_file = tmp_path / "grandchild.pid"
    child = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '600']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(600)")
    out, _, code = bench._run_group([sys.executable, "-c", child], timeout=5)
    assert code is None and "started" in out
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:  # reaped by init once its parent is gone
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie waiting for init is gone in all but name
    except FileNotFoundError:
        return False


def test_long_context_rows_checkpoint_as_the_estimate_says():
    """[long-context] Part 5's rows use the checkpointing `lmforge estimate` picks for one 80 GB GPU."""
    import importlib.util

    from lmforge.config.model import get_preset
    from lmforge.plan.context import checkpointing_mode, context_plan
    from lmforge.plan.layout import Sharding

    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    assert sorted(c["seq"] for c in gpu.LONG_CONTEXT.values()) == [8192, 16384, 32768]
    for c in gpu.LONG_CONTEXT.values():
        shape = get_preset(c["preset"]).model_copy(update={"vocab_size": c["vocab"]})
        choice = context_plan(shape, c["seq"], Sharding("fsdp", 1), 80e9, micro_batch=c["mb"])["choice"]
        assert (choice["context_parallel"], choice["checkpointing"]) == (1, checkpointing_mode(c["ac"]))


@pytest.mark.integration
def test_the_muon_overhead_config_times_both_optimizers_on_one_model():
    rows = {r["name"]: r for r in _config("1b-muon-overhead")}
    adamw, muon = rows["1b-muon-overhead/adamw"], rows["1b-muon-overhead/muon"]
    assert 0 < adamw["opt_ms"] < muon["opt_ms"] and 0 < muon["opt_share"] < 1  # Newton–Schulz costs more
    assert muon["mfu"] > 0 and "optimizer step" in muon["note"]
