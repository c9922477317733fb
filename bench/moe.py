"""Tokens/s and MFU of an MoE model against its dense twin (same active parameters), fwd+bwd+AdamW.

    python bench/moe.py                    # CPU: moe-tiny, fp32, batch 4 × 256
    python bench/moe.py --device cuda      # GPU: a moe-9b-shaped stack, bf16 autocast, compiled, 8 × 2048

GPU: a stack of `--layers` (default 4) blocks of moe-9b's shape (d 2048, 16 heads / 8 KV heads, 16
experts of hidden 3584, top-4, vocabulary 100352) — the whole 24-layer model's weights and Adam
state do not fit one GPU without sharding — trained as `lmforge train` trains on one GPU: fp32
master weights, bf16 autocast, every block compiled (fullgraph), fused AdamW, gradient clipping.
The dense twin replaces each MoE layer with one SwiGLU MLP of hidden top_k × expert hidden, so one
token meets the same parameters. MFU is on active parameters on the standard basis
(`lmforge.estimate.flops.mfu_flops_per_token`: 6·N_active + 12·L·H·Dh·T) against the device's
dense bf16 peak (fp32 peak on the CPU, `estimate.hardware.cpu_spec`).

Both models are built and warmed up once; rounds then alternate MoE and dense and keep each one's
best, so load from other processes on a shared machine hits both alike; tokens per CPU-second of
this process are printed too, and the median over rounds of each round's MoE/dense ratio (the
steadiest figure on a noisy machine) —
for whole steps, and for forward + backward alone (the layers' own work: the optimizer and
gradient clipping walk every parameter, and the MoE has several times the dense twin's).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lmforge.config.model import ModelConfig, get_preset, resolve_model  # noqa: E402
from lmforge.config.schema import ComputeConfig  # noqa: E402
from lmforge.data.batch import Batch  # noqa: E402
from lmforge.distributed.dist import DistInfo  # noqa: E402
from lmforge.distributed.host_memory import keep_freed_memory  # noqa: E402
from lmforge.distributed.parallelize import parallelize  # noqa: E402
from lmforge.estimate.flops import mfu_flops_per_token, param_counts  # noqa: E402
from lmforge.estimate.hardware import detect_device_spec, peak_flops  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from lmforge.train.optim import build_optimizer  # noqa: E402


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(update={"n_experts": 0, "top_k": 0, "ffn_hidden": cfg.top_k * cfg.expert_dim,
                                  "preset": None})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(cfg: ModelConfig, args, device: torch.device):
    """A model and its optimizer, warmed up; -> step(): one training step, returning the seconds
    spent in forward + backward (the model's work, without the optimizer over every parameter)."""
    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    train_forward = parallelize(model, ComputeConfig(compile=args.compile, data_parallel="none"), one,
                                precision="bf16" if args.bf16 else "fp32")
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.bf16 else nullcontext
    batch = Batch.from_tokens(torch.randint(0, cfg.vocab_size, (args.batch, args.seq))).to(device)
    n_targets = int(batch.num_targets())

    def step() -> float:
        t = time.perf_counter()
        with autocast():
            out = train_forward(batch.input_ids, batch.targets)
        loss = out.ce_sum / n_targets
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        loss.backward()
        sync(device)
        model_s = time.perf_counter() - t
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model_s

    for _ in range(args.warmup):  # allocations, kernel selection, compilation
        step()
    sync(device)
    return step


def timed(step, args, device: torch.device) -> tuple[float, float, float]:
    """`args.iters` steps -> (tokens per wall second of whole steps, per CPU second of this
    process, per wall second of forward + backward alone)."""
    sync(device)
    t, cpu = time.perf_counter(), time.process_time()
    model_s = sum(step() for _ in range(args.iters))
    sync(device)
    tokens = args.batch * args.seq * args.iters
    return tokens / (time.perf_counter() - t), tokens / (time.process_time() - cpu), tokens / model_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=4, help="cuda: blocks in the moe-9b-shaped stack")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (cpu 4, cuda 8)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (cpu 256, cuda 2048)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (cpu 5, cuda 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (cpu 2, cuda 3)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (cpu 8, cuda 2)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile every block (default: on for cuda, off for cpu)")
    ap.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU: malloc keeps freed memory, as `lmforge train` sets it (distributed.host_memory)")
    args = ap.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    gpu = args.device == "cuda"
    defaults = dict(batch=8, seq=2048, iters=20, warmup=3, compile=True, rounds=2) if gpu else \
        dict(batch=4, seq=256, iters=5, warmup=2, compile=False, rounds=8)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.bf16 = gpu
    device = torch.device(args.device)
    if gpu:
        moe = get_preset("moe-9b").model_copy(update={"n_layers": args.layers, "max_seq_len": max(4096, args.seq),
                                                      "preset": None})
        name = torch.cuda.get_device_name()
    else:
        moe = resolve_model({"preset": "moe-tiny", "vocab_size": 8192, "max_seq_len": max(512, args.seq)})
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    peak = peak_flops(detect_device_spec(device), "bf16" if gpu else "fp32")
    print(f"# {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, micro-batch {args.batch} × seq "
          f"{args.seq}, {args.iters} iters, {'bf16 autocast' if gpu else 'fp32'}"
          f"{', compiled' if args.compile else ''}")
    print(f"{'model':<8} {'layers':>6} {'active params':>14} {'all params':>11} {'tokens/s':>10} "
          f"{'tokens/cpu-s':>13} {'MFU':>7} {'fwd+bwd tokens/s':>17}")
    models = {"moe": moe, "dense": dense_twin(moe)}
    best: dict[str, tuple[float, float, float]] = {}
    ratios: dict[str, list[float]] = {"whole steps": [], "forward + backward": []}
    steps = {label: make_step(cfg, args, device) for label, cfg in models.items()}
    for _ in range(args.rounds):  # moe / dense within a round: the two ran back to back under the same load
        this = {label: timed(step, args, device) for label, step in steps.items()}
        ratios["whole steps"].append(this["moe"][0] / this["dense"][0])
        ratios["forward + backward"].append(this["moe"][2] / this["dense"][2])
        for label in models:
            best[label] = tuple(max(a, b) for a, b in zip(best.get(label, (0.0, 0.0, 0.0)), this[label]))
    for label, cfg in models.items():
        tps, tpcpu, model_tps = best[label]
        mfu = tps * mfu_flops_per_token(cfg, args.seq) / peak
        counts = param_counts(cfg)
        print(f"{label:<8} {cfg.n_layers:>6} {counts['active'] / 1e6:>13.1f}M {counts['total'] / 1e6:>10.1f}M "
              f"{tps:>10.0f} {tpcpu:>13.0f} {100 * mfu:>6.1f}% {model_tps:>17.0f}")
    for what, r in ratios.items():
        print(f"moe / dense tokens/s, {what}: median of {len(r)} rounds {statistics.median(r):.2f}× "
              f"(range {min(r):.2f}–{max(r):.2f})")

if __name__ == "__main__":
    main()
