"""The estimate of a run: parameters, FLOPs, tokens, time, cost and memory, as one dict — a view of
its plan.

`plan_view` turns a resolved run's plan (`plan.run.make_plan`, reached through `resolve`) into the
dict: nothing is decided again, the micro-batch, checkpointing, speed and memory verdict are the
plan's. Every command that shows an estimate shows this view: `lmforge estimate` (every form but a
nominal `--params`, which has no shape to plan), `train --dry-run`, and the run itself, which
saves it for the report (`plan.json`). `estimate_run` computes the dict from plain inputs (the
nominal path; `plan_view` fills its inputs from the plan), `format_plan` renders it as a table,
`check_fits` turns a nominal plan that cannot run into a one-line UserError.
"""

from __future__ import annotations

import io
from dataclasses import KW_ONLY, dataclass, replace

from lmforge.config.counts import human
from lmforge.config.model import ModelConfig
from lmforge.config.schema import ComputeConfig, RunConfig
from lmforge.errors import UserError
from lmforge.plan.activations import option_words
from lmforge.plan.auto import TOKENS_PER_PARAM
from lmforge.plan.checks import check_context_parallel, check_mesh
from lmforge.plan.comm import OVERLAP, moe_traffic
from lmforge.plan.context import checkpointing_label, context_plan, setting
from lmforge.plan.fit import FLAGS, KEYS, remedy
from lmforge.plan.goodput import format_goodput_rows, goodput_view
from lmforge.plan.flops import DEFAULT_VOCAB, flops_per_token, param_counts
from lmforge.plan.hardware import ASSUMED_MFU, GPUSpec, get_gpu_type, mfu_basis, peak_flops, tokens_per_s_at
from lmforge.plan.layout import REPLICATED, Sharding, shard_group
from lmforge.plan.memory import data_parallel_mode, memory_plan
from lmforge.plan.micro_batch import Choice, choose
from lmforge.plan.run import TrainPlan

DEFAULT_SEQ_LEN = 2048
DAY = 86400.0


def _check_positive(value, name: str) -> None:
    if value is not None and not value > 0:
        raise UserError(f"{name}: expected a number > 0, got {value}")


@dataclass(frozen=True)
class EstimateInputs:
    """What an estimate is computed from: a model, the tokens it trains on and the cluster.

    ``model``: a ModelConfig (exact counts) or a nominal parameter count (with ``active_params``
    for MoE). ``tokens`` None = Chinchilla-optimal (20 × params). ``gpus`` per node × ``nodes``
    devices of ``gpu_type`` (or an explicit ``spec``, e.g. the machine a run resolved for).
    ``mfu`` in (0, 1]; ``price`` per GPU-hour; ``seq_len`` defaults to the model's max_seq_len.
    ``expert_parallel`` (MoE): GPUs each layer's experts are split over; ``grad_accum``:
    micro-batches per optimizer step (for the MoE traffic per step); ``context_parallel``: GPUs
    each row is split over (activations per GPU); ``data_parallel``: how the GPUs share the model
    (fsdp, hsdp: sharded within a node, ddp/none: replicated), which the memory verdict is for.
    The keyword-only fields after ``plan`` come from a plan (`plan_view`): its memory verdict,
    speed, batch and what it says, shown as they are.
    """

    model: ModelConfig | int | float
    tokens: float | None = None
    gpus: int = 1
    nodes: int = 1
    gpu_type: str = "h100-sxm"
    mfu: float = ASSUMED_MFU
    price: float | None = None
    seq_len: int | None = None
    _: KW_ONLY
    active_params: float | None = None
    vocab_size: int | None = None
    precision: str = "bf16"
    micro_batch: int | str | None = None  # "auto": what `micro_batch_size: auto` chooses (modelled)
    activation_checkpointing: bool | str | int | dict | None = None
    activation_compression: str | dict = "off"
    activation_offload: bool | str = False
    spec: GPUSpec | None = None
    expert_parallel: int = 1
    grad_accum: int = 1
    context_parallel: int = 1
    data_parallel: str = "auto"  # resolved as `lmforge train` resolves it
    shard_size: int | None = None  # hsdp: GPUs of a shard group (default: a node's)
    # --- from a plan
    memory: dict | None = None  # its memory verdict
    tokens_per_s: float | None = None  # its expected speed, all devices: the time comes from it
    rate_source: str | None = None  # where that speed comes from
    compute_devices: int | None = None  # devices whose peaks add up (CPU ranks share one); default every GPU
    batch: dict | None = None  # its batch split
    micro_batch_reason: str | None = None
    remedy: str | None = None  # what makes a plan that does not fit fit, in the reader's words
    said: tuple[str, ...] = ()  # what the plan says (RoPE scaling, ...)
    communication: dict | None = None  # a step's collectives and the time they add (`communication_view`)
    tokens_source: str | None = None  # where ``tokens`` come from, when not given by hand
    goodput: dict | None = None  # its goodput projection (`plan.goodput.goodput_view`)


def _check_inputs(x: EstimateInputs) -> None:
    if not 0 < x.mfu <= 1:
        raise UserError(f"--mfu: expected a fraction in (0, 1], got {x.mfu}")
    micro = None if x.micro_batch == "auto" else x.micro_batch
    for value, name in ((x.tokens, "--tokens"), (x.gpus, "--gpus"), (x.nodes, "--nodes"),
                        (x.seq_len, "--seq-len"), (micro, "--micro-batch"),
                        (x.vocab_size, "--vocab-size"), (x.active_params, "--active-params")):
        _check_positive(value, name)
    if x.price is not None and x.price < 0:
        raise UserError(f"--price-per-gpu-hour: expected a number >= 0, got {x.price}")


def _model_side(x: EstimateInputs) -> tuple[ModelConfig | None, dict, int, dict, str, list[str]]:
    """(shape or None, parameter counts, sequence length, FLOPs per token, name, notes)."""
    if isinstance(x.model, ModelConfig):
        cfg = x.model
        notes = []
        if x.vocab_size:
            cfg = cfg.model_copy(update={"vocab_size": x.vocab_size})
        elif cfg.vocab_size is None:
            cfg = cfg.model_copy(update={"vocab_size": DEFAULT_VOCAB})
            notes.append(f"vocab_size not set (the tokenizer's): assumed {DEFAULT_VOCAB}; "
                         "use --vocab-size to change")
        if x.active_params:
            raise UserError("--active-params: only with --params; a model shape knows its active parameters")
        seq_len = x.seq_len or cfg.max_seq_len
        return cfg, param_counts(cfg), seq_len, flops_per_token(cfg, seq_len), cfg.label(), notes
    _check_positive(x.model, "--params")
    total = float(x.model)
    active = float(x.active_params or total)
    if active > total:
        raise UserError(f"--active-params: {active:.3g} is more than --params {total:.3g}")
    counts = {"total": total, "active": active, "embedding": None, "non_embedding": None}
    per_token = {"dense": 6.0 * active, "attention": 0.0, "total": 6.0 * active}
    notes = ["nominal --params: no shape, so no attention FLOPs, embedding split or "
             "activation memory; use --model for exact numbers"]
    return None, counts, x.seq_len or DEFAULT_SEQ_LEN, per_token, f"{human(total)} parameters (nominal)", notes


def plan_view(cfg: RunConfig, plan: TrainPlan, *, names: dict = FLAGS) -> dict:
    """The estimate of a resolved run: its plan's numbers (nothing decided again). A wall-clock run's
    tokens are what its expected speed buys. ``names``: how a remedy names its settings."""
    c = cfg.compute
    gpu = plan.device == "cuda"
    tokens = plan.total_tokens or (plan.time_limit_s or 0) * plan.tokens_per_s
    source = f"the run's: {plan.total_steps:,} steps of {plan.tokens_per_step:,} tokens" if plan.total_steps else \
        f"what {cfg.training_duration} buys at the plan's speed"
    return estimate_run(EstimateInputs(
        cfg.model, tokens=tokens, tokens_source=source, gpus=plan.ranks // c.nodes, nodes=c.nodes, price=c.price_per_gpu_hour,
        seq_len=plan.context_length, spec=plan.spec, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
        activation_checkpointing=plan.activation_checkpointing, activation_compression=plan.activation_compression,
        activation_offload=plan.activation_offload, precision=mfu_basis(plan.precision),
        expert_parallel=c.expert_parallel if gpu else 1, context_parallel=c.context_parallel,
        data_parallel=plan.layout.data_parallel, shard_size=plan.sharding.shard_size, memory=plan.memory,
        tokens_per_s=plan.tokens_per_s, rate_source=plan.rate_source, compute_devices=plan.ranks if gpu else 1,
        batch={"global_batch": plan.global_batch, "context_length": plan.context_length,
               "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum, "replicas": plan.replicas,
               "ranks": plan.ranks, "group_size": plan.layout.group_size},
        micro_batch_reason=plan.micro_batch_reason, remedy=plan.remedy.text(names) if plan.remedy else None,
        said=plan.notes + ((plan.evaluation.line,) if plan.evaluation else ()),
        communication=communication_view(plan), goodput=goodput_view(plan.goodput) if plan.goodput else None))


def communication_view(plan: TrainPlan) -> dict | None:
    """A plan's step communication (`plan.run.StepCommunication`) as the view's dict; None without any."""
    comm = plan.communication
    if comm is None or not comm.collectives:
        return None
    spec = plan.spec
    return {"compute_s": comm.compute_s, "exposed_s": comm.exposed_s, "step_s": plan.step_time_s, "overlap": OVERLAP,
            "link_bytes_per_s": spec.link_bytes_per_s, "network_bytes_per_s": spec.network_bytes_per_s,
            "collectives": [{"what": c.what, "bytes": c.bytes, "network": c.network, "hidden": c.hidden,
                             "seconds": c.seconds(spec)} for c in comm.collectives]}


def batch_rows(b: dict) -> str:
    """A plan's global batch in words: samples × tokens (task_type rl: prompts × completions)."""
    group = b.get("group_size", 1)
    return f"{b['global_batch']} × {b['context_length']} tokens" if group == 1 else \
        f"{b['global_batch']} prompts × {group} completions of ≤ {b['context_length']} tokens"


def batch_split(b: dict) -> str:
    return f"micro-batch {b['micro_batch']} × {b['grad_accum']} accumulation × {b['replicas']} replica(s) of " \
           f"{b['ranks']} rank(s)"


def batch_text(b: dict) -> str:
    return f"{batch_rows(b)} = {batch_split(b)}"


def run_record(cfg: RunConfig, plan: TrainPlan) -> dict:
    """What a run saves of its plan for its report (``plan.json``): the headline numbers of its view
    (`plan_view`, named in config keys) and the view itself. The report reads it as it is."""
    view = plan_view(cfg, plan, names=KEYS)
    return {"device": plan.spec.name, "device_description": plan.spec.description, "devices": plan.ranks,
            "precision": plan.precision, "total_steps": plan.total_steps, "total_tokens": plan.total_tokens,
            "tokens_per_step": plan.tokens_per_step, "params_total": plan.params["total"],
            "params_active": plan.params["active"], "price_per_gpu_hour": cfg.compute.price_per_gpu_hour,
            "training_duration": str(cfg.training_duration),
            "estimate": {"mfu": view["time"]["mfu"], "rate_source": view["time"]["rate_source"],
                         "seconds": view["time"]["seconds"], "tokens_per_second": view["time"]["tokens_per_second"],
                         "flops": view["flops"]["total"], "cost": view["cost"]["total"]},
            "view": view}


def estimate_run(x: EstimateInputs) -> dict:
    """Every planning number for training ``x.model`` on ``x.tokens`` tokens (JSON-ready).
    Raises UserError on bad input."""
    _check_inputs(x)
    spec = x.spec or get_gpu_type(x.gpu_type)
    cfg, counts, seq_len, per_token, name, notes = _model_side(x)
    chinchilla = TOKENS_PER_PARAM * counts["total"]
    tokens, tokens_source = x.tokens, x.tokens_source or "given"
    if tokens is None:
        tokens, tokens_source = chinchilla, f"Chinchilla-optimal ({TOKENS_PER_PARAM:g} × parameters)"
    n = x.gpus * x.nodes
    if x.data_parallel == "auto":  # the rule `lmforge train` resolves it by (`plan.memory.data_parallel_mode`)
        x = replace(x, data_parallel=data_parallel_mode(
            "auto", counts["total"], cfg, seq_len, devices=n, nodes=x.nodes, gpu=spec.name != "cpu",
            gpu_memory=spec.memory_bytes, expert_parallel=x.expert_parallel, shard_size=x.shard_size,
            context_parallel=x.context_parallel))
    sharding = Sharding(x.data_parallel, n, shard_group(x.data_parallel, n, x.nodes, x.shard_size), x.expert_parallel)
    if x.memory is None:
        _check_layout(x, cfg, n, seq_len)
    peak = peak_flops(spec, x.precision)
    training_flops, attention_flops = per_token["dense"] * tokens, per_token["attention"] * tokens
    devices = x.compute_devices or n
    # A plan's speed (measured here, or its machine's assumed MFU), else the one at --mfu; MFU is on the
    # standard basis (6·N_active + attention), as the trainer logs it.
    tokens_per_s = x.tokens_per_s or tokens_per_s_at(x.mfu, per_token["total"], devices, peak)
    seconds = tokens / tokens_per_s
    mfu = tokens_per_s * per_token["total"] / (peak * devices)
    gpu_hours = seconds * n / 3600
    choice = _auto_micro_batch(x, cfg, seq_len, spec, sharding) if x.micro_batch == "auto" and x.memory is None \
        else None
    micro_batch, checkpointing, compression, offload = \
        (choice.micro_batch, choice.checkpointing, choice.compression, choice.offload) if choice else \
        (x.micro_batch, x.activation_checkpointing, x.activation_compression, x.activation_offload is True)
    memory = x.memory or memory_plan(counts["total"], cfg, seq_len, sharding, spec.memory_bytes,
                                     micro_batch=micro_batch, activation_checkpointing=checkpointing,
                                     context_parallel=x.context_parallel,
                                     compression="off" if compression == "auto" else compression, offload=offload,
                                     precision=x.precision)
    context = None if cfg is None else context_plan(cfg, seq_len, sharding, spec.memory_bytes,
                                                    micro_batch=micro_batch or 1)
    fix = x.remedy
    if fix is None and cfg is not None and not memory["fits"]:  # the remedy a plan would give (`plan.fit`)
        fix = remedy(cfg, seq_len, sharding, spec.memory_bytes, context_parallel=x.context_parallel,
                     checkpointing=memory["activation_checkpointing"], micro_batch=memory["micro_batch"] or 1,
                     auto_checkpointing=False).text(FLAGS)
    return {
        "model": {"name": name, "shape": cfg.model_dump(exclude_none=True) if cfg else None,
                  "vocab_size": cfg.vocab_size if cfg else None},
        "params": counts,
        "tokens": {"tokens": tokens, "source": tokens_source, "chinchilla_tokens": chinchilla,
                   "tokens_per_param": tokens / counts["total"]},
        "flops": {
            "per_token": per_token, "training": training_flops, "attention": attention_flops,
            "total": training_flops + attention_flops,
            "mfu_basis": "6 × active parameters + 12·L·H·Dh·T attention per token (as logged in training)",
        },
        "cluster": {"gpu_type": spec.name, "description": spec.description, "gpus_per_node": x.gpus,
                    "nodes": x.nodes, "gpus": n, "precision": x.precision,
                    "peak_flops_per_gpu": peak, "peak_flops": peak * devices},
        "time": {
            "mfu": mfu, "rate_source": x.rate_source or "assumed", "seconds": seconds,
            "hours": seconds / 3600, "days": seconds / DAY, "days_at_100pct_mfu": seconds * mfu / DAY,
            "gpu_hours": gpu_hours, "tokens_per_second": tokens / seconds, "tokens_per_second_per_gpu": tokens / seconds / n,
        },
        "cost": {"price_per_gpu_hour": x.price, "total": gpu_hours * x.price if x.price is not None else None},
        "batch": x.batch,
        "memory": memory,
        "remedy": fix,
        "micro_batch_choice": choice.reason if choice else x.micro_batch_reason,
        "context": context,
        "moe_traffic": _moe_traffic(cfg, memory, seq_len, x, n),
        "communication": x.communication,
        "goodput": x.goodput,
        "notes": list(x.said) + notes + ([x.goodput["note"]] if x.goodput and x.goodput.get("note") else []),
    }


def _check_layout(x: EstimateInputs, cfg: ModelConfig | None, n: int, seq_len: int) -> None:
    """The layout's rules (`plan.checks`) for inputs that come without a plan."""
    if x.expert_parallel != 1 and (cfg is None or not cfg.is_moe):
        raise UserError(f"--expert-parallel: {x.expert_parallel} needs a mixture-of-experts model (--model with "
                        "n_experts > 0)")
    if cfg is None:
        return
    compute = ComputeConfig(data_parallel=x.data_parallel, context_parallel=x.context_parallel,
                            expert_parallel=x.expert_parallel, shard_size=x.shard_size)
    check_mesh(compute, n, x.nodes, n_experts=cfg.n_experts)
    check_context_parallel(x.context_parallel, seq_len, cfg, packed_rows=False, device_type="cpu")


def _auto_micro_batch(x: EstimateInputs, cfg: ModelConfig | None, seq_len: int, spec: GPUSpec,
                      sharding: Sharding) -> Choice:
    """--micro-batch auto: the micro-batch and checkpointing mode a run would choose here (modelled)."""
    if cfg is None:
        raise UserError("--micro-batch auto: needs a model shape (--model), not a nominal --params")
    return choose(cfg, seq_len // x.context_parallel, sharding=sharding, gpu_memory=spec.memory_bytes,
                  peak_flops=peak_flops(spec, mfu_basis(x.precision)), where=f"{sharding.devices} × {spec.name}",
                  checkpointing="auto" if x.activation_checkpointing is None else x.activation_checkpointing,
                  compression=x.activation_compression, offload=x.activation_offload, precision=x.precision,
                  context_parallel=x.context_parallel)


def _moe_traffic(cfg: ModelConfig | None, memory: dict, seq_len: int, x: EstimateInputs, n: int) -> dict | None:
    """An MoE model's expert traffic per GPU and step, with and without expert parallelism."""
    if cfg is None or not cfg.is_moe:
        return None
    mb = memory["micro_batch"] or memory["suggested_micro_batch"] or 1
    common = dict(tokens_per_microbatch=mb * seq_len, micro_batches=x.grad_accum, n_devices=n,
                  full_recompute=bool(memory["activation_checkpointing"]))
    return {"micro_batch": mb, "grad_accum": x.grad_accum,
            "with_ep": moe_traffic(cfg, expert_parallel=x.expert_parallel, **common),
            "without_ep": moe_traffic(cfg, expert_parallel=1, **common)}


def check_fits(plan: dict) -> None:
    """Raise a one-line UserError, with the numbers, when an estimate computed without a plan (a
    nominal --params, or direct inputs) cannot run at all."""
    mem, cluster = plan["memory"], plan["cluster"]
    if mem["fits"]:
        return
    where = f"{cluster['gpus']} × {cluster['gpu_type']} under {mem['data_parallel']}"
    states, usable = _bytes(mem["states_bytes_per_gpu"]), _bytes(mem["usable_bytes"])
    if mem["data_parallel"] in REPLICATED and cluster["gpus"] > 1:  # more GPUs of the same kind do not help: shard
        more = "--data-parallel fsdp (compute.data_parallel: fsdp) to shard the model states"
    else:
        more = f"at least {mem['min_gpus']} GPUs" if mem["min_gpus"] else "a shorter --seq-len"
    if mem["activation_bytes_per_sample"] is None:
        raise UserError(f"model does not fit on {where}: model states need {states} per GPU of {usable} usable; "
                        f"use {more}")
    raise UserError(f"model does not fit on {where} at micro-batch {mem['micro_batch'] or 1}, seq {mem['seq_len']}: "
                    f"needs {_bytes(mem['total_bytes_per_gpu'])} per GPU (states {states}) of {usable} usable; "
                    + plan["remedy"])


def _max_micro_text(mem: dict) -> str:
    """The largest micro-batches that fit, with and without activation checkpointing, in words."""
    top = mem["max_micro_batch"]
    if top["ac"] < 1:
        return "no micro-batch fits, not even 1 with activation checkpointing"
    if top["no_ac"] < 1:
        return f"max micro-batch {top['ac']} with activation checkpointing (none fits without)"
    return f"max micro-batch {top['no_ac']} without activation checkpointing, {top['ac']} with"


def _unsharded(mem: dict) -> str:
    """What the memory beside the model states is, by data-parallel mode."""
    return {"ddp": "gradient buckets", "none": "unsharded"}.get(mem["data_parallel"], "gathered")


def _states_where(mem: dict) -> str:
    dp, shards = mem["data_parallel"], mem["shards"]
    if dp in REPLICATED:
        return f"whole on each GPU: {dp}"
    return f"over {shards} GPUs: {dp}" + (" within a shard group" if dp == "hsdp" else "")


def _bytes(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    if seconds >= 2 * DAY:
        return f"{seconds / DAY:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 60:.1f} min"


def _context_text(ctx: dict) -> str:
    """The context plan in one cell: the pair that fits first, in flags, and the other modes at its degree."""
    choice = ctx["choice"]
    where = f"{ctx['seq_len']} tokens per row (micro-batch {ctx['micro_batch']})"
    if choice is None:
        dp = ctx.get("data_parallel", "fsdp")
        if dp in REPLICATED:  # whole model states on each GPU: more GPUs do not help, sharding does
            sharded = ctx.get("sharded_choice")
            if sharded is not None:
                return (f"{where}: no context-parallel degree or checkpointing fits under {dp} (whole model states "
                        f"on each GPU); --data-parallel fsdp fits first with --context-parallel "
                        f"{sharded['context_parallel']} and {checkpointing_label(setting(sharded['checkpointing']))} "
                        f"({_bytes(sharded['bytes_per_gpu'])} per GPU)")
            more = f" on at least {ctx['min_gpus']} GPUs" if ctx["min_gpus"] else " on more GPUs"
            return (f"{where}: no context-parallel degree or checkpointing fits under {dp} (whole model states on "
                    f"each GPU); needs --data-parallel fsdp{more}")
        more = f"at least {ctx['min_gpus']} GPUs" if ctx["min_gpus"] else "more GPUs"
        return f"{where}: no context-parallel degree or checkpointing fits on {ctx['gpus']} GPU(s); needs {more}"
    cp = choice["context_parallel"]
    modes = ", ".join(f"{o['checkpointing']} {_bytes(o['bytes_per_gpu'])}" for o in ctx["options"]
                      if o["context_parallel"] == cp)
    return (f"{where}: fits first with --context-parallel {cp} and {checkpointing_label(setting(choice['checkpointing']))}"
            f" ({_bytes(choice['bytes_per_gpu'])} per GPU; at CP {cp}: {modes})")


def _verdict(plan: dict) -> str:
    """The one verdict: fits (with what), or does not (with what makes it fit)."""
    m = plan["memory"]
    label = option_words(m["activation_checkpointing"], m.get("activation_compression", "off"),
                         m.get("activation_offload", False))
    if "host" in m:  # a CPU: the model states of every rank in this machine's memory
        h = m["host"]
        state = "fits" if m["fits"] else "DOES NOT FIT"
        return (f"{state}: {h['what']} need {_bytes(h['need_bytes'])} of this machine's {_bytes(h['host_bytes'])} "
                f"({plan['batch']['ranks'] if plan.get('batch') else 1} rank(s) under {m['data_parallel']})")
    mb = m["micro_batch"] or m["suggested_micro_batch"]
    if not m["fits"]:
        fix = plan.get("remedy")  # (a nominal count's: `check_fits` says it)
        return (f"DOES NOT FIT under {m['data_parallel']} at micro-batch {mb or 1} with {label}: "
                f"{_bytes(m['total_bytes_per_gpu'])} per GPU of {_bytes(m['usable_bytes'])} usable"
                + (f"; {fix}" if fix else ""))
    how = " (auto)" if plan.get("micro_batch_choice") else ""
    at = f"; micro-batch {mb} with {label}{how}" if mb else ""
    return f"fits under {m['data_parallel']}{at}; total {_bytes(m['total_bytes_per_gpu'])} per GPU"


def format_plan(plan: dict) -> str:
    """The plan as a small plain-text table (rich, no colour codes)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    p, t, f, tm, c, m = (plan[k] for k in ("params", "tokens", "flops", "time", "cluster", "memory"))
    table = Table(box=box.SIMPLE, show_header=False, title=f"Plan: {plan['model']['name']}")
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("parameters", f"{human(p['total'])} total, {human(p['active'])} active"
                       + (f" ({human(p['embedding'])} embedding, {human(p['non_embedding'])} non-embedding)"
                          if p["embedding"] is not None else "")),
        ("tokens", f"{human(t['tokens'])} ({t['source']}; {t['tokens_per_param']:.1f} per parameter, "
                   f"Chinchilla {human(t['chinchilla_tokens'])})"),
        ("FLOPs", f"{f['training']:.3g} (6·N_active·D) + attention {f['attention']:.3g} = {f['total']:.3g}"),
        ("cluster", f"{c['gpus']} × {c['gpu_type']} ({c['nodes']} node(s)), {c['precision']} peak "
                    f"{c['peak_flops_per_gpu'] / 1e12:.4g} TFLOP/s per device"),
    ]
    if plan.get("batch"):
        rows.append(("batch", batch_text(plan["batch"])))
    rows += [
        ("time", f"{_duration(tm['seconds'])} at {tm['mfu']:.1%} MFU, {tm['rate_source']}; "
                 f"{human(tm['tokens_per_second'])} tokens/s ({tm['days_at_100pct_mfu']:.2f} days at 100% MFU)"),
        ("GPU-hours", f"{tm['gpu_hours']:,.0f}"),
        ("cost", f"{plan['cost']['total']:,.0f} at {plan['cost']['price_per_gpu_hour']:g} per GPU-hour"
                 if plan["cost"]["total"] is not None else "— (give --price-per-gpu-hour)"),
        ("memory/GPU", f"model states {_bytes(m['states_bytes_per_gpu'])} (18 B/param {_states_where(m)}), "
                       f"{_unsharded(m)} {_bytes(m['gathered_bytes_per_gpu'])}, "
                       f"loss {_bytes(m['loss_workspace_bytes'])}, "
                       f"usable {_bytes(m['usable_bytes'])} of {_bytes(m['gpu_memory_bytes'])}"),
    ]
    act = m["activation_bytes_per_sample"]
    if act is not None:
        split = f" ({m['seq_len'] // m['context_parallel']} per GPU, context parallel {m['context_parallel']})" \
            if m.get("context_parallel", 1) > 1 else ""
        rows.append(("activations", f"{_bytes(act['no_ac'])} per sequence of {m['seq_len']}{split} "
                                    f"({_bytes(act['ac'])} with activation checkpointing); {_max_micro_text(m)}"))
    rows += _moe_rows(plan.get("moe_traffic"), m["seq_len"])
    rows += _communication_rows(plan.get("communication"))
    if plan.get("context") is not None:
        rows.append(("long context", _context_text(plan["context"])))
    rows.append(("fits", _verdict(plan)))
    if plan.get("goodput"):
        rows += format_goodput_rows(plan["goodput"])
    for key, value in rows:
        table.add_row(key, value)
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, force_terminal=False).print(table)
    text = "\n".join(line.rstrip() for line in buf.getvalue().strip("\n").splitlines()) + "\n"
    text += options_table(m)
    if plan.get("micro_batch_choice"):
        text += plan["micro_batch_choice"] + "\n"
    for note in plan["notes"]:
        text += f"note: {note}\n"
    return text


def options_table(mem: dict) -> str:
    """Each way of keeping activations (`plan.activations.activation_options`) as a small table: its
    activations per sequence and the total per GPU at the plan's micro-batch, and whether it fits."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    options = mem.get("activation_options")
    if not options:
        return ""
    mb = mem["micro_batch"] or mem["suggested_micro_batch"] or 1
    table = Table(box=box.SIMPLE, title=f"Activation memory per GPU (micro-batch {mb} × {mem['seq_len']} tokens)")
    for name, justify in (("activations kept", "left"), ("per sequence", "right"), ("total per GPU", "right"),
                          ("fits", "left")):
        table.add_column(name, justify=justify)
    for words, o in options.items():
        table.add_row(words, _bytes(o["bytes_per_sample"]),
                      _bytes(o["total_bytes_per_gpu"]), ("yes" if o["fits"] else "no") + (" (this run)" if o["chosen"]
                                                                                          else ""))
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().strip("\n").splitlines()) + "\n"


def _communication_rows(comm: dict | None) -> list[tuple[str, str]]:
    """A step's collectives, each with its bytes, link and time, and what of them the step waits for."""
    if comm is None:
        return []
    def link(c: dict) -> str:
        rate = comm["network_bytes_per_s"] if c["network"] else comm["link_bytes_per_s"]
        return f"{'across nodes' if c['network'] else 'within a node'} at {rate / 1e9:g} GB/s"

    parts = "; ".join(f"{c['what']} {_bytes(c['bytes'])} {link(c)}: {c['seconds']:.3g}s"
                      + ("" if c["hidden"] else " (not overlapped)") for c in comm["collectives"])
    return [("communication", f"per GPU and step: {parts}"),
            ("", f"step {comm['step_s']:.3g}s = compute {comm['compute_s']:.3g}s + {comm['exposed_s']:.3g}s of "
                 f"communication not hidden (collectives overlap at most {comm['overlap']:.0%} of the compute; "
                 "an all-to-all none)")]


def _moe_rows(moe: dict | None, seq_len: int) -> list[tuple[str, str]]:
    """An MoE model's expert traffic, with and without expert parallelism."""
    if moe is None:
        return []
    ep, no = moe["with_ep"], moe["without_ep"]
    per = f"per GPU and step ({moe['grad_accum']} micro-batch(es) of {moe['micro_batch']} × {seq_len} tokens)"
    without = (f"expert all-gather {_bytes(no['expert_all_gather_bytes'])}, reduce-scatter "
               f"{_bytes(no['expert_reduce_scatter_bytes'])}")
    if ep["expert_parallel"] > 1:
        return [("MoE traffic", f"expert parallel {ep['expert_parallel']}: all-to-all {_bytes(ep['all_to_all_bytes'])}, "
                                f"expert all-gather {_bytes(ep['expert_all_gather_bytes'])}, reduce-scatter "
                                f"{_bytes(ep['expert_reduce_scatter_bytes'])} {per}"),
                ("", f"without expert parallelism: {without}")]
    return [("MoE traffic", f"{without} {per}; --expert-parallel N trades them for an all-to-all of the routed tokens")]
