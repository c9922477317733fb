"""GPU training speed, in one table (run through bench/gpu.sh on a CUDA machine).

    python bench/gpu.py headline [NAME,...] [--budget S]           # the headline rows (+ NAMEs), one process each
    python bench/gpu.py part 1|2|3|5 [--results FILE] [--budget S] # a part: each config in its own process
    python bench/gpu.py only NAME[,NAME...]                        # chosen configs (e.g. ones a call skipped)
    python bench/gpu.py config NAME[,NAME...]                      # configs, in this process
    python bench/gpu.py table [FILE]                               # the table of the results so far
    python bench/gpu.py list                                       # the configs, their parts and budgets

**Headline** (`HEADLINE`, most important first; one device call of ≤ 9 minutes, compilation
included): llama-3b in bf16 and FP8 at the micro-batch and checkpointing mode
`micro_batch_size: auto` chooses (`plan.micro_batch`, modelled: one GPU, no sharding); a
4-layer slice of llama-8b's shape (d 4096, 32 heads / 8 KV heads, hidden 14336, vocabulary
16,384: 128,256 × 4/32, so that the head weighs in the slice what it weighs in the 32-layer
model) in bf16 and FP8, at the micro-batch and mode auto chooses for the whole llama-8b on 8
such GPUs under FSDP; the moe-9b-shaped 4-layer stack and its dense twin (bench/moe.py's
comparison, one process each, with where their kernel time goes); the `gpu`-marked tests; and
the real `lmforge train` on llama-1b. The dense rows accumulate gradients to 32k tokens per
optimizer step, as a real run does (its global batch over its GPUs): with one micro-batch per
step the optimizer's pass over llama-3b's fp32 states (~90 GB of memory traffic) is a fifth of
the step, a cost that does not depend on the precision or the micro-batch.

Part 1: which kernel scaled_dot_product_attention picks for grouped-query attention, and the
time of each; llama-1b at seq 2048, micro-batch 8, vocab 32k and 128k, eager vs compiled bf16
(and the two loss kernels at 128k). Part 2: FP8 tensorwise and rowwise vs bf16 on llama-1b and
llama-3b (micro-batch 2, one micro-batch per step). Part 3: the real `lmforge train` loop for
60 steps against the same step run by this script (their gap is the trainer's own overhead:
data loading, bookkeeping, logging), and FSDP2 on one rank vs none. Part 4: Muon's step-time
overhead against AdamW on llama-1b (`run_muon`). Part 5: llama-1b on long rows (8k, 16k, 32k
tokens) with the checkpointing each needs.

Every model config runs the trainer's pieces: `parallelize` (activation checkpointing → FP8 →
compile → FSDP2, as in training), `build_optimizer` (fused AdamW), the model's training loss
(with the MoE's auxiliary loss), bf16 autocast, gradient clipping, and `after_optimizer_step`.
Data are random tokens resident on the GPU (never zeros). Each step is timed with CUDA events
after warm-up steps (compilation happens there); the table shows the median step. MFU is on
the standard basis (6·N_active + 12·L·H·Dh·T per token, `plan.flops.mfu_flops_per_token`)
against the bf16 dense peak (FP8 rows too, so that their speed-up reads directly); "MFU 6N"
counts 6·N_active alone. Every row records its micro-batch × accumulation, its checkpointing
mode, the peak memory allocated (and reserved) and what the memory model expected.

Each config runs in its own process under its own time budget (`budget`, and what is left of
the call's); a config that runs out is stopped (its process group killed) and the rows it
printed before are kept. Rows are appended to a JSON-lines file (--results, default
.bench/gpu.jsonl, and a copy in $OUT when that is set); each call prints the table of everything
in it, so calls that carry the file from one to the next end with one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_RESULTS = os.path.join(REPO, ".bench", "gpu.jsonl")


def _model(preset, vocab, mb, *, compile_=True, precision="bf16", recipe="tensorwise", loss="auto", fsdp=False,
           accum=1, part, note="", **extra):
    """A model config. ``extra``: shape (ModelConfig fields over the preset's), twin (the MoE's dense
    twin), auto ({"shape": the whole model, "gpus": N}: micro-batch and checkpointing from
    `plan.micro_batch`), ac, tokens_per_step (accumulate micro-batches up to it), seq,
    fp8_experts, profile (where the kernel time goes), warmup, steps, budget (seconds)."""
    return {"kind": "model", "preset": preset, "vocab": vocab, "seq": 2048, "mb": mb, "accum": accum,
            "compile": compile_, "precision": precision, "recipe": recipe, "loss": loss, "fsdp": fsdp,
            "part": part, "note": note} | extra


M1 = "llama-1b"
M3 = "llama-3b"
# llama-8b's shape (Llama 3 8B) and a 4-layer slice of it whose head weighs what it weighs in the whole
# model (vocabulary 128,256 × 4/32).
LLAMA_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
            "vocab_size": 128256, "rope_theta": 5e5, "max_seq_len": 8192}
SLICE_8B = LLAMA_8B | {"n_layers": 4, "vocab_size": 16384}
MOE_STACK = {"n_layers": 4}  # moe-9b's blocks (bench/moe.py's stack)
STEP_TOKENS = 32768  # tokens per optimizer step of the headline's dense rows (see the docstring)
AUTO_3B = {"preset": M3, "vocab_size": 32000, "gpus": 1}
AUTO_8B = {"shape": LLAMA_8B, "gpus": 8}
HEADLINE_STEPS = dict(warmup=2, steps=4)
CONFIGS = {
    # -- the headline (part 0), most important first
    "3b-bf16-auto": _model(M3, 32000, None, auto=AUTO_3B, tokens_per_step=STEP_TOKENS, part=0, budget=110,
                           **HEADLINE_STEPS),
    "3b-fp8-auto": _model(M3, 32000, None, precision="fp8", auto=AUTO_3B, tokens_per_step=STEP_TOKENS, part=0,
                          budget=120, **HEADLINE_STEPS),
    "8b-slice-bf16": _model(None, None, None, shape=SLICE_8B, auto=AUTO_8B, tokens_per_step=STEP_TOKENS, part=0,
                            budget=90, note="4 of 32 layers, vocab 16k", **HEADLINE_STEPS),
    "8b-slice-fp8": _model(None, None, None, shape=SLICE_8B, precision="fp8", auto=AUTO_8B,
                           tokens_per_step=STEP_TOKENS, part=0, budget=100, note="4 of 32 layers, vocab 16k",
                           **HEADLINE_STEPS),
    "moe-stack": _model("moe-9b", None, 8, shape=MOE_STACK, part=0, budget=100, profile=True, warmup=3, steps=8,
                        note="moe-9b's blocks × 4"),
    "moe-twin": _model("moe-9b", None, 8, shape=MOE_STACK, twin=True, part=0, budget=80, profile=True, warmup=3,
                       steps=8, note="dense twin: one SwiGLU of hidden top_k × expert"),
    "gpu-tests": {"kind": "pytest", "part": 0, "budget": 150,
                  "files": ["tests/test_moe.py", "tests/test_fp8.py", "tests/test_micro_batch.py", "tests/test_loss.py",
                            "tests/test_attention.py", "tests/test_trainer.py"]},
    "trainer-1b": {"kind": "trainer", "part": 0, "steps": 30, "mb": 8, "accum": 4, "loop": False, "budget": 200},
    # -- optional: the MoE with its experts' grouped GEMMs in FP8 too, against its twin in FP8
    "moe-stack-fp8-experts": _model("moe-9b", None, 8, shape=MOE_STACK, precision="fp8", fp8_experts=True, part=4,
                                    budget=110, profile=True, warmup=3, steps=8),
    "moe-twin-fp8": _model("moe-9b", None, 8, shape=MOE_STACK, twin=True, precision="fp8", part=4, budget=90,
                           profile=True, warmup=3, steps=8),
    # -- parts 1–3 (earlier sessions' tables)
    "sdpa-gqa": {"kind": "sdpa", "part": 1},
    "1b-32k-eager": _model(M1, 32000, 8, compile_=False, part=1),
    "1b-32k-compiled": _model(M1, 32000, 8, part=1),
    "1b-128k-compiled": _model(M1, 128256, 8, part=1),
    "1b-128k-eager": _model(M1, 128256, 8, compile_=False, part=1),
    "1b-128k-compiled-chunked-loss": _model(M1, 128256, 8, loss="chunked", part=1,
                                            note="lmforge's chunked loss instead of liger's"),
    "1b-bf16": _model(M1, 32000, 8, part=2),
    "1b-fp8-tensorwise": _model(M1, 32000, 8, precision="fp8", recipe="tensorwise", part=2),
    "3b-bf16": _model(M3, 32000, 2, part=2),
    "3b-fp8-tensorwise": _model(M3, 32000, 2, precision="fp8", recipe="tensorwise", part=2),
    "3b-fp8-rowwise": _model(M3, 32000, 2, precision="fp8", recipe="rowwise", part=2),
    "1b-fp8-rowwise": _model(M1, 32000, 8, precision="fp8", recipe="rowwise", part=2),
    "trainer-60-steps": {"kind": "trainer", "part": 3, "steps": 60},
    "1b-no-fsdp": _model(M1, 32000, 8, part=3),
    "1b-fsdp2-1-rank": _model(M1, 32000, 8, fsdp=True, part=3),
}
# [long-context] Part 5: llama-1b on rows of 8k, 16k and 32k tokens on one GPU (context_parallel 1,
# micro-batch 1, compiled bf16), with the activation checkpointing `plan.context.context_plan`
# picks for an 80 GB GPU: none at 8k and 16k, selective at 32k. MFU's attention term grows with
# the row (12·L·H·Dh·T per token: at 32k it is 2.7× the 6·N term). Few steps each: the three fit
# in about 3 minutes with compilation.
LONG_CONTEXT = {f"1b-{k}k-tokens": _model(M1, 32000, 1, part=5) | {"seq": k * 1024, "ac": ac, "warmup": 2,
                                                                     "steps": steps}
                for k, ac, steps in ((8, False, 5), (16, False, 4), (32, "selective", 3))}
CONFIGS |= LONG_CONTEXT
# [optimizers] Muon's step-time overhead against AdamW on llama-1b (`run_muon`): one model whose steps
# alternate between the two optimizers (same shape, same forward/backward; compiled once), CUDA events
# around the whole step and around the optimizer step alone.
CONFIGS["1b-muon-overhead"] = _model(M1, 32000, 8, part=4, budget=120) | {"kind": "muon", "warmup": 2, "steps": 6}

HEADLINE = [name for name, c in CONFIGS.items() if c["part"] == 0]
# What each row is compared with (the "vs" column): FP8 with bf16, compiled with eager, FSDP with none.
BASELINES = {"1b-32k-compiled": "1b-32k-eager", "1b-128k-compiled": "1b-128k-eager",
             "1b-128k-compiled-chunked-loss": "1b-128k-compiled",
             "1b-fp8-tensorwise": "1b-bf16", "1b-fp8-rowwise": "1b-bf16",
             "3b-fp8-tensorwise": "3b-bf16", "3b-fp8-rowwise": "3b-bf16",
             "1b-fsdp2-1-rank": "1b-no-fsdp", "trainer-60-steps": "trainer-60-steps/bench-loop",
             "3b-fp8-auto": "3b-bf16-auto", "8b-slice-fp8": "8b-slice-bf16", "moe-stack": "moe-twin",
             "moe-stack-fp8-experts": "moe-twin-fp8", "1b-muon-overhead/muon": "1b-muon-overhead/adamw"}
DEFAULT_BUDGET = 300  # seconds a config may take when it names no budget
MIN_BUDGET = 40  # a config is not started with less than this left
WARMUP, STEPS = 3, 10


# --------------------------------------------------------------------------- one config, in-process

def model_shape(c: dict):
    """The ModelConfig a model config trains: its preset with ``shape`` over it (or ``shape``
    alone), the vocabulary and context set, and the MoE's dense twin with ``twin``."""
    from lmforge.config.model import ModelConfig, get_preset

    update = dict(c.get("shape") or {})
    if c.get("vocab"):
        update["vocab_size"] = c["vocab"]
    cfg = get_preset(c["preset"]).model_copy(update=update) if c.get("preset") else ModelConfig(**update)
    cfg = cfg.model_copy(update={"max_seq_len": max(cfg.max_seq_len, c["seq"])})
    if c.get("twin"):  # one SwiGLU MLP of hidden top_k × expert hidden: the same parameters meet a token
        cfg = cfg.model_copy(update={"n_experts": 0, "top_k": 0, "ffn_hidden": cfg.top_k * cfg.expert_dim,
                                     "preset": None})
    return cfg


def auto_micro_batch(c: dict, device):
    """`plan.micro_batch.Choice` for a config with ``auto``: what `micro_batch_size: auto`
    picks (modelled) for the whole model it names on ``gpus`` GPUs like this one (an H100's
    figures where there is none: the CPU smoke test), its other candidates ranked after it."""
    from lmforge.config.model import ModelConfig, get_preset
    from lmforge.plan.hardware import GPU_TYPES, detect_device_spec, peak_flops
    from lmforge.plan.layout import Sharding
    from lmforge.plan.micro_batch import choose

    a = c["auto"]
    whole = get_preset(a["preset"]).model_copy(update={"vocab_size": a["vocab_size"]}) if a.get("preset") \
        else ModelConfig(**a["shape"])
    if str(device).startswith("cuda"):
        import torch

        memory, spec = float(torch.cuda.get_device_properties(device).total_memory), detect_device_spec(device)
    else:
        spec = GPU_TYPES["h100-sxm"]
        memory = spec.memory_bytes
    return choose(whole, c["seq"], sharding=Sharding("fsdp", a["gpus"]), gpu_memory=memory,
                  peak_flops=peak_flops(spec, "bf16"), where=f"{a['gpus']} × {spec.name}")


def ac_label(value) -> str:
    if value in (False, None, "auto"):
        return "none"
    if value is True or value == "full":
        return "full"
    if isinstance(value, dict):  # {granularity, layers} (`plan.activations`)
        return f"{value['granularity']} {value.get('layers', 'all')}"
    return "selective" if value == "selective" else f"every {value}"


def run_model(c: dict) -> dict:
    """One model config's row. With ``auto``, the chooser's micro-batch and checkpointing mode;
    should that run out of memory (the memory model was wrong), the next candidate it ranked,
    and the row says so."""
    import gc

    import torch

    shape = model_shape(c)
    attempts, choice = [(c["mb"], c.get("ac", False))], None
    if c.get("auto"):
        choice = auto_micro_batch(c, c.get("device", "cuda"))
        attempts = [(min(k.micro_batch, c.get("max_mb", k.micro_batch)), k.checkpointing)
                    for k in choice.candidates[:3]]
    failed = []
    for mb, ac in attempts:
        try:
            row = _run_model(c, shape, mb, ac)
        except torch.cuda.OutOfMemoryError:
            failed.append(f"{ac_label(ac)} × {mb}")
        else:
            if choice:
                row["choice"] = choice.reason
            if failed:
                row["note"] = (row.get("note", "") + f" out of memory at {', '.join(failed)}; ran the next "
                               "candidate").strip()
            return row
        gc.collect()  # (outside the except: its traceback no longer holds the failed model's frames)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    raise torch.cuda.OutOfMemoryError(f"out of memory at {', '.join(failed)}")


def _run_model(c: dict, shape, mb: int, ac) -> dict:
    import torch

    from lmforge.config.schema import ComputeConfig
    from lmforge.data.batch import Batch
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.float8 import FP8Options, after_optimizer_step
    from lmforge.distributed.parallelize import materialize, parallelize
    from lmforge.plan.flops import flops_per_token, mfu_flops_per_token, param_counts
    from lmforge.plan.hardware import detect_device_spec, mfu, peak_flops
    from lmforge.plan.layout import Layout, Sharding
    from lmforge.plan.memory import activation_bytes, fixed_bytes
    from lmforge.models import build_model
    from lmforge.models.transformer import Transformer
    from lmforge.train.optim import build_optimizer

    device = torch.device(c.get("device", "cuda"))
    cuda = device.type == "cuda"
    accum = max(1, c["tokens_per_step"] // (mb * c["seq"])) if c.get("tokens_per_step") else c["accum"]
    layout = Layout(data_parallel="fsdp" if c["fsdp"] else "none", device=device.type)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    options = dict(compute=ComputeConfig(compile=c["compile"], loss_kernel=c["loss"]), checkpointing=ac,
                   precision=c["precision"], fp8=FP8Options(c["recipe"], experts=c.get("fp8_experts", False)))
    torch.manual_seed(0)
    if c["fsdp"]:  # as the trainer does it: a meta-device model, sharded, then filled from a full copy
        full = build_model(shape, device="cpu").state_dict()
        with torch.device("meta"):
            model = Transformer(shape)
        step_forward = parallelize(model, layout, dist, **options)
        materialize(model, device, full)
        del full
    else:
        model = build_model(shape, device=device)
        step_forward = parallelize(model, layout, dist, **options)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    bf16 = c["precision"] in ("bf16", "fp8")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    gen = torch.Generator().manual_seed(1)
    batches = [Batch.from_tokens(torch.randint(0, shape.vocab_size, (mb, c["seq"]), generator=gen)).to(device)
               for _ in range(accum)]
    n_targets = float(sum(int(b.num_targets()) for b in batches))
    last = {}

    def step():
        for b in batches:
            with autocast:
                out = step_forward(b.input_ids, b.targets)
            loss = out.ce_sum / n_targets
            if out.aux_loss is not None:  # the MoE's router losses, as training weighs them
                loss = loss + out.aux_loss / len(batches)
            loss.backward()
            last["loss"] = out.ce_sum.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_optimizer_step(model)

    warmup, steps = c.get("warmup", WARMUP), c.get("steps", STEPS)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    times = _timed(step, steps, cuda)
    warm_s = time.perf_counter() - t0 - sum(times)
    dt = statistics.median(times)
    tokens = mb * c["seq"] * accum
    tps = tokens / dt
    spec = detect_device_spec(device)
    peak = peak_flops(spec, "bf16" if (cuda or bf16) else "fp32")
    expected = (fixed_bytes(param_counts(shape)["total"], shape, Sharding("fsdp", 1))
                + mb * activation_bytes(shape, c["seq"], ac))
    row = {"tokens_per_s": tps, "step_ms": dt * 1e3, "step_ms_spread": (max(times) - min(times)) * 1e3,
           "mfu": mfu(tps, mfu_flops_per_token(shape, c["seq"]), 1, peak),
           "mfu_6n": mfu(tps, flops_per_token(shape, c["seq"])["dense"], 1, peak),
           "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
           "model_gb": expected / 2**30, "mb": mb, "accum": accum, "ac": ac_label(ac), "note": c.get("note", ""),
           "warmup_s": warm_s, "loss": float(last["loss"]) / (mb * c["seq"]), "device": spec.description}
    if c.get("profile") and cuda:
        row["kernels"] = kernel_breakdown(step)
    return row


def kernel_breakdown(step) -> dict:
    """Where one more step's GPU time goes (torch profiler, kernel time summed by kind): the
    MoE's grouped GEMMs against plain GEMMs, attention, compiled element-wise kernels (routing,
    dispatch, combine, norms) and the rest, in ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for e in prof.key_averages():
        ms = e.self_device_time_total / 1e3 if hasattr(e, "self_device_time_total") else e.self_cuda_time_total / 1e3
        if ms <= 0:
            continue
        name = e.key.lower()
        if any(k in name for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            kind = "attention"
        elif any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "_mm", "matmul")):
            kind = "grouped GEMM" if "group" in name else "GEMM"
        elif name.startswith("triton"):
            kind = "triton"
        else:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def run_muon(c: dict) -> list[dict]:
    """Muon against AdamW on the same model (`CONFIGS["1b-muon-overhead"]`): both optimizers hold
    the model's parameters and take turns (AdamW, Muon, Muon, AdamW, ...), so compilation happens
    once and the forward and backward are the same work in both rows. Rows: one per optimizer,
    with the optimizer step's own time and share of the step; "vs" is Muon's throughput over AdamW's.
    MFU stays on the model's FLOPs: the optimizer's work is overhead, not model FLOPs."""
    import torch

    from lmforge.config.schema import ComputeConfig
    from lmforge.data.batch import Batch
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import parallelize
    from lmforge.plan.flops import flops_per_token, mfu_flops_per_token
    from lmforge.plan.hardware import detect_device_spec, mfu, peak_flops
    from lmforge.plan.layout import Layout
    from lmforge.models import build_model
    from lmforge.train.optim import build_optimizer

    device = torch.device(c.get("device", "cuda"))
    cuda = device.type == "cuda"
    shape = model_shape(c)
    compute = ComputeConfig(compile=c["compile"], loss_kernel=c["loss"])
    torch.manual_seed(0)
    model = build_model(shape, device=device)
    step_forward = parallelize(model, Layout(device=device.type), DistInfo(rank=0, world_size=1, local_rank=0,
                                                                           device=device),
                               compute=compute, precision=c["precision"])
    bf16 = c["precision"] == "bf16"
    ns_dtype = torch.bfloat16 if bf16 else torch.float32  # Newton–Schulz as the trainer runs it
    opts = {kind: build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                  device_type=device.type, kind=kind, ns_dtype=ns_dtype) for kind in ("adamw", "muon")}
    gen = torch.Generator().manual_seed(1)
    batch = Batch.from_tokens(torch.randint(0, shape.vocab_size, (c["mb"], c["seq"]), generator=gen)).to(device)
    n_targets = float(batch.num_targets())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step(kind: str) -> tuple[float, float]:
        """(step s, optimizer step s)."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
        t = [time.perf_counter()]
        if cuda:
            marks[0].record()
        with autocast:
            out = step_forward(batch.input_ids, batch.targets)
        (out.ce_sum / n_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if cuda:
            marks[1].record()
        t.append(time.perf_counter())
        opts[kind].step()
        opts[kind].zero_grad(set_to_none=True)
        if cuda:
            marks[2].record()
            marks[2].synchronize()
            return marks[0].elapsed_time(marks[2]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3
        t.append(time.perf_counter())
        return t[2] - t[0], t[2] - t[1]

    t0 = time.perf_counter()
    for kind in ("adamw", "muon") * c.get("warmup", WARMUP):
        step(kind)
    warm_s = time.perf_counter() - t0
    times: dict[str, list[tuple[float, float]]] = {"adamw": [], "muon": []}
    for i in range(c.get("steps", STEPS)):
        for kind in (("adamw", "muon") if i % 2 == 0 else ("muon", "adamw")):
            times[kind].append(step(kind))
    spec = detect_device_spec(device)
    peak = peak_flops(spec, "bf16" if (cuda or bf16) else "fp32")
    tokens = c["mb"] * c["seq"]
    rows = []
    for kind, ts in times.items():
        dt = statistics.median(s for s, _ in ts)
        opt_s = statistics.median(o for _, o in ts)
        tps = tokens / dt
        rows.append({"name": f"1b-muon-overhead/{kind}", "tokens_per_s": tps, "step_ms": dt * 1e3,
                     "opt_ms": opt_s * 1e3, "opt_share": opt_s / dt,
                     "mfu": mfu(tps, mfu_flops_per_token(shape, c["seq"]), 1, peak),
                     "mfu_6n": mfu(tps, flops_per_token(shape, c["seq"])["dense"], 1, peak),
                     "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                     "warmup_s": warm_s, "device": spec.description, "mb": c["mb"], "accum": 1,
                     "note": f"optimizer step {opt_s * 1e3:.0f} ms = {opt_s / dt:.0%} of the step"})
    return rows


def _timed(fn, n: int, cuda: bool) -> list[float]:
    """Seconds of each of n calls: CUDA events around each (the host never waits in between)."""
    import torch

    if not cuda:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for i in range(n):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]


def run_sdpa(c: dict) -> list[dict]:
    """Which SDPA kernel runs grouped-query causal attention (llama-1b's heads: 16 query, 8 key/value,
    head dim 128, 8 × 2048 tokens, bf16), and forward + backward time of each backend and of
    FlexAttention with a causal block mask (the packed-documents path)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, KV, T, D = 8, 16, 8, 2048, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 3.5 * 4 * B * H * T * T * D / 2  # fwd 2 matmuls + bwd 5, causal half (what the kernels do)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for name, backend in backends.items():
        try:
            with sdpa_kernel(backend):
                times = _warm_and_time(sdpa)
            rows.append({"name": f"sdpa-gqa/{name}", "step_ms": statistics.median(times) * 1e3,
                         "tflops": flops / statistics.median(times) / 1e12})
        except RuntimeError as e:
            rows.append({"name": f"sdpa-gqa/{name}", "error": str(e).splitlines()[0][:90]})
    times = _warm_and_time(sdpa)
    rows.append({"name": "sdpa-gqa/default", "step_ms": statistics.median(times) * 1e3,
                 "tflops": flops / statistics.median(times) / 1e12, "note": "kernels: " + _kernels(sdpa)})
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_step():
        flex(q, k, v, block_mask=mask, enable_gqa=True).backward(grad)

    try:
        times = _warm_and_time(flex_step)
        rows.append({"name": "sdpa-gqa/flex-compiled", "step_ms": statistics.median(times) * 1e3,
                     "tflops": flops / statistics.median(times) / 1e12})
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        rows.append({"name": "sdpa-gqa/flex-compiled", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
    return rows


def _warm_and_time(fn, warmup: int = 3, n: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    return _timed(fn, n, True)


def _kernels(fn) -> str:
    """The attention kernels one call launches (from the profiler), to name the default backend."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if any(s in e.key.lower() for s in ("flash", "fmha", "cudnn", "attention",
                                                                                      "efficient", "sdpa"))}
    return ", ".join(sorted(n[:48] for n in names)[:3]) or "none matched (math?)"


def run_trainer(name: str, c: dict) -> Iterator[dict]:
    """`lmforge train` for ``steps`` steps on llama-1b (tokenizer with a 32k vocabulary trained on
    the built-in corpus, micro-batch ``mb`` × 2048, ``accum`` micro-batches per step, compiled,
    bf16), its tokens/s read from metrics.jsonl (the median of the log windows after the first,
    which holds the compilation), then (unless ``loop`` is false) the same step in this script's
    loop."""
    steps = c.get("steps", 60)
    preset = c.get("preset", M1)
    mb, accum, seq = c.get("mb", 8), c.get("accum", 2), c.get("seq", 2048)
    log_every = 10 if steps >= 30 else max(1, steps // 4)
    compile_ = c.get("compile", True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 60e9 else None
    root = tempfile.mkdtemp(prefix="lmforge-bench-", dir=shm)
    try:
        folder = os.path.join(root, "run")
        cfg = {"name": "gpu-bench-trainer", "model": preset, "train_data": "builtin:python-stdlib",
               "tokenizer": {"train": {"vocab_size": c.get("vocab", 32000)}},
               "training_duration": f"{steps}ba", "save_folder": folder, "save_interval": "100000ba",
               "parameters": {"global_batch_size": mb * accum, "micro_batch_size": mb, "context_length": seq},
               "eval": {"interval": "100000ba", "max_batches": 1, "prompts": []},
               "experiment_tracker": {"mlflow": None, "console": True}, "log_interval": log_every,
               "compute": {"device": c.get("device", "cuda"), "compile": compile_}}
        path = os.path.join(root, "run.yaml")
        with open(path, "w") as f:
            json.dump(cfg, f)  # JSON is YAML
        env = os.environ | {"LMFORGE_HOME": os.path.join(root, "home"), "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        timeout = min(c.get("timeout", 420), c.get("deadline") or 420)
        try:
            proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", path], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [{"name": name, "error": f"`lmforge train` still running after {timeout:.0f}s"}]
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["?"]
            return [{"name": name, "error": f"exit {proc.returncode}: {tail[0][:100]}"}]
        rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        windows = [r for r in rows if "throughput/tokens_per_s" in r and r["step"] > log_every]
        with open(os.path.join(folder, "run.json")) as f:
            vocab = json.load(f)["config"]["model"]["vocab_size"]
        trainer = {"name": name, "tokens_per_s": statistics.median(r["throughput/tokens_per_s"]
                                                                                 for r in windows),
                   "mfu": statistics.median(r["throughput/mfu"] for r in windows),
                   "mfu_6n": statistics.median(r["throughput/mfu_6n"] for r in windows),
                   "peak_gb": max((r.get("memory/max_allocated_gb") or 0) for r in windows) or None,
                   "mb": mb, "accum": accum, "ac": "none",
                   "note": f"vocab {vocab}, {len(windows)} windows; run wall {wall:.0f}s"}
        trainer["step_ms"] = mb * accum * seq / trainer["tokens_per_s"] * 1e3
    finally:
        shutil.rmtree(root, ignore_errors=True)
    yield trainer  # printed now: kept if the loop below runs out of the call's budget
    if not c.get("loop", True):
        return
    loop = run_model(_model(preset, vocab, mb, accum=accum, compile_=compile_, part=3)
                     | {"device": c.get("device", "cuda"), "seq": seq} | {k: c[k] for k in ("warmup", "steps") if k in c})
    yield loop | {"name": f"{name}/bench-loop", "note": "the same step in this script's loop"}


def run_pytest(c: dict) -> dict:
    """The `gpu`-marked tests of ``files`` (most important first), stopped before the config's
    deadline: what passed, failed and was skipped, and the names of the failures."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", c.get("marker", "gpu"), "-p", "no:cacheprovider",
           *c["files"]]
    t0 = time.perf_counter()
    try:
        deadline = c.get("deadline")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, start_new_session=True,
                              timeout=None if deadline is None else max(10.0, deadline - 5))
        out, timed_out = proc.stdout, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out = True
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", out, re.M)
    count = {k: sum(r == k for _, r in results) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = [n.split("::", 1)[1] for n, r in results if r in ("FAILED", "ERROR")]
    note = f"{count['PASSED']} passed, {count['FAILED'] + count['ERROR']} failed, {count['SKIPPED']} skipped"
    if failed:
        note += ": " + ", ".join(failed[:4]) + (" …" if len(failed) > 4 else "")
    if timed_out:
        note += f"; stopped at the budget after {time.perf_counter() - t0:.0f}s"
    tail = [line for line in out.splitlines() if line.startswith(("E ", "FAILED", "ERROR"))][:20]
    return {"passed": count["PASSED"], "failed": count["FAILED"] + count["ERROR"], "skipped": count["SKIPPED"],
            "failures": failed, "note": note, "log_tail": tail}


def smoke(c: dict) -> dict:
    """The same config at toy size on the CPU: checks the script itself (tests/test_bench_gpu.py)."""
    if c["kind"] == "model":
        tiny = c | {"device": "cpu", "vocab": 512, "seq": 64, "mb": 2, "compile": False, "max_mb": 2,
                    "precision": "fp32" if c["precision"] == "bf16" else c["precision"], "warmup": 1, "steps": 2,
                    "profile": False}
        if (c.get("preset") or "").startswith("moe"):
            tiny |= {"preset": "moe-tiny", "shape": {"n_layers": 2}}
        else:
            tiny |= {"preset": "llama-tiny", "shape": None}
        if c.get("tokens_per_step"):
            tiny["tokens_per_step"] = 2 * 2 * 64  # two micro-batches of 2 × 64
        return tiny
    if c["kind"] == "trainer":
        return c | {"device": "cpu", "preset": "llama-tiny", "vocab": 512, "seq": 64, "mb": 2, "compile": False,
                    "steps": 12, "warmup": 1}
    if c["kind"] == "muon":
        return c | {"device": "cpu", "preset": "llama-tiny", "vocab": 512, "seq": 64, "mb": 2, "compile": False,
                    "precision": "fp32", "warmup": 1, "steps": 2}
    if c["kind"] == "pytest":  # the tests are checked by the suite itself: here only the runner, on one file
        return c | {"files": ["tests/test_bench_gpu.py::test_the_table_compares_each_row_with_its_baseline"],
                    "marker": "not gpu"}
    return c | {"device": "cpu"}


def run_config(name: str, c: dict) -> Iterator[dict]:
    """The config's rows, each as soon as it is measured."""
    if c.get("device") == "cpu" and (c["kind"] == "sdpa" or c.get("precision") == "fp8"):
        yield {"name": name, "config": name, "part": c["part"], "error": "needs CUDA"}
        return
    if c["kind"] == "sdpa":
        rows = run_sdpa(c)
    elif c["kind"] == "trainer":
        rows = run_trainer(name, c)
    elif c["kind"] == "pytest":
        rows = [run_pytest(c) | {"name": name}]
    elif c["kind"] == "muon":
        rows = run_muon(c)
    else:
        rows = [run_model(c) | {"name": name}]
    for r in rows:
        # The bench's own import path must not need the tracker back-ends or the object-store client.
        heavy = sorted(m for m in ("mlflow", "wandb", "s3fs") if m in sys.modules)
        r.setdefault("name", name)
        yield r | {"config": name, "part": c["part"], "heavy_imports": heavy}


# --------------------------------------------------------------------------- parts, table

def _result_rows(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def run_part(names: list[str], results: str, budget: float, smoke_: bool = False) -> None:
    """Each config in its own process, in order, each under its own budget and what is left of
    the call's; one that runs out is stopped with its whole process group (a trainer or pytest
    below it included), and the rows it printed before are kept."""
    start = time.monotonic()
    meta = _meta()
    for name in names:
        c = CONFIGS[name]
        left = budget - (time.monotonic() - start)
        if left < MIN_BUDGET:
            _append(results, {"name": name, "config": name, "part": c["part"],
                              "error": "skipped: out of this call's time budget (run it with `only`)"} | meta)
            print(f"# {name}: skipped (out of the call's budget)", flush=True)
            continue
        allowed = min(c.get("budget", DEFAULT_BUDGET), left - 5)
        t0 = time.monotonic()
        cmd = [sys.executable, os.path.abspath(__file__), "config", name, "--deadline", str(allowed - 10)] \
            + (["--smoke"] if smoke_ else [])
        out, err, code = _run_group(cmd, allowed)
        rows = _result_rows(out)
        if code is None:
            rows.append({"name": name, "error": f"stopped at its budget ({allowed:.0f}s)"})
        elif code != 0 or not rows:
            tail = (err.strip() or out.strip()).splitlines()[-1:] or ["?"]
            rows.append({"name": name, "error": f"exit {code}: {tail[0][:120]}"})
            sys.stderr.write(err[-4000:])
        for r in rows:
            r.setdefault("config", name)
            r.setdefault("part", c["part"])
            _append(results, r | meta | {"wall_s": round(time.monotonic() - t0, 1)})
            if r.get("choice"):
                print(f"# {r['name']}: {r['choice']}", flush=True)
        print(f"# {name}: {time.monotonic() - t0:.0f}s of {allowed:.0f}s allowed", flush=True)
    print(table(results))


def _run_group(cmd: list[str], timeout: float) -> tuple[str, str, int | None]:
    """(stdout, stderr, exit code) of ``cmd`` in a new process group; past ``timeout`` the whole
    group is killed (a config's own subprocesses too) and the code is None."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out, err, None


def _meta() -> dict:
    import torch

    commit = os.environ.get("LMFORGE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "commit": commit or "unknown", "date": time.strftime("%Y-%m-%d")}


def _append(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(path, os.path.join(os.environ["OUT"], os.path.basename(path)))


def table(path: str) -> str:
    """All rows of the results file (the latest row per name), as a markdown table."""
    if not os.path.exists(path):
        return f"(no results in {path})"
    rows: dict[str, dict] = {}
    for line in open(path):
        r = json.loads(line)
        rows[r["name"]] = r
    lines = ["| part | config | tokens/s | MFU | MFU 6N | step ms | mb × acc | AC | peak GiB | model GiB | vs "
             "| note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: (kv[1].get("part", 9), list(rows).index(kv[0]))):
        if "error" in r:
            lines.append(f"| {r.get('part', '')} | {name} | — | | | | | | | | | {r['error']} |")
            continue
        if "tflops" in r:
            lines.append(f"| {r['part']} | {name} | | | | {r['step_ms']:.2f} | | | | | {r['tflops']:.0f} TFLOP/s | "
                         f"{r.get('note', '')} |")
            continue
        if "passed" in r:  # the GPU tests
            lines.append(f"| {r['part']} | {name} | | | | | | | | | | {r['note']} |")
            continue
        base = rows.get(BASELINES.get(name, ""), {})
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}× {BASELINES[name].split('/')[-1]}" \
            if base.get("tokens_per_s") else ""
        heavy = f" imported {','.join(r['heavy_imports'])}!" if r.get("heavy_imports") else ""
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else ""
        expected = f"{r['model_gb']:.1f}" if r.get("model_gb") else ""
        batch = f"{r['mb']} × {r.get('accum', 1)}" if r.get("mb") else ""
        kernels = r.get("kernels") or {}
        total = sum(kernels.values())
        where = ("; " + ", ".join(f"{k} {v / total:.0%}" for k, v in kernels.items())) if total else ""
        lines.append(f"| {r['part']} | {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['mfu_6n']:.1%} | "
                     f"{r['step_ms']:.0f} | {batch} | {r.get('ac', '')} | {peak} | {expected} | {vs} | "
                     f"{r.get('note', '')}{where}{heavy} |")
    first = next(iter(rows.values()))
    return "\n".join([f"# {first.get('gpu')}, torch {first.get('torch')}, commit {first.get('commit')}, "
                      f"{first.get('date')}"] + lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["headline", "part", "only", "config", "table", "list"])
    p.add_argument("arg", nargs="?")
    p.add_argument("--results", default=DEFAULT_RESULTS)
    p.add_argument("--budget", type=float, default=520.0, help="seconds this call may take (a device call has 600)")
    p.add_argument("--deadline", type=float, default=None, help="config: seconds it may take (its subprocesses stop "
                   "before)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script, measures nothing)")
    args = p.parse_args()
    if args.what == "list":
        for name, c in CONFIGS.items():
            print(c["part"], name, f"{c.get('budget', DEFAULT_BUDGET)}s", "(headline)" if name in HEADLINE else "")
    elif args.what == "table":
        print(table(args.arg or args.results))
    elif args.what == "config":  # (several names: one after the other in this process, for smoke tests)
        for name in args.arg.split(","):
            config = smoke(CONFIGS[name]) if args.smoke else CONFIGS[name]
            if args.deadline is not None:
                config = config | {"deadline": args.deadline}
            for row in run_config(name, config):
                print("RESULT " + json.dumps(row), flush=True)
    else:
        extra = [n for n in (args.arg or "").split(",") if n]
        if args.what == "headline":
            names = HEADLINE + [n for n in extra if n not in HEADLINE]
        elif args.what == "part":
            names = [n for n, c in CONFIGS.items() if str(c["part"]) == args.arg]
        else:
            names = extra
        unknown = [n for n in names if n not in CONFIGS]
        if unknown or not names:
            sys.exit(f"error: unknown config(s) {unknown or args.arg}; see `python bench/gpu.py list`")
        run_part(names, args.results, args.budget, args.smoke)


if __name__ == "__main__":
    main()
