"""Muon (`parameters.optimizer: muon`): the update against `torch.optim.Muon`, which tensors it
trains (dense, MoE, LoRA), whole matrices under every sharded layout (FSDP2, HSDP, expert
parallelism: real gloo ranks), 2 ranks against 1, a killed run resumed bitwise, and bad input."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_run_config
from lmforge.config.model import ModelConfig
from lmforge.config.schema import LoRAConfig
from lmforge.models import build_model
from lmforge.models.lora import apply_lora
from lmforge.train.muon import Muon, orthogonalize
from lmforge.train.optim import build_optimizer
from train_helpers import (REPO, assert_one_line_error, cli, communicate, env, lmforge, metrics, train_here,
                           train_losses, worker_with_rank, write_config)

DENSE = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
MOE = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32, n_experts=4,
                  top_k=2, expansion_ratio=1.0)


def muon_optimizer(model, **kw):
    return build_optimizer(model, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type="cpu",
                           kind="muon", **kw)


# ---------------------------------------------------------------------------- the update

def test_muon_is_torch_muon_with_rms_matching():
    """Same hyperparameters and Moonshot's LR rule (torch's ``match_rms_adamw``): bitwise the same
    weights with the iterations in bf16 (torch always uses bf16), within bf16's error in fp32."""
    torch.manual_seed(0)
    for shape in ((48, 32), (32, 48)):  # wide and tall
        w = torch.randn(shape)
        grads = [torch.randn(shape) for _ in range(3)]
        theirs = w.clone().requires_grad_()
        ref = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
        for g in grads:
            theirs.grad = g.clone()
            ref.step()
        for dtype in (torch.bfloat16, torch.float32):
            ours = w.clone().requires_grad_()
            opt = Muon([ours], lr=0.02, weight_decay=0.1, momentum=0.9, ns_dtype=dtype)
            for g in grads:
                ours.grad = g.clone()
                opt.step()
            if dtype == torch.bfloat16:
                assert torch.equal(ours, theirs)
            else:
                torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
        assert not torch.allclose(theirs, w, atol=1e-2)


def test_stacked_and_fused_matrices_are_orthogonalized_one_by_one():
    """[E, d, 2h] with gate | up side by side: each of the 2E matrices on its own, as a 2-D one."""
    torch.manual_seed(0)
    w13 = torch.randn(3, 16, 2 * 24)
    got = orthogonalize(w13, 5, torch.float32, column_blocks=2)
    for e in range(3):
        for half in (slice(0, 24), slice(24, 48)):
            torch.testing.assert_close(got[e][:, half], orthogonalize(w13[e][:, half], 5, torch.float32),
                                       rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(got[0][:, :24].double())  # roughly orthogonal: singular values ≈ 1
    assert s.min() > 0.5 and s.max() < 1.5


# ---------------------------------------------------------------------------- which tensors

def muon_names(model, opt) -> dict[str, int]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["column_blocks"] for g in opt[0].param_groups for p in g["params"]} \
        if len(opt) == 2 else {}


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    dense = build_model(DENSE)
    names = muon_names(dense, muon_optimizer(dense))
    assert names == {f"blocks.{i}.{m}.weight": 1 for i in range(2)
                     for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")}

    moe = build_model(MOE)
    opt = muon_optimizer(moe)
    names = muon_names(moe, opt)
    # each expert's gate and up (fused in w13) and down matrix; the router is a classifier: AdamW
    assert names == {f"blocks.{i}.{m}": (2 if m.endswith("w13") else 1) for i in range(2)
                     for m in ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
                               "mlp.experts.w13", "mlp.experts.w2")}
    in_adamw = {id(p) for g in opt[1].param_groups for p in g["params"]}
    assert {n for n, p in moe.named_parameters() if id(p) in in_adamw} == {
        "tok_embeddings.weight", "norm.weight", "output.weight",
        *(f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn_norm", "mlp_norm", "mlp.router"))}
    assert len(opt.param_groups) == len(opt[0].param_groups) + len(opt[1].param_groups)

    lora = apply_lora(build_model(DENSE), LoRAConfig(rank=4))
    opt = muon_optimizer(lora)  # adapters are low-rank factors and the base is frozen: nothing for Muon
    assert len(opt) == 1 and isinstance(opt[0], torch.optim.AdamW)
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in lora.named_parameters() if n.endswith(("lora_A", "lora_B"))}


def test_muon_has_its_own_momentum_and_weight_decay():
    model = build_model(DENSE)
    muon, adamw = muon_optimizer(model, muon_momentum=0.9, muon_weight_decay=0.0)
    assert {(g["momentum"], g["weight_decay"]) for g in muon.param_groups} == {(0.9, 0.0)}
    assert max(g["weight_decay"] for g in adamw.param_groups) == 0.1
    muon, _ = muon_optimizer(model)
    assert {(g["momentum"], g["weight_decay"]) for g in muon.param_groups} == {(0.95, 0.1)}  # the config's defaults


# ---------------------------------------------------------------------------- the default

def test_auto_is_muon_where_the_sweep_measured_it_to_win(tiny_data, tmp_path):
    """From scratch and ≤5M non-embedding parameters: muon at its own tuned LR; a bigger model, or
    weights to fine-tune, stay on AdamW; a choice given is kept."""
    from lmforge.config.defaults import default_learning_rate
    from lmforge.config.load import build_config
    from lmforge.plan.run import make_plan, resolved_config
    from lmforge.train.machine import local_machine

    def plan(**overrides):
        raw = tiny_run_config(tiny_data, tmp_path / "run", **{"parameters.learning_rate": None,
                                                               "parameters.optimizer": "auto"} | overrides)
        cfg = build_config(raw)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 512})})
        plan = make_plan(cfg, local_machine(torch.device("cpu")), samples_per_epoch=None, data_seq_len=64)
        assert resolved_config(cfg, plan).parameters.optimizer == plan.optimizer  # what --dry-run prints
        return plan

    tiny = plan()
    assert (tiny.optimizer, tiny.learning_rate) == ("muon", 4e-3)
    assert (plan(**{"parameters.optimizer": "adamw"}).optimizer, plan(**{"parameters.optimizer": "adamw"})
            .learning_rate) == ("adamw", 2e-3)
    big = plan(model={"d_model": 512, "n_layers": 4, "n_heads": 8, "max_seq_len": 64})  # 12.6M non-embedding
    assert big.optimizer == "adamw" and big.params["non_embedding"] > 5e6
    assert plan(custom_weights_path=str(tmp_path / "w")).optimizer == "adamw"  # fine-tuning AdamW-trained weights
    assert plan(**{"parameters.optimizer": "muon", "parameters.learning_rate": 1e-3}).learning_rate == 1e-3
    # above the measured size Muon's LR joins AdamW's anchors (Moonshot's RMS matching reuses them)
    assert default_learning_rate(125e6, "muon") == default_learning_rate(125e6, "adamw") == 6e-4
    assert 1e-3 < default_learning_rate(12e6, "muon") < 4e-3


# ---------------------------------------------------------------------------- sharded, end to end

@pytest.mark.e2e
def test_every_sharded_layout_orthogonalizes_whole_matrices():
    """4 gloo ranks: FSDP2 + EP, HSDP 2 × 2 + EP, FSDP2 with uneven rows — bitwise the whole
    model's Muon step (tests/muon_worker.py)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(REPO / "tests" / "muon_worker.py")], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "muon: 3 sharded layouts × (spread, gathered) equal the whole model bitwise" in proc.stdout


def losses_by_attempt(folder) -> dict[int, list[float]]:
    """step → every loss logged for it, in order (a step re-run after a resume appears twice)."""
    out: dict[int, list[float]] = {}
    for r in metrics(folder):
        if "train/loss" in r:
            out.setdefault(r["step"], []).append(r["train/loss"])
    return out


# Global batch 8 = micro-batch 2 × 4 accumulation on one rank, × 2 accumulation × 2 ranks.
COMMON = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "n_experts": 4,
                   "top_k": 2, "expansion_ratio": 1.0},
          "training_duration": "20ba", "save_interval": "5ba", "eval.interval": "100ba", "eval.prompts": [],
          "eval.max_batches": 1, "parameters.micro_batch_size": 2, "parameters.optimizer": "muon"}
TWO_RANKS = {"compute.ranks": 2, "compute.data_parallel": "fsdp", "compute.expert_parallel": 2, "max_retries": 1,
             "compute.async_checkpoint": False}


@pytest.mark.e2e
def test_two_ranks_match_one_and_a_killed_run_resumes_bitwise(tmp_path, tiny_data):
    """An MoE model with Muon on 2 gloo ranks (FSDP2: attention matrices gathered for their
    update; expert parallelism: each rank's experts orthogonalized where they are) follows the
    single process over 20 steps within 1e-4. Rank 1 is SIGKILLed after step 12; torchrun restarts
    both ranks from the step-10 checkpoint, and the re-run steps 11–12 give bitwise the losses they
    gave before. The step-15 checkpoint (sharded momentum buffers) then resumes on 1 rank."""
    ref = tmp_path / "ref"
    train_here(tiny_run_config(tiny_data, ref, **COMMON))

    folder = tmp_path / "two"
    cfg = write_config(tmp_path / "two.yaml", tiny_run_config(tiny_data, folder, **COMMON, **TWO_RANKS))
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(LMFORGE_TEST_HANG="1:12:0"), cwd=REPO)
    deadline = time.time() + 240
    victim = None
    while victim is None:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        victim = worker_with_rank(proc.pid, 1)
    while max(train_losses(folder), default=0) < 12:  # rank 1 then holds after step 12: step 10 is the latest checkpoint
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    out, err = communicate(proc, 240)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "elastic: workers restarted after a failure" in out

    attempts = losses_by_attempt(folder)
    assert [len(attempts[s]) for s in (10, 11, 12, 13)] == [1, 2, 2, 1]  # resumed at step 10
    assert attempts[11][0] == attempts[11][1] and attempts[12][0] == attempts[12][1]
    expected, got = train_losses(ref), train_losses(folder)
    assert sorted(got) == list(range(1, 21)) and got[20] < got[1] - 0.5
    for step in range(1, 21):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step

    resumed = tmp_path / "resumed"  # the last two checkpoints are kept: 15 and 20
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(folder / "checkpoints" / "step_00000015", resumed / "checkpoints" / "step_00000015")
    log = train_here(tiny_run_config(tiny_data, resumed, **COMMON))
    assert any("written by 2 rank(s), resharded onto 1" in line for line in log)
    again = train_losses(resumed)
    assert sorted(again) == list(range(16, 21))
    for step in range(16, 21):
        assert again[step] == pytest.approx(got[step], rel=1e-4), step


# ---------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("sets,needles", [
    (["parameters.muon_momentum=-0.5"], ["parameters.muon_momentum", "greater than or equal to 0"]),
    (["parameters.muon_momentum=1"], ["parameters.muon_momentum", "less than 1"]),
    (["parameters.muon_weight_decay=-1"], ["parameters.muon_weight_decay"]),
    (["lora.rank=4", "custom_weights_path={dir}/weights"], ["parameters.optimizer: muon", "lora", "adamw"]),
])
def test_bad_muon_settings_are_one_line(tmp_path, tiny_data, sets, needles):
    cfg = write_config(tmp_path / "c.yaml", tiny_run_config(tiny_data, tmp_path / "run",
                                                             **{"parameters.optimizer": "muon"}))
    args = [a for s in sets for a in ("--set", s.format(dir=tmp_path))]
    assert_one_line_error(cli("train", "-f", cfg, *args, "--dry-run"), *needles)
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_resume_under_another_optimizer_or_batch_is_one_line(tmp_path, tiny_data):
    """A run continued with another optimizer (say, one started with AdamW before `auto` picked
    Muon for its size) or batch is refused before anything loads: one line naming the key and the
    checkpoint's value; the checkpoints stay as they were."""
    folder = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_run_config(tiny_data, folder, training_duration="4ba",
                                                             **{"eval.prompts": []}))
    lmforge("train", "-f", cfg, check=True)
    before = sorted(os.listdir(folder / "checkpoints"))
    for sets, needles in ((["parameters.optimizer=auto"], ["parameters.optimizer resolves to muon",
                                                           "trained with adamw", "parameters.optimizer: adamw"]),
                          (["parameters.global_batch_size=16"], ["parameters.global_batch_size is 16",
                                                                 "set it back to 8"])):
        args = [a for s in sets + ["training_duration=8ba"] for a in ("--set", s)]
        assert_one_line_error(lmforge("train", "-f", cfg, *args), *needles)
        assert sorted(os.listdir(folder / "checkpoints")) == before


# ---------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_muon_trains_under_fsdp_on_a_gpu(tiny_data, tmp_path, precision):
    """The GPU paths the CPU cannot take: Newton–Schulz in bf16, and (fp8) torchao's FP8 weights
    under FSDP2, whose wrapped shards Muon updates in place; the run learns and resumes."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    import torch.distributed as td

    def fit(duration):
        train_here(tiny_run_config(tiny_data, tmp_path / "run", training_duration=duration, save_interval="4ba",
                                   **{"parameters.precision": precision, "parameters.optimizer": "muon",
                                      "compute.device": "cuda", "compute.data_parallel": "fsdp",
                                      "compute.async_checkpoint": False, "eval.prompts": []}))

    try:
        fit("8ba")
        fit("12ba")  # resumes at step 8
    finally:
        if td.is_initialized():  # FSDP's one-rank process group
            td.destroy_process_group()
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1] - 0.5
    assert all(v == v for v in losses.values())  # no NaN
