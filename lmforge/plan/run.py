"""Turn a run config plus facts about its data and machine into concrete numbers: the plan.

Everything the trainer needs that the user may leave unset — learning rate, batch sizes,
steps, warmup, intervals, precision — is decided here, once, and written back into the
resolved config that is printed by ``--dry-run`` and saved with every checkpoint. No torch:
the machine comes as a `resolve.machine.Machine` (described, or measured by the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config.defaults import (MAX_WARMUP_STEPS, WARMUP_FRACTION, auto_precision, default_batch_tokens,
                                     micro_batch_for, run_optimizer, task_learning_rate)
from lmforge.config.durations import Duration, parse_duration
from lmforge.config.model import ModelConfig
from lmforge.config.schema import FINETUNE_TASKS, RunConfig, phase_end
from lmforge.data.pieces import training_context
from lmforge.errors import UserError
from lmforge.plan.context import check_context_parallel, context_fit_error
from lmforge.plan.flops import flops_per_token, mfu_flops_per_token, param_counts
from lmforge.plan.hardware import mfu_basis, peak_flops
from lmforge.plan.micro_batch import choose
from lmforge.plan.estimate import EstimateInputs
from lmforge.plan.machine import Machine
from lmforge.plan.schedule import Schedule


@dataclass(frozen=True)
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
    activation_checkpointing: bool | str | int = False  # the mode `parallelize` applies (`auto` resolved)
    micro_batch_reason: str | None = None  # the line saying how micro-batch and checkpointing were chosen
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


def replicas(cfg: RunConfig, machine: Machine) -> int:
    """Data-parallel replicas: the ranks that read different rows (context-parallel ranks share
    theirs), over which the global batch is split."""
    return machine.world_size // cfg.compute.context_parallel


def micro_batch_and_checkpointing(cfg: RunConfig, ctx: int, gbs: int, machine: Machine,
                                  precision: str) -> tuple[int, object, str | None]:
    """(micro-batch, activation-checkpointing mode, the line saying why — None where nothing was
    chosen). ``micro_batch_size: auto`` / ``activation_checkpointing: auto`` on GPUs: the pair with
    the most tokens/s that fits (`estimate.micro_batch`: memory first, then the machine's probe,
    or the model where nothing is measured); on a CPU today's rule (the largest divisor of the
    rank's batch up to 8, no checkpointing)."""
    p, c, world = cfg.parameters, cfg.compute, replicas(cfg, machine)
    auto_micro, auto_ac = p.micro_batch_size == "auto", c.activation_checkpointing == "auto"
    if auto_micro:
        check_batch_split(gbs, None, world)
    if machine.device == "cpu" or not (auto_micro or auto_ac):
        micro = micro_batch_for(gbs // world, 8) if auto_micro else int(p.micro_batch_size)
        return micro, (False if auto_ac else c.activation_checkpointing), None
    devices = machine.world_size if c.data_parallel in ("fsdp", "hsdp") else 1  # the states are sharded over
    # With context parallelism a GPU holds ctx / N tokens of each row: its activations and its GEMM rows.
    local_ctx = ctx // c.context_parallel

    def measure(cand) -> float | None:
        return machine.probe.micro_batch_tokens_per_s(cfg, local_ctx, cand.micro_batch, cand.checkpointing,
                                                      precision=precision)

    choice = choose(cfg.model, local_ctx, n_devices=devices, gpu_memory=machine.memory_bytes,
                    peak_flops=peak_flops(machine.spec, mfu_basis(precision)),
                    where=f"{devices} × {machine.spec.description or machine.spec.name}", per_rank=gbs // world,
                    micro_batch=None if auto_micro else int(p.micro_batch_size), checkpointing=c.activation_checkpointing,
                    expert_parallel=c.expert_parallel, measure=measure if auto_micro and machine.probe.measures else None,
                    measured_as="measured (a slice of the model, scaled to it)",
                    ddp_ranks=machine.world_size if c.data_parallel == "ddp" else 1)
    return choice.micro_batch, choice.checkpointing, choice.reason


def _check_fits(cfg: RunConfig, ctx: int, micro: int, checkpointing, machine: Machine) -> None:
    """A GPU run whose micro-batch and checkpointing were set by hand: one line with what to set
    when its rows cannot fit (`estimate.context`), before any process builds the model."""
    c = cfg.compute
    per_node = max(1, machine.world_size // c.nodes)
    shards = {"fsdp": machine.world_size, "hsdp": c.shard_size or per_node}.get(c.data_parallel, 1)
    line = context_fit_error(cfg.model, ctx, machine.world_size, machine.memory_bytes,
                             machine.spec.description or machine.gpu_type, context_parallel=c.context_parallel,
                             activation_checkpointing=checkpointing, micro_batch=micro,
                             expert_parallel=c.expert_parallel, state_shards=shards)
    if line:
        raise UserError(line)


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


def make_plan(cfg: RunConfig, machine: Machine, *, samples_per_epoch: int | None,
              data_seq_len: int | None) -> TrainPlan:
    """Fill every default; raises UserError for impossible combinations."""
    p = cfg.parameters
    world = replicas(cfg, machine)
    counts = param_counts(cfg.model)
    optimizer = plan_optimizer(cfg)
    ctx = training_context(p.context_length, cfg.model.max_seq_len, data_seq_len)
    check_context(ctx, data_seq_len)
    check_context_parallel(cfg.compute.context_parallel, ctx, cfg.model, device_type=machine.device,
                           packed_rows=p.document_masking or cfg.task_type in FINETUNE_TASKS)
    precision = plan_precision(cfg, machine)
    fpt = mfu_flops_per_token(cfg.model, ctx, cfg.lora)
    gbs = _global_batch(cfg, ctx, machine, precision, samples_per_epoch, fpt)
    micro, checkpointing, micro_reason = micro_batch_and_checkpointing(cfg, ctx, gbs, machine, precision)
    check_batch_split(gbs, micro, world)
    if machine.device == "cuda" and micro_reason is None:  # set by hand: refused now if it cannot fit
        _check_fits(cfg, ctx, micro, checkpointing, machine)

    def steps(d: Duration, what: str) -> int | None:
        return _steps(d, what, gbs=gbs, ctx=ctx, samples_per_epoch=samples_per_epoch, flops_per_token=fpt)

    total = steps(cfg.training_duration, "training_duration")
    time_limit = cfg.training_duration.value if cfg.training_duration.unit == "s" else None
    step_s, fastest_s = step_seconds(cfg, ctx, gbs, micro, machine, precision)
    if time_limit is not None and fastest_s >= time_limit:
        raise UserError(f"training_duration: {cfg.training_duration} is shorter than one optimizer step of this model "
                        f"and batch here (≈{fastest_s:.3g}s); expected a longer duration or a smaller batch/model")
    nominal = total or max(1, int(time_limit / step_s))  # wall-clock runs: intervals from the expected steps
    schedule = make_schedule(cfg, total, time_limit, step_s, lambda d: steps(d, "parameters.warmup"))
    warmup = int(schedule.warmup if schedule.warmup_unit == "steps" else math.ceil(schedule.warmup / step_s))
    return TrainPlan(
        context_length=ctx, global_batch=gbs, micro_batch=micro, grad_accum=gbs // (micro * world),
        world_size=world, total_steps=total, time_limit_s=time_limit, warmup_steps=warmup,
        learning_rate=p.learning_rate or task_learning_rate(counts["non_embedding"], cfg.task_type, cfg.lora is not None,
                                                            optimizer),
        optimizer=optimizer,
        eval_interval=_interval(cfg.eval.interval, "eval.interval", max(1, nominal // 10), steps),
        save_interval=_interval(cfg.save_interval, "save_interval", max(1, min(1000, nominal // 5)), steps),
        icl_interval=_interval(cfg.eval.icl_interval, "eval.icl_interval", 0, steps) or None,
        precision=precision, params=counts, flops_per_token=fpt, schedule=schedule, step_time_s=step_s,
        phase_steps=curriculum_steps(cfg, total, gbs=gbs, ctx=ctx) if cfg.curriculum else None,
        model_flops_per_token=flops_per_token(cfg.model, ctx, cfg.lora)["dense"],
        activation_checkpointing=checkpointing, micro_batch_reason=micro_reason,
    )


def plan_precision(cfg: RunConfig, machine: Machine) -> str:
    """What the run trains in: `precision: auto` by the machine, an explicit one checked against it."""
    precision = cfg.parameters.precision
    if precision == "auto":
        return auto_precision(machine.bf16)
    if precision == "bf16" and not machine.bf16 and machine.device != "cpu":
        raise UserError(f"parameters.precision: bf16 is not supported on {machine.spec.description or machine.device}")
    if precision == "fp8" and machine.fp8_problem:  # one clear line, never a silent fallback
        raise UserError(machine.fp8_problem)
    if precision == "fp8" and cfg.parameters.fp8_experts and machine.fp8_experts_problem:
        raise UserError(machine.fp8_experts_problem)
    return precision


def _global_batch(cfg: RunConfig, ctx: int, machine: Machine, precision: str, samples_per_epoch: int | None,
                  fpt: float) -> int:
    """The global batch in samples (a default or a batch in tokens rounded so every rank gets the same share)."""
    p, world = cfg.parameters, replicas(cfg, machine)
    if isinstance(p.global_batch_size, int):
        return int(p.global_batch_size)
    if p.global_batch_size is None:
        run_tokens = _run_tokens(cfg, ctx, samples_per_epoch, fpt, lambda: _tokens_per_s(cfg, ctx, machine, precision))
        gbs = max(1, round(default_batch_tokens(param_counts(cfg.model)["non_embedding"], run_tokens) / ctx))
    else:
        d = parse_duration(p.global_batch_size)
        gbs = max(1, round(d.value / ctx)) if d.unit == "tok" else max(1, int(d.value))
    return world * max(1, math.ceil(gbs / world))


def _interval(d: Duration | None, what: str, default: int, steps) -> int:
    """An eval/save/ICL interval in steps (``steps``: a duration in this plan's steps)."""
    if d is None:
        return default
    n = steps(d, what)
    if n is None:
        raise UserError(f"{what}: use steps or tokens ('100ba', '1M tok'), not wall-clock time")
    return n


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


def _tokens_per_s(cfg: RunConfig, ctx: int, machine: Machine, precision: str) -> float:
    """Expected training tokens/s of all ranks (see step_seconds), at the CPU micro-batch size."""
    micro = micro_batch_for(max(1, default_batch_tokens(param_counts(cfg.model)["non_embedding"]) // ctx))
    step_s, _ = step_seconds(cfg, ctx, micro * machine.world_size, micro, machine, precision)
    return micro * ctx * machine.world_size / step_s


def plan_optimizer(cfg: RunConfig, model: ModelConfig | None = None) -> str:
    """``parameters.optimizer`` with ``auto`` resolved for ``model`` (default: the run's) by
    `config.defaults.run_optimizer`: Muon's evidence is for pretraining from scratch, so weights to
    continue from, LoRA and the fine-tuning tasks keep AdamW."""
    from_scratch = not cfg.custom_weights_path and cfg.lora is None and cfg.task_type not in FINETUNE_TASKS
    return run_optimizer(cfg.parameters.optimizer, param_counts(model or cfg.model)["non_embedding"], from_scratch)


def step_seconds(cfg: RunConfig, ctx: int, gbs: int, micro: int, machine: Machine,
                 precision: str) -> tuple[float, float]:
    """(expected, fastest possible) seconds per optimizer step. Expected: this machine's cached
    measurement of the shape (`train.throughput`), else the FLOPs at half the device's peak;
    fastest: the measurement, else the FLOPs at the full peak (a lower bound)."""
    tokens = gbs * ctx / machine.world_size  # per device
    measured = None
    if cfg.model.vocab_size:
        measured = machine.probe.tokens_per_s(cfg.model, ctx, micro, precision=precision,
                                              optimizer=plan_optimizer(cfg), measure=False)
    if measured:
        return tokens / measured, tokens / measured
    peak = peak_flops(machine.spec, mfu_basis(precision))
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
        optimizer=plan.optimizer)
    data["eval"]["interval"] = f"{plan.eval_interval}ba"
    if plan.icl_interval:
        data["eval"]["icl_interval"] = f"{plan.icl_interval}ba"
    data["save_interval"] = f"{plan.save_interval}ba"
    data["compute"]["activation_checkpointing"] = plan.activation_checkpointing
    return RunConfig.model_validate(data)


def _warmup_text(schedule: Schedule) -> str:
    if schedule.warmup_unit == "steps":
        return f"{int(schedule.warmup)}ba"
    return f"{schedule.warmup:.4g}s"


def estimate_inputs(cfg: RunConfig, plan: TrainPlan, machine: Machine) -> EstimateInputs:
    """The estimate of a resolved run (`--dry-run`): its model, tokens, batch and machine, at the
    peak its MFU is logged against (on a CPU without AMX the run trains in fp32, and that CPU's
    bf16 peak would halve the time estimate)."""
    gpu = machine.device == "cuda"
    return EstimateInputs(cfg.model, tokens=plan.total_tokens, gpus=machine.world_size if gpu else 1,
                          price=cfg.compute.price_per_gpu_hour, seq_len=plan.context_length, spec=machine.spec,
                          micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
                          precision=mfu_basis(plan.precision),
                          expert_parallel=cfg.compute.expert_parallel if gpu else 1,
                          context_parallel=cfg.compute.context_parallel, data_parallel=cfg.compute.data_parallel)
