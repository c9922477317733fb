"""Turn a run config plus facts about its data and machine into concrete numbers: the plan.

Everything the trainer needs that the user may leave unset — learning rate, batch sizes,
steps, warmup, intervals, precision, micro-batch and activation checkpointing — and the memory
verdict are decided here, once, and written back into the resolved config that is printed by
``--dry-run`` and saved with every checkpoint. Every command plans through `make_plan` (by way of
`resolve`): `train` on every rank, preflight, `--dry-run`, `lmforge estimate` (whose table is a
view of the plan, `plan.estimate.plan_view`) and the report (which reads the view the run saved).
No torch: the machine comes as a `plan.machine.Machine` (described, or measured by the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config.defaults import MAX_WARMUP_STEPS, WARMUP_FRACTION, micro_batch_for, task_learning_rate
from lmforge.config.durations import Duration
from lmforge.config.schema import FINETUNE_TASKS, RunConfig, phase_end
from lmforge.errors import UserError
from lmforge.frozen import freeze
from lmforge.plan.batch import (CPU_MICRO_BATCH, assumed_tokens_per_s, batch_change, expected_rate, global_batch,
                                group_size, plan_optimizer, plan_precision, run_tokens, training_context)
from lmforge.plan.comm import OVERLAP, Collective, exposed_seconds, step_collectives
from lmforge.plan.checks import (check_batch_split, check_context, check_context_parallel, check_mesh, check_rl,
                                 replicas)
from lmforge.plan.evaluation import EvalPlan, plan_evaluation
from lmforge.plan.fit import KEYS, Remedy, does_not_fit_line, host_line, host_verdict, remedy
from lmforge.plan.flops import flops_per_token, lora_adapter_params, mfu_flops_per_token, param_counts
from lmforge.plan.goodput import GoodputPlan, plan_goodput
from lmforge.plan.hardware import GPUSpec, mfu_basis, peak_flops
from lmforge.plan.machine import Machine
from lmforge.plan.layout import SHARDED, Layout, Sharding, shard_group
from lmforge.plan.activations import OFFLOAD_KEY, activation_policy, canonical_checkpointing, canonical_compression
from lmforge.plan.memory import data_parallel_mode, memory_plan
from lmforge.plan.micro_batch import candidates, choose, smallest
from lmforge.plan.schedule import Schedule


@dataclass(frozen=True)
class TrainPlan:
    context_length: int
    layout: Layout  # the ranks and the batch split: what the runtime reads (never `compute.*`)
    total_steps: int | None  # None: wall-clock bounded
    time_limit_s: float | None
    warmup_steps: int  # the warmup in steps (estimated from step_time_s when it is given in seconds)
    learning_rate: float
    eval_interval: int
    eval_batches: int  # held-out micro-batches per rank and evaluation (eval.max_batches)
    save_interval: int
    icl_interval: int | None
    precision: str  # "bf16" | "fp32" | "fp8"
    params: dict
    flops_per_token: float  # the MFU basis: 6·N_active + 12·L·H·Dh·T (plan.flops.mfu_flops_per_token)
    schedule: Schedule  # the LR shape, in the run's own unit (steps, or seconds of training)
    step_time_s: float  # expected seconds per optimizer step: measured on this machine, else estimated
    phase_steps: list[int] | None = None  # curriculum: the optimizer step at which each phase but the last ends
    model_flops_per_token: float = 0.0  # the dense term alone: 6·N_active (LoRA: 4·N_active + 6·N_adapters)
    activation_checkpointing: bool | str | int | dict = False  # the mode `parallelize` applies (`auto` resolved)
    activation_compression: str | dict = "off"  # what the blocks' saved tensors are stored in (`auto` resolved)
    activation_offload: bool = False  # whether they wait in host memory (`auto` resolved)
    micro_batch_reason: str | None = None  # the line saying how micro-batch and checkpointing were chosen
    optimizer: str = "adamw"  # "adamw" | "muon": parameters.optimizer with auto resolved
    spec: GPUSpec | None = None  # one device's peak FLOP/s and memory
    memory: dict | None = None  # the memory verdict (`plan.memory.memory_plan`; on a CPU `fits` is `fit.host_verdict`'s)
    remedy: Remedy | None = None  # what makes a plan that does not fit fit
    tokens_per_s: float = 0.0  # expected training tokens/s of the whole run
    rate_source: str = ""  # where that rate comes from (measured here, or assumed; with what communication adds)
    communication: StepCommunication | None = None  # a step's collectives and the time they add to it
    notes: tuple[str, ...] = ()  # what the run says about its plan at its start (RoPE scaling, ...)
    evaluation: EvalPlan | None = None  # how often, on how much, and what it costs (`plan.evaluation`)
    goodput: GoodputPlan | None = None  # expected interruptions, checkpoint cost, the optimal interval (`plan.goodput`)
    local_interval: int | None = None  # steps between checkpoints of the local tier (`local_checkpoints`), if any

    # The layout's numbers under the names the views use (one source: `layout`).
    global_batch = property(lambda self: self.layout.global_batch)  # samples per optimizer step, all ranks
    micro_batch = property(lambda self: self.layout.micro_batch)  # samples per forward pass, per rank
    grad_accum = property(lambda self: self.layout.grad_accum)
    replicas = property(lambda self: self.layout.replicas)  # the ranks the global batch is split over
    ranks = property(lambda self: self.layout.ranks)
    device = property(lambda self: self.layout.device)  # what the plan was made for: "cpu" | "cuda"
    context_parallel = property(lambda self: self.layout.context_parallel)
    sharding = property(lambda self: self.layout.sharding)  # how the devices hold the model states

    def __post_init__(self):  # deep-frozen: no view or rank can change what every other one reads
        for name in ("params", "memory", "phase_steps", "notes", "activation_checkpointing", "activation_compression"):
            object.__setattr__(self, name, freeze(getattr(self, name)))

    @property
    def tokens_per_step(self) -> int:
        """The rows of a step at the context length (task_type rl: every completion's row)."""
        return self.layout.sequences * self.context_length

    @property
    def total_tokens(self) -> int | None:
        return None if self.total_steps is None else self.total_steps * self.tokens_per_step

    @property
    def fits(self) -> bool:
        return self.memory is None or bool(self.memory["fits"])


class NotKnownYet(UserError):
    """What the plan needs is known only once the data is prepared (an epoch of raw text)."""


class DoesNotFit(UserError):
    """A plan made in full but refused: it does not fit in memory. ``plan`` and ``config`` are what
    `lmforge estimate` shows before the line; ``text(names)`` the line in other words (its flags)."""

    def __init__(self, plan: TrainPlan, config: RunConfig, where: str):
        self.plan, self.config, self.where = plan, config, where
        super().__init__(self.text())

    def text(self, names: dict = KEYS) -> str:
        p = self.plan
        if p.device == "cpu":
            return host_line(p.params["total"], p.memory["host"], p.sharding.data_parallel in SHARDED)
        return does_not_fit_line(self.config.model, p.memory, self.where, p.remedy, names)


def _steps(d: Duration, what: str, *, gbs: int, ctx: int, samples_per_epoch: int | None,
           flops_per_token: float = 0.0, rows: int | None = None) -> int | None:
    """A duration in optimizer steps (None for wall-clock durations). ``rows``: the rows of a step
    (task_type rl: its completions; default ``gbs``), which tokens and FLOPs count."""
    rows = rows or gbs
    if d.unit == "ba":
        return max(1, math.ceil(d.value))
    if d.unit == "tok":
        return max(1, math.ceil(d.value / (rows * ctx)))
    if d.unit == "flop":
        return max(1, math.ceil(d.value / (flops_per_token * rows * ctx)))
    if d.unit == "sp":
        return max(1, math.ceil(d.value / gbs))
    if d.unit == "ep":
        if not samples_per_epoch:
            raise NotKnownYet(f"{what}: epochs need the dataset size, which is not known here")
        return max(1, math.ceil(d.value * samples_per_epoch / gbs))
    if d.unit == "s":
        return None
    raise UserError(f"{what}: unsupported unit {d.unit!r}")


def run_sharding(cfg: RunConfig, machine: Machine) -> Sharding:
    """How the run's devices hold its model states (HSDP's shard group: `compute.shard_size`, else a node's)."""
    c = cfg.compute
    return Sharding(c.data_parallel, machine.world_size, shard_group(c.data_parallel, machine.world_size, c.nodes,
                                                                     c.shard_size), c.expert_parallel)


def run_layout(cfg: RunConfig, machine: Machine, *, global_batch: int, micro_batch: int, precision: str) -> Layout:
    """The run's one layout, from the checked mesh and batch split: what the runtime reads."""
    c, sharding = cfg.compute, run_sharding(cfg, machine)
    return Layout(ranks=machine.world_size, nodes=c.nodes, data_parallel=c.data_parallel,
                  shard_group=sharding.shards, context_parallel=c.context_parallel, expert_parallel=c.expert_parallel,
                  global_batch=global_batch, micro_batch=micro_batch, group_size=group_size(cfg), device=machine.device,
                  peak_flops=peak_flops(machine.spec, mfu_basis(precision)))


def make_plan(cfg: RunConfig, machine: Machine, *, samples_per_epoch: int | None,
              data_seq_len: int | None) -> TrainPlan:
    """Fill every default; raises UserError for impossible combinations (DoesNotFit, with the plan,
    for one that does not fit in memory)."""
    ctx = training_context(cfg.parameters.context_length, cfg.model.max_seq_len, data_seq_len)
    cfg = with_data_parallel(cfg, machine, ctx)
    p, c = cfg.parameters, cfg.compute
    check_mesh(c, machine.world_size, c.nodes, n_experts=cfg.model.n_experts)
    reps = replicas(machine.world_size, c.context_parallel)
    counts = param_counts(cfg.model)
    optimizer = plan_optimizer(cfg)
    check_context(ctx, data_seq_len)
    check_rl(cfg, ctx, machine.device)
    check_context_parallel(c.context_parallel, ctx, cfg.model, device_type=machine.device,
                           packed_rows=p.document_masking or cfg.task_type in FINETUNE_TASKS)
    precision = plan_precision(cfg, machine)
    check_activations(cfg, machine)
    fpt = mfu_flops_per_token(cfg.model, ctx, cfg.lora)
    tokens = run_tokens(cfg.training_duration, cfg.model, ctx, lora=cfg.lora, samples_per_epoch=samples_per_epoch,
                        tokens_per_s=lambda: assumed_tokens_per_s(cfg.model, ctx, machine, precision, cfg.lora))
    gbs = global_batch(cfg, cfg.model, ctx, reps, tokens)
    batch_line = batch_change(cfg, cfg.model, ctx, reps, tokens)
    choice = micro_batch_and_checkpointing(cfg, ctx, gbs, machine, precision)
    group = group_size(cfg)
    check_batch_split(gbs, choice.micro_batch, machine.world_size, c.context_parallel, group)
    layout = run_layout(cfg, machine, global_batch=gbs, micro_batch=choice.micro_batch, precision=precision)

    def steps(d: Duration, what: str) -> int | None:
        return _steps(d, what, gbs=gbs, ctx=ctx, samples_per_epoch=samples_per_epoch, flops_per_token=fpt,
                      rows=gbs * group)

    total = steps(cfg.training_duration, "training_duration")
    time_limit = cfg.training_duration.value if cfg.training_duration.unit == "s" else None
    rate = expected_rate(cfg, ctx, choice.micro_batch, machine, precision)
    rows = layout.sequences  # the rows of a step (task_type rl: every completion's)
    comm = step_communication(cfg, machine, layout, ctx=ctx, precision=precision,
                              checkpointing=choice.checkpointing, compute_s=rows * ctx / rate.tokens_per_s)
    step_s = rows * ctx / rate.tokens_per_s + comm.exposed_s
    if time_limit is not None and rows * ctx / rate.fastest_tokens_per_s >= time_limit:
        raise UserError(f"training_duration: {cfg.training_duration} is shorter than one optimizer step of this model "
                        f"and batch here (≈{gbs * group * ctx / rate.fastest_tokens_per_s:.3g}s); expected a longer "
                        "duration or a smaller batch/model")
    nominal = total or max(1, int(time_limit / step_s))  # wall-clock runs: intervals from the expected steps
    evaluation = eval_plan(cfg, nominal, time_limit or nominal * step_s, ctx=ctx, micro=choice.micro_batch,
                           reps=reps, tokens_per_s=rows * ctx / step_s, rate_source=rate.source, steps=steps)
    gp = plan_run_goodput(cfg, machine, counts, optimizer, step_s, total, time_limit, nominal, steps)
    schedule = make_schedule(cfg, total, time_limit, step_s, lambda d: steps(d, "parameters.warmup"))
    warmup = int(schedule.warmup if schedule.warmup_unit == "steps" else math.ceil(schedule.warmup / step_s))
    plan = TrainPlan(
        context_length=ctx, layout=layout,
        total_steps=total, time_limit_s=time_limit,
        warmup_steps=warmup,
        learning_rate=p.learning_rate or task_learning_rate(counts["non_embedding"], cfg.task_type, cfg.lora is not None,
                                                            optimizer),
        optimizer=optimizer,
        eval_interval=evaluation.interval, eval_batches=evaluation.batches,
        save_interval=gp.durable.interval_steps, goodput=gp, local_interval=gp.local.interval_steps if gp.local else None,
        icl_interval=_interval(cfg.eval.icl_interval, "eval.icl_interval", 0, steps) or None,
        precision=precision, params=counts, flops_per_token=fpt, schedule=schedule, step_time_s=step_s,
        phase_steps=curriculum_steps(cfg, total, gbs=gbs, ctx=ctx) if cfg.curriculum else None,
        model_flops_per_token=flops_per_token(cfg.model, ctx, cfg.lora)["dense"],
        activation_checkpointing=choice.checkpointing, activation_compression=choice.compression,
        activation_offload=choice.offload, micro_batch_reason=choice.reason, spec=machine.spec,
        memory=choice.memory, remedy=choice.remedy,
        tokens_per_s=rows * ctx / step_s, rate_source=rate.source + comm.source, communication=comm,
        notes=tuple(plan_notes(cfg, ctx)) + ((batch_line,) if batch_line else ()), evaluation=evaluation)
    if not plan.fits:
        raise DoesNotFit(plan, cfg, machine.where)
    return plan


def plan_run_goodput(cfg: RunConfig, machine: Machine, counts: dict, optimizer: str, step_s: float,
                     total: int | None, time_limit: float | None, nominal: int, steps) -> GoodputPlan:
    """The run's goodput projection and checkpoint intervals: ``save_interval`` (and the local tier's)
    as given, by default ~5 per run, or with `auto` the interval that maximises goodput."""
    g, local = cfg.goodput, cfg.local_checkpoints
    given = None if cfg.save_interval == "auto" else \
        _interval(cfg.save_interval, "save_interval", max(1, min(1000, nominal // 5)), steps)
    local_steps = "none" if local is None else None if local.interval == "auto" else \
        _interval(local.interval, "local_checkpoints.interval", 1, steps)
    trained = counts["total"] if cfg.lora is None else lora_adapter_params(cfg.model, cfg.lora.rank, cfg.lora.targets)
    return plan_goodput(
        devices=machine.world_size, nodes=cfg.compute.nodes, device=machine.device, params=counts["total"],
        trained=trained, optimizer=optimizer, step_s=step_s, run_s=total * step_s if total else time_limit or 0.0,
        total_steps=total, async_checkpoint=cfg.compute.async_checkpoint,
        failures_per_device_hour=g.failures_per_gpu_hour, restart_s=g.restart_s, start_s=g.start_s,
        write_bytes_per_s=g.write_gb_per_s * 1e9 if g.write_gb_per_s else None,
        save_interval=given, local_interval=local_steps,
        save_rule="as set" if cfg.save_interval else "the default: ~5 per run, at most 1000 steps")


def with_data_parallel(cfg: RunConfig, machine: Machine, ctx: int) -> RunConfig:
    """The config with ``compute.data_parallel: auto`` resolved for ``machine`` (`plan.memory.data_parallel_mode`):
    what the plan, its layout and the resolved config then say."""
    c = cfg.compute
    mode = data_parallel_mode(c.data_parallel, param_counts(cfg.model)["total"], cfg.model, ctx,
                              devices=machine.world_size, nodes=c.nodes, gpu=machine.device == "cuda",
                              gpu_memory=machine.memory_bytes, expert_parallel=c.expert_parallel,
                              shard_size=c.shard_size, context_parallel=c.context_parallel)
    if mode == c.data_parallel:
        return cfg
    return cfg.model_copy(update={"compute": c.model_copy(update={"data_parallel": mode})})


def plan_notes(cfg: RunConfig, ctx: int) -> list[str]:
    """What a run says about its plan at its start, beside the micro-batch's reason."""
    rope = cfg.model.rope_scaling
    if rope is None:
        return []
    base = f" of a model trained at {rope.original_max_seq_len} tokens" if rope.original_max_seq_len else ""
    return [f"RoPE scaling: {rope.type} × {rope.factor:g}{base} (model.rope_scaling), training at a context of "
            f"{ctx} tokens"]


def check_activations(cfg: RunConfig, machine: Machine) -> None:
    """The activation settings against the model and the machine (`plan.activations`): a ``layers``
    form past the model's depth, experts checkpointing of a dense model, offload off CUDA — each one
    line naming its key."""
    c = cfg.compute
    activation_policy(False if c.activation_checkpointing == "auto" else c.activation_checkpointing,
                      c.activation_compression, n_layers=cfg.model.n_layers, moe=cfg.model.is_moe)
    if c.activation_offload is True and machine.device != "cuda":
        raise UserError(f"{OFFLOAD_KEY}: true needs CUDA (pinned host memory and a copy stream); this run trains "
                        f"on the {machine.device.upper()}: set it to false")


@dataclass(frozen=True)
class StepCommunication:
    """A step's collectives (`plan.comm`) and the seconds of them compute does not hide."""

    collectives: tuple[Collective, ...] = ()
    compute_s: float = 0.0  # the step's compute, at the plan's rate
    exposed_s: float = 0.0  # added to it

    @property
    def source(self) -> str:
        """What the plan's speed says of it (beside where its compute rate comes from)."""
        if not self.collectives:
            return ""
        return (f", with {self.exposed_s:.3g}s of communication per step not hidden behind compute "
                f"(at most {OVERLAP:.0%} of it overlapped)" if self.exposed_s > 0 else
                ", communication hidden behind compute")


def step_communication(cfg: RunConfig, machine: Machine, layout: Layout, *, ctx: int, precision: str,
                       checkpointing, compute_s: float) -> StepCommunication:
    """The collectives of one step of ``layout`` on ``machine`` (GPUs: a CPU's gloo traffic shares the
    measured rate's cores) and what of them is added to its ``compute_s``."""
    c = cfg.compute
    if machine.device != "cuda" or layout.ranks <= 1:
        return StepCommunication(compute_s=compute_s)
    collectives = tuple(step_collectives(
        cfg.model, layout.sharding, nodes=layout.nodes, micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
        seq_len=ctx, context_parallel=layout.context_parallel, precision=mfu_basis(precision),
        reshard_after_forward=c.reshard_after_forward, full_recompute=checkpointing in (True, "full")))
    return StepCommunication(collectives, compute_s, exposed_seconds(list(collectives), machine.spec, compute_s))


def eval_plan(cfg: RunConfig, nominal: int, run_seconds: float, *, ctx: int, micro: int, reps: int,
              tokens_per_s: float, rate_source: str, steps) -> EvalPlan:
    """`eval.interval` and `eval.max_batches`, those left unset sized to the run (`plan.evaluation`)."""
    e = cfg.eval
    given = None if e.interval is None else _interval(e.interval, "eval.interval", 0, steps)
    if e.data_path:
        sets = 1
    else:  # a fine-tuning run holds out only what eval.data_path gives; pretraining: each dataset's split
        sets = 0 if cfg.task_type in FINETUNE_TASKS else len(cfg.train_data)
    return plan_evaluation(interval=given, batches=e.max_batches, nominal_steps=nominal, run_seconds=run_seconds,
                           eval_sets=sets, micro_batch=micro, context=ctx, replicas=reps, tokens_per_s=tokens_per_s,
                           generated_tokens=len(e.prompts) * e.max_new_tokens, n_layers=cfg.model.n_layers,
                           rate_source=rate_source, timed=cfg.training_duration.unit == "s")


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch and way of keeping activations a plan takes, why, and its memory verdict."""

    micro_batch: int
    checkpointing: object
    reason: str | None
    memory: dict
    remedy: Remedy | None = None
    compression: object = "off"
    offload: bool = False


def micro_batch_and_checkpointing(cfg: RunConfig, ctx: int, gbs: int, machine: Machine,
                                  precision: str) -> MicroBatch:
    """``micro_batch_size: auto`` / ``activation_checkpointing: auto`` on GPUs: the micro-batch and way
    of keeping activations (checkpointing, and compression and offload where set to auto) with the most
    tokens/s that fits (`plan.micro_batch`: memory first, then the machine's probe, or the model
    where nothing is measured); on a CPU the largest divisor of the replica's batch up to
    CPU_MICRO_BATCH, no checkpointing, compression or offload unless set. With the memory verdict of
    what was chosen (`fit_verdict`): a pair set by hand, or auto's least-memory pair where nothing
    fits, may not fit."""
    p, c = cfg.parameters, cfg.compute
    reps, group = replicas(machine.world_size, c.context_parallel), group_size(cfg)
    auto_micro, auto_ac = p.micro_batch_size == "auto", c.activation_checkpointing == "auto"
    if auto_micro:
        check_batch_split(gbs, None, machine.world_size, c.context_parallel, group)
    given = None if auto_micro else int(p.micro_batch_size)
    per_rank = gbs * group // reps  # the rows one replica trains on per step (task_type rl: completions)
    ac_set = canonical_checkpointing(c.activation_checkpointing)
    if machine.device == "cpu" or not (auto_micro or auto_ac):
        micro = micro_batch_for(per_rank, CPU_MICRO_BATCH) if auto_micro else given
        comp = "off" if c.activation_compression == "auto" else canonical_compression(c.activation_compression)
        offload = c.activation_offload is True
        return fit_verdict(cfg, ctx, machine, micro, False if auto_ac else ac_set, None, precision, comp, offload)
    sharding, local_ctx = run_sharding(cfg, machine), ctx // c.context_parallel  # a GPU holds ctx / N of each row
    peak = peak_flops(machine.spec, mfu_basis(precision))
    ways = dict(checkpointing=ac_set, compression=canonical_compression(c.activation_compression)
                if c.activation_compression != "auto" else "auto", offload=c.activation_offload,
                precision=precision)
    kw = dict(sharding=sharding, gpu_memory=machine.memory_bytes, peak_flops=peak, per_rank=per_rank,
              micro_batch=given, **ways)
    if not candidates(cfg.model, local_ctx, **kw):  # nothing fits: the least memory, refused with the remedy
        micro, ac, comp, offload = smallest(cfg.model, local_ctx, given, **ways)
        return fit_verdict(cfg, ctx, machine, micro, ac, None, precision, comp, offload)

    def measure(cand) -> float | None:
        return machine.probe.micro_batch_tokens_per_s(cfg, local_ctx, cand.micro_batch, cand.checkpointing,
                                                      precision=precision, compression=cand.compression,
                                                      offload=cand.offload)

    choice = choose(cfg.model, local_ctx, where=machine.where, context_parallel=c.context_parallel,
                    measure=measure if auto_micro and machine.probe.measures else None,
                    measured_as="measured (a slice of the model, scaled to it)", **kw)
    return fit_verdict(cfg, ctx, machine, choice.micro_batch, choice.checkpointing, choice.reason, precision,
                       choice.compression, choice.offload)


def fit_verdict(cfg: RunConfig, ctx: int, machine: Machine, micro: int, checkpointing, reason: str | None,
                precision: str = "bf16", compression="off", offload: bool = False) -> MicroBatch:
    """The memory verdict of ``micro`` × ``checkpointing`` (with ``compression`` and ``offload``) on
    ``machine`` (the one memory model, `plan.memory`), and the remedy when it does not fit (`plan.fit`)."""
    c = cfg.compute
    sharding, total = run_sharding(cfg, machine), param_counts(cfg.model)["total"]
    memory = memory_plan(total, cfg.model, ctx, sharding, machine.memory_bytes, micro, checkpointing,
                         c.context_parallel, compression=compression, offload=offload, precision=precision,
                         device=machine.device)
    if machine.device == "cpu":  # every rank in one machine's memory: only a sure failure is refused
        host = host_verdict(total, machine.world_size, c.data_parallel in SHARDED, machine.memory_bytes,
                            cfg.lora is not None)
        return MicroBatch(micro, checkpointing, reason, memory | {"fits": host["fits"], "host": host},
                          compression=compression, offload=offload)
    fix = None if memory["fits"] else remedy(
        cfg.model, ctx, sharding, machine.memory_bytes, context_parallel=c.context_parallel,
        checkpointing=checkpointing, micro_batch=micro, auto_checkpointing=c.activation_checkpointing == "auto")
    return MicroBatch(micro, checkpointing, reason, memory, fix, compression, offload)


def _interval(d: Duration | None, what: str, default: int, steps) -> int:
    """An eval/save/ICL interval in steps (``steps``: a duration in this plan's steps)."""
    if d is None:
        return default
    n = steps(d, what)
    if n is None:
        raise UserError(f"{what}: use steps or tokens ('100ba', '1M tok'), not wall-clock time")
    return n


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
    elif p.warmup.value == 0:  # no warmup: the first step at the peak (a duration's steps are ≥ 1 otherwise)
        warmup, warmup_unit = 0.0, "steps"
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
    data["eval"]["max_batches"] = plan.eval_batches
    if plan.icl_interval:
        data["eval"]["icl_interval"] = f"{plan.icl_interval}ba"
    if cfg.save_interval != "auto":  # auto stays auto: the run re-estimates it from what it measures
        data["save_interval"] = f"{plan.save_interval}ba"
    data["compute"].update(activation_checkpointing=plan.activation_checkpointing,
                           activation_compression=plan.activation_compression,
                           activation_offload=plan.activation_offload, data_parallel=plan.layout.data_parallel)
    return RunConfig.model_validate(data)


def _warmup_text(schedule: Schedule) -> str:
    if schedule.warmup_unit == "steps":
        return f"{int(schedule.warmup)}ba"
    return f"{schedule.warmup:.4g}s"


