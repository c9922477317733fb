"""The machine a run is resolved for, described without torch.

Resolution needs a few facts about the devices (their kind, peak FLOP/s, memory, whether bf16 and
FP8 run natively) and, on a real machine, two services: the measured training speed of a shape
(`model: auto`, wall-clock budgets) and "run this on rank 0, give every rank its result"
(rank 0 chooses and prepares, the others follow). Both come through a `Machine`:

- `nominal_machine` describes GPUs from the table in `plan.hardware` (`lmforge estimate
  --gpu-type h100-sxm`, a dry run planned for a cluster): nothing is measured; speeds are
  modelled from FLOPs at ``assumed_mfu`` of the peak (ASSUMED_MFU unless `--mfu` says otherwise);
- `train.machine.local_machine` describes the devices this process trains on and measures them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from lmforge.config.model import ModelConfig
from lmforge.config.schema import RunConfig
from lmforge.plan.hardware import ASSUMED_MFU, GPUSpec, get_gpu_type

T = TypeVar("T")
FP8_DEVICES = "an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, L4, B200)"
NO_FP8 = f"parameters.precision: fp8 needs {FP8_DEVICES}; use bf16 or auto"


def no_fp8_on(kind: str) -> str:
    """The line refusing FP8 training on a device of ``kind`` (cpu, mps, …)."""
    return f"parameters.precision: fp8 needs {FP8_DEVICES}; this run trains on {kind} (use bf16 or auto)"


class Probe(Protocol):
    """What only a real machine can do for resolution."""

    measures: bool  # whether `tokens_per_s(..., measure=True)` times the shape here

    def tokens_per_s(self, model: ModelConfig, context_length: int, micro_batch: int, *, precision: str,
                     optimizer: str, measure: bool) -> float | None:
        """Training tokens/s of one device for this shape: the cached measurement, else (``measure``)
        a fresh one; None where neither exists."""

    def micro_batch_tokens_per_s(self, cfg: RunConfig, context_length: int, micro_batch: int, checkpointing, *,
                                 precision: str, compression="off", offload: bool = False) -> float | None:
        """The whole model's training tokens/s at this micro-batch and way of keeping activations
        (checkpointing, compression, offload), measured here (a GPU times a slice of the model); None
        where nothing is measured."""

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0; its result (or its UserError) on every rank."""


class NoProbe:
    """A machine that is only described: nothing is measured, and there is one process."""

    measures = False

    def tokens_per_s(self, model, context_length, micro_batch, *, precision, optimizer, measure):
        return None

    def micro_batch_tokens_per_s(self, cfg, context_length, micro_batch, checkpointing, *, precision,
                                 compression="off", offload=False):
        return None

    def on_main(self, fn):
        return fn()


@dataclass(frozen=True)
class Machine:
    """The devices one run trains on."""

    device: str  # "cpu" | "cuda"
    spec: GPUSpec  # one device: peak FLOP/s per precision and memory (bytes)
    world_size: int = 1  # ranks, all nodes
    bf16: bool = False  # bf16 matmuls run natively (what `precision: auto` chooses)
    fp8_problem: str | None = NO_FP8  # the line refusing `precision: fp8` here; None: FP8 can run
    fp8_experts_problem: str | None = NO_FP8  # the same for FP8 grouped GEMMs (`parameters.fp8_experts`)
    probe: Probe = field(default_factory=NoProbe, compare=False)
    assumed_mfu: float = ASSUMED_MFU  # of the peak, where nothing is measured

    @property
    def memory_bytes(self) -> float:
        return self.spec.memory_bytes

    @property
    def compute_devices(self) -> int:
        """Devices whose speeds add up: every GPU; CPU ranks share one machine's cores, whose
        measured (or peak) rate already counts them all."""
        return self.world_size if self.device == "cuda" else 1

    @property
    def where(self) -> str:
        """The devices in words: ``8 × NVIDIA H100 SXM5 80GB``."""
        return f"{self.world_size} × {self.spec.description or self.spec.name}"

    @property
    def gpu_type(self) -> str:
        """The name `lmforge estimate --gpu-type` knows this device by (``cpu`` for a CPU)."""
        return self.spec.name


def nominal_machine(gpu_type: str = "h100-sxm", devices: int = 1, mfu: float = ASSUMED_MFU) -> Machine:
    """``devices`` GPUs of a type from the table (``cpu``: this machine's CPU), not measured:
    their speed is ``mfu`` of the peak."""
    spec = get_gpu_type(gpu_type)
    if gpu_type == "cpu":
        return Machine("cpu", spec, devices, bf16=False, assumed_mfu=mfu)
    fp8 = None if spec.fp8 else f"parameters.precision: fp8 needs FP8 tensor cores, which {spec.name} lacks (use bf16)"
    return Machine("cuda", spec, devices, bf16=True, fp8_problem=fp8, fp8_experts_problem=fp8, assumed_mfu=mfu)
