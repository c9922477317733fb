"""What a model's blocks keep for backward, as the plan says (`plan.activations`): recomputed in
backward (activation checkpointing), compressed to one byte per element, moved to pinned host memory
(CUDA), and counted.

**Checkpointing** (`apply_activation_checkpointing`) replaces a method on the instance with a
non-reentrant `torch.utils.checkpoint` of it: the block's ``forward`` (``block``, and ``selective``
with a policy that keeps the outputs of matmuls and attention, `selective_keep`), one sublayer
(`Block.attention`, `Block.feed_forward`) or an MoE block's experts.

Each block's forward runs inside saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`)
of its own, installed on the instance after compilation (`install`), so the hooks see what the
compiled block — or its checkpointed regions' inputs — hands autograd, never the traced code:

- **weights** (a parameter or buffer, a view of one, autocast's copy of one) are left to autograd:
  they are model states, not activations;
- every other saved tensor is stored **once per storage**: the query, key and value projections
  all save the same normed input, and several views of one buffer may be saved — its storage is
  compressed or sent to the host once, and each view is rebuilt from it (`torch.as_strided`);
- **compression** (fp8 e4m3 or int8) takes floating storages of at least `MIN_ELEMENTS` elements
  saved as tensors whose last dimension is at least `MIN_ROW` wide, scaled per `SCALE_BLOCK`
  consecutive elements (or per tensor) by the largest magnitude, and restores them in their dtype
  when backward unpacks them. A block's originals stay referenced until its forward ends (so no
  freed storage can be taken for a saved one): the one block in flight the planner counts;
- **offload** copies what a block keeps to pinned host memory on a side stream (the GPU's copy is
  released once the copy is done: `record_stream`), and backward fetches a block's tensors back on
  that stream, one block ahead of the one it computes. Unmeasured: no GPU was at hand when it was
  written (docs/activation-memory.md);
- the **meter** (`Meter`), when armed, counts the bytes stored over one forward pass (a
  micro-batch): what the trainer logs as ``memory/activations_saved``. Selective checkpointing keeps
  its matmul and attention outputs in a cache of its own, out of the hooks' sight: while the meter
  counts, a dispatch mode around such a block counts them too (they are kept as they are: neither
  compressed nor offloaded).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (SAC_IGNORED_OPS, CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from lmforge.plan.activations import MIN_ELEMENTS, MIN_ROW, SCALE_BLOCK, ActivationPolicy, activation_policy

# --------------------------------------------------------------------------- checkpointing

@functools.cache
def selective_keep() -> frozenset:
    """The ops whose outputs selective checkpointing keeps."""
    from lmforge.models import grouped_mm, moe  # noqa: F401 - registers the lmforge:: ops

    aten = torch.ops.aten
    # Expensive to recompute: keep their outputs (matmuls, the MoE experts' grouped GEMMs and
    # the CPU loop's forward, attention, and the expert-parallel all-to-all, which recomputing
    # would send again).
    # The router's top-k too: a recompute must route exactly as the forward did (on a GPU a tie
    # could flip, and the all-to-all's split sizes with it), as torchtitan does.
    # Norms, activations, RoPE, the rest of routing: recompute.
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default,
            torch.ops.lmforge.grouped_mm.default, torch.ops.lmforge.expert_loop.default, aten.topk.default,
            torch.ops._c10d_functional.all_to_all_single.default,
            torch.ops._c10d_functional_autograd.all_to_all_single.default,  # (what torch 2.11's autograd
            # all-to-all dispatches; 2.13's dispatches the plain one)
            aten._scaled_mm.default,  # FP8 (torchao) matmuls
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,  # where SDPA picks cuDNN (H100)
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    # Expert parallelism nests the experts' FSDP unit inside the block: on recompute FSDP opens one
    # more profiler range there (it takes the iteration's root role again) than in forward, and
    # SAC would look for that extra op in its cache. Profiler ranges compute nothing: skip them.
    SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                            torch.ops.profiler._record_function_exit._RecordFunction})

    # FlexAttention (packed documents on CUDA) is attention too: keep its output.
    keep.add(torch._higher_order_ops.flex_attention)
    return frozenset(keep)


def _selective_policy():
    keep = selective_keep()

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


def apply_activation_checkpointing(model: nn.Module, policy) -> None:
    """Recompute activations in backward instead of storing them, per block as ``policy`` says
    (`plan.activations`): the whole block (``block``, ``selective``), one sublayer (``attention``,
    ``mlp``: `Block.attention`, `Block.feed_forward`) or an MoE block's experts (``experts``).

    The method is replaced on the instance (not wrapped in a new module), so parameter names — and
    therefore checkpoints — are the same with and without it. ``policy``: an `ActivationPolicy`, or a
    `compute.activation_checkpointing` value.
    """
    if not isinstance(policy, ActivationPolicy):
        policy = activation_policy(policy, n_layers=len(model.blocks), moe=model.cfg.is_moe)
    for i, granularity in policy.checkpointed().items():
        block = model.blocks[i]
        if granularity in ("block", "selective"):
            block.forward = _checkpointed(block.forward, selective=granularity == "selective")
        elif granularity == "attention":
            block.attention = _checkpointed(block.attention, selective=False)
        elif granularity == "mlp":
            block.feed_forward = _checkpointed(block.feed_forward, selective=False)
        else:  # experts
            block.mlp.experts.forward = _checkpointed(block.mlp.experts.forward, selective=False)



# --------------------------------------------------------------------------- saved tensors

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = {"fp8": (torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max), "int8": (torch.int8, 127.0)}
# Autograd nodes that only view or cast their one input: a weight seen through them is still a weight.
_PASS_THROUGH = {"TBackward0", "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "ExpandBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0"}


class Meter:
    """The bytes the blocks store for backward over one forward pass, counted when armed: `arm`, a
    forward pass, then `bytes` (and `host_bytes`, offloaded). Off when not armed: nothing counted."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.armed = False
        self.bytes: int | None = None  # on the device (compressed size where compressed)
        self.host_bytes: int | None = None  # in pinned host memory (offload)
        self._counting: list[int] | None = None

    def arm(self) -> None:
        """Count the next forward pass with gradients (its first block starts the count)."""
        self.armed = True

    def _add(self, index: int, device: int, host: int) -> None:
        if index == 0 or self._counting is None:
            self._counting = [0, 0]
        self._counting[0] += device
        self._counting[1] += host
        if index == self.n_blocks - 1:
            self.bytes, self.host_bytes = self._counting
            self._counting, self.armed = None, False


def _storage_key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return t.untyped_storage().data_ptr(), t._version, t.dtype


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-D tensor of its dtype (no copy)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


def compress(flat: torch.Tensor, kind: str, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D floating tensor → (one-byte values, fp32 scales): per `SCALE_BLOCK` elements or per tensor."""
    dtype, top = FORMATS[kind]
    if scale == "tensor":
        rows = flat.unsqueeze(0)
    else:
        pad = -flat.numel() % SCALE_BLOCK
        rows = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, SCALE_BLOCK)
    scales = (rows.abs().amax(dim=1, keepdim=True).float() / top).clamp_(min=torch.finfo(torch.float32).tiny)
    # |value| ≤ top by the scale's choice (up to a rounding, which the casts take: fp8 saturates at
    # its largest finite value, int8 receives rounded values); one tensor's fp32 copy at a time.
    scaled = rows.float() / scales
    if kind == "int8":
        scaled = scaled.round_()
    return scaled.to(dtype), scales


def decompress(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    return (values.to(torch.float32) * scales).to(dtype).view(-1)[:n]


@dataclass
class _Stored:
    """One saved storage as it is kept: compressed and/or on the host. ``get`` gives it back whole."""

    dtype: torch.dtype
    numel: int
    device: torch.device
    parts: list  # [values, scales] compressed, or [flat] as it was; each a tensor or an `_OnHost`
    kind: str | None = None
    _back: torch.Tensor | None = field(default=None, repr=False)

    def get(self) -> torch.Tensor:
        if self._back is None:  # once per backward, however many views of it are unpacked
            parts = [p.get() if isinstance(p, _OnHost) else p for p in self.parts]
            self._back = decompress(*parts, self.dtype, self.numel) if self.kind else parts[0]
        return self._back


@dataclass
class _View:
    stored: _Stored
    size: tuple
    stride: tuple
    offset: int


class Offload:
    """CUDA: tensors to pinned host memory on a side stream, and back one block ahead of backward."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.blocks: dict[int, list[_OnHost]] = {}  # this forward pass's, by block

    def begin(self) -> None:
        """A new forward pass (its first block): the last one's tensors are all fetched by now."""
        self.blocks = {}

    def send(self, t: torch.Tensor, index: int) -> _OnHost:
        current = torch.cuda.current_stream(t.device)
        self.stream.wait_stream(current)  # t is complete
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            sent = torch.cuda.Event()
            sent.record(self.stream)
        t.record_stream(self.stream)  # the allocator keeps t's memory until the copy is done
        out = _OnHost(self, index, host, sent, t.device)
        self.blocks.setdefault(index, []).append(out)
        return out

    def fetch(self, index: int) -> None:
        """Start bringing block ``index``'s tensors back (once: autograd alone holds them after, and
        frees them as their backward ends)."""
        for part in self.blocks.pop(index, ()):
            part.fetch()


@dataclass
class _OnHost:
    offload: Offload
    index: int
    host: torch.Tensor
    sent: torch.cuda.Event
    device: torch.device
    back: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def fetch(self) -> None:
        if self.back is not None:
            return
        stream = self.offload.stream
        with torch.cuda.stream(stream):
            stream.wait_event(self.sent)
            self.back = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def get(self) -> torch.Tensor:
        self.fetch()
        self.offload.fetch(self.index)  # this block's others (a no-op once fetched) ...
        self.offload.fetch(self.index - 1)  # ... and the next one backward needs, while this one computes
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        self.back.record_stream(current)
        return self.back


class _BlockSaver:
    """The hooks of one block's forward (see the module docstring)."""

    def __init__(self, block: nn.Module, constants: set[int], index: int, compression: str | None, scale: str,
                 offload: Offload | None, rows: tuple[int, int]):
        self.rows = rows  # the block input's (rows, positions)
        self.index, self.compression, self.scale, self.offload = index, compression, scale, offload
        self.weights = constants | {p.untyped_storage().data_ptr() for p in block.parameters()
                                    if type(p) in (torch.Tensor, nn.Parameter)}
        self.stored: dict = {}  # storage key → what it became (kept until the block's forward ends)
        self.originals: list[torch.Tensor] = []
        self.device_bytes = self.host_bytes = 0

    def is_weight(self, t: torch.Tensor) -> bool:
        if t.untyped_storage().data_ptr() in self.weights:
            return True
        fn = t.grad_fn
        while fn is not None and fn.name().rsplit("::", 1)[-1] in _PASS_THROUGH:
            inputs = [f for f, _ in fn.next_functions if f is not None]
            if len(inputs) != 1:
                return False
            fn = inputs[0]
        return fn is not None and fn.name().endswith("AccumulateGrad")

    def pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or self.is_weight(t):  # (a tensor subclass, e.g. FP8's, is left as it is)
            return t
        key = _storage_key(t)
        if key not in self.stored:
            self.stored[key] = self.store(t)
        stored = self.stored[key]
        if stored is None:  # kept as autograd keeps it
            return t
        return _View(stored, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def store(self, t: torch.Tensor) -> _Stored | None:
        # Per-token statistics stay as they are: narrow (a norm's 1/rms), or, among tensors autograd
        # does not differentiate, laid out as [rows, …, positions] (attention's log-sum-exp [B, H, T]).
        statistic = t.grad_fn is None and t.dim() >= 2 and (t.shape[0], t.shape[-1]) == self.rows
        big = t.numel() >= MIN_ELEMENTS and t.dim() > 0 and t.shape[-1] >= MIN_ROW and not statistic
        compress_it = self.compression is not None and big and t.dtype in FLOATS
        offload_it = self.offload is not None and big and t.is_cuda
        if not (compress_it or offload_it):
            self.device_bytes += t.untyped_storage().nbytes()
            return None
        self.originals.append(t)
        flat = _flat(t.detach())
        parts = list(compress(flat, self.compression, self.scale)) if compress_it else [flat]
        size = sum(p.numel() * p.element_size() for p in parts)
        if offload_it:
            parts = [self.offload.send(p, self.index) for p in parts]
            self.host_bytes += size
        else:
            self.device_bytes += size
        return _Stored(t.dtype, flat.numel(), t.device, parts, self.compression if compress_it else None)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return torch.as_strided(packed.stored.get(), packed.size, packed.stride, packed.offset)


class _KeptBySelective(TorchDispatchMode):
    """Counts the outputs selective checkpointing keeps (`selective_keep`) into ``saver``: SAC caches
    them itself, out of the saved-tensor hooks' sight. Outside SAC's own mode, so it sees each op
    SAC lets through."""

    def __init__(self, saver: _BlockSaver):
        super().__init__()
        self.saver, self.keep = saver, selective_keep()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.keep:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage_key(t) not in self.saver.stored:
                    self.saver.stored[_storage_key(t)] = None
                    self.saver.device_bytes += t.untyped_storage().nbytes()
        return out


def _saving(forward, block: nn.Module, index: int, model: nn.Module, policy: ActivationPolicy,
            offload: Offload | None, constants: list[set[int]]):
    compression = policy.blocks[index].compression
    acts = compression is not None or offload is not None
    selective = policy.blocks[index].checkpointing == "selective"

    def run(*args, **kwargs):
        meter = model.activation_meter
        if not torch.is_grad_enabled() or not (acts or meter.armed):
            return forward(*args, **kwargs)
        if offload is not None and index == 0:
            offload.begin()
        if index == 0 or not constants:  # the model's buffers: read at a pass's first block, not at every block
            constants[:] = [{b.untyped_storage().data_ptr() for b in model.buffers()}]
        x = args[0] if args else kwargs["x"]  # the block's input [rows, positions, d]
        saver = _BlockSaver(block, constants[0], index, compression, policy.scale, offload, rows=(x.shape[0], x.shape[-2]))
        counting = _KeptBySelective(saver) if selective and meter.armed else nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(saver.pack, saver.unpack), counting:
            out = forward(*args, **kwargs)
        if meter.armed:
            meter._add(index, saver.device_bytes, saver.host_bytes)
        return out

    run.__wrapped__ = forward  # what it runs (a compiled block's forward, say)
    return run


def install(model: nn.Module, policy: ActivationPolicy, device: torch.device) -> None:
    """Give ``model`` its `Meter` and wrap each block's forward in its saved-tensor hooks (on the
    instance: names unchanged). ``policy.offload`` needs CUDA (the planner refuses it elsewhere)."""
    if policy.offload and device.type != "cuda":
        raise ValueError("activation offload needs CUDA")
    offload = Offload(device) if policy.offload else None
    model.activation_meter = Meter(len(model.blocks))
    constants: list[set[int]] = []  # shared by the blocks' hooks: the buffers' storages of this forward
    for i, block in enumerate(model.blocks):
        block.forward = _saving(block.forward, block, i, model, policy, offload, constants)
