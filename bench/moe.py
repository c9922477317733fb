"""Tokens/s and MFU of an MoE model against its dense twin (same active parameters), fwd+bwd+AdamW.

    python bench/moe.py                    # CPU: moe-tiny, fp32, micro-batch 4 × 256, then 8 × 512
    python bench/moe.py --device cuda      # GPU: a moe-9b-shaped stack, bf16 autocast, compiled, 8 × 2048

GPU: a stack of `--layers` (default 4) blocks of moe-9b's shape (d 2048, 16 heads / 8 KV heads, 16
experts of hidden 3584, top-4, vocabulary 100352) — the whole 24-layer model's weights and Adam
state do not fit one GPU without sharding — trained as `lmforge train` trains on one GPU: fp32
master weights, bf16 autocast, every block compiled (fullgraph), fused AdamW, gradient clipping.
The dense twin replaces each MoE layer with one SwiGLU MLP of hidden top_k × expert hidden, so one
token meets the same parameters. MFU is on active parameters on the standard basis
(`lmforge.plan.flops.mfu_flops_per_token`: 6·N_active + 12·L·H·Dh·T) against the device's
dense bf16 peak (fp32 peak on the CPU, `plan.hardware.cpu_spec`).

CPU: moe-tiny (d 256, 8 experts of hidden 256, top-2) in fp32, eager, at two micro-batch shapes:
4 × 256, and 8 × 512 — what a default moe-tiny run uses on the CPU (context_length defaults to the
model's max_seq_len, the CPU micro-batch to 8). The ratio grows with the tokens per micro-batch:
routing's many small ops weigh less, and each expert's GEMMs get more rows. Each shape also times
one block (attention + MoE against attention + the dense MLP) forward + backward alone, calls
interleaved one by one: the issue's own unit, without the embedding, the head and the optimizer.

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
from lmforge.plan.flops import mfu_flops_per_token, param_counts  # noqa: E402
from lmforge.plan.hardware import detect_device_spec, peak_flops  # noqa: E402
from lmforge.plan.layout import Layout  # noqa: E402
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
    train_forward = parallelize(model, Layout(device=device.type), one, compute=ComputeConfig(compile=args.compile),
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


def block_ratio(moe: ModelConfig, args, device: torch.device, calls: int) -> tuple[float, float, float]:
    """One MoE block (attention + MoE) against one dense block, eager and in fp32, forward + backward
    on the same [batch, seq, d] input, calls interleaved one by one -> (MoE ms, dense ms, median over pairs of
    dense time / MoE time, i.e. the MoE block's tokens/s as a fraction of the dense block's)."""
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, moe.d_model, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def call(cfg: ModelConfig):
        model = build_model(cfg, device=device)
        block = model.blocks[0]
        cos, sin, mask = model._attention_inputs(args.seq, 0, None, device)[0]

        def once() -> float:
            t = time.perf_counter()
            y, aux = block(x, cos, sin, attn_mask=mask)
            outputs, grads = [y], [grad]
            if aux:  # the router's losses, weighted as moe-tiny's defaults weigh them
                outputs.append(cfg.moe_aux_loss_coef * aux["lb_loss"] + cfg.moe_z_loss_coef * aux["z_loss"])
                grads.append(None)
            torch.autograd.backward(outputs, grads)
            sync(device)
            x.grad = None
            block.zero_grad(set_to_none=True)
            return time.perf_counter() - t
        return once

    calls_of = {"moe": call(moe), "dense": call(dense_twin(moe))}
    for once in calls_of.values():
        for _ in range(args.warmup + 2):
            once()
    times: dict[str, list[float]] = {"moe": [], "dense": []}
    for i in range(calls):
        for label in (("moe", "dense") if i % 2 else ("dense", "moe")):
            times[label].append(calls_of[label]())
    ratio = statistics.median(d / m for m, d in zip(times["moe"], times["dense"]))
    return 1e3 * statistics.median(times["moe"]), 1e3 * statistics.median(times["dense"]), ratio


def compare(moe: ModelConfig, args, device: torch.device, peak: float, name: str) -> None:
    """Print the table and the MoE / dense ratios for one micro-batch shape."""
    gpu = device.type == "cuda"
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
    if args.block_calls:
        moe_ms, dense_ms, ratio = block_ratio(moe, args, device, args.block_calls)
        print(f"one block, eager fp32, forward + backward: moe {moe_ms:.1f} ms, dense {dense_ms:.1f} ms; moe / dense "
              f"tokens/s {ratio:.2f}× (median of {args.block_calls} interleaved pairs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=4, help="cuda: blocks in the moe-9b-shaped stack")
    ap.add_argument("--batch", type=int, default=None,
                    help="micro-batch (cuda 8; cpu: both 4 and 8, see --seq)")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (cuda 2048; cpu: 4 × 256, then 8 × 512 — moe-tiny as `lmforge train` "
                         "runs it by default)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per round (cpu 5 at 4 × 256, 2 at 8 × 512; "
                                                            "cuda 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (cpu 2, cuda 3)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (cpu 8, cuda 2)")
    ap.add_argument("--block-calls", type=int, default=None,
                    help="interleaved forward + backward calls of one block each (cpu 40; cuda 0: off)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile every block (default: on for cuda, off for cpu)")
    ap.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU: malloc keeps freed memory, as `lmforge train` sets it (distributed.host_memory)")
    args = ap.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    gpu = args.device == "cuda"
    defaults = dict(warmup=3, compile=True, rounds=2, block_calls=0) if gpu else \
        dict(warmup=2, compile=False, rounds=8, block_calls=40)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.bf16 = gpu
    device = torch.device(args.device)
    if gpu:
        shapes = [(args.batch or 8, args.seq or 2048)]
    elif args.batch or args.seq:
        shapes = [(args.batch or 4, args.seq or 256)]
    else:
        # A small micro-batch, then the one a default moe-tiny run uses on the CPU: context_length
        # defaults to the model's max_seq_len (512), the CPU micro-batch to 8 (`plan.run`).
        shapes = [(4, 256), (8, 512)]
    iters = args.iters
    peak = peak_flops(detect_device_spec(device), "bf16" if gpu else "fp32")
    for batch, seq in shapes:
        args.batch, args.seq = batch, seq
        args.iters = iters or (20 if gpu else max(2, 5 * 1024 // (batch * seq)))
        if gpu:
            moe = get_preset("moe-9b").model_copy(update={"n_layers": args.layers, "max_seq_len": max(4096, seq),
                                                          "preset": None})
            name = torch.cuda.get_device_name()
        else:
            moe = resolve_model({"preset": "moe-tiny", "vocab_size": 8192, "max_seq_len": max(512, seq)})
            name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
        compare(moe, args, device, peak, name)


if __name__ == "__main__":
    main()
