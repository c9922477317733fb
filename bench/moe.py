"""Tokens/s of a MoE model vs a dense model with the same active parameters (fwd+bwd).

CPU (default): `moe-tiny` against a dense twin whose SwiGLU hidden equals top_k · expert_dim.
GPU (`--device cuda`): a small MoE (16 experts, top-4, d 1024) vs its dense twin in bf16 with
the grouped-GEMM path, with MFU on active parameters (6·N_active + attention, per token).

    python bench/moe.py [--device cuda] [--iters 5] [--batch 4] [--seq 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from lmforge.config.model import ModelConfig, resolve_model
from lmforge.data.batch import Batch
from lmforge.models import build_model, num_active_params

# Dense bf16 peak FLOP/s, for MFU.
PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(update={"n_experts": 0, "top_k": 0, "ffn_hidden": cfg.top_k * cfg.expert_dim,
                                  "preset": None})


def bench(cfg: ModelConfig, device: str, dtype, batch: int, seq: int, iters: int) -> tuple[float, float, int]:
    """-> (tokens per wall second, tokens per CPU second of this process, active params)."""
    torch.manual_seed(0)
    model = build_model(cfg, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = Batch.from_tokens(torch.randint(0, cfg.vocab_size, (batch, seq))).to(device)
    n_targets = int(data.num_targets())

    def step():
        out = model.training_loss(data.input_ids, data.targets)
        loss = out.ce_sum / n_targets
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, kernel selection)
    if device == "cuda":
        torch.cuda.synchronize()
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    tokens = batch * seq * iters
    return tokens / (time.perf_counter() - t), tokens / (time.process_time() - cpu), num_active_params(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.device == "cuda":
        moe = ModelConfig(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=32768,
                          max_seq_len=max(2048, args.seq), n_experts=16, top_k=4, expansion_ratio=1.75)
        dtype = torch.bfloat16
        name = torch.cuda.get_device_name()
    else:
        moe = resolve_model({"preset": "moe-tiny", "vocab_size": 8192, "max_seq_len": max(512, args.seq)})
        dtype = torch.float32
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    peak = next((v for k, v in PEAK.items() if k in name), None) if args.device == "cuda" else None
    print(f"# {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, batch {args.batch} × "
          f"seq {args.seq}, {args.iters} iters, {dtype}")
    print(f"{'model':<8} {'active params':>14} {'tokens/s':>10} {'tokens/cpu-s':>13} {'MFU':>6}")
    # On a shared CPU, wall time depends on other processes; CPU seconds of this process much less.
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(args.rounds):  # alternate and keep the best, so load from others hits both alike
        for label, cfg in (("moe", moe), ("dense", dense_twin(moe))):
            best[label] = max(best.get(label, (0.0, 0.0, 0)),
                              bench(cfg, args.device, dtype, args.batch, args.seq, args.iters))
    for label, cfg in (("moe", moe), ("dense", dense_twin(moe))):
        tps, tpcpu, active = best[label]
        flops_per_token = 6 * active + 6 * cfg.n_layers * args.seq * cfg.n_heads * cfg.dim_head
        mfu = f"{100 * tps * flops_per_token / peak:.1f}%" if peak else "-"
        print(f"{label:<8} {active / 1e6:>13.1f}M {tps:>10.0f} {tpcpu:>13.0f} {mfu:>6}")


if __name__ == "__main__":
    main()
