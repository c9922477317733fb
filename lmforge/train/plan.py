"""Turn a run config plus facts about data and devices into concrete numbers.

Everything the trainer needs that the user may leave unset — learning rate, batch sizes,
steps, warmup, intervals, precision — is decided here, once, and written back into the
resolved config that is printed by ``--dry-run`` and saved with every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmforge.config.defaults import (MAX_WARMUP_STEPS, WARMUP_FRACTION, auto_precision, bf16_supported,
                                     default_batch_tokens, default_learning_rate, micro_batch_for,
                                     run_optimizer)
from lmforge.config.durations import Duration, parse_duration
from lmforge.config.schema import RunConfig, phase_end
from lmforge.distributed.float8 import check_fp8_supported
from lmforge.errors import UserError
from lmforge.estimate.flops import flops_per_token, mfu_flops_per_token, param_counts
from lmforge.estimate.hardware import detect_device_spec, mfu_basis, peak_flops
from lmforge.estimate.memory import memory_plan
from lmforge.train.optim import Schedule


@dataclass
class TrainPlan:
    context_length: int
    global_batch: int  # samples per optimizer step, all ranks
    micro_batch: int  # samples per forward pass, per rank
    grad_accum: int
    world_size: int
    total_steps: int | None  # None: wall-clock bounded
    time_limit_s: float | None
    warmup_steps: int  # the warmup in steps (estimated from step_time_s when it is given in seconds)
    learning_rate: float
    eval_interval: int
    save_interval: int
    icl_interval: int | None
    precision: str  # "bf16" | "fp32" | "fp8"
    params: dict
    flops_per_token: float  # the MFU basis: 6·N_active + 12·L·H·Dh·T (estimate.flops.mfu_flops_per_token)
    schedule: Schedule  # the LR shape, in the run's own unit (steps, or seconds of training)
    step_time_s: float  # expected seconds per optimizer step: measured on this machine, else estimated
    phase_steps: list[int] | None = None  # curriculum: the optimizer step at which each phase but the last ends
    model_flops_per_token: float = 0.0  # the dense term alone: 6·N_active (LoRA: 4·N_active + 6·N_adapters)
    optimizer: str = "adamw"  # "adamw" | "muon": parameters.optimizer with auto resolved

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.context_length

    @property
    def total_tokens(self) -> int | None:
        return None if self.total_steps is None else self.total_steps * self.tokens_per_step


def _steps(d: Duration, what: str, *, gbs: int, ctx: int, samples_per_epoch: int | None,
           flops_per_token: float = 0.0) -> int | None:
    """A duration in optimizer steps (None for wall-clock durations)."""
    if d.unit == "ba":
        return max(1, math.ceil(d.value))
    if d.unit == "tok":
        return max(1, math.ceil(d.value / (gbs * ctx)))
    if d.unit == "flop":
        return max(1, math.ceil(d.value / (flops_per_token * gbs * ctx)))
    if d.unit == "sp":
        return max(1, math.ceil(d.value / gbs))
    if d.unit == "ep":
        if not samples_per_epoch:
            raise UserError(f"{what}: epochs need the dataset size, which is not known here")
        return max(1, math.ceil(d.value * samples_per_epoch / gbs))
    if d.unit == "s":
        return None
    raise UserError(f"{what}: unsupported unit {d.unit!r}")


def _gpu_micro_batch(cfg: RunConfig, ctx: int, world_size: int, device: torch.device) -> int:
    """Largest micro-batch the memory model says fits on this GPU (activations + sharded states)."""
    sharded = cfg.compute.data_parallel in ("fsdp", "hsdp")
    plan = memory_plan(param_counts(cfg.model)["total"], cfg.model, ctx, world_size if sharded else 1,
                       float(torch.cuda.get_device_properties(device).total_memory),
                       activation_checkpointing=bool(cfg.compute.activation_checkpointing))
    return plan["suggested_micro_batch"] or 1


def check_context(ctx: int, data_seq_len: int | None) -> None:
    """The context fits in the prepared training samples (None: not known here)."""
    if data_seq_len is not None and ctx > data_seq_len:
        raise UserError(f"parameters.context_length ({ctx}) is longer than the training data's samples "
                        f"({data_seq_len} tokens); prepare the data with --seq-len {ctx} or lower the context")


def check_batch_split(gbs: int, micro: int | None, world_size: int) -> None:
    """The global batch (samples) splits evenly over the ranks and, ``micro`` given, into whole
    micro-batches on each."""
    if micro is None:
        if gbs % world_size:
            raise UserError(f"parameters.global_batch_size ({gbs}) must be divisible by the number of ranks "
                            f"({world_size})")
    elif gbs % (micro * world_size):
        raise UserError(f"parameters.global_batch_size ({gbs}) must be divisible by micro_batch_size ({micro}) "
                        f"× ranks ({world_size}) = {micro * world_size}")


def make_plan(cfg: RunConfig, *, world_size: int, device: torch.device,
              samples_per_epoch: int | None, data_seq_len: int | None,
              micro_batch_hint: int | None = None) -> TrainPlan:
    """Fill every default; raises UserError for impossible combinations."""
    p = cfg.parameters
    model = cfg.model
    counts = param_counts(model)
    optimizer = run_optimizer(cfg, counts["non_embedding"])  # [optimizers] auto → muon | adamw
    ctx = p.context_length or (min(model.max_seq_len, data_seq_len) if data_seq_len else model.max_seq_len)
    check_context(ctx, data_seq_len)

    if p.precision == "auto":
        precision = auto_precision(device)
    else:
        precision = p.precision
        if precision == "bf16" and not bf16_supported(device) and device.type != "cpu":
            raise UserError(f"parameters.precision: bf16 is not supported on {device}")
        if precision == "fp8":
            check_fp8_supported(device)  # one clear line, never a silent fallback
    fpt = mfu_flops_per_token(model, ctx, cfg.lora)

    # Global batch in samples (rounded so that every rank gets the same share).
    if p.global_batch_size is None:
        run_tokens = _run_tokens(cfg, ctx, samples_per_epoch, fpt,
                                 lambda: _tokens_per_s(cfg, ctx, world_size, precision, device))
        gbs = max(1, round(default_batch_tokens(counts["non_embedding"], run_tokens) / ctx))
    elif isinstance(p.global_batch_size, str):
        d = parse_duration(p.global_batch_size)
        gbs = max(1, round(d.value / ctx)) if d.unit == "tok" else max(1, int(d.value))
    else:
        gbs = int(p.global_batch_size)
    if p.global_batch_size is None or isinstance(p.global_batch_size, str):
        gbs = world_size * max(1, math.ceil(gbs / world_size))

    if p.micro_batch_size == "auto":
        check_batch_split(gbs, None, world_size)
        cap = 8 if device.type == "cpu" else (micro_batch_hint or _gpu_micro_batch(cfg, ctx, world_size, device))
        micro = micro_batch_for(gbs // world_size, cap)
    else:
        micro = int(p.micro_batch_size)
    check_batch_split(gbs, micro, world_size)
    grad_accum = gbs // (micro * world_size)

    total = _steps(cfg.training_duration, "training_duration", gbs=gbs, ctx=ctx, samples_per_epoch=samples_per_epoch,
                   flops_per_token=fpt)
    time_limit = cfg.training_duration.value if cfg.training_duration.unit == "s" else None

    step_s, fastest_s = step_seconds(cfg, ctx, gbs, micro, world_size, precision, device)
    if time_limit is not None and fastest_s >= time_limit:
        raise UserError(f"training_duration: {cfg.training_duration} is shorter than one optimizer step of this model "
                        f"and batch here (≈{fastest_s:.3g}s); expected a longer duration or a smaller batch/model")

    def interval(d: Duration | None, what: str, default: int) -> int:
        if d is None:
            return default
        steps = _steps(d, what, gbs=gbs, ctx=ctx, samples_per_epoch=samples_per_epoch, flops_per_token=fpt)
        if steps is None:
            raise UserError(f"{what}: use steps or tokens ('100ba', '1M tok'), not wall-clock time")
        return steps

    # Wall-clock runs: intervals from the expected number of steps.
    nominal = total or max(1, int(time_limit / step_s))
    schedule = make_schedule(cfg, total, time_limit, step_s,
                             lambda d: _steps(d, "parameters.warmup", gbs=gbs, ctx=ctx,
                                              samples_per_epoch=samples_per_epoch, flops_per_token=fpt))
    warmup = int(schedule.warmup if schedule.warmup_unit == "steps" else math.ceil(schedule.warmup / step_s))
    eval_every = interval(cfg.eval.interval, "eval.interval", max(1, nominal // 10))
    save_every = interval(cfg.save_interval, "save_interval", max(1, min(1000, nominal // 5)))
    icl_every = interval(cfg.eval.icl_interval, "eval.icl_interval", 0) or None

    phase_steps = curriculum_steps(cfg, total, gbs=gbs, ctx=ctx) if cfg.curriculum else None

    return TrainPlan(
        context_length=ctx, global_batch=gbs, micro_batch=micro, grad_accum=grad_accum,
        world_size=world_size, total_steps=total, time_limit_s=time_limit, warmup_steps=warmup,
        learning_rate=p.learning_rate or default_learning_rate(counts["non_embedding"], optimizer), optimizer=optimizer,
        eval_interval=eval_every, save_interval=save_every, icl_interval=icl_every,
        precision=precision, params=counts, flops_per_token=fpt, schedule=schedule, step_time_s=step_s,
        phase_steps=phase_steps, model_flops_per_token=flops_per_token(model, ctx, cfg.lora)["dense"],
    )


def _run_tokens(cfg: RunConfig, ctx: int, samples_per_epoch: int | None, fpt: float, rate) -> float | None:
    """The run's length in tokens where it is known before the batch (None for a step count):
    what the default batch is sized for. ``rate()``: expected tokens/s (wall-clock budgets)."""
    d = cfg.training_duration
    if d.unit == "tok":
        return d.value
    if d.unit == "sp":
        return d.value * ctx
    if d.unit == "ep":
        return d.value * samples_per_epoch * ctx if samples_per_epoch else None
    if d.unit == "flop":
        return d.value / fpt
    if d.unit == "s":
        return d.value * rate()
    return None


def _tokens_per_s(cfg: RunConfig, ctx: int, world_size: int, precision: str, device: torch.device) -> float:
    """Expected training tokens/s of all ranks (see step_seconds), at the CPU micro-batch size."""
    micro = micro_batch_for(max(1, default_batch_tokens(param_counts(cfg.model)["non_embedding"]) // ctx))
    step_s, _ = step_seconds(cfg, ctx, micro * world_size, micro, world_size, precision, device)
    return micro * ctx * world_size / step_s


def step_seconds(cfg: RunConfig, ctx: int, gbs: int, micro: int, world_size: int, precision: str,
                 device: torch.device) -> tuple[float, float]:
    """(expected, fastest possible) seconds per optimizer step. Expected: this machine's cached
    measurement of the shape (`train.throughput`), else the FLOPs at half the device's peak;
    fastest: the measurement, else the FLOPs at the full peak (a lower bound)."""
    from lmforge.train.throughput import cached_tokens_per_s

    tokens = gbs * ctx / world_size  # per device
    measured = None
    if cfg.model.vocab_size:
        measured = cached_tokens_per_s(cfg.model, ctx, micro, precision=precision,
                                       optimizer=run_optimizer(cfg, param_counts(cfg.model)["non_embedding"]),
                                       device=device)  # [optimizers] ^ auto resolved
    if measured:
        return tokens / measured, tokens / measured
    peak = peak_flops(detect_device_spec(device), mfu_basis(precision))
    flops = tokens * flops_per_token(cfg.model, ctx)["total"]
    return flops / (0.5 * peak), flops / peak


def make_schedule(cfg: RunConfig, total_steps: int | None, time_limit_s: float | None, step_s: float,
                  to_steps) -> Schedule:
    """The LR schedule in the run's unit. The default warmup is WARMUP_FRACTION of the run
    (at most MAX_WARMUP_STEPS steps' worth); a given warmup keeps its own unit."""
    p = cfg.parameters
    unit, total = ("steps", float(total_steps)) if total_steps is not None else ("s", float(time_limit_s))
    if p.warmup is None:
        cap = MAX_WARMUP_STEPS * (1.0 if unit == "steps" else step_s)
        warmup = min(cap, WARMUP_FRACTION * total)
        warmup = float(max(1, round(warmup))) if unit == "steps" else warmup
        warmup_unit = unit
    elif p.warmup.unit == "s":
        warmup, warmup_unit = p.warmup.value, "s"
    else:
        warmup, warmup_unit = float(to_steps(p.warmup)), "steps"
    if warmup_unit == unit:
        warmup = min(warmup, total)
    return Schedule(kind=p.schedule, unit=unit, total=total, warmup=warmup, warmup_unit=warmup_unit,
                    decay_fraction=p.decay_fraction, min_ratio=p.min_lr_ratio)


def curriculum_steps(cfg: RunConfig, total: int | None, *, gbs: int, ctx: int) -> list[int]:
    """Each phase's end as an optimizer step (phases change only between steps); the last phase is open."""
    ends, prev = [], 0
    for i, phase in enumerate(cfg.curriculum[:-1] if cfg.curriculum[-1].until is None else cfg.curriculum):
        unit, value = phase_end(phase.until)
        where = f"train_data[{i}].until"
        if unit == "frac":
            if total is None:
                raise UserError(f"{where}: a fraction of the run needs a run length in tokens, steps, samples "
                                f"or epochs, not wall-clock time ({cfg.training_duration})")
            step = round(value * total)
        else:
            step = _steps(Duration(value, unit), where, gbs=gbs, ctx=ctx, samples_per_epoch=None)
        if step <= prev:
            raise UserError(f"{where}: {phase.until!r} is step {step}, not after the previous phase's end "
                            f"(step {prev}); end points must increase")
        if total is not None and step > total:
            raise UserError(f"{where}: {phase.until!r} is step {step}, past the end of the run ({total} steps)")
        ends.append(step)
        prev = step
    if cfg.curriculum[-1].until is not None and total is not None and ends and ends[-1] < total:
        raise UserError(f"train_data[{len(ends) - 1}].until: the last phase ends at step {ends[-1]}, before the "
                        f"run does ({total} steps); leave out its `until` or end it at 100%")
    # The last phase always runs on (past the planned end too, e.g. for wall-clock runs).
    return ends[:-1] if cfg.curriculum[-1].until is not None else ends


def resolved_config(cfg: RunConfig, plan: TrainPlan) -> RunConfig:
    """The config with every default written in (what --dry-run prints and checkpoints keep)."""
    data = cfg.model_dump(mode="json")
    data["parameters"].update(
        learning_rate=plan.learning_rate, context_length=plan.context_length,
        global_batch_size=plan.global_batch, micro_batch_size=plan.micro_batch,
        warmup=_warmup_text(plan.schedule), precision=plan.precision,
        optimizer=plan.optimizer)  # [optimizers] auto resolved
    data["eval"]["interval"] = f"{plan.eval_interval}ba"
    if plan.icl_interval:
        data["eval"]["icl_interval"] = f"{plan.icl_interval}ba"
    data["save_interval"] = f"{plan.save_interval}ba"
    return RunConfig.model_validate(data)


def _warmup_text(schedule: Schedule) -> str:
    if schedule.warmup_unit == "steps":
        return f"{int(schedule.warmup)}ba"
    return f"{schedule.warmup:.4g}s"
