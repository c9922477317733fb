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
(an FP8 tensor-core requirement), LoRA adapters, and (``parameters.fp8_skip_small``, on by
default) layers too small for FP8 to pay: casting the input, weight and gradient to FP8 and
back costs memory passes that a small GEMM's speed-up does not repay. The thresholds on a
layer's K (in features) and N (out features) are torchao's, measured on an H100 (its float8
README's tables): tensorwise keeps K ≤ 4096 with N ≤ 1024 in bf16 (llama-3b/8b's key and value
projections), rowwise N ≤ 2048, K ≤ 1024, or N ≤ 4096 with K ≤ 2048.

MoE experts (``parameters.fp8_experts``, sm90 GPUs): their grouped GEMMs run through torchao's
FP8 rowwise grouped GEMM (`GroupedExperts`); each expert's rows are padded to 16 by the
dispatch (the FP8 grouped kernel's alignment), without a host sync. Off by default: bf16
grouped GEMMs otherwise.

Applied by `parallelize` after activation checkpointing and before compile (as torchao
documents): the swapped modules are what compile traces (and fuses the casts into their
neighbours) and what FSDP shards. Names and shapes of parameters are unchanged, so checkpoints
move freely between bf16 and fp8 runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.plan.machine import no_fp8_on

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer: FP8 tensor cores
GROUPED_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm: Hopper and newer


@dataclass(frozen=True)
class FP8Options:
    """How a ``precision: fp8`` run uses FP8 (``parameters.fp8_*``)."""

    recipe: str = "tensorwise"
    skip_small: bool = True
    experts: bool = False
    emulate: bool = False  # torchao's emulation: the FP8 casts with bf16 matmuls (tests on a CPU)

    @classmethod
    def of(cls, parameters) -> "FP8Options":
        """From a run's `Parameters`."""
        return cls(parameters.fp8_recipe, parameters.fp8_skip_small, parameters.fp8_experts)


def check_fp8_supported(device: torch.device, experts: bool = False) -> None:
    """Raise a one-line UserError unless this device and install can train in FP8 (the
    experts' grouped GEMMs too, with ``experts``)."""
    where = "parameters.precision: fp8"
    if device.type != "cuda":
        raise UserError(no_fp8_on(device.type))
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise UserError(f"{where} needs compute capability 8.9+ (H100, H200, L4, B200); "
                        f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]} (use bf16)")
    if not torchao_available():
        raise UserError(f"{where} needs torchao: pip install 'lmforge[gpu]'")
    if experts and cap < GROUPED_CAPABILITY:
        raise UserError(f"parameters.fp8_experts: FP8 grouped GEMMs need compute capability 9.0+ (H100, H200, "
                        f"B200); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]} (set fp8_experts: false)")


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # not installed, or built for another torch
        return False
    return True


def too_small(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a K × N linear layer gains too little from FP8 to pay for its casts (torchao's H100
    thresholds, see the module docstring)."""
    k, n = in_features, out_features
    if recipe == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024


def keeps_high_precision(module: nn.Module, fqn: str, recipe: str = "tensorwise", skip_small: bool = False) -> bool:
    """True for linear layers that stay in bf16 (see the module docstring)."""
    if type(module) is not nn.Linear:  # LoRA adapters subclass nn.Linear: never swap them
        return True
    if fqn == "output" or fqn.endswith((".output", ".router")):
        return True
    if module.in_features % 16 != 0 or module.out_features % 16 != 0:
        return True
    return skip_small and too_small(module.in_features, module.out_features, recipe)


def apply_float8(model: nn.Module, options: FP8Options = FP8Options(), *, fsdp: bool,
                 expert_parallel: int = 1) -> int:
    """Swap the model's eligible nn.Linear layers for torchao Float8Linear in place, and with
    ``options.experts`` route the MoE experts through FP8 grouped GEMMs; returns how many linear
    layers were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = options.recipe
    if recipe not in RECIPES:
        raise UserError(f"parameters.fp8_recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": options.emulate}
    if recipe == "tensorwise" and fsdp:
        changes["enable_fsdp_float8_all_gather"] = True
    config = _replace(config, **changes)
    before = sum(type(m) is nn.Linear for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: not keeps_high_precision(
        m, fqn, recipe, options.skip_small))
    if options.experts:
        _fp8_experts(model, expert_parallel)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def _fp8_experts(model: nn.Module, expert_parallel: int) -> None:
    """Every MoE layer's experts in FP8 grouped GEMMs, their rows padded to 16 by the dispatch."""
    from lmforge.models.moe import FP8_ROW_ALIGN, MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise UserError("parameters.fp8_experts: this model has no experts (model.n_experts is 0); set "
                        "fp8_experts: false")
    if expert_parallel > 1:
        raise UserError("parameters.fp8_experts: not with compute.expert_parallel > 1 yet (the rows an expert "
                        "receives are not padded to 16); set expert_parallel: 1 or fp8_experts: false")
    try:  # here rather than at the first step: the GEMM imports it while compile traces the block
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError as e:
        raise UserError(f"parameters.fp8_experts needs torchao's FP8 grouped GEMM (torchao>=0.17): {e}") from None
    for moe in layers:
        moe.align = FP8_ROW_ALIGN
        moe.experts.fp8 = True


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
