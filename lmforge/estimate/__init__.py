"""Plan before spending: parameter counts, FLOPs, MFU, time, cost and memory per GPU."""

from lmforge.estimate.flops import flops_per_token, mfu_flops_per_token, param_counts
from lmforge.estimate.hardware import GPU_TYPES, GPUSpec, detect_device_spec, mfu, peak_flops
from lmforge.estimate.plan import check_fits, format_plan, estimate_run

__all__ = [
    "GPU_TYPES", "GPUSpec", "check_fits", "detect_device_spec", "flops_per_token", "format_plan",
    "estimate_run", "mfu", "mfu_flops_per_token", "param_counts", "peak_flops",
]
