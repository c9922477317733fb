"""A run's batch and speed, the parts its plan and `model: auto` share: the context it trains at,
the tokens its duration buys, its global batch, the micro-batch a CPU takes, its precision and
optimizer, and the tokens/s it is expected to reach.

`model: auto` (`plan.auto`) sizes and times its candidates with these functions, and the plan
(`plan.run.make_plan`) sizes the chosen one with them, so the shape timed is the shape planned.
A default batch is sized from the FLOPs-modelled speed (`assumed_tokens_per_s`), never from a
measurement: a plan must not change with what happens to be cached, or a dry run and the run it
describes would disagree on their batch. Measurements (`expected_rate`) only say how long a step
takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lmforge.config.counts import human
from lmforge.config.defaults import (RL_PROMPTS_PER_STEP, auto_precision, default_batch_rule, default_batch_tokens,
                                     micro_batch_for, run_optimizer)
from lmforge.config.durations import Duration, parse_duration
from lmforge.config.model import ModelConfig
from lmforge.config.schema import FINETUNE_TASKS, RL_TASK, RunConfig
from lmforge.errors import UserError
from lmforge.plan.flops import mfu_flops_per_token, param_counts
from lmforge.plan.hardware import mfu_basis, peak_flops, tokens_per_s_at
from lmforge.plan.machine import Machine

CPU_MICRO_BATCH = 8  # the largest micro-batch a CPU takes (`micro_batch_for`): beyond it, no faster
PROBE_MICRO_BATCH = 64  # a GPU's largest, where a shape is timed before its plan


def training_context(context_length: int | None, max_seq_len: int, data_seq_len: int | None) -> int:
    """The context a run trains at: ``parameters.context_length``, else the model's ``max_seq_len``
    capped by the prepared samples' length (``None``: not known here)."""
    if context_length:
        return context_length
    return min(max_seq_len, data_seq_len) if data_seq_len else max_seq_len


def plan_optimizer(cfg: RunConfig, model: ModelConfig | None = None) -> str:
    """``parameters.optimizer`` with ``auto`` resolved for ``model`` (default: the run's) by
    `config.defaults.run_optimizer`: Muon's evidence is for pretraining from scratch, so weights to
    continue from, LoRA and the fine-tuning tasks keep AdamW."""
    from_scratch = not cfg.custom_weights_path and cfg.lora is None and cfg.task_type not in FINETUNE_TASKS
    return run_optimizer(cfg.parameters.optimizer, param_counts(model or cfg.model)["non_embedding"], from_scratch)


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


def run_tokens(d: Duration, model: ModelConfig, ctx: int, *, tokens_per_s: Callable[[], float], lora=None,
               samples_per_epoch: int | None = None) -> float | None:
    """The run's length in tokens where it is known before the batch (None for a step count):
    what its default batch is sized for. ``tokens_per_s()``: the run's speed (wall-clock budgets)."""
    if d.unit == "tok":
        return d.value
    if d.unit == "sp":
        return d.value * ctx
    if d.unit == "ep":
        return d.value * samples_per_epoch * ctx if samples_per_epoch else None
    if d.unit == "flop":
        return d.value / mfu_flops_per_token(model, ctx, lora)
    if d.unit == "s":
        return d.value * tokens_per_s()
    return None


def group_size(cfg: RunConfig) -> int:
    """Completions sampled per prompt (task_type rl: ``rl.group_size``); 1 for every other task."""
    return cfg.rl.group_size if cfg.task_type == RL_TASK else 1


def batch_samples(parameters, model: ModelConfig, ctx: int, tokens: float | None) -> int:
    """``parameters.global_batch_size`` in samples of ``ctx`` tokens: as given (samples, or tokens
    rounded to whole samples), else the default for ``model`` and a run of ``tokens`` tokens."""
    global_batch_size = parameters.global_batch_size
    if isinstance(global_batch_size, int):
        return int(global_batch_size)
    if global_batch_size is None:
        return max(1, round(default_batch_tokens(param_counts(model)["non_embedding"], tokens) / ctx))
    d = parse_duration(global_batch_size)
    return max(1, round(d.value / ctx)) if d.unit == "tok" else max(1, int(d.value))


def global_batch(cfg: RunConfig, model: ModelConfig, ctx: int, replicas: int, tokens: float | None) -> int:
    """The global batch in samples (`batch_samples`; task_type rl: prompts, RL_PROMPTS_PER_STEP by
    default); a batch in tokens or the default rounded up so every replica gets the same share."""
    given = cfg.parameters.global_batch_size
    if isinstance(given, int):
        return given  # as given: `plan.checks.check_batch_split` refuses one that does not split
    # (task_type rl: the config allows no batch in tokens)
    gbs = RL_PROMPTS_PER_STEP if cfg.task_type == RL_TASK else batch_samples(cfg.parameters, model, ctx, tokens)
    return replicas * max(1, math.ceil(gbs / replicas))


def batch_change(cfg: RunConfig, model: ModelConfig, ctx: int, replicas: int, tokens: float | None) -> str | None:
    """The line naming how the planned batch differs from the tokens per step asked for (a batch in
    tokens, or the default rule's), and why; None where it is as asked (a batch in samples is taken
    as given)."""
    p = cfg.parameters
    if isinstance(p.global_batch_size, int):
        return None
    if cfg.task_type == RL_TASK:  # prompts, not tokens
        gbs = global_batch(cfg, model, ctx, replicas, tokens)
        return None if gbs == RL_PROMPTS_PER_STEP else (
            f"batch raised to {gbs:,} prompts per step from the default {RL_PROMPTS_PER_STEP:,}: the same whole number "
            f"for each of the {replicas:,} data-parallel replicas")
    if p.global_batch_size is None:
        non_embedding = param_counts(model)["non_embedding"]
        asked = default_batch_tokens(non_embedding, tokens)
        what = f"the default rule ({default_batch_rule(non_embedding, tokens)})"
    else:
        d = parse_duration(p.global_batch_size)
        asked, what = (d.value if d.unit == "tok" else max(1, int(d.value)) * ctx), "parameters.global_batch_size"
    gbs, samples = global_batch(cfg, model, ctx, replicas, tokens), batch_samples(p, model, ctx, tokens)
    if gbs * ctx == asked:
        return None
    how = [f"{samples:,} whole sample(s) of {ctx:,}"]
    if gbs != samples:
        how.append(f"{'raised' if gbs > samples else 'rounded'} to {gbs:,}: the same whole number for each of the "
                   f"{replicas:,} data-parallel replicas" + (", at least one" if samples < replicas else ""))
    fewer = ("; fewer tokens per step need fewer replicas (compute.context_parallel, fewer ranks) or a shorter "
             "context") if gbs > samples and samples < replicas else ""
    verb = "raised" if gbs * ctx > asked else "lowered"
    return (f"batch {verb} to {human(gbs * ctx)} tokens per step ({gbs:,} × {ctx:,}) from the {human(asked)} of "
            f"{what}: " + ", ".join(how) + fewer)


def probe_micro_batch(gbs: int, replicas: int, device: str) -> int:
    """The micro-batch a shape is run at before its plan (on a CPU: the one its plan takes)."""
    return micro_batch_for(max(1, gbs // replicas), CPU_MICRO_BATCH if device == "cpu" else PROBE_MICRO_BATCH)


def assumed_tokens_per_s(model: ModelConfig, ctx: int, machine: Machine, precision: str, lora=None) -> float:
    """Training tokens/s of the whole run modelled from FLOPs: the machine's assumed MFU of its
    devices' peak (what sizes a default batch; see the module docstring)."""
    return tokens_per_s_at(machine.assumed_mfu, mfu_flops_per_token(model, ctx, lora), machine.compute_devices,
                           peak_flops(machine.spec, mfu_basis(precision)))


@dataclass(frozen=True)
class Rate:
    """A run's expected speed and where the number comes from."""

    tokens_per_s: float  # all ranks
    fastest_tokens_per_s: float  # a measurement, else the devices' full peak: no step can be quicker
    source: str  # said next to the time it gives


def expected_rate(cfg: RunConfig, ctx: int, micro: int, machine: Machine, precision: str) -> Rate:
    """This machine's cached measurement of the run's shape (`train.throughput`: `model: auto`
    times its shapes), else FLOPs at the machine's assumed MFU of its peak — which the source says,
    and on a CPU that it reaches far less (timing a shape before every plan would cost a dry run
    seconds to minutes)."""
    measured = None
    if cfg.model.vocab_size:
        measured = machine.probe.tokens_per_s(cfg.model, ctx, micro, precision=precision,
                                              optimizer=plan_optimizer(cfg), measure=False)
    if measured:
        rate = measured * machine.compute_devices
        return Rate(rate, rate, "measured on this machine")
    assumed = assumed_tokens_per_s(cfg.model, ctx, machine, precision, cfg.lora)
    cpu = "; a CPU reaches far less" if machine.device == "cpu" else ""
    return Rate(assumed, assumed / machine.assumed_mfu,
                f"assumed {machine.assumed_mfu:.0%} of the peak{cpu}, nothing measured here")
