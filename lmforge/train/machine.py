"""The machine this process trains on, as resolution sees it (`plan.machine.Machine`).

Facts come from torch (the device, its memory, whether bf16 and FP8 run natively); the probe
measures a shape's training speed here (`train.throughput`, cached per machine) and runs a step
of resolution on rank 0 with its result — or its bad-input error — given to every rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lmforge.config.model import ModelConfig
from lmforge.distributed.dist import DistInfo, broadcast_object
from lmforge.config.schema import ComputeConfig, RunConfig
from lmforge.distributed.float8 import FP8Options, check_fp8_supported
from lmforge.errors import PeerUserError, UserError
from lmforge.plan.hardware import detect_device_spec
from lmforge.plan.machine import Machine
from lmforge.train.micro_batch import probe_tokens_per_s
from lmforge.train.throughput import cached_tokens_per_s, measure_tokens_per_s


def bf16_supported(device: torch.device) -> bool:
    """bf16 autocast only where matmuls run natively in bf16 (else it is slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # AMX tiles only (`config.defaults.auto_precision` says why not AVX512-BF16 alone).
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return amx is not None and amx() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False


def fp8_problem(device: torch.device, experts: bool = False) -> str | None:
    """The line refusing FP8 training (``experts``: FP8 grouped GEMMs too) on this device and
    install, None where it can run."""
    try:
        check_fp8_supported(device, experts=experts)
    except UserError as e:
        return str(e)
    return None


class LocalProbe:
    """Measures on this process's device (``measures`` False: reads only what was measured before);
    rank 0 of ``dist`` decides for every rank."""

    def __init__(self, device: torch.device, dist: DistInfo | None = None, measures: bool = True):
        self.device, self.dist, self.measures = device, dist, measures

    def tokens_per_s(self, model: ModelConfig, context_length: int, micro_batch: int, *, precision: str,
                     optimizer: str, measure: bool) -> float | None:
        kw = dict(precision=precision, optimizer=optimizer, device=self.device)
        if not (measure and self.measures):
            return cached_tokens_per_s(model, context_length, micro_batch, **kw)
        try:
            return measure_tokens_per_s(model, context_length, micro_batch, **kw)
        except torch.OutOfMemoryError:
            return 1e-9  # does not fit: never chosen

    def micro_batch_tokens_per_s(self, cfg: RunConfig, context_length: int, micro_batch: int, checkpointing, *,
                                 precision: str) -> float | None:
        if self.device.type != "cuda" or not self.measures:
            return None  # a CPU keeps its fixed rule (`plan.run.micro_batch_and_checkpointing`)
        return probe_tokens_per_s(cfg.model, context_length, micro_batch, checkpointing, precision=precision,
                                  fp8=FP8Options.of(cfg.parameters), compile_=cfg.compute.compile, device=self.device)

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
        result, message, peer_user = broadcast_object(
            (result, None if error is None else f"{type(error).__name__}: {error}" if not user else str(error), user))
        if error is not None:
            raise error
        if message and peer_user:
            raise PeerUserError(message)
        if message:
            raise RuntimeError(f"rank 0 failed while resolving the run ({message})")
        return result


def local_machine(device: torch.device, world_size: int = 1, dist: DistInfo | None = None, *,
                  measure: bool = True) -> Machine:
    """``world_size`` devices like ``device`` (this process's), ``dist`` its process group if any;
    ``measure`` False: nothing is timed here (only earlier measurements are read)."""
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
    for: ``compute.ranks`` on a CPU, GPUs per node × nodes on GPUs."""
    from lmforge.distributed.torchrun import resolve_device_kind

    kind = resolve_device_kind(compute.device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("compute.device: cuda was asked for but no CUDA GPU is visible")
    if world_size is None:
        per_node = torch.cuda.device_count() if compute.gpus == "auto" else compute.gpus
        world_size = per_node * compute.nodes if kind == "cuda" else compute.ranks or 1
    return local_machine(torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), world_size, measure=measure)
