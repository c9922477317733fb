"""Context parallelism: rows of 1,024 tokens split over 2 real gloo ranks (one torchrun launch,
tests/cp_worker.py) against one rank with whole rows; checkpoints across CP sizes; the layout
against torch's own; bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, tiny_run_config
from test_expert_parallel import assert_same_losses
from train_helpers import assert_one_line_error, cli, env, metrics, train_here, train_losses, write_config

SEQ = 1024
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "max_seq_len": SEQ}
# Global batch 4 = micro-batch 2 × 2 accumulation, on one rank and on one pair of CP ranks alike.
COMMON = {"model": MODEL, "training_duration": "6ba", "save_interval": "3ba", "eval.interval": "100ba",
          "eval.max_batches": 1, "eval.max_new_tokens": 4, "parameters.context_length": SEQ,
          "parameters.global_batch_size": 4, "parameters.micro_batch_size": 2}
CP2 = {"compute.ranks": 2, "compute.data_parallel": "fsdp", "compute.context_parallel": 2}


@pytest.fixture(scope="module")
def long_rows(tiny_data, tmp_path_factory):
    """The tiny corpus packed into rows of 1,024 tokens."""
    from lmforge.data.prepare.prepare import prepare

    out = tmp_path_factory.mktemp("rows-1024") / "data"
    prepare([str(tiny_data.raw)], str(tiny_data.tokenizer), str(out), SEQ, eval_fraction=0.1)
    return out


@pytest.mark.e2e
def test_two_context_parallel_ranks_match_one_rank_and_resume_on_one(tmp_path, tiny_data, long_rows):
    """2 ranks, each holding half of every 1,024-token row (chunks r and 3−r of 4), train with the
    single process's losses and gradient norms (rel 1e-4); the CP run's step 3 resumes on one rank
    with whole rows and the same next losses. The worker first checks the model on split rows
    against whole rows for every kind of mask (documents, windows, soft-caps)."""
    common = COMMON | {"train_data": str(long_rows)}
    ref = tmp_path / "ref"
    train_here(tiny_run_config(tiny_data, ref, **common))

    cp = tmp_path / "cp"
    cp_yaml = write_config(tmp_path / "cp.yaml", tiny_run_config(tiny_data, cp, **common, **CP2))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "cp_worker.py"), str(cp_yaml)],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "masks: sharded rows match whole rows" in proc.stdout
    assert "micro-batch 2 × 2 accumulation × 1 replica(s) of 2 context-parallel ranks" in proc.stdout
    # the plan the ranks printed is the dry run's (tests/test_plan_agreement.py: the functions, over a grid)
    assert "(micro-batch 2 × 2 accumulation × 1 replica(s) of 2 rank(s))" in cli("train", "-f", cp_yaml, "--dry-run").stdout
    assert "FutureWarning" not in proc.stderr  # (torch 2.13's renamed collectives)
    assert_same_losses(train_losses(ref), train_losses(cp), range(1, 7))
    ref_rows = {r["step"]: r for r in metrics(ref) if "train/loss" in r}
    for r in (r for r in metrics(cp) if "train/loss" in r):
        # The gradients are reduced over the CP ranks too: a missing or doubled reduction shows here.
        assert r["train/grad_norm"] == pytest.approx(ref_rows[r["step"]]["train/grad_norm"], rel=1e-4)
        assert r["train/tokens"] == ref_rows[r["step"]]["train/tokens"]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(cp / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    log = train_here(tiny_run_config(tiny_data, resumed, **common))
    assert any("written by 2 rank(s), resharded onto 1" in line for line in log)
    assert_same_losses(train_losses(ref), train_losses(resumed), range(4, 7))


def test_layout_is_torchs_head_tail_load_balancing():
    """Rank r of N holds chunks r and 2N−1−r of 2N: the order torch's `context_parallel` shards
    buffers in on CUDA (its head-tail load balancer), so both attention paths see one layout."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    from lmforge.distributed.context_parallel import chunk_positions

    for seq, n in ((8, 2), (32, 4), (24, 3)):
        theirs = _HeadTailLoadBalancer(seq, n, "cpu")._generate_indices()[0]
        ours = torch.cat([chunk_positions(seq, n, r) for r in range(n)])
        assert ours.tolist() == theirs.tolist(), (seq, n)
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]


def test_sequence_rules():
    """One line for each thing a split row cannot have (a torch-free rule); the CUDA refusals (ring attention is
    plain causal), checked on the rule itself since this machine has no GPU."""
    from lmforge.config.model import ModelConfig
    from lmforge.plan.checks import check_context_parallel
    from lmforge.errors import UserError

    model = ModelConfig(**MODEL)
    check_context_parallel(2, 1024, model, packed_rows=True, device_type="cpu")  # every mask on the CPU path
    with pytest.raises(UserError, match=r"context_parallel: 2 does not divide the context length 1002 into 4"):
        check_context_parallel(2, 1002, model, packed_rows=False, device_type="cpu")
    with pytest.raises(UserError, match=r"ring attention.*cannot take packed documents"):
        check_context_parallel(2, 1024, model, packed_rows=True, device_type="cuda")
    windowed = model.model_copy(update={"sliding_window": 128})
    with pytest.raises(UserError, match="cannot take model.sliding_window"):
        check_context_parallel(4, 1024, windowed, packed_rows=False, device_type="cuda")
    check_context_parallel(4, 1024, model, packed_rows=False, device_type="cuda")


@pytest.mark.parametrize("sets, message", [
    (["compute.context_parallel=4"], "compute.context_parallel: 4 does not divide the 2 ranks"),
    (["compute.context_parallel=2", "parameters.context_length=62"],
     "compute.context_parallel: 2 does not divide the context length 62 into 4 equal chunks"),
    (["compute.context_parallel=2", "compute.data_parallel=none"], "needs data_parallel ddp, fsdp or hsdp"),
])
def test_context_parallel_that_does_not_fit_fails_before_any_process_starts(tmp_path, tiny_data, sets, message):
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, tmp_path / "bad"))
    proc = cli("train", "-f", cfg, "--set", "compute.ranks=2", *[a for s in sets for a in ("--set", s)])
    assert_one_line_error(proc, message)
    assert not (tmp_path / "bad").exists()
