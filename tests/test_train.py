"""The trainer end to end on a tiny model: real processes, real checkpoints, real torchrun."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import tiny_run_config
from train_helpers import (assert_one_line_error, communicate, env, final_weights, lmforge, metrics,
                           train_losses, write_config)


def run(tmp_path, tiny_data, name="run", **overrides):
    folder = tmp_path / name
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_run_config(tiny_data, folder, **overrides))
    return cfg, folder


@pytest.mark.e2e
def test_loss_drops_and_everything_is_written(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, training_duration="80ba", **{
        "experiment_tracker.mlflow": {}, "eval.interval": "40ba", "save_interval": "40ba",
        "parameters.learning_rate": 6e-3, "parameters.global_batch_size": 16, "parameters.micro_batch_size": 8})
    proc = lmforge("train", "-f", cfg, "--json", check=True)
    losses = train_losses(folder)
    first, last = losses[1], sum(losses[s] for s in range(76, 81)) / 5
    assert first > 5.5  # ≈ ln(512) at init
    assert last < first - 1.5, (first, last)
    # eval metrics (bits per byte from the prepared data's byte counts), generations, checkpoints, export
    evals = [r for r in metrics(folder) if "eval/bits_per_byte" in r]
    assert [r["step"] for r in evals] == [40, 80]
    assert 0 < evals[-1]["eval/bits_per_byte"] < evals[0]["eval/bits_per_byte"] + 0.5
    assert math.isclose(evals[-1]["eval/perplexity"], math.exp(evals[-1]["eval/loss"]), rel_tol=1e-6)
    assert (folder / "generations.jsonl").exists()
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["step_00000040", "step_00000080"]
    assert (folder / "final" / "model.safetensors").exists() and (folder / "final" / "tokenizer.json").exists()
    summary = __import__("json").loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["status"] == "completed" and summary["step"] == 80
    assert summary["generations"][0].startswith("def main(")
    # MLflow: read the real sqlite store back through mlflow's client
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{os.environ['LMFORGE_HOME']}/mlflow/mlflow.db")
    exp = client.get_experiment_by_name("lmforge")
    name = yaml.safe_load(cfg.read_text())["name"]
    (mlrun,) = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 81))
    assert history[0].value == pytest.approx(losses[1])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["model.d_model"] == "64"


# Gradient accumulation == the full batch: test_trainer.py (in-process).


# SIGKILL at random points and resume bitwise: test_runs.py::test_random_sigkills_resume_bitwise_without_orphans
# (bench/faults.py), through the supervisor as users run it.


@pytest.mark.e2e
def test_sigterm_stops_gracefully_with_a_checkpoint(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, name="stop", training_duration="400ba", save_interval="1000ba")
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.time() + 120
    while max(train_losses(folder), default=0) < 3:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = communicate(proc, 120)
    assert proc.returncode == 0, err
    assert "stopped" in out
    ckpts = list((folder / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and int(ckpts[0].name.split("_")[1]) >= 3


@pytest.mark.e2e
def test_torchrun_two_cpu_ranks_match_single_process(tmp_path, tiny_data):
    """DDP over 2 gloo ranks (compute.ranks: 2 starts torchrun) follows the single-process
    loss trajectory for the same global batch. Tolerance: only the order of float sums differs
    (gradients are averaged across ranks), ~1e-6 relative per step, compounding over 6 steps."""
    single_cfg, single = run(tmp_path, tiny_data, name="single", training_duration="6ba")
    lmforge("train", "-f", single_cfg, check=True)
    ddp_cfg, ddp = run(tmp_path, tiny_data, name="ddp", training_duration="6ba", **{"compute.ranks": 2})
    proc = lmforge("train", "-f", ddp_cfg, check=True)
    assert "2 rank(s)" in proc.stdout
    a, b = train_losses(single), train_losses(ddp)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step
    wa, wb = final_weights(single), final_weights(ddp)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)


@pytest.mark.e2e
def test_nan_loss_stops_with_a_clear_message(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, name="nan", training_duration="30ba", save_interval="2ba",
                      **{"parameters.grad_clip": None, "parameters.warmup": "1ba"})
    proc = lmforge("train", "-f", cfg, env={"LMFORGE_FAULT": "nan:step=3"})  # the weights turn NaN after step 3
    assert_one_line_error(proc, "became", "Last good checkpoint", "parameters.learning_rate", code=3)
    assert not (folder / "final").exists()


@pytest.mark.e2e
def test_rerun_of_a_completed_run_trains_nothing(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, name="done", training_duration="2ba", **{"eval.prompts": []})
    lmforge("train", "-f", cfg, check=True)
    before = (folder / "final" / "model.safetensors").read_bytes()
    again = lmforge("train", "-f", cfg, check=True)
    assert "already completed" in again.stdout
    assert (folder / "final" / "model.safetensors").read_bytes() == before
