"""One rank of tests/test_expert_parallel.py, started by torchrun with 2 gloo ranks.

    torchrun --standalone --nproc-per-node 2 tests/ep_worker.py SINGLE_RANK_CHECKPOINT RUN_YAML

1. An MoE layer with its experts split over the two ranks (expert parallelism: dispatch →
   all-to-all → experts → all-to-all → combine) against the same layer whole on each rank, at
   random routing and at fully skewed routing (every token to rank 1's experts: rank 0's
   experts get nothing, zero-sized splits both ways — dropless at any load): the same outputs,
   input and router gradients, and expert gradients (summed over ranks, as data parallelism does).
2. A checkpoint written by a single process loads into the run's expert-parallel, FSDP-sharded
   model (DCP reshards 1 → 2) with the same weights.
3. This rank of `lmforge train -f RUN_YAML`, in the same process group.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as td
from torch.distributed.device_mesh import init_device_mesh

from lmforge.cli.main import main
from lmforge.config.load import load_config
from lmforge.config.model import ModelConfig
from lmforge.distributed.dist import all_reduce_sum, init_distributed
from lmforge.distributed.parallelize import full_state_dict, materialize, parallelize, shard_experts
from lmforge.models import build_model
from lmforge.models.moe import MoE
from lmforge.models.transformer import Transformer
from lmforge.plan.layout import Layout
from lmforge.train.checkpoint import load_checkpoint, read_state
from lmforge.train.optim import build_optimizer


def check_layer(skewed: bool) -> None:
    rank = td.get_rank()
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, vocab_size=64, n_experts=4, top_k=2, expansion_ratio=1.5)
    torch.manual_seed(0)
    whole = MoE(cfg)
    whole.init_weights(0.2, 0.1)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(rank))  # each rank its own tokens
    if skewed:
        with torch.no_grad():  # positive inputs, experts 2 and 3 (rank 1's) win for every token
            whole.router.weight.copy_(torch.tensor([-1.0, -1.0, 1.0, 1.0])[:, None].expand(4, 32))
        x = x.abs() + 0.1
    split = copy.deepcopy(whole)
    shard_experts(split, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    outputs = []
    for layer in (whole, split):
        xi = x.clone().requires_grad_(True)
        y, stats = layer(xi)
        y.backward(torch.ones_like(y) * (rank + 1))
        outputs.append((y, stats["tokens_per_expert"], xi.grad, layer.router.weight.grad))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if skewed:
        assert outputs[1][1].tolist() == [0, 0, 21, 21], outputs[1][1]
    for name in ("w13", "w2"):
        expected = all_reduce_sum(getattr(whole.experts, name).grad.clone())
        torch.testing.assert_close(getattr(split.experts, name).grad.full_tensor(), expected, rtol=1e-5, atol=1e-6)


def check_reshard_from_one_rank(checkpoint: str, run_yaml: str, dist) -> None:
    cfg = load_config(run_yaml)
    shape = ModelConfig(**read_state(checkpoint)["config"]["model"])  # with the tokenizer's vocab
    with torch.device("meta"):
        model = Transformer(shape)
    c = cfg.compute
    parallelize(model, Layout(ranks=dist.world_size, data_parallel=c.data_parallel, shard_group=dist.world_size,
                              expert_parallel=c.expert_parallel, global_batch=dist.world_size), dist)
    materialize(model, dist.device, build_model(shape).state_dict() if dist.is_main else None)
    assert model.blocks[0].mlp.experts.w13.to_local().shape[0] == shape.n_experts // 2  # E/N experts here
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, device_type="cpu")
    load_checkpoint(checkpoint, model, optimizer, rank=dist.rank)
    reference = build_model(shape, init=False)
    load_checkpoint(checkpoint, reference, None, rank=dist.rank)
    gathered = full_state_dict(model)
    if dist.is_main:
        expected = reference.state_dict()
        assert gathered.keys() == expected.keys()
        for k, v in expected.items():
            torch.testing.assert_close(gathered[k], v, rtol=0, atol=0)


if __name__ == "__main__":
    single_rank_checkpoint, run_yaml = sys.argv[1:]
    dist = init_distributed("cpu")  # `lmforge train` below reuses this process group
    for skewed in (False, True):
        check_layer(skewed)
    check_reshard_from_one_rank(single_rank_checkpoint, run_yaml, dist)
    sys.exit(main(["train", "-f", run_yaml]))
