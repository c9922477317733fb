"""Training throughput of a preset: tokens/s and MFU, eager vs compile, fp32 vs bf16.

    python bench/train_throughput.py --preset llama-tiny --micro-batch 8 --seq 256
    python bench/train_throughput.py --preset llama-1b --micro-batch 8 --seq 2048 --modes compile:bf16

Each mode builds the model fresh, runs warm-up steps (compilation happens there), then times
`--steps` full optimizer steps (forward, backward, clip, fused AdamW) exactly as the trainer runs
them. MFU uses lmforge.plan's FLOPs (`mfu_flops_per_token`: 6 × active params + 12·L·H·Dh·T
attention per token) and the device's peak.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lmforge.config.model import get_preset  # noqa: E402
from lmforge.data.batch import Batch  # noqa: E402
from lmforge.distributed.host_memory import keep_freed_memory  # noqa: E402
from lmforge.distributed.parallelize import apply_compile  # noqa: E402
from lmforge.plan.flops import mfu_flops_per_token, param_counts  # noqa: E402
from lmforge.plan.hardware import detect_device_spec, peak_flops  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from lmforge.train.optim import build_optimizer  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(args, compile_: bool, precision: str, device: torch.device) -> dict:
    cfg = get_preset(args.preset).model_copy(update={"vocab_size": args.vocab, "max_seq_len": args.seq})
    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    if compile_:
        apply_compile(model)  # the blocks and the norm + head + loss, as training compiles them
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    batch = Batch.from_tokens(torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq))).to(device)
    n_targets = int(batch.num_targets())

    def step():
        with autocast():
            out = model.training_loss(batch.input_ids, batch.targets)
        loss = out.ce_sum / n_targets
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / args.steps
    tps = args.micro_batch * args.seq / dt
    spec = detect_device_spec(device)
    peak = peak_flops(spec, precision if precision == "bf16" else "fp32")
    mfu = tps * mfu_flops_per_token(cfg, args.seq) / peak
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"mode": f"{'compile' if compile_ else 'eager'}:{precision}", "step_s": dt, "tokens_per_s": tps,
            "mfu": mfu, "warmup_s": warm, "mem_gb": mem}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default="eager:fp32,compile:fp32,eager:bf16,compile:bf16",
                   help="comma-separated eager|compile:fp32|bf16")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU: malloc keeps freed memory, as `lmforge train` sets it (distributed.host_memory)")
    args = p.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    device = torch.device(args.device)
    cfg = get_preset(args.preset).model_copy(update={"vocab_size": args.vocab})
    counts = param_counts(cfg)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'} × {torch.get_num_threads()} threads"
    print(f"# {args.preset}: {counts['total'] / 1e6:.1f}M params ({counts['active'] / 1e6:.1f}M active), "
          f"micro-batch {args.micro_batch} × seq {args.seq}, vocab {args.vocab}")
    print(f"# device: {name}; peak per {detect_device_spec(device).description or detect_device_spec(device).name}; "
          f"torch {torch.__version__}")
    print("| mode | step (s) | tokens/s | MFU | warm-up (s) | peak mem (GB) |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        kind, precision = mode.split(":")
        try:
            r = measure(args, kind == "compile", precision, device)
        except Exception as e:  # e.g. no C++ compiler for inductor on this machine
            print(f"| {mode} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | |")
            continue
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
              f"{r['warmup_s']:.1f} | {r['mem_gb']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
