"""Plan before spending: parameter counts, FLOPs, MFU, time, cost and memory per GPU."""

from lmforge.plan.flops import flops_per_token, mfu_flops_per_token, param_counts
from lmforge.plan.hardware import GPU_TYPES, GPUSpec, detect_device_spec, mfu, peak_flops
from lmforge.plan.estimate import EstimateInputs, check_fits, estimate_run, format_plan

__all__ = [
    "EstimateInputs", "GPU_TYPES", "GPUSpec", "check_fits", "detect_device_spec", "flops_per_token", "format_plan",
    "estimate_run", "mfu", "mfu_flops_per_token", "param_counts", "peak_flops",
]
