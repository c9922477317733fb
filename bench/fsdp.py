"""Training throughput (tokens/s, MFU) of one preset with FSDP on/off and activation checkpointing on/off.

Uses the trainer's own pieces (``parallelize``: activation checkpointing → compile → FSDP2,
meta-device init + sharded materialization, the trainer's MFU formula). FSDP runs on however
many ranks started the script: plain ``python`` gives one rank (FSDP on 1 device, a 1-rank
process group), ``torchrun --nproc-per-node N`` gives N.

    GPU:  python bench/fsdp.py --preset llama-1b --seq 2048 --batch 4 --compile
          torchrun --nproc-per-node 8 bench/fsdp.py --preset llama-7b --seq 4096 --compile
    CPU:  OMP_NUM_THREADS=2 python bench/fsdp.py --preset llama-tiny --seq 256 --batch 4 --iters 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as td

from lmforge.config.model import resolve_model
from lmforge.config.schema import ComputeConfig
from lmforge.data.batch import Batch
from lmforge.distributed.dist import init_distributed
from lmforge.distributed.parallelize import materialize, parallelize
from lmforge.plan.flops import mfu_flops_per_token
from lmforge.plan.hardware import detect_device_spec, mfu, peak_flops
from lmforge.models import build_model
from lmforge.models.transformer import Transformer
from lmforge.plan.layout import Layout


def bench(shape, dist, *, fsdp: bool, ac, compile_: bool, batch: int, seq: int, iters: int, warmup: int) -> dict:
    bf16 = dist.device.type == "cuda"
    compute = ComputeConfig(compile=compile_)
    layout = Layout(ranks=dist.world_size, data_parallel="fsdp" if fsdp else "none",
                    shard_group=dist.world_size if fsdp else 1, device=dist.device.type)
    torch.manual_seed(0)
    if fsdp:
        full = build_model(shape, device="cpu").state_dict() if dist.rank == 0 else None
        with torch.device("meta"):
            model = Transformer(shape)
        train_forward = parallelize(model, layout, dist, compute=compute, checkpointing=ac,
                                    precision="bf16" if bf16 else "fp32")
        materialize(model, dist.device, full)
        del full
    else:
        model = build_model(shape, device=dist.device)
        train_forward = parallelize(model, layout, dist, compute=compute, checkpointing=ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dist.device.type == "cuda")
    data = Batch.from_tokens(torch.randint(0, shape.vocab_size, (batch, seq))).to(dist.device)
    n_targets = int(data.num_targets())
    autocast = torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=bf16)

    def step():
        with autocast:
            out = train_forward(data.input_ids, data.targets)
        (out.ce_sum / n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if dist.device.type == "cuda" else (lambda: None)
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):  # includes compilation
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    dt = time.perf_counter() - t0
    tps = batch * seq * iters * dist.world_size / dt
    spec = detect_device_spec(dist.device)
    peak = peak_flops(spec, "bf16" if bf16 else "fp32")
    row = {"fsdp": fsdp, "act_ckpt": ac, "compile": compile_, "tokens_per_s": round(tps, 1),
           "mfu": round(mfu(tps, mfu_flops_per_token(shape, seq), dist.world_size, peak), 4),
           "ranks": dist.world_size, "device": spec.name}
    if dist.device.type == "cuda":
        row["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, opt
    gc.collect()
    if dist.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-tiny")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's, else 32000)")
    ap.add_argument("--ac", default="off,full", help="activation checkpointing modes to run (off,full,selective,N)")
    ap.add_argument("--fsdp", default="off,on", help="fsdp settings to run (off,on); off needs a single rank")
    args = ap.parse_args()

    dist = init_distributed("auto")
    shape = resolve_model(args.preset)
    shape = shape.model_copy(update={"vocab_size": args.vocab or shape.vocab_size or 32000,
                                     "max_seq_len": max(shape.max_seq_len, args.seq)})
    rows = []
    for fsdp in [s == "on" for s in args.fsdp.split(",")]:
        if not fsdp and dist.world_size > 1:
            continue
        for ac in args.ac.split(","):
            ac_value = False if ac == "off" else (int(ac) if ac.isdigit() else ac)
            row = bench(shape, dist, fsdp=fsdp, ac=ac_value, compile_=args.compile, batch=args.batch,
                        seq=args.seq, iters=args.iters, warmup=args.warmup)
            row |= {"preset": args.preset, "seq": args.seq, "batch": args.batch}
            rows.append(row)
            if dist.rank == 0:
                print(json.dumps(row), flush=True)
    if td.is_initialized():
        td.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
