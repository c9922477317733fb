"""Muon's cost per training step against AdamW's, measured interleaved in one process.

    python bench/muon.py                          # the sweep's base shape (4 × 128, vocab 1024, 8 × 256)
    python bench/muon.py --accum 4 --threads 2
    python bench/muon.py --threads 2 --repeat 5 --record   # quiet machine: store the median ratio for bench/sweep.py

Two copies of the same model (same seed), one with AdamW and one with Muon (`build_optimizer`,
as the trainer builds them), take full optimizer steps in turn — forward and backward over
``--accum`` micro-batches, clipping, the optimizer step — alternating which goes first each
round, so a change in the machine's load falls on both alike. Each step's wall time and process
CPU time are taken, and the optimizer step's own share. Printed: the median step of each, the
Muon/AdamW throughput ratio (CPU time: what the sweep's one-thread runs pay; wall: what a quiet
machine shows), the optimizer's share of the step, and MFU on the *model's* FLOPs (the optimizer
is overhead: it lowers MFU, it never adds FLOPs to it).

``--record`` writes the ratio into ``bench/throughput.json`` under the Muon configuration's key
(``ab_ratio``) — the wall-clock one when the machine is quiet (load < 1.5), else the CPU-time one:
bench/sweep.py then gives a Muon point the AdamW point's token budget × that ratio, the tokens
Muon would have had in the same wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from lmforge.config.model import ModelConfig, padded_vocab  # noqa: E402
from lmforge.data.batch import Batch  # noqa: E402
from lmforge.distributed.host_memory import keep_freed_memory  # noqa: E402
from lmforge.plan.flops import mfu_flops_per_token  # noqa: E402
from lmforge.plan.hardware import detect_device_spec, peak_flops  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from lmforge.train.optim import build_optimizer  # noqa: E402


class Arm:
    """One model and its optimizer, stepping on fixed random batches."""

    def __init__(self, cfg: ModelConfig, kind: str, batches: list[Batch]):
        torch.manual_seed(0)
        self.kind, self.batches = kind, batches
        self.model = build_model(cfg)
        self.opt = build_optimizer(self.model, lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                   device_type="cpu", kind=kind)
        self.n = float(sum(int(b.num_targets()) for b in batches))
        self.wall, self.cpu, self.opt_wall, self.opt_cpu = [], [], [], []

    def step(self, record: bool) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        for b in self.batches:
            out = self.model.training_loss(b.input_ids, b.targets)
            (out.ce_sum / self.n).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        w1, c1 = time.perf_counter(), time.process_time()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        w2, c2 = time.perf_counter(), time.process_time()
        if record:
            self.wall.append(w2 - w0)
            self.cpu.append(c2 - c0)
            self.opt_wall.append(w2 - w1)
            self.opt_cpu.append(c2 - c1)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a training process does
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      vocab_size=padded_vocab(args.vocab), max_seq_len=args.context, tie_embeddings=True)
    gen = torch.Generator().manual_seed(1)
    batches = [Batch.from_tokens(torch.randint(0, cfg.vocab_size, (args.micro, args.context), generator=gen))
               for _ in range(args.accum)]
    arms = [Arm(cfg, "adamw", batches), Arm(cfg, "muon", batches)]
    for r in range(args.warmup + args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            arm.step(record=r >= args.warmup)
    adamw, muon = arms
    tokens = args.micro * args.context * args.accum
    fpt = mfu_flops_per_token(cfg, args.context)
    peak = peak_flops(detect_device_spec("cpu"), "fp32") * args.threads / (os.cpu_count() or 1)
    med = statistics.median
    out = {"shape": f"{args.layers}×{args.d_model}, vocab {cfg.vocab_size}, {args.accum} × {args.micro} × "
                    f"{args.context}", "threads": args.threads, "rounds": args.rounds,
           "load": round(os.getloadavg()[0], 2)}
    for arm in arms:
        out[arm.kind] = {
            "step_wall_s": med(arm.wall), "step_cpu_s": med(arm.cpu), "opt_wall_s": med(arm.opt_wall),
            "opt_cpu_s": med(arm.opt_cpu), "tokens_per_s_wall": tokens / med(arm.wall),
            "tokens_per_s_cpu": tokens / med(arm.cpu), "opt_share_cpu": sum(arm.opt_cpu) / sum(arm.cpu),
            "mfu_wall": tokens / med(arm.wall) * fpt / peak}
    # Ratios of the medians and of the sums (the sums weigh every step, the medians drop outliers).
    out["ratio_cpu"] = med(adamw.cpu) / med(muon.cpu)
    out["ratio_cpu_sum"] = sum(adamw.cpu) / sum(muon.cpu)
    out["ratio_wall"] = med(adamw.wall) / med(muon.wall)
    return out


def record(args, result: dict) -> None:
    from sweep import THROUGHPUT, _save_table, throughput_key

    knobs = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab,
                 context_length=args.context, micro_batch_size=args.micro, optimizer="muon", tie_embeddings=True)
    # Quiet machine (load < 1.5): the wall-clock ratio, as the quiet reference runs see it; else the
    # CPU-time ratio (the load barely changes it, but it misses how well each parallelizes).
    quiet = result["load"] < 1.5
    ratio = result["ratio_wall"] if quiet else result["ratio_cpu"]
    _save_table(lambda t: t.setdefault(throughput_key(knobs), {}).update(
        ab_ratio=round(ratio, 4), ab_clock="wall (quiet)" if quiet else "CPU time", ab_threads=args.threads,
        ab_when=time.strftime("%Y-%m-%d %H:%M"), ab_rounds=args.rounds, ab_load=result["load"]))
    print(f"recorded ab_ratio {ratio:.4f} ({'wall, quiet' if quiet else 'CPU time'}) in {THROUGHPUT}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--record", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--repeat", type=int, default=1, help="measure this many times; the median ratio counts")
    args = p.parse_args()
    results = [run(args) for _ in range(args.repeat)]
    result = sorted(results, key=lambda r: r["ratio_wall"])[len(results) // 2]  # the median run
    result["load"] = max(r["load"] for r in results)
    if args.repeat > 1:
        print("ratios (wall): " + ", ".join(f"{r['ratio_wall']:.3f}" for r in results) + "; "
              "(CPU): " + ", ".join(f"{r['ratio_cpu']:.3f}" for r in results))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['shape']}; {args.threads} thread(s); {args.rounds} interleaved rounds; load {result['load']}")
    print("| optimizer | step (CPU s) | step (wall s) | optimizer step (CPU s) | optimizer share | tokens/s (CPU) "
          "| MFU (wall, model FLOPs) |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("adamw", "muon"):
        r = result[kind]
        print(f"| {kind} | {r['step_cpu_s']:.4f} | {r['step_wall_s']:.4f} | {r['opt_cpu_s']:.4f} | "
              f"{r['opt_share_cpu']:.1%} | {r['tokens_per_s_cpu']:,.0f} | {r['mfu_wall']:.1%} |")
    print(f"Muon/AdamW throughput: {result['ratio_cpu']:.3f} (CPU time, medians; sums {result['ratio_cpu_sum']:.3f}), "
          f"{result['ratio_wall']:.3f} (wall)")
    if args.record:
        record(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
