"""Apply parallelism and compilation to a model, in one place and one order.

Order (as in torchtitan): activation checkpointing → torch.compile (per block) → data
parallel wrapping. Checkpointing wraps blocks first so compile sees the recompute region;
compiling per block keeps compile times short and lets FSDP shard at block boundaries.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from lmforge.config.schema import ComputeConfig
from lmforge.distributed.dist import DistInfo


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / generation: nothing to save
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them.

    The block's ``forward`` is replaced on the instance (not wrapped in a new module), so
    parameter names — and therefore checkpoints — are the same with and without it.
    """
    for block in model.blocks:
        block.forward = _checkpointed(block.forward)


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (``Module.compile`` keeps parameter names unchanged)."""
    for block in model.blocks:
        block.compile(dynamic=False)


def parallelize(model: nn.Module, compute: ComputeConfig, dist: DistInfo) -> nn.Module:
    """Returns the module to train (possibly a DDP wrapper around ``model``)."""
    if compute.activation_checkpointing:
        apply_activation_checkpointing(model)
    if compute.compile:
        apply_compile(model)
    if dist.distributed and compute.data_parallel != "none":
        # FSDP/HSDP come with the scale-out work; DDP is correct for every model that fits.
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model
