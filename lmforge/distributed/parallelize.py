"""Apply parallelism and compilation to a model, in one place and one order.

Order (as in torchtitan): activation checkpointing → FP8 → torch.compile (per block, and
the final norm + head + loss) → data parallel wrapping (DDP, or FSDP2 ``fully_shard`` per
block then the root). Checkpointing wraps block forwards first so compile sees the recompute
region; FP8 (torchao) swaps the linear layers next — after checkpointing and before compile,
as torchao documents — so compile traces the FP8 casts and FSDP shards (and all-gathers in
FP8) the swapped weights; compiling per block keeps compile times short; FSDP's hooks then sit
outside the compiled regions, at block boundaries.

Everything is applied to the module in place and never renames parameters, so checkpoints
(DCP) and exports are the same whatever parallelism or compilation a run used.

FSDP on CPU: the gloo backend in this torch implements ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` natively, so FSDP2 runs unchanged on N gloo ranks (what the tests
use); on GPUs the same code runs on NCCL.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as td
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lmforge.config.schema import ComputeConfig
from lmforge.distributed.dist import DistInfo
from lmforge.distributed.float8 import apply_float8
from lmforge.errors import UserError

SHARDED = ("fsdp", "hsdp")


# --------------------------------------------------------------------------- activation checkpointing

def ac_plan(value, n_layers: int) -> tuple[str | None, list[int]]:
    """Config value → (mode, indices of the blocks to checkpoint).

    ``true``/``full``: every block; ``selective``: every block, keeping matmul and attention
    outputs (recomputing only the cheap element-wise ops); ``N``: every N-th block (full).
    """
    if value is False or value is None:
        return None, []
    if value is True or value == "full":
        return "full", list(range(n_layers))
    if value == "selective":
        return "selective", list(range(n_layers))
    return "full", [i for i in range(n_layers) if (i + 1) % int(value) == 0]


def _selective_policy():
    aten = torch.ops.aten
    # Expensive to recompute: keep their outputs. Norms, activations, RoPE: recompute.
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}

    # FlexAttention (packed documents on CUDA) is attention too: keep its output.
    keep.add(torch._higher_order_ops.flex_attention)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def _checkpointed(forward, selective: bool):
    context_fn = _selective_policy() if selective else None

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / generation: nothing to save
            return forward(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, value=True) -> None:
    """Recompute blocks' activations in backward instead of storing them.

    The block's ``forward`` is replaced on the instance (not wrapped in a new module), so
    parameter names — and therefore checkpoints — are the same with and without it.
    """
    mode, which = ac_plan(value, len(model.blocks))
    for i in which:
        block = model.blocks[i]
        block.forward = _checkpointed(block.forward, selective=mode == "selective")


def compile_enabled(value, device: torch.device) -> bool:
    """compute.compile → on or off: ``auto`` compiles on CUDA (the CPU gains nothing on small
    models and pays the compile time, see BENCHMARKS.md)."""
    return device.type == "cuda" if value == "auto" else bool(value)


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile each block's forward, and the final norm + output head + loss (`head_loss`) as
    one more unit (on the instance: names unchanged, FSDP hooks stay eager).

    ``fullgraph``: a block must trace as one graph (an error otherwise, never a silent break).
    The loss unit may break only around liger-kernel's fused loss, which runs eagerly.
    """
    for block in model.blocks:
        block.forward = torch.compile(block.forward, dynamic=False, fullgraph=fullgraph)
    model.head_loss = torch.compile(model.head_loss, dynamic=False)


# --------------------------------------------------------------------------- device mesh and FSDP2

def ensure_process_group(dist: DistInfo) -> None:
    """FSDP needs a process group even for one rank (e.g. FSDP on 1 GPU): make a 1-rank one."""
    if not td.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if dist.device.type == "cuda" else "gloo"
        td.init_process_group(backend, store=td.HashStore(), rank=0, world_size=1)


def check_mesh(compute: ComputeConfig, world_size: int, local_world_size: int | None = None) -> tuple[int, int]:
    """(replicate, shard) sizes for the run's data parallelism; raises UserError when they do not fit."""
    if compute.data_parallel != "hsdp":
        if compute.shard_size is not None and compute.shard_size != world_size and compute.data_parallel == "fsdp":
            raise UserError(f"compute.shard_size: {compute.shard_size} is for data_parallel: hsdp; fsdp shards "
                            f"over all {world_size} ranks (set data_parallel: hsdp or remove shard_size)")
        return 1, world_size
    shard = compute.shard_size or local_world_size or world_size
    if shard > world_size or world_size % shard:
        raise UserError(f"compute.shard_size: {shard} does not divide the {world_size} ranks; expected a divisor "
                        f"of {world_size} (ranks per shard group)")
    return world_size // shard, shard


def build_mesh(compute: ComputeConfig, dist: DistInfo):
    """1-D mesh (shard) for fsdp, 2-D (replicate, shard) for hsdp."""
    ensure_process_group(dist)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    replicate, shard = check_mesh(compute, dist.world_size, local)
    if compute.data_parallel == "hsdp":
        return init_device_mesh(dist.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(dist.device.type, (shard,), mesh_dim_names=("shard",))


def apply_fsdp(model: nn.Module, mesh, *, bf16: bool, reshard_after_forward: bool) -> None:
    """FSDP2 per transformer block, then the root (embeddings, final norm, head)."""
    # bf16 compute and communication of weights, fp32 gradient reduction and master weights.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root's weights are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # FSDP gathers the root's weights around `forward` only; the model's other entry points
    # (the training forward and cached decoding) need the same hooks.
    for method in ("training_loss", "decode"):
        register_fsdp_forward_method(model, method)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


class TrainingForward(nn.Module):
    """Makes the model's training forward (`training_loss`) a module's `forward`.

    DDP synchronizes gradients only for calls that go through the wrapped module's `forward`;
    with this adapter every kind of data parallelism is driven the same way:
    ``parallelize(model, ...)(input_ids, targets, doc_ids=...)`` → `LossOutput`. It owns no
    parameters of its own (the model's names are unchanged in checkpoints).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None):
        return self.model.training_loss(input_ids, targets, doc_ids=doc_ids)


def parallelize(model: nn.Module, compute: ComputeConfig, dist: DistInfo, *, precision: str = "fp32",
                fp8_recipe: str = "tensorwise") -> nn.Module:
    """Apply, in this order, activation checkpointing → FP8 (``precision`` "fp8") → compile →
    data parallelism; returns the module that runs one training forward (a `TrainingForward`,
    inside DDP when replicated).

    With fsdp/hsdp, ``model`` may live on the meta device; call ``materialize`` afterwards.
    """
    sharded = compute.data_parallel in SHARDED
    model.loss_kernel = compute.loss_kernel
    if compute.activation_checkpointing:
        apply_activation_checkpointing(model, compute.activation_checkpointing)
    if precision == "fp8":
        apply_float8(model, fp8_recipe, fsdp=sharded)
    if compile_enabled(compute.compile, dist.device):
        apply_compile(model)
    if sharded:
        apply_fsdp(model, build_mesh(compute, dist), bf16=precision in ("bf16", "fp8"),
                   reshard_after_forward=compute.reshard_after_forward)
        return TrainingForward(model)
    if dist.distributed and compute.data_parallel != "none":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DDP(TrainingForward(model), device_ids=ids)
    return TrainingForward(model)


def materialize(model: nn.Module, device: torch.device, full_state: dict | None) -> None:
    """Allocate a sharded meta-device model's shards on ``device`` and fill them.

    ``full_state`` (a full, unsharded state dict on the CPU) is needed on rank 0 only; its
    tensors are scattered to the other ranks piece by piece, so no device ever holds the whole
    model. Rank 0 builds it with the run's seed, which keeps "same seed → same weights"
    whatever the number of ranks.
    """
    model.to_empty(device=device)
    model.init_rope()  # non-persistent buffers are not in any state dict
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state if td.get_rank() == 0 else {}, options=opts)


def full_state_dict(model: nn.Module) -> dict | None:
    """The whole model's weights on the CPU, on rank 0 (None on the others). Collective."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if td.get_rank() == 0 else None


@contextmanager
def no_grad_sync(train_forward: nn.Module, skip: bool):
    """Accumulate gradients locally (no all-reduce / reduce-scatter) while ``skip``."""
    model = unwrap(train_forward)
    if not skip:
        yield
    elif isinstance(train_forward, DDP):
        with train_forward.no_sync():
            yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def device_value(t) -> torch.Tensor:
    """A (possibly DTensor) scalar as a plain tensor on its device, without waiting for it (a
    replicated DTensor's full tensor is its local one: no communication)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def unwrap(train_forward: nn.Module) -> nn.Module:
    """The model inside what `parallelize` returned."""
    if isinstance(train_forward, DDP):
        train_forward = train_forward.module
    return train_forward.model if isinstance(train_forward, TrainingForward) else train_forward
