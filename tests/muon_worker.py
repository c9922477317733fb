"""One rank of tests/test_muon.py's sharded-layout check, started by torchrun with 4 gloo ranks.

    torchrun --standalone --nproc-per-node 4 tests/muon_worker.py

For each layout lmforge shards a model into — FSDP2 over 4 ranks with expert parallelism 2 (the
experts' FSDP shards are strided inside EP's), HSDP 2 × 2 with expert parallelism 2, and plain
FSDP2 over 4 ranks (2-D weights split on rows, unevenly where 4 does not divide them) — a tiny MoE
model and an unsharded copy get the same gradients for three Muon + AdamW steps, with the
row-sharded matrices' work spread over the ranks (each orthogonalizes 1/W of them) and gathered on
every rank; the sharded Muon weights and momentum buffers, gathered, must equal the unsharded ones
bitwise: every matrix was orthogonalized whole.
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.distributed as td
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.config.model import ModelConfig
from lmforge.distributed.dist import init_distributed
from lmforge.distributed.parallelize import parallelize
from lmforge.models import build_model
from lmforge.plan.layout import Layout
from lmforge.train.optim import build_optimizer

LAYOUTS = [Layout(ranks=4, data_parallel="fsdp", shard_group=4, expert_parallel=2, global_batch=4),
           Layout(ranks=4, data_parallel="hsdp", shard_group=2, expert_parallel=2, global_batch=4),
           Layout(ranks=4, data_parallel="fsdp", shard_group=4, global_batch=4)]
# d_model 36: the 36-row attention weights and the 18-row KV projections split unevenly over 4 ranks.
CFG = ModelConfig(d_model=36, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, n_experts=4,
                  top_k=2, expansion_ratio=1.0)


def optimizer(model):
    return build_optimizer(model, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type="cpu",
                           kind="muon")


def check(layout: Layout, spread: bool, dist) -> None:
    torch.manual_seed(0)
    whole = build_model(CFG)
    sharded = copy.deepcopy(whole)
    parallelize(sharded, layout, dist)
    opt_whole, opt_sharded = optimizer(whole), optimizer(sharded)
    opt_sharded[0].spread = spread
    params = dict(sharded.named_parameters())
    matrices = sum(1 for g in opt_sharded[0].param_groups for _ in g["params"])
    assert matrices == 2 * (4 + 2), matrices  # per block: wq wk wv wo, the experts' w13 and w2
    for step in range(3):
        for name, p in whole.named_parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(f"{name}{step}".encode())))
            q = params[name]
            q.grad = distribute_tensor(p.grad, q.device_mesh, q.placements) if isinstance(q, DTensor) else p.grad
        opt_whole.step()
        opt_sharded.step()
    for name, p in whole.named_parameters():
        q = params[name]
        got = q.full_tensor() if isinstance(q, DTensor) else q
        if p not in opt_whole[0].state:  # AdamW: its fused kernel's vector tails differ on a shard
            torch.testing.assert_close(got, p, rtol=1e-6, atol=1e-8)
            continue
        assert torch.equal(got, p), (layout, name, (got - p).abs().max())
        m = opt_sharded[0].state[q]["momentum_buffer"]
        assert isinstance(m, DTensor) and m.placements == q.placements, (layout, name)
        assert torch.equal(m.full_tensor(), opt_whole[0].state[p]["momentum_buffer"]), (layout, name)


if __name__ == "__main__":
    dist = init_distributed("cpu")
    for layout in LAYOUTS:
        for spread in (True, False):
            check(layout, spread, dist)
    td.barrier()
    if dist.is_main:
        print(f"muon: {len(LAYOUTS)} sharded layouts × (spread, gathered) equal the whole model bitwise")
    td.destroy_process_group()
