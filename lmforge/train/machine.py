"""The machine this process trains on, as resolution sees it (`plan.machine.Machine`).

Facts come from torch (the device, its memory, whether bf16 and FP8 run natively); the probe
measures a shape's training speed here (`train.throughput`, cached per machine) and runs a step
of resolution on rank 0 with its result — or its bad-input error — given to every rank.

A CPU is described without torch (`cpu_machine`): the command a user starts (its supervisor and
preflight, `plan.run` up to the memory verdict) then never imports it — a second of every start-up
— and torch is imported only where a GPU is asked about or a speed measured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lmforge.config.model import ModelConfig
from lmforge.config.schema import ComputeConfig, RunConfig
from lmforge.errors import PeerUserError, UserError
from lmforge.plan.hardware import cpu_bf16_native, cpu_spec, detect_device_spec
from lmforge.plan.machine import Machine, NoProbe, no_fp8_on
from lmforge.train.throughput import cached_tokens_per_s, measure_tokens_per_s

if TYPE_CHECKING:
    import torch

    from lmforge.distributed.dist import DistInfo


def bf16_supported(device: torch.device) -> bool:
    """bf16 autocast only where matmuls run natively in bf16 (else it is slower than fp32)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_bf16_native()


def fp8_problem(device: torch.device, experts: bool = False) -> str | None:
    """The line refusing FP8 training (``experts``: FP8 grouped GEMMs too) on this device and
    install, None where it can run."""
    if device.type != "cuda":
        return no_fp8_on(device.type)
    from lmforge.distributed.float8 import check_fp8_supported

    try:
        check_fp8_supported(device, experts=experts)
    except UserError as e:
        return str(e)
    return None


class LocalProbe:
    """Measures on this process's device (``measures`` False: reads only what was measured before);
    rank 0 of ``dist`` decides for every rank."""

    def __init__(self, device: torch.device | str, dist: DistInfo | None = None, measures: bool = True):
        self.device, self.dist, self.measures = device, dist, measures

    def tokens_per_s(self, model: ModelConfig, context_length: int, micro_batch: int, *, precision: str,
                     optimizer: str, measure: bool) -> float | None:
        kw = dict(precision=precision, optimizer=optimizer, device=self.device)
        if not (measure and self.measures):
            return cached_tokens_per_s(model, context_length, micro_batch, **kw)
        import torch

        try:
            return measure_tokens_per_s(model, context_length, micro_batch, **kw)
        except torch.OutOfMemoryError:
            return 1e-9  # does not fit: never chosen

    def micro_batch_tokens_per_s(self, cfg: RunConfig, context_length: int, micro_batch: int, checkpointing, *,
                                 precision: str, compression="off", offload: bool = False) -> float | None:
        if str(self.device).split(":")[0] != "cuda" or not self.measures:
            return None  # a CPU keeps its fixed rule (`plan.run.micro_batch_and_checkpointing`)
        from lmforge.distributed.float8 import FP8Options
        from lmforge.train.micro_batch import probe_tokens_per_s

        return probe_tokens_per_s(cfg.model, context_length, micro_batch, checkpointing, precision=precision,
                                  fp8=FP8Options.of(cfg.parameters), compile_=cfg.compute.compile, device=self.device,
                                  compression=compression, offload=offload)

    def on_main(self, fn):
        if self.dist is None or not self.dist.distributed:
            return fn()
        result = error = None
        if self.dist.is_main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
                error = e
        user = isinstance(error, UserError)
        from lmforge.distributed.dist import broadcast_object

        result, message, peer_user = broadcast_object(
            (result, None if error is None else f"{type(error).__name__}: {error}" if not user else str(error), user))
        if error is not None:
            raise error
        if message and peer_user:
            raise PeerUserError(message)
        if message:
            raise RuntimeError(f"rank 0 failed while resolving the run ({message})")
        return result


def cpu_machine(world_size: int = 1, dist: DistInfo | None = None, *, measure: bool = True,
                speeds: bool = True) -> Machine:
    """``world_size`` ranks on this host's CPU, described from its flags without torch; ``speeds``
    False: no speed is read either (the cache's key holds torch's thread count, `train.throughput`)."""
    probe = LocalProbe("cpu", dist, measure) if speeds else NoProbe()
    return Machine("cpu", cpu_spec(), world_size, bf16=cpu_bf16_native(), fp8_problem=no_fp8_on("cpu"),
                   fp8_experts_problem=no_fp8_on("cpu"), probe=probe)


def local_machine(device: torch.device, world_size: int = 1, dist: DistInfo | None = None, *,
                  measure: bool = True) -> Machine:
    """``world_size`` devices like ``device`` (this process's), ``dist`` its process group if any;
    ``measure`` False: nothing is timed here (only earlier measurements are read)."""
    if device.type == "cpu":
        return cpu_machine(world_size, dist, measure=measure)
    import torch

    spec = detect_device_spec(device)
    if device.type == "cuda":  # what this card really has (the table's is the nominal size)
        spec = replace(spec, memory_bytes=float(torch.cuda.get_device_properties(device).total_memory))
    return Machine(device.type, spec, world_size, bf16=bf16_supported(device), fp8_problem=fp8_problem(device),
                   fp8_experts_problem=fp8_problem(device, experts=True),
                   probe=LocalProbe(device, dist, measure))


def process_machine(dist: DistInfo) -> Machine:
    """The machine of a training process: its device, every rank of its group."""
    return local_machine(dist.device, dist.world_size, dist)


def planned_machine(compute: ComputeConfig, world_size: int | None = None, *, measure: bool = True) -> Machine:
    """The machine a run of ``compute`` trains on, described before it starts (`--dry-run`,
    preflight): this host's device kind and ``world_size`` ranks — by default what the config asks
    for: ``compute.ranks`` × nodes on a CPU, GPUs per node × nodes on GPUs."""
    from lmforge.distributed.torchrun import resolve_device_kind

    if resolve_device_kind(compute.device) == "cpu":
        return cpu_machine((compute.ranks or 1) * compute.nodes if world_size is None else world_size, measure=measure)
    import torch  # cuda (the only other kind)

    if not torch.cuda.is_available():
        raise UserError("compute.device: cuda was asked for but no CUDA GPU is visible")
    if world_size is None:
        per_node = torch.cuda.device_count() if compute.gpus == "auto" else compute.gpus
        world_size = per_node * compute.nodes
    return local_machine(torch.device("cuda", 0), world_size, measure=measure)
