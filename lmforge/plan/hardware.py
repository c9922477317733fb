"""Peak throughput and memory of the accelerators lmforge plans for and measures MFU on.

Peak numbers are *dense* (no 2:4 sparsity) tensor-core rates per GPU from NVIDIA's
datasheets; "fp32" is the plain (non-TF32) FP32 rate. Memory is the nominal size in
decimal GB (what the datasheet says; slightly below what `torch.cuda` reports, which
errs on the safe side for fit checks).

| type      | bf16 TFLOP/s | fp8 TFLOP/s | fp32 TFLOP/s | memory | source                              |
|-----------|-------------:|------------:|-------------:|-------:|-------------------------------------|
| a100-40g  |          312 |           — |         19.5 |  40 GB | A100 datasheet (SXM4)               |
| a100-80g  |          312 |           — |         19.5 |  80 GB | A100 datasheet (SXM4)               |
| h100-sxm  |        989.4 |      1978.9 |           67 |  80 GB | H100 datasheet, SXM5                |
| h100-pcie |          756 |        1513 |           51 |  80 GB | H100 datasheet, PCIe                |
| h200      |        989.4 |      1978.9 |           67 | 141 GB | H200 datasheet (SXM)                |
| b200      |         2250 |        4500 |           75 | 180 GB | HGX/DGX B200 datasheet, per GPU     |
| gpu       |          312 |           — |         19.5 |  40 GB | unknown CUDA GPU: A100-class guess  |

A100 has no FP8 tensor cores, so asking for its fp8 peak is an error. The CPU entry
is computed for the machine at hand, see `cpu_spec`.

Links, per GPU and direction (what a collective's time is counted against, `plan.comm`): within a
node, NVLink (A100 NVLink 3: 600 GB/s both ways; H100/H200 NVLink 4: 900; B200 NVLink 5: 1.8 TB/s)
or, for a PCIe card, its PCIe 5.0 x16 slot (64 GB/s); across nodes, one NIC per GPU as in NVIDIA's
DGX/HGX reference designs (A100: HDR 200 Gb/s; H100, H200, B200: NDR 400 Gb/s ConnectX-7). These
are the links' rates; NCCL's bus bandwidth reaches 70–90% of them, which the overlap the
estimate assumes does not make up for: its communication time is a floor.

| type      | within a node GB/s | across nodes GB/s |
|-----------|-------------------:|------------------:|
| a100-*    |                300 |                25 |
| h100-sxm  |                450 |                50 |
| h100-pcie |                 64 |                50 |
| h200      |                450 |                50 |
| b200      |                900 |                50 |
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmforge.errors import UserError

if TYPE_CHECKING:  # torch is imported where needed, so `lmforge estimate` starts fast
    import torch

T = 1e12


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peak dense FLOP/s per precision and its memory in bytes."""

    name: str
    bf16: float
    fp8: float | None
    fp32: float
    memory_bytes: float
    description: str = ""
    link_bytes_per_s: float = 0.0  # to another GPU of the node, one direction (0: not counted, e.g. a CPU)
    network_bytes_per_s: float = 0.0  # to a GPU of another node, one direction


GB = 1e9
GPU_TYPES: dict[str, GPUSpec] = {
    "a100-40g": GPUSpec("a100-40g", 312 * T, None, 19.5 * T, 40e9, "NVIDIA A100 SXM4 40GB", 300 * GB, 25 * GB),
    "a100-80g": GPUSpec("a100-80g", 312 * T, None, 19.5 * T, 80e9, "NVIDIA A100 SXM4 80GB", 300 * GB, 25 * GB),
    "h100-sxm": GPUSpec("h100-sxm", 989.4 * T, 1978.9 * T, 67 * T, 80e9, "NVIDIA H100 SXM5 80GB", 450 * GB, 50 * GB),
    "h100-pcie": GPUSpec("h100-pcie", 756 * T, 1513 * T, 51 * T, 80e9, "NVIDIA H100 PCIe 80GB", 64 * GB, 50 * GB),
    "h200": GPUSpec("h200", 989.4 * T, 1978.9 * T, 67 * T, 141e9, "NVIDIA H200 141GB", 450 * GB, 50 * GB),
    "b200": GPUSpec("b200", 2250 * T, 4500 * T, 75 * T, 180e9, "NVIDIA B200 180GB", 900 * GB, 50 * GB),
}
# Not user-selectable; what an unrecognised CUDA GPU is assumed to be.
GENERIC_GPU = GPUSpec("gpu", 312 * T, None, 19.5 * T, 40e9, "unknown CUDA GPU (A100-class guess)", 300 * GB, 25 * GB)

PRECISIONS = ("bf16", "fp8", "fp32")


def gpu_type_names() -> list[str]:
    """Names accepted by --gpu-type (the table above plus ``cpu``)."""
    return [*GPU_TYPES, "cpu"]


def get_gpu_type(name: str) -> GPUSpec:
    """Spec for a --gpu-type name; ``cpu`` means this machine's CPU."""
    if name == "cpu":
        return cpu_spec()
    if name not in GPU_TYPES:
        raise UserError(f"--gpu-type: unknown GPU type {name!r}; valid types: {', '.join(gpu_type_names())}")
    return GPU_TYPES[name]


def peak_flops(spec: GPUSpec, precision: str) -> float:
    """Peak dense FLOP/s of one device at ``bf16`` | ``fp8`` | ``fp32``."""
    if precision not in PRECISIONS:
        raise UserError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    value = getattr(spec, precision)
    if value is None:
        raise UserError(f"precision: {spec.name} has no {precision} tensor cores; use bf16")
    return float(value)


def mfu_basis(precision: str) -> str:
    """The peak a run's MFU is counted against: fp32 runs the fp32 peak; bf16 and fp8 runs the bf16
    peak (fp8 too, as torchtitan counts it: an FP8 speed-up then shows as a higher MFU)."""
    return "fp32" if precision == "fp32" else "bf16"


# The efficiencies assumed where nothing is measured, each named for what it is and kept here once:
# a whole run's MFU (standard basis) — the speed of a plan, `lmforge estimate` (`--mfu`'s default),
# `model: auto`'s first ranking — where a block at its best (many GEMM rows, `plan.micro_batch`'s
# model) reaches BLOCK_PEAK_MFU and a bare large bf16 matmul MATMUL_SHARE_OF_PEAK (the diagnostic
# sweep's bar for a healthy GPU); a run loses the difference to attention, norms, the loss and
# communication.
ASSUMED_MFU = 0.4
BLOCK_PEAK_MFU = 0.55
MATMUL_SHARE_OF_PEAK = 0.6


def mfu(tokens_per_second: float, flops_per_token: float, n_devices: int, peak_per_device: float) -> float:
    """Model-FLOPs utilization: achieved model FLOP/s over the cluster's peak FLOP/s."""
    if n_devices <= 0 or peak_per_device <= 0:
        raise ValueError("mfu: n_devices and peak_per_device must be positive")
    return tokens_per_second * flops_per_token / (n_devices * peak_per_device)


def tokens_per_s_at(mfu_: float, flops_per_token: float, n_devices: int, peak_per_device: float) -> float:
    """The training speed at an MFU: `mfu`'s inverse, the one time formula of every modelled plan."""
    return mfu_ * n_devices * peak_per_device / flops_per_token


def _match_cuda_name(name: str) -> GPUSpec | None:
    """Map a `torch.cuda.get_device_name` string to a table entry."""
    n = name.upper()
    if "B200" in n:
        return GPU_TYPES["b200"]
    if "H200" in n:
        return GPU_TYPES["h200"]
    if "H100" in n:
        # "H100 PCIe" is the PCIe card; "H100 80GB HBM3" and "H100 SXM5" are SXM.
        return GPU_TYPES["h100-pcie"] if "PCIE" in n else GPU_TYPES["h100-sxm"]
    if "A100" in n:
        return GPU_TYPES["a100-80g"] if "80GB" in n.replace(" ", "") else GPU_TYPES["a100-40g"]
    return None


def detect_device_spec(device: torch.device | str) -> GPUSpec:
    """Spec of the device a run trains on: a table entry for known GPUs, else an estimate."""
    if str(device).split(":")[0] == "cpu":
        return cpu_spec()
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = _match_cuda_name(name)
        if spec is None:
            warnings.warn(f"unknown GPU {name!r}: MFU assumes an A100-class peak of 312 TFLOP/s bf16", stacklevel=2)
            total = float(torch.cuda.get_device_properties(device).total_memory)
            return GPUSpec("gpu", GENERIC_GPU.bf16, None, GENERIC_GPU.fp32, total, name, GENERIC_GPU.link_bytes_per_s,
                           GENERIC_GPU.network_bytes_per_s)
        return spec
    warnings.warn(f"no peak FLOP/s known for device type {device.type!r}; MFU assumes an A100-class GPU", stacklevel=2)
    return GENERIC_GPU


def _cpu_flags() -> tuple[set[str], float | None]:
    """CPU feature flags and the highest clock (Hz) /proc and /sys tell us about."""
    flags: set[str] = set()
    mhz: list[float] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "cpu MHz":
                    mhz.append(float(value))
    except (OSError, ValueError):
        pass
    try:  # the rated maximum beats a momentary reading when it is exposed
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return flags, float(f.read()) * 1e3
    except (OSError, ValueError):
        pass
    return flags, (max(mhz) * 1e6 if mhz else None)


def cpu_bf16_native() -> bool:
    """Whether this CPU runs bf16 matmuls natively: AMX tiles with bf16 (`config.defaults.auto_precision`
    says why AVX512-BF16 alone is not enough). Read from the CPU's flags, as torch's AMX check does."""
    return {"amx_tile", "amx_bf16"} <= _cpu_flags()[0]


@functools.lru_cache(maxsize=1)
def cpu_spec() -> GPUSpec:
    """This machine's CPU as a device: peak = cores × clock × FLOPs per cycle per core.

    FLOPs/cycle/core at fp32 = SIMD lanes × 2 (an FMA is two FLOPs) × 2 FMA units:
    64 with AVX-512, 32 with AVX2+FMA, 16 otherwise (and for ARM NEON: 4 lanes × 2 × 2).
    bf16 is 2× fp32 with AVX512-BF16, 16× fp32 with AMX (1024 FLOPs/cycle), else equal
    to fp32 (PyTorch converts). Cores are the CPUs this process may run on; clock is
    the rated maximum, or the highest current reading, or 2.5 GHz if neither is known.
    Reads two small files, so it is cheap; cached for the process.
    """
    flags, hz = _cpu_flags()
    hz = hz or 2.5e9
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if "avx512f" in flags:
        per_cycle = 64
    elif "avx2" in flags and "fma" in flags:
        per_cycle = 32
    else:
        per_cycle = 16
    fp32 = cores * hz * per_cycle
    if "amx_bf16" in flags:
        bf16 = cores * hz * 1024
    elif "avx512_bf16" in flags:
        bf16 = 2 * fp32
    else:
        bf16 = fp32
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = 16e9
    desc = f"CPU: {cores} cores × {hz / 1e9:.2f} GHz × {per_cycle} fp32 FLOPs/cycle"
    return GPUSpec("cpu", bf16, None, fp32, memory, desc)
