"""Expert parallelism on 2 real gloo ranks: one torchrun launch (tests/ep_worker.py) and in-process
single-rank runs around it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import REPO, tiny_run_config
from train_helpers import assert_one_line_error, env, lmforge, metrics, train_here, train_losses, write_config

MOE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
       "n_experts": 4, "top_k": 2, "expansion_ratio": 1.0}
# Global batch 8 = micro-batch 2 × 4 accumulation on one rank, × 2 accumulation × 2 ranks.
COMMON = {"model": MOE, "training_duration": "6ba", "save_interval": "3ba", "eval.interval": "100ba",
          "eval.max_new_tokens": 4, "parameters.micro_batch_size": 2}
EP2 = {"compute.ranks": 2, "compute.data_parallel": "fsdp", "compute.expert_parallel": 2}


def assert_same_losses(expected: dict, got: dict, steps) -> None:
    """Tolerance rel 1e-4: the same math on one rank or two; only the order of float sums
    differs (gradients reduce-scattered over ranks; each expert's gradient summed over the tokens
    the all-to-all brought it), ~1e-7 relative per step here, compounding over a few Adam steps."""
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.e2e
def test_two_ranks_with_expert_parallel_match_one_rank_and_reshard_both_ways(tmp_path, tiny_data):
    """2 ranks, each with 2 of the 4 experts of every layer, train with the single process's losses
    (and router statistics); checkpoints move between the two layouts in both directions:
    the single process's step 3 loads into the expert-parallel model (in the worker), and the
    expert-parallel run's step 3 resumes on one rank with the same next losses."""
    ref = tmp_path / "ref"
    train_here(tiny_run_config(tiny_data, ref, **COMMON))

    ep = tmp_path / "ep"
    ep_yaml = write_config(tmp_path / "ep.yaml", tiny_run_config(tiny_data, ep, **COMMON, **EP2))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "ep_worker.py"), str(ref / "checkpoints" / "step_00000003"),
                           str(ep_yaml)], capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "2 rank(s)" in proc.stdout and "--- generation_0 at step" in proc.stdout  # generation: ranks in step
    # The experts' gradient norm is summed over both mesh dimensions in one all-reduce (a flattened
    # mesh exists for them), not two in a row with torch's warning on every rank.
    assert "sequential all_reduce" not in proc.stderr
    # Gathering the experts' weights for final/ takes two all-gathers torch cannot merge: exact,
    # once a run, and not worth a warning on every rank.
    assert "While redistributing" not in proc.stderr
    assert_same_losses(train_losses(ref), train_losses(ep), range(1, 7))
    ref_rows = {r["step"]: r for r in metrics(ref) if "train/loss" in r}
    for r in (r for r in metrics(ep) if "train/loss" in r):
        # Adam hides a wrongly scaled gradient from the losses; the norm shows it (the experts'
        # gradients are divided by all 2 ranks, not by the 1 rank that holds the same experts).
        assert r["train/grad_norm"] == pytest.approx(ref_rows[r["step"]]["train/grad_norm"], rel=1e-4)
        # routing statistics are global: all ranks' tokens
        assert r["moe/layer_1/max_expert_share"] == pytest.approx(ref_rows[r["step"]]["moe/layer_1/max_expert_share"])

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ep / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    log = train_here(tiny_run_config(tiny_data, resumed, **COMMON))
    assert any("(step 3," in line for line in log) and any("written by 2 rank(s), resharded onto 1" in line
                                                           for line in log)
    assert_same_losses(train_losses(ref), train_losses(resumed), range(4, 7))


@pytest.mark.e2e
def test_expert_parallel_that_does_not_fit_fails_before_any_process_starts(tmp_path, tiny_data):
    """One line, exit 2, nothing written (the other cases: tests/test_moe.py, in-process)."""
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, tmp_path / "bad"))
    sets = ["model.n_experts=4", "model.top_k=2", "compute.ranks=2", "compute.data_parallel=fsdp",
            "compute.expert_parallel=4"]
    proc = lmforge("train", "-f", cfg, *[a for s in sets for a in ("--set", s)], timeout=60)
    assert_one_line_error(proc, "compute.expert_parallel: 4 does not divide the 2 ranks")
    assert not (tmp_path / "bad").exists()
