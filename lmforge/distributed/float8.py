"""FP8 training (``parameters.precision: fp8``) through torchao's float8 linear layers.

The matmuls of the transformer's linear layers run in FP8 on the tensor cores (H100-class
GPUs, compute capability 8.9+); everything else (attention, norms, the loss, the optimizer's
fp32 master weights) stays as under bf16. Two recipes (``parameters.fp8_recipe``):

- **tensorwise**: one scale per tensor — the fastest; under FSDP2 the weights are all-gathered
  in FP8 (half the bytes of bf16) with their scales computed for all layers at once by one
  all-reduce after each optimizer step (`after_optimizer_step`).
- **rowwise**: one scale per row — more accurate with outliers, a little slower; weights are
  all-gathered in bf16 (torchao supports the FP8 all-gather for tensorwise scaling only).

Kept in bf16: the output head (its logits feed the softmax, where FP8's 3 mantissa bits hurt
most, and it runs inside the fused loss), an MoE layer's router (its logits choose each token's
experts: FP8 rounding would move tokens between experts, and a GEMM as narrow as the expert
count gains nothing from FP8), any linear layer with a dimension that is not a multiple of 16
(an FP8 tensor-core requirement), and LoRA adapters. The MoE experts' stacked weights are not
linear layers: they stay in bf16 (grouped GEMMs).

Applied by `parallelize` after activation checkpointing and before compile (as torchao
documents): the swapped modules are what compile traces and what FSDP shards. Names and
shapes of parameters are unchanged, so checkpoints move freely between bf16 and fp8 runs.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.errors import UserError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer: FP8 tensor cores


def check_fp8_supported(device: torch.device) -> None:
    """Raise a one-line UserError unless this device and install can train in FP8."""
    where = "parameters.precision: fp8"
    if device.type != "cuda":
        raise UserError(f"{where} needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, "
                        f"L4, B200); this run trains on {device.type} (use bf16 or auto)")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise UserError(f"{where} needs compute capability 8.9+ (H100, H200, L4, B200); "
                        f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]} (use bf16)")
    if not torchao_available():
        raise UserError(f"{where} needs torchao: pip install 'lmforge[gpu]'")


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # not installed, or built for another torch
        return False
    return True


def keeps_high_precision(module: nn.Module, fqn: str) -> bool:
    """True for linear layers that stay in bf16 (see the module docstring)."""
    if type(module) is not nn.Linear:  # LoRA adapters subclass nn.Linear: never swap them
        return True
    if fqn == "output" or fqn.endswith((".output", ".router")):
        return True
    return module.in_features % 16 != 0 or module.out_features % 16 != 0


def apply_float8(model: nn.Module, recipe: str, *, fsdp: bool, emulate: bool = False) -> int:
    """Swap the model's eligible nn.Linear layers for torchao Float8Linear in place; returns how
    many were swapped. ``emulate`` runs the FP8 casts with bf16 matmuls (tests on a CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise UserError(f"parameters.fp8_recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate}
    if recipe == "tensorwise" and fsdp:
        changes["enable_fsdp_float8_all_gather"] = True
    config = _replace(config, **changes)
    before = sum(type(m) is nn.Linear for m in model.modules())
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: not keeps_high_precision(m, fqn))
    return before - sum(type(m) is nn.Linear for m in model.modules())


def after_optimizer_step(model: nn.Module) -> None:
    """FP8 all-gather under FSDP (tensorwise): compute every weight's scale for the next forward
    in one all-reduce, instead of one per layer during it. A no-op for other runs."""
    if not any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _replace(config, **changes):
    """A frozen dataclass copy with ``changes`` (Float8LinearConfig validates in __post_init__)."""
    import dataclasses

    return dataclasses.replace(config, **changes)
