"""Activation memory, planned against measured, and what compression costs in quality (issue 55).

    python bench/memory.py                      # all three tables (≈ 10 min on 2 loaded cores)
    python bench/memory.py --skip-quality       # the byte tables alone (seconds)
    python bench/memory.py --steps 100          # a shorter quality check
    python bench/memory.py --shakespeare PATH   # tinyshakespeare.txt from elsewhere

1. **Planned vs measured**, per way of keeping activations (`plan.activations.activation_options`,
   and a few ``layers`` ranges): the bytes the blocks saved for backward over one micro-batch, as
   the run's meter counts them (`distributed.activations.Meter`: what ``memory/activations_saved``
   logs), against the planner's `plan.memory.blocks_saved_bytes` for the same run's precision —
   on the CPU, fp32, the 70-second recipe's llama shape (4 × 128, context 256, micro-batch 8) and a
   small MoE of the same width. Target: within 15% for every option; fp8 ≤ 0.3× of uncompressed.
2. **On paper**: `lmforge estimate`'s plan of moe-73b at 4,096 tokens (64 H100s, fsdp, expert
   parallel 8, micro-batch 1): activations and total per GPU with none against the least-memory
   option. Target: ≥ 2.5× less of each.
3. **Quality**: held-out loss on tinyshakespeare after the steps the 70-second recipe takes (295
   of 2,048 tokens: BENCHMARKS.md), the recipe's shape and settings, uncompressed against fp8 and
   int8 activations. Target: within 1%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

RECIPE = dict(d_model=128, n_layers=4, n_heads=4, vocab=1024, context_length=256, batch_tokens=2048,
              micro_batch_size=8, learning_rate=2e-3, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0,
              weight_decay=0.1, tie_embeddings=True, optimizer="adamw")  # bench/sweep.py's, at the 70 s LR
RECIPE_STEPS = 295  # 604,160 tokens / 2,048: the wall-clock 70 s run (BENCHMARKS.md)
RANGES = [{"granularity": "block", "layers": "first-2"}, {"granularity": "mlp", "layers": "range(1,3)"},
          {"granularity": "attention", "layers": "last-1"}]


def measure(shape, micro_batch: int, ctx: int, checkpointing, compression) -> int:
    """Bytes the blocks saved over one micro-batch (fp32, CPU), as a training run's meter counts them."""
    import torch

    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import parallelize
    from lmforge.models import build_model
    from lmforge.plan.layout import Layout

    torch.manual_seed(0)
    model = build_model(shape)
    train_forward = parallelize(model, Layout(), DistInfo(rank=0, world_size=1, local_rank=0,
                                                          device=torch.device("cpu")),
                                checkpointing=checkpointing, compression=compression)
    tokens = torch.randint(0, shape.vocab_size, (micro_batch, ctx + 1), generator=torch.Generator().manual_seed(0))
    model.activation_meter.arm()
    out = train_forward(tokens[:, :-1], tokens[:, 1:])
    (out.ce_sum + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    return model.activation_meter.bytes


def bytes_table() -> list[dict]:
    from lmforge.config.model import ModelConfig
    from lmforge.plan.activations import activation_options, option_words
    from lmforge.plan.memory import blocks_saved_bytes

    mb, ctx = RECIPE["micro_batch_size"], RECIPE["context_length"]
    dense = ModelConfig(d_model=128, n_layers=4, n_heads=4, vocab_size=1024, max_seq_len=ctx, tie_embeddings=True)
    moe = dense.model_copy(update={"n_experts": 8, "top_k": 2, "expansion_ratio": 1.0})
    rows = []
    print(f"\n1. Saved for backward per micro-batch ({mb} × {ctx} tokens, fp32, CPU): planned vs measured")
    print(f"{'model':6} {'activations kept':58} {'planned':>10} {'measured':>10} {'planned/measured':>17} {'vs none':>8}")
    for name, shape in (("llama", dense), ("moe", moe)):
        options = [o for o in activation_options(shape, offload=False)]
        options += [(r, "off", False) for r in RANGES] + [(False, "int8", False),
                                                          (False, {"kind": "fp8", "scale": "tensor"}, False)]
        base = None
        for ckpt, comp, _ in options:
            if name == "moe" and ckpt == "selective":
                continue  # the CPU's expert loop keeps more than the GPU's grouped GEMM the planner counts
            got = measure(shape, mb, ctx, ckpt, comp)
            planned = blocks_saved_bytes(shape, ctx, ckpt, compression=comp, precision="fp32") * mb
            base = base or got
            row = {"model": name, "option": option_words(ckpt, comp, False), "planned": planned, "measured": got,
                   "ratio": planned / got, "vs_none": got / base}
            rows.append(row)
            print(f"{name:6} {row['option'][:58]:58} {planned / 2**20:8.2f}MB {got / 2**20:8.2f}MB "
                  f"{row['ratio']:17.3f} {row['vs_none']:8.3f}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    fp8 = next(r["vs_none"] for r in rows if r["model"] == "llama" and r["option"] == "no checkpointing, fp8 activations")
    print(f"   worst planned/measured: {worst:.1%} off (target ≤ 15%); fp8 / uncompressed: {fp8:.3f} (target ≤ 0.3)")
    return rows


def paper() -> dict:
    """moe-73b at 4k on 64 H100s (EP 8): none against the least-memory option, from the estimate's plan."""
    import contextlib
    import io
    import json

    from lmforge.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        main(["estimate", "--model", "moe-73b", "--seq-len", "4096", "--gpus", "8", "--nodes", "8",
              "--expert-parallel", "8", "--micro-batch", "1", "--activation-checkpointing", "full", "--json"])
    mem = json.loads(buf.getvalue())["memory"]
    options = list(mem["activation_options"].values())
    none, best = options[0], min(options, key=lambda o: o["total_bytes_per_gpu"])
    from lmforge.plan.activations import option_words

    print("\n2. On paper: lmforge estimate --model moe-73b --seq-len 4096 --gpus 8 --nodes 8 --expert-parallel 8 "
          "--micro-batch 1")
    for o in (none, best):
        print(f"   {option_words(o['checkpointing'], o['compression'], o['offload']):60} activations "
              f"{o['bytes_per_sample'] / 1e9:6.1f} GB, total {o['total_bytes_per_gpu'] / 1e9:6.1f} GB per GPU")
    out = {"activations": none["bytes_per_sample"] / best["bytes_per_sample"],
           "total": none["total_bytes_per_gpu"] / best["total_bytes_per_gpu"]}
    print(f"   less with the best: activations {out['activations']:.1f}×, total {out['total']:.2f}× (target ≥ 2.5×)")
    return out


def quality(steps: int) -> list[dict]:
    import torch

    from common import train_config

    from lmforge.config.load import build_config
    from lmforge.distributed.dist import DistInfo
    from lmforge.resolve import resolve
    from lmforge.train.build import build_trainer
    from lmforge.train.machine import process_machine
    import tempfile

    print(f"\n3. Held-out loss on tinyshakespeare after {steps} steps of the 70 s recipe's shape (fp32, CPU)")
    rows = []
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    for compression in ("off", "fp8", "int8"):
        with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
            raw = train_config("shakespeare", dict(RECIPE), f"{steps}ba", os.path.join(tmp, "run"))
            raw["compute"] |= {"activation_compression": compression}
            raw["parameters"]["precision"] = "fp32"
            cfg = build_config(raw)
            setup = resolve(cfg, process_machine(dist), log=lambda *_: None)
            trainer = build_trainer(setup, dist, log=lambda *_: None)
            batches = iter(trainer.stream)
            trainer._start_clock()
            t0 = time.perf_counter()
            while not trainer._done():
                trainer.train_step([next(batches) for _ in range(trainer.plan.grad_accum)])
            seconds = time.perf_counter() - t0
            trainer.stream.close()
            from common import heldout_bpb

            result = heldout_bpb(trainer)
        rows.append({"compression": compression, "loss": result["loss"], "bpb": result["bpb"], "train_s": seconds})
        print(f"   {compression:5} held-out loss {result['loss']:.4f} ({result['bpb']:.3f} bits per byte), "
              f"{seconds:.0f} s of training", flush=True)
    base = rows[0]["loss"]
    for r in rows[1:]:
        print(f"   {r['compression']}: {r['loss'] / base - 1:+.2%} held-out loss against uncompressed (target within 1%)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=RECIPE_STEPS, help="steps of the quality check")
    ap.add_argument("--skip-quality", action="store_true", help="the byte tables alone")
    ap.add_argument("--shakespeare", metavar="PATH", help="tinyshakespeare.txt, where the shared corpora folder is "
                    "not beside this checkout (bench/common.py's SHAKESPEARE)")
    args = ap.parse_args()
    if args.shakespeare:
        import common

        common.SHAKESPEARE = args.shakespeare
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    bytes_table()
    paper()
    if not args.skip_quality:
        quality(args.steps)


if __name__ == "__main__":
    main()
