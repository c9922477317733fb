"""Grouped GEMM over contiguous row groups: rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]``.

`torch._grouped_mm` does this in one kernel, on CUDA (bf16) and on the CPU (any float type),
with no padding of the groups. Its shape function for compilation (the meta kernel) accepts
bf16 only, though, so a compiled block in fp32 on the CPU could not trace it: there the GEMM goes
through a custom op, `lmforge::grouped_mm`, which compile treats as one opaque kernel of known
output shape — the block still compiles as a single graph.
"""

from __future__ import annotations

import torch

_native = getattr(torch, "_grouped_mm", None)


def supported(dtype: torch.dtype, device_type: str, *row_lengths: int) -> bool:
    """Whether the grouped kernel takes operands of this dtype on this device whose rows (or
    columns, transposed in backward) have these lengths: torch has it, CUDA only in bf16, and
    every such stride a multiple of 16 bytes (its alignment rule: e.g. % 4 in fp32, % 8 in bf16)."""
    if _native is None or (device_type == "cuda" and dtype != torch.bfloat16):
        return False
    return all(n * dtype.itemsize % 16 == 0 for n in row_lengths)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [R, k] rows sorted by group, w [G, k, n], offs [G] int32 group ends -> [R, n]."""
    if x.dtype == torch.bfloat16:
        return _native(x, w, offs=offs)  # traceable as is
    return torch.ops.lmforge.grouped_mm(x, w, offs)


@torch.library.custom_op("lmforge::grouped_mm", mutates_args=())
def _op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _native(x, w, offs=offs)


@_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("lmforge::grouped_mm_weight_grad", mutates_args=())
def _weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, k, n]: group g's x rows transposed times its gradient rows."""
    return _native(x.t(), grad, offs=offs)


@_weight_grad.register_fake
def _(x, grad, offs):
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    # An empty gradient counts as contiguous whatever its strides (a broadcast one has all-zero
    # strides, which the kernel refuses): give it real ones.
    grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
    return _op(grad, w.transpose(-2, -1), offs), _weight_grad(x, grad, offs), None


_op.register_autograd(_backward, setup_context=_setup)
