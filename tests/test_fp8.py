"""FP8 training (`parameters.precision: fp8`, torchao): refused in one line where it cannot run,
the right layers converted (torchao's emulation runs the FP8 casts on a CPU), and a real FP8
step on a GPU with FP8 tensor cores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dataclasses import replace

from conftest import tiny_run_config
from lmforge.config.model import ModelConfig
from lmforge.distributed.float8 import FP8Options
from lmforge.models.lora import LoRALinear
from lmforge.models.transformer import Transformer
from train_helpers import assert_one_line_error, lmforge, write_config

# Tiny layers: FP8 on every one that can take it (the size filter would keep them all in bf16).
EMULATED = FP8Options(skip_small=False, emulate=True)
CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


@pytest.mark.e2e
@pytest.mark.parametrize("parameters,needles", [
    ({"precision": "fp8"}, ("parameters.precision: fp8", "compute capability 8.9")),
    ({"precision": "bf16", "fp8_experts": True}, ("fp8_experts: true needs precision: fp8",)),
])
def test_fp8_without_a_capable_gpu_is_one_line_and_exit_2(tmp_path, tiny_data, parameters, needles):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and "fp8_experts" not in parameters:
        pytest.skip("this machine can train in FP8")
    cfg = write_config(tmp_path / "fp8.yaml", tiny_run_config(tiny_data, tmp_path / "run", **{
        f"parameters.{k}": v for k, v in parameters.items()}))
    proc = lmforge("train", "-f", cfg)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fp8_converts_the_linear_layers_but_the_head_odd_shapes_and_adapters():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from lmforge.distributed.float8 import apply_float8

    torch.manual_seed(0)
    model = Transformer(CFG)
    model.blocks[1].mlp.w2 = nn.Linear(120, 64, bias=False)  # 120 is not a multiple of 16
    model.blocks[1].mlp.w1 = nn.Linear(64, 120, bias=False)
    model.blocks[1].mlp.w3 = nn.Linear(64, 120, bias=False)
    model.blocks[0].attn.wq = LoRALinear(model.blocks[0].attn.wq, rank=4, alpha=8.0, dropout=0.0)
    names = [n for n, _ in model.named_parameters()]
    swapped = apply_float8(model, EMULATED, fsdp=True)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == len(fp8) == 10  # block 0: wk wv wo w1 w2 w3; block 1: wq wk wv wo (not the MLP)
    assert "output" not in fp8 and "blocks.0.attn.wq" not in fp8 and "blocks.1.mlp.w2" not in fp8
    assert type(model.blocks[0].attn.wq) is LoRALinear
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints load either way
    assert all(model.get_submodule(n).config.enable_fsdp_float8_all_gather for n in fp8)

    moe = Transformer(CFG.model_copy(update={"ffn_hidden": None, "n_experts": 16, "top_k": 2}))
    apply_float8(moe, EMULATED, fsdp=False)
    fp8 = {n for n, m in moe.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {f"blocks.{i}.attn.w{p}" for i in range(2) for p in "qkvo"}  # not the routers (64 → 16)
    assert type(moe.blocks[0].mlp.router) is nn.Linear

    rowwise = Transformer(CFG)
    apply_float8(rowwise, replace(EMULATED, recipe="rowwise"), fsdp=True)  # no FP8 all-gather for rowwise
    assert not any(getattr(m, "config", None) and m.config.enable_fsdp_float8_all_gather
                   for m in rowwise.modules() if isinstance(m, Float8Linear))


@pytest.mark.parametrize("recipe,fp8", [("tensorwise", {"wq", "wo", "w1", "w2", "w3"}), ("rowwise", {"w1", "w3"})])
def test_layers_too_small_to_gain_stay_bf16(recipe, fp8):
    """The size filter (on by default) at llama-1b's shapes (d 2048, 8 × 128 KV, ffn 5632):
    tensorwise keeps the key/value projections (K 2048, N 1024) in bf16, rowwise everything
    but gate and up (N 5632); the head always. Off, every layer FP8 can take is converted."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from lmforge.config.model import get_preset
    from lmforge.distributed.float8 import apply_float8

    cfg = get_preset("llama-1b").model_copy(update={"n_layers": 1, "vocab_size": 32000})
    for options, expected in ((FP8Options(recipe, emulate=True), fp8),
                              (FP8Options(recipe, skip_small=False, emulate=True), {"wq", "wk", "wv", "wo", "w1",
                                                                                    "w2", "w3"})):
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_float8(model, options, fsdp=False)
        assert {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, Float8Linear)} == expected


def test_fp8_experts_need_experts_and_no_expert_parallelism():
    pytest.importorskip("torchao.float8")
    from lmforge.distributed.float8 import apply_float8
    from lmforge.errors import UserError

    options = FP8Options(experts=True, emulate=True)
    with pytest.raises(UserError, match="fp8_experts: this model has no experts"):
        apply_float8(Transformer(CFG), options, fsdp=False)
    moe = Transformer(CFG.model_copy(update={"ffn_hidden": None, "n_experts": 4, "top_k": 2}))
    with pytest.raises(UserError, match="not with compute.expert_parallel > 1"):
        apply_float8(moe, options, fsdp=True, expert_parallel=2)
    apply_float8(moe, options, fsdp=False)
    assert all(b.mlp.align == 16 and b.mlp.experts.fp8 for b in moe.blocks)  # padded dispatch, FP8 GEMMs


@pytest.mark.integration
def test_fp8_weights_are_all_gathered_in_fp8_with_scales_from_after_the_step():
    """FSDP2 (one gloo rank, torchao's emulation): tensorwise weights are FP8-cast before the
    all-gather, and after each optimizer step one pass sets every weight's scale for the next
    forward from its whole (all-reduced) absolute maximum."""
    pytest.importorskip("torchao.float8")
    import torch.distributed as td
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from lmforge.config.schema import ComputeConfig
    from lmforge.plan.layout import Layout
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.float8 import after_optimizer_step
    from lmforge.distributed.parallelize import materialize, parallelize

    torch.manual_seed(0)
    full = Transformer(CFG).state_dict()
    with torch.device("meta"):
        model = Transformer(CFG)
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        step = parallelize(model, Layout(data_parallel="fsdp"), cpu, compute=ComputeConfig(compile=False),
                           precision="fp8", fp8=EMULATED)
        materialize(model, cpu.device, full)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 100, (2, 32))
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = step(ids, ids.roll(-1, 1))
            (out.ce_sum / ids.numel()).backward()
            opt.step()
            opt.zero_grad()
            after_optimizer_step(model)
            losses.append(out.ce_sum.item() / ids.numel())
        weight = model.blocks[0].mlp.w2.weight
        assert isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        amax = weight.full_tensor().abs().max()
        expected = torch.finfo(torch.float8_e4m3fn).max / amax.double()
        torch.testing.assert_close(weight._local_tensor._precomputed_scale.double(), expected, rtol=1e-6, atol=0)
        assert losses[-1] < losses[0]
    finally:
        if td.is_initialized():
            td.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_emulated_fp8_step_tracks_bf16(recipe):
    """FP8 casts (emulated on the CPU) change the loss by what e4m3 rounding allows, not more,
    and the gradients flow into every swapped layer."""
    pytest.importorskip("torchao.float8")
    from lmforge.distributed.float8 import apply_float8

    torch.manual_seed(0)
    ref = Transformer(CFG)
    model = Transformer(CFG)
    model.load_state_dict(ref.state_dict())
    apply_float8(model, replace(EMULATED, recipe=recipe), fsdp=False)
    ids, targets = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
    losses = []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m.training_loss(ids, targets)
        out.ce_sum.backward()
        losses.append(out.ce_sum.item() / ids.numel())
    assert abs(losses[0] - losses[1]) < 0.05, losses
    assert model.blocks[0].mlp.w2.weight.grad is not None and model.blocks[0].mlp.w2.weight.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_steps_on_a_gpu(recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    pytest.importorskip("torchao.float8")
    from lmforge.config.schema import ComputeConfig
    from lmforge.plan.layout import Layout
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import parallelize

    torch.manual_seed(0)
    cfg = CFG.model_copy(update={"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 512})
    model = Transformer(cfg).cuda()
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    step = parallelize(model, Layout(device="cuda"), dist, compute=ComputeConfig(compile=True), precision="fp8",
                       fp8=FP8Options(recipe, skip_small=False))  # (a small model: every layer FP8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 100, (8, 64), device="cuda")
    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step(ids, ids.roll(-1, 1))
        (out.ce_sum / ids.numel()).backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.ce_sum.item() / ids.numel())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.gpu
def test_fp8_under_fsdp_trains_saves_resumes_and_exports(tiny_data, tmp_path):
    """The trainer's whole path with FP8 all-gathers (tensorwise, FSDP2 on one GPU): meta-device
    build, sharded materialization, scales precomputed after each step, DCP checkpoints, resume,
    and a plain safetensors export."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    pytest.importorskip("torchao.float8")
    import torch.distributed as td
    from safetensors.torch import load_file

    from lmforge.config.load import build_config
    from lmforge.distributed.dist import DistInfo
    from lmforge.resolve import resolve
    from lmforge.train.machine import process_machine
    from lmforge.train.build import build_trainer

    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))

    def fit(duration):
        raw = tiny_run_config(tiny_data, tmp_path / "run", training_duration=duration, save_interval="2ba",
                              **{"parameters.precision": "fp8", "compute.data_parallel": "fsdp",
                                 "compute.async_checkpoint": False, "eval.prompts": []})
        return build_trainer(resolve(build_config(raw), process_machine(cuda), log=lambda *_: None), cuda, log=lambda *_: None).fit()

    try:
        assert fit("4ba").status == "completed"
        resumed = fit("6ba")
        assert resumed.status == "completed" and resumed.step == 6 and resumed.final_dir
        weights = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values())
    finally:
        if td.is_initialized():
            td.destroy_process_group()
