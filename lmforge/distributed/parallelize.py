"""Apply parallelism and compilation to a model, in one place and one order.

Order (as in torchtitan): expert parallelism → activation checkpointing → FP8 → torch.compile
(per block, and the final norm + head + loss) → the blocks' saved-tensor hooks (compression,
offload, the meter: `activations.py`, around each compiled block) → data parallel wrapping (DDP,
or FSDP2 ``fully_shard`` per block then the root). Expert parallelism is model parallelism: it splits the
expert weights first, so everything after sees the layout training runs with. Checkpointing wraps
block forwards next so compile sees the recompute region; FP8 (torchao) swaps the linear layers
next — after checkpointing and before compile, as torchao documents — so compile traces the FP8
casts and FSDP shards (and all-gathers in FP8) the swapped weights; compiling per block keeps
compile times short; FSDP's hooks then sit outside the compiled regions, at block boundaries.

Every size here comes from the run's layout (`plan.layout.Layout`, made and checked by the planner):
ranks, data parallelism and its shard group, context and expert parallelism.

Expert parallelism (``compute.expert_parallel: N``, MoE models, fsdp/hsdp) splits the ranks of
a shard group into groups of N consecutive ranks (one node's GPUs, on a cluster: the
all-to-all stays on NVLink). Each rank of such a group holds E/N of each layer's experts — a
DTensor sharded on the expert dimension over the ``ep`` mesh dimension — and tokens travel to
their experts and back by all-to-all (`models.moe`). The device mesh is, outermost first::

    (replicate,) shard_mod_ep, ep        — replicate only with hsdp (across nodes)

Every parameter outside the experts is sharded (FSDP2) over ``shard`` = shard_mod_ep × ep,
exactly as without expert parallelism; the expert weights are sharded further over
``shard_mod_ep`` (and replicated over ``replicate``), their own FSDP unit inside each block.
Each rank's expert gradient already sums the tokens of the N ranks it served, so that unit
divides its reduced gradients by the whole data-parallel size, not by its own mesh's.

Context parallelism (``compute.context_parallel: N``, `context_parallel.py`) splits each row's
tokens over N consecutive ranks: the model gets the group first (`Transformer.sequence_group`);
no parameter changes, and its gradients are reduced over every rank by DDP / FSDP as they are.

Everything is applied to the module in place and never renames parameters, so checkpoints
(DCP) and exports are the same whatever parallelism or compilation a run used.

FSDP on CPU: the gloo backend in this torch implements ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` natively, so FSDP2 runs unchanged on N gloo ranks (what the tests
use); on GPUs the same code runs on NCCL.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as td
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lmforge.config.schema import ComputeConfig
from lmforge.distributed import activations
from lmforge.distributed.activations import apply_activation_checkpointing
from lmforge.distributed.context_parallel import sequence_group
from lmforge.distributed.dist import DistInfo
from lmforge.distributed.float8 import FP8Options, apply_float8, check_fp8_supported
from lmforge.plan.layout import Layout
from lmforge.plan.activations import activation_policy


def compile_enabled(value, device: torch.device) -> bool:
    """compute.compile → on or off: ``auto`` compiles on CUDA (the CPU gains nothing on small
    models and pays the compile time, see BENCHMARKS.md)."""
    return device.type == "cuda" if value == "auto" else bool(value)


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile each block's forward, and the final norm + output head + loss (`head_loss`, and its
    per-token twin `head_logprobs` of preference tuning) as one more unit each (on the instance:
    names unchanged, FSDP hooks stay eager).

    ``fullgraph``: a block must trace as one graph (an error otherwise, never a silent break).
    The exceptions are MoE blocks whose experts run eagerly between two graphs: under expert
    parallelism (the all-to-all needs the split sizes on the host), and where the grouped GEMM
    does not take the experts (`_experts_grouped`). The loss unit may break only around
    liger-kernel's fused loss, which runs eagerly.
    """
    for block in model.blocks:
        block.forward = torch.compile(block.forward, dynamic=False, fullgraph=fullgraph)
    model.head_loss = torch.compile(model.head_loss, dynamic=False)
    model.head_logprobs = torch.compile(model.head_logprobs, dynamic=False)


def is_moe_layer(module: nn.Module) -> bool:
    return hasattr(module, "ep_group") and hasattr(module, "experts")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Split every MoE layer's experts over ``ep_mesh`` (see `shard_experts`)."""
    for block in model.blocks:
        if is_moe_layer(block.mlp):
            shard_experts(block.mlp, ep_mesh)


def shard_experts(moe: nn.Module, ep_mesh) -> None:
    """Make an MoE layer's expert weights DTensors sharded on the expert dimension over
    ``ep_mesh`` (E/N experts per rank) and give the layer the group its tokens are exchanged in.
    Names and global shapes stay, so checkpoints load on any expert-parallel size."""
    experts = moe.experts
    for name, p in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)]),
                                                      requires_grad=p.requires_grad))
    moe.ep_group = ep_mesh.get_group()


# --------------------------------------------------------------------------- device mesh and FSDP2

def ensure_process_group(dist: DistInfo) -> None:
    """FSDP needs a process group even for one rank (e.g. FSDP on 1 GPU): make a 1-rank one."""
    if not td.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if dist.device.type == "cuda" else "gloo"
        td.init_process_group(backend, store=td.HashStore(), rank=0, world_size=1)


@dataclass
class Meshes:
    """Where each kind of parameter is sharded (see the module docstring)."""

    dense: object  # DeviceMesh: (shard,) for fsdp, (replicate, shard) for hsdp
    experts: object | None = None  # DeviceMesh of the expert weights' FSDP: (replicate,) shard_mod_ep
    ep: object | None = None  # 1-D DeviceMesh: the ranks one layer's experts are split over


def mesh_dims(layout: Layout) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A sharded layout's dense mesh, names and sizes outermost first: ``(shard,)`` for fsdp (every
    rank, context-parallel ones included), ``(replicate, shard)`` for hsdp. Their product is the
    layout's ranks."""
    if layout.data_parallel == "hsdp":
        return ("replicate", "shard"), (layout.replicate, layout.shard_group)
    return ("shard",), (layout.shard_group,)


def build_meshes(layout: Layout, dist: DistInfo) -> Meshes:
    ensure_process_group(dist)
    names, sizes = mesh_dims(layout)
    shard = sizes[-1]
    dense = init_device_mesh(dist.device.type, sizes, mesh_dim_names=names)
    ep = layout.expert_parallel
    if ep == 1:
        return Meshes(dense)
    # The same ranks, the shard dimension seen as (shard_mod_ep, ep): one mesh family, as FSDP
    # requires of a DTensor parameter's mesh and its own. The dimension by position: torch 2.11's
    # `_unflatten` refuses every dimension given by name (its name check is inverted).
    full = dense._unflatten(len(names) - 1, (shard // ep, ep), ("shard_mod_ep", "ep"))
    # The experts' gradient norm (`clip_grad_norm`) is partial over both new dimensions. With them
    # also flattened into one, DTensor sums it in one all-reduce; else in two in a row, and torch
    # warns about it on every rank of every run.
    full["shard_mod_ep", "ep"]._flatten()
    return Meshes(dense, experts=full[names[:-1] + ("shard_mod_ep",)], ep=full["ep"])


def apply_fsdp(model: nn.Module, meshes: Meshes, *, bf16: bool, reshard_after_forward: bool) -> None:
    """FSDP2 per transformer block (the experts first, as their own unit, under expert
    parallelism), then the root (embeddings, final norm, head)."""
    # bf16 compute and communication of weights, fp32 gradient reduction and master weights.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    mesh = meshes.dense
    for block in model.blocks:
        experts = None
        if meshes.experts is not None and is_moe_layer(block.mlp):
            experts = fully_shard(block.mlp.experts, mesh=meshes.experts, mp_policy=mp,
                                  reshard_after_forward=reshard_after_forward)
            experts.set_gradient_divide_factor(float(mesh.size()))
            if meshes.experts["shard_mod_ep"].size() > 1:
                # gloo has no pre-multiplied sum: plain sums, then one division. (Not on a
                # 1-rank shard group: there torch's FSDP would divide twice.)
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if experts is not None:  # gather the experts while attention and routing run
            block.set_modules_to_forward_prefetch([experts])
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
    ``parallelize(model, ...)(input_ids, targets, doc_ids, positions)`` → `LossOutput`. It owns no
    parameters of its own (the model's names are unchanged in checkpoints).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, per_token: bool = False):
        return self.model.training_loss(input_ids, targets, doc_ids=doc_ids, positions=positions, per_token=per_token)


def _experts_grouped(model: nn.Module, precision: str, device: torch.device) -> bool:
    """Whether every MoE layer's experts run as grouped GEMMs when compiled: bf16 under bf16 or
    fp8 training, with row sizes the kernel aligns (`GroupedExperts.takes_grouped`). Else (fp32
    on a GPU, or an expert hidden size like 1.03 × d) they loop, outside the compiled graphs."""
    from lmforge.models.moe import GroupedExperts

    dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
    return all(m.takes_grouped(dtype, device.type) for m in model.modules() if isinstance(m, GroupedExperts))


def parallelize(model: nn.Module, layout: Layout, dist: DistInfo, *, compute: ComputeConfig = ComputeConfig(),
                checkpointing=False, compression="off", offload: bool = False, precision: str = "fp32",
                fp8: FP8Options = FP8Options()) -> nn.Module:
    """Apply, in this order, expert parallelism → activation checkpointing (``checkpointing``: the
    plan's mode) → FP8 (``precision`` "fp8", as ``fp8`` says) → compile → what the blocks keep for
    backward (``compression``, ``offload``: the plan's; and the meter, `distributed.activations`) →
    data parallelism, as the run's ``layout`` says; returns the module that runs one training forward
    (a `TrainingForward`, inside DDP when replicated). ``compute``: the switches that are not the
    layout (compile, the loss kernel, resharding after forward).

    With fsdp/hsdp, ``model`` may live on the meta device; call ``materialize`` afterwards.
    """
    if layout.ranks != dist.world_size:
        raise ValueError(f"parallelize: a layout of {layout.ranks} rank(s) in a group of {dist.world_size}")
    model.loss_kernel = compute.loss_kernel
    if layout.context_parallel > 1:
        ensure_process_group(dist)
        model.sequence_group = sequence_group(layout.context_parallel, dist.world_size, dist.device)
    meshes = build_meshes(layout, dist) if layout.sharded else None
    if meshes is not None and meshes.ep is not None:
        apply_expert_parallel(model, meshes.ep)
    policy = activation_policy(checkpointing, compression, offload, n_layers=len(model.blocks),
                               moe=model.cfg.is_moe)
    apply_activation_checkpointing(model, policy)
    if precision == "fp8":
        if fp8.experts:
            check_fp8_supported(dist.device, experts=True)
        apply_float8(model, fp8, fsdp=layout.sharded, expert_parallel=layout.expert_parallel)
    if compile_enabled(compute.compile, dist.device):
        whole_blocks = layout.expert_parallel == 1 and _experts_grouped(model, precision, dist.device)
        # (the all-gathered K/V of context parallelism off CUDA are collectives dynamo breaks at)
        whole_blocks = whole_blocks and (model.sequence_group is None or model.sequence_group.ring)
        apply_compile(model, fullgraph=whole_blocks)
    activations.install(model, policy, dist.device)
    if meshes is not None:
        apply_fsdp(model, meshes, bf16=precision in ("bf16", "fp8"),
                   reshard_after_forward=compute.reshard_after_forward)
        return TrainingForward(model)
    if dist.distributed and layout.data_parallel != "none":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        # No buffer broadcast before each forward: the model's buffers (RoPE tables) are constants every
        # rank computes alike, and a forward without a collective is a rank's own time (`train.telemetry`).
        ddp = DDP(TrainingForward(model), device_ids=ids, forward_sync_buffers=False)
        if dist.device.type == "cpu":
            fix_buckets(ddp)
        return ddp
    return TrainingForward(model)


def fix_buckets(ddp: DDP) -> None:
    """Give DDP's gradient buckets their final layout now (the parameters in their order), not after the
    first step — where torch rebuilds them in the order the gradients became ready. A bucket's layout
    decides in which order the ranks' gradients are summed (each rank starts the ring on its own
    chunk): with more than two ranks the sums differ in the last bits, and a run restarted from a
    checkpoint would take its first step on other buckets than the uninterrupted run took that step
    on — not a bitwise resume. On CPUs only: the parameter order delays the first bucket's all-reduce
    to the end of backward (no overlap with it), which gloo hardly has, and GPU kernels are not bitwise
    deterministic anyway."""
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


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
    with _quiet_sequential_gathers():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if td.get_rank() == 0 else None


class _SequentialGatherFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("While redistributing") and "all_gather" in message)


@contextmanager
def _quiet_sequential_gathers():
    """Expert-parallel weights are sharded on the expert dim twice (FSDP's strided shard inside
    EP's shard); gathering one whole takes two all-gathers in a row, which torch cannot merge and
    warns about on every rank. Here that happens once a run, for the final weights, and an
    all-gather is exact whatever its order (the warning's concern is reductions): the warning is
    dropped for this call only."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet = _SequentialGatherFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


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


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model whose gradients live on several device meshes
    (expert parallelism: the experts' mesh and the rest's). The norm of each mesh's gradients is
    taken there, the total combined, and every gradient scaled by the same factor."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.stack(norms).norm()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total



def device_value(t) -> torch.Tensor:
    """A (possibly DTensor) scalar as a plain tensor on its device, without waiting for it (a
    replicated DTensor's full tensor is its local one: no communication)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def unwrap(train_forward: nn.Module) -> nn.Module:
    """The model inside what `parallelize` returned."""
    if isinstance(train_forward, DDP):
        train_forward = train_forward.module
    return train_forward.model if isinstance(train_forward, TrainingForward) else train_forward
