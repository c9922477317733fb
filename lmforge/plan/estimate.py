"""A training plan: parameters, FLOPs, tokens, time, cost and memory, as one dict.

`estimate_run` computes every number (JSON-ready), `format_plan` renders it as a table,
`check_fits` turns a plan that cannot run into a one-line UserError. Used by
`lmforge estimate` and `lmforge train --dry-run`.
"""

from __future__ import annotations

import io
from dataclasses import KW_ONLY, dataclass

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.comm import moe_traffic
from lmforge.plan.context import context_plan
from lmforge.plan.flops import DEFAULT_VOCAB, flops_per_token, param_counts
from lmforge.plan.hardware import GPUSpec, get_gpu_type, mfu_basis, peak_flops
from lmforge.plan.memory import REPLICATED, memory_plan
from lmforge.plan.micro_batch import Choice, checkpointing_label, choose

CHINCHILLA_TOKENS_PER_PARAM = 20
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
    each row is split over (activations per GPU), and the plan's ``context`` says which
    context-parallel degree and checkpointing mode the length needs (`estimate.context`);
    ``data_parallel``: how the GPUs share the model (fsdp, hsdp: sharded within a node, ddp/none:
    replicated), which the memory verdict is for. A
    resolved run's plan gives them all (`resolve.plan.estimate_inputs`); `lmforge estimate` its flags.
    """

    model: ModelConfig | int | float
    tokens: float | None = None
    gpus: int = 1
    nodes: int = 1
    gpu_type: str = "h100-sxm"
    mfu: float = 0.4
    price: float | None = None
    seq_len: int | None = None
    _: KW_ONLY
    active_params: float | None = None
    vocab_size: int | None = None
    precision: str = "bf16"
    micro_batch: int | str | None = None  # "auto": what `micro_batch_size: auto` chooses (modelled)
    activation_checkpointing: bool | str | int | None = None
    spec: GPUSpec | None = None
    expert_parallel: int = 1
    grad_accum: int = 1
    context_parallel: int = 1
    data_parallel: str = "fsdp"


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
    return None, counts, x.seq_len or DEFAULT_SEQ_LEN, per_token, f"{_count(total)} parameters (nominal)", notes


def estimate_run(x: EstimateInputs) -> dict:
    """Every planning number for training ``x.model`` on ``x.tokens`` tokens (JSON-ready).
    Raises UserError on bad input."""
    _check_inputs(x)
    spec = x.spec or get_gpu_type(x.gpu_type)
    cfg, counts, seq_len, per_token, name, notes = _model_side(x)
    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * counts["total"]
    tokens, tokens_source = x.tokens, "given"
    if tokens is None:
        tokens, tokens_source = chinchilla, f"Chinchilla-optimal ({CHINCHILLA_TOKENS_PER_PARAM} × parameters)"
    n = x.gpus * x.nodes
    _check_expert_parallel(x.expert_parallel, cfg, n)
    _check_context_parallel(x.context_parallel, n, seq_len)
    peak = peak_flops(spec, x.precision)
    training_flops = per_token["dense"] * tokens
    attention_flops = per_token["attention"] * tokens
    # MFU is on the standard basis (6·N_active + attention), as the trainer logs it.
    seconds = (training_flops + attention_flops) / (x.mfu * peak * n)
    gpu_hours = seconds * n / 3600
    choice = _auto_micro_batch(x, cfg, seq_len, spec, n) if x.micro_batch == "auto" else None
    micro_batch, checkpointing = (choice.micro_batch, choice.checkpointing) if choice else \
        (x.micro_batch, x.activation_checkpointing)
    memory = memory_plan(counts["total"], cfg, seq_len, n, spec.memory_bytes, micro_batch=micro_batch,
                         activation_checkpointing=checkpointing, expert_parallel=x.expert_parallel,
                         context_parallel=x.context_parallel, data_parallel=x.data_parallel, shard_devices=x.gpus)
    context = None if cfg is None else context_plan(cfg, seq_len, n, spec.memory_bytes, micro_batch=micro_batch or 1,
                                                    expert_parallel=x.expert_parallel)
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
                    "peak_flops_per_gpu": peak, "peak_flops": peak * n},
        "time": {
            "mfu": x.mfu, "seconds": seconds, "hours": seconds / 3600, "days": seconds / DAY,
            "days_at_100pct_mfu": seconds * x.mfu / DAY, "gpu_hours": gpu_hours,
            "tokens_per_second": tokens / seconds, "tokens_per_second_per_gpu": tokens / seconds / n,
        },
        "cost": {"price_per_gpu_hour": x.price, "total": gpu_hours * x.price if x.price is not None else None},
        "memory": memory,
        "micro_batch_choice": choice.reason if choice else None,
        "context": context,
        "moe_traffic": _moe_traffic(cfg, memory, seq_len, x, n),
        "notes": notes,
    }


def _auto_micro_batch(x: EstimateInputs, cfg: ModelConfig | None, seq_len: int, spec: GPUSpec,
                      n: int) -> Choice:
    """--micro-batch auto: the micro-batch and checkpointing mode a run would choose here (modelled)."""
    if cfg is None:
        raise UserError("--micro-batch auto: needs a model shape (--model), not a nominal --params")
    return choose(cfg, seq_len, n_devices=n if x.data_parallel in ("fsdp", "hsdp") else 1,  # ddp: whole states
                  gpu_memory=spec.memory_bytes, peak_flops=peak_flops(spec, mfu_basis(x.precision)),
                  where=f"{n} × {spec.name}",
                  checkpointing="auto" if x.activation_checkpointing is None else x.activation_checkpointing,
                  expert_parallel=x.expert_parallel, ddp_ranks=n if x.data_parallel == "ddp" else 1)


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


def _check_expert_parallel(ep: int, cfg: ModelConfig | None, n_devices: int) -> None:
    if ep == 1:
        return
    if ep < 1:
        raise UserError(f"--expert-parallel: expected a number >= 1, got {ep}")
    if cfg is None or not cfg.is_moe:
        raise UserError(f"--expert-parallel: {ep} needs a mixture-of-experts model (--model with n_experts > 0)")
    if cfg.n_experts % ep:
        raise UserError(f"--expert-parallel: {ep} does not divide the model's {cfg.n_experts} experts")
    if n_devices % ep:
        raise UserError(f"--expert-parallel: {ep} does not divide the {n_devices} GPUs")


def _check_context_parallel(cp: int, n_devices: int, seq_len: int) -> None:
    if cp == 1:
        return
    if cp < 1:
        raise UserError(f"--context-parallel: expected a number >= 1, got {cp}")
    if n_devices % cp:
        raise UserError(f"--context-parallel: {cp} does not divide the {n_devices} GPUs")
    if seq_len % (2 * cp):
        raise UserError(f"--context-parallel: {cp} does not divide --seq-len {seq_len} into {2 * cp} equal chunks "
                        f"(2 per GPU); expected a multiple of {2 * cp}")


def check_fits(plan: dict) -> None:
    """Raise a one-line UserError, with the numbers, when the plan cannot run at all."""
    mem, cluster = plan["memory"], plan["cluster"]
    if mem["fits"]:
        return
    where = f"{cluster['gpus']} × {cluster['gpu_type']} under {mem['data_parallel']}"
    usable = _bytes(mem["usable_bytes"])
    states = _bytes(mem["states_bytes_per_gpu"])
    if mem["data_parallel"] in REPLICATED:  # more GPUs of the same kind do not help: shard instead
        more = "compute.data_parallel fsdp to shard the model states (--data-parallel fsdp for an estimate)"
    else:
        more = f"at least {mem['min_gpus']} GPUs" if mem["min_gpus"] else "a shorter --seq-len"
    if mem["activation_bytes_per_sample"] is None:
        raise UserError(f"model does not fit on {where}: model states need {states} per GPU of "
                        f"{usable} usable; use {more}")
    act = mem["activation_bytes_per_sample"]
    mb = mem["micro_batch"] or 1
    with_ac = " with activation checkpointing" if mem["activation_checkpointing"] else ""
    top = mem["max_micro_batch"]
    if top["ac"] >= 1:  # only the chosen micro-batch is too large
        hint = (f"use a micro-batch of at most {top['no_ac']} ({top['ac']} with activation checkpointing)"
                if top["no_ac"] else f"use a micro-batch of at most {top['ac']} with activation checkpointing")
    else:
        hint = ("" if mem["activation_checkpointing"] else "enable activation checkpointing and ") + f"use {more}"
    raise UserError(
        f"model does not fit on {where} at micro-batch {mb}, seq {mem['seq_len']}: "
        f"needs {_bytes(mem['total_bytes_per_gpu'])} per GPU{with_ac} (states {states}, {_unsharded(mem)} "
        f"{_bytes(mem['gathered_bytes_per_gpu'])}, activations {_bytes(act['no_ac'])} per sequence, "
        f"{_bytes(act['ac'])} with checkpointing) of {usable} usable; {hint}"
    )


def _unsharded(mem: dict) -> str:
    """What the memory beside the model states is, by data-parallel mode."""
    return {"ddp": "gradient buckets", "none": "unsharded"}.get(mem["data_parallel"], "gathered")


def _states_where(mem: dict) -> str:
    dp, shards = mem["data_parallel"], mem["shards"]
    if dp in REPLICATED:
        return f"whole on each GPU: {dp}"
    return f"over {shards} GPUs: {dp}" + (" within a node" if dp == "hsdp" else "")


def _count(x: float | None) -> str:
    if x is None:
        return "—"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


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
    """The context plan in one cell: the pair that fits first and the other modes at its degree."""
    choice = ctx["choice"]
    where = f"{ctx['seq_len']} tokens per row (micro-batch {ctx['micro_batch']})"
    if choice is None:
        more = f"at least {ctx['min_gpus']} GPUs" if ctx["min_gpus"] else "more GPUs"
        return f"{where}: no context-parallel degree or checkpointing fits on {ctx['gpus']} GPU(s); needs {more}"
    cp = choice["context_parallel"]
    modes = ", ".join(f"{o['checkpointing']} {_bytes(o['bytes_per_gpu'])}" for o in ctx["options"]
                      if o["context_parallel"] == cp)
    return (f"{where}: context_parallel {cp} with {choice['checkpointing']} activation checkpointing "
            f"({_bytes(choice['bytes_per_gpu'])} per GPU; at CP {cp}: {modes})")


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
        ("parameters", f"{_count(p['total'])} total, {_count(p['active'])} active"
                       + (f" ({_count(p['embedding'])} embedding, {_count(p['non_embedding'])} non-embedding)"
                          if p["embedding"] is not None else "")),
        ("tokens", f"{_count(t['tokens'])} ({t['source']}; {t['tokens_per_param']:.1f} per parameter, "
                   f"Chinchilla {_count(t['chinchilla_tokens'])})"),
        ("FLOPs", f"{f['training']:.3g} (6·N_active·D) + attention {f['attention']:.3g} "
                  f"= {f['total']:.3g}"),
        ("cluster", f"{c['gpus']} × {c['gpu_type']} ({c['nodes']} node(s)), {c['precision']} peak "
                    f"{c['peak_flops_per_gpu'] / 1e12:.4g} TFLOP/s per device"),
        ("time", f"{_duration(tm['seconds'])} at {tm['mfu']:.1%} MFU "
                 f"({tm['days_at_100pct_mfu']:.2f} days at 100%); {tm['tokens_per_second']:.3g} tokens/s"),
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
                                    f"({_bytes(act['ac'])} with activation checkpointing); max micro-batch "
                                    f"{m['max_micro_batch']['no_ac']} ({m['max_micro_batch']['ac']} with)"))
    moe = plan.get("moe_traffic")
    if moe is not None:
        ep, no = moe["with_ep"], moe["without_ep"]
        per = (f"per GPU and step ({moe['grad_accum']} micro-batch(es) of {moe['micro_batch']} × {m['seq_len']} "
               "tokens)")
        without = (f"expert all-gather {_bytes(no['expert_all_gather_bytes'])}, reduce-scatter "
                   f"{_bytes(no['expert_reduce_scatter_bytes'])}")
        if ep["expert_parallel"] > 1:
            rows.append(("MoE traffic", f"expert parallel {ep['expert_parallel']}: all-to-all "
                                        f"{_bytes(ep['all_to_all_bytes'])}, expert all-gather "
                                        f"{_bytes(ep['expert_all_gather_bytes'])}, reduce-scatter "
                                        f"{_bytes(ep['expert_reduce_scatter_bytes'])} {per}"))
            rows.append(("", f"without expert parallelism: {without}"))
        else:
            rows.append(("MoE traffic", f"{without} {per}; --expert-parallel N trades them for an all-to-all "
                                        "of the routed tokens"))
    if plan.get("context") is not None:
        rows.append(("long context", _context_text(plan["context"])))
    verdict = ("fits" if m["fits"] else "DOES NOT FIT") + f" under {m['data_parallel']}"
    if plan.get("micro_batch_choice"):
        verdict += f"; micro-batch {m['micro_batch']} with {checkpointing_label(m['activation_checkpointing'])} (auto)"
    elif m["suggested_micro_batch"]:
        verdict += (f"; suggested micro-batch {m['suggested_micro_batch']}"
                    f"{' with activation checkpointing' if m['activation_checkpointing'] else ''}")
    rows.append(("fits", f"{verdict}; total {_bytes(m['total_bytes_per_gpu'])} per GPU"))
    for key, value in rows:
        table.add_row(key, value)
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, force_terminal=False).print(table)
    text = "\n".join(line.rstrip() for line in buf.getvalue().strip("\n").splitlines()) + "\n"
    if plan.get("micro_batch_choice"):
        text += plan["micro_batch_choice"] + "\n"
    for note in plan["notes"]:
        text += f"note: {note}\n"
    return text

