"""Context parallelism (``compute.context_parallel: N``): each row's tokens split over N ranks.

**Mesh.** Ranks are grouped in blocks of N consecutive ranks (one node's GPUs on a cluster, so
attention's traffic stays on NVLink): rank r is token shard ``r % N`` of data-parallel replica
``r // N``. A group reads one replica's samples (`StreamLayout` by data-parallel rank) and splits
every row. Gradients are reduced over *all* ranks, the group's included — DDP and FSDP already
average over every rank, as torchtitan folds its CP dimension into the data-parallel mesh — and
the loss is normalized by the global target count (`Trainer.train_step`).

**Layout** (causal load balancing). A row of T tokens is cut into 2N chunks; rank r holds chunks
r and 2N−1−r — an early, cheap chunk and a late, expensive one — so every rank does the same
causal-attention work. This is torch's head-tail load balancing (`context_parallel` on CUDA
shards the same way; tests check the two agree). The tokens keep their global positions (RoPE,
masks): `data.batch.Batch.part`.

The rules a split row must follow (sizes, what ring attention takes) are torch-free:
`plan.checks.check_context_parallel`.

**Attention** (`models.sharded_attention`): on CUDA torch's `context_parallel` turns the
blocks' SDPA into ring attention (plain causal rows only); elsewhere each rank all-gathers K/V
and attends with a mask built from global positions (every mask: documents, windows, soft-caps).

Checkpoints hold the same unsharded model whatever N is: a run saved under CP 2 resumes under
CP 1 (and back) like under any other number of ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from lmforge.data.batch import Batch
from lmforge.models.sharded_attention import SequenceGroup


def chunk_positions(seq_len: int, size: int, rank: int, device=None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``size`` holds: chunks rank and 2·size−1−rank of
    2·size equal chunks, in that order."""
    chunk = seq_len // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def sequence_group(context_parallel: int, world_size: int, device: torch.device) -> SequenceGroup:
    """The group of ``context_parallel`` consecutive ranks this rank splits rows with (collective:
    every rank calls it). Ring attention on CUDA; all-gathered K/V elsewhere."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // context_parallel, context_parallel),
                            mesh_dim_names=("cp_replica", "cp"))
    return SequenceGroup(mesh["cp"], ring=device.type == "cuda")


@contextmanager
def shard_rows(group: SequenceGroup | None, batch: Batch) -> Iterator[Batch]:
    """This rank's part of ``batch`` (`Batch.part`), for one forward and backward; ``batch``
    itself without context parallelism. On CUDA the part comes from torch's `context_parallel`
    (which shards the positions with its own load balancer and turns SDPA into ring attention
    until the backward is done)."""
    if group is None:
        yield batch
        return
    seq_len = batch.input_ids.shape[1]
    if not group.ring:
        yield batch.part(chunk_positions(seq_len, group.size, group.rank, batch.input_ids.device))
        return
    from torch.distributed.tensor.experimental import context_parallel

    positions = torch.arange(seq_len, device=batch.input_ids.device)
    with context_parallel(group.mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
        yield batch.part(positions)
