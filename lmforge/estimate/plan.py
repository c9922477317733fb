"""A training plan: parameters, FLOPs, tokens, time, cost and memory, as one dict.

`estimate_run` computes every number (JSON-ready), `format_plan` renders it as a table,
`check_fits` turns a plan that cannot run into a one-line UserError. Used by
`lmforge estimate` and `lmforge train --dry-run`.
"""

from __future__ import annotations

import io

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.estimate.comm import moe_traffic
from lmforge.estimate.flops import DEFAULT_VOCAB, flops_per_token, param_counts
from lmforge.estimate.hardware import GPUSpec, get_gpu_type, peak_flops
from lmforge.estimate.memory import REPLICATED, memory_plan

CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_SEQ_LEN = 2048
DAY = 86400.0


def _check_positive(value, name: str) -> None:
    if value is not None and not value > 0:
        raise UserError(f"{name}: expected a number > 0, got {value}")


def estimate_run(
    model: ModelConfig | int | float,
    tokens: float | None = None,
    gpus: int = 1,
    nodes: int = 1,
    gpu_type: str = "h100-sxm",
    mfu: float = 0.4,
    price: float | None = None,
    seq_len: int | None = None,
    *,
    active_params: float | None = None,
    vocab_size: int | None = None,
    precision: str = "bf16",
    micro_batch: int | None = None,
    activation_checkpointing: bool | None = None,
    spec: GPUSpec | None = None,
    expert_parallel: int = 1,
    grad_accum: int = 1,
    data_parallel: str = "fsdp",
) -> dict:
    """Every planning number for training ``model`` on ``tokens`` tokens.

    ``model``: a ModelConfig (exact counts) or a nominal parameter count (with
    ``active_params`` for MoE). ``tokens`` None = Chinchilla-optimal (20 × params).
    ``gpus`` per node × ``nodes`` devices of ``gpu_type`` (or an explicit ``spec``,
    e.g. from `detect_device_spec`). ``mfu`` in (0, 1]; ``price`` per GPU-hour.
    ``seq_len`` defaults to the model's max_seq_len. ``expert_parallel`` (MoE): GPUs each
    layer's experts are split over; ``grad_accum``: micro-batches per optimizer step (for the MoE
    traffic per step); ``data_parallel``: how the GPUs share the model (fsdp, hsdp: sharded within a
    node, ddp/none: replicated), which the memory verdict is for. Raises UserError on bad input.
    """
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu: expected a fraction in (0, 1], got {mfu}")
    for value, name in ((tokens, "--tokens"), (gpus, "--gpus"), (nodes, "--nodes"),
                        (seq_len, "--seq-len"), (micro_batch, "--micro-batch"),
                        (vocab_size, "--vocab-size"), (active_params, "--active-params")):
        _check_positive(value, name)
    if price is not None and price < 0:
        raise UserError(f"--price-per-gpu-hour: expected a number >= 0, got {price}")
    spec = spec or get_gpu_type(gpu_type)
    notes: list[str] = []

    cfg: ModelConfig | None = None
    if isinstance(model, ModelConfig):
        cfg = model
        if vocab_size:
            cfg = cfg.model_copy(update={"vocab_size": vocab_size})
        elif cfg.vocab_size is None:
            cfg = cfg.model_copy(update={"vocab_size": DEFAULT_VOCAB})
            notes.append(f"vocab_size not set (the tokenizer's): assumed {DEFAULT_VOCAB}; "
                         "use --vocab-size to change")
        if active_params:
            raise UserError("--active-params: only with --params; a model shape knows its active parameters")
        counts = param_counts(cfg)
        seq_len = seq_len or cfg.max_seq_len
        per_token = flops_per_token(cfg, seq_len)
        name = cfg.label()
    else:
        _check_positive(model, "--params")
        total = float(model)
        active = float(active_params or total)
        if active > total:
            raise UserError(f"--active-params: {active:.3g} is more than --params {total:.3g}")
        counts = {"total": total, "active": active, "embedding": None, "non_embedding": None}
        seq_len = seq_len or DEFAULT_SEQ_LEN
        per_token = {"dense": 6.0 * active, "attention": 0.0, "total": 6.0 * active}
        name = f"{_count(total)} parameters (nominal)"
        notes.append("nominal --params: no shape, so no attention FLOPs, embedding split or "
                     "activation memory; use --model for exact numbers")

    chinchilla = CHINCHILLA_TOKENS_PER_PARAM * counts["total"]
    tokens_source = "given"
    if tokens is None:
        tokens, tokens_source = chinchilla, f"Chinchilla-optimal ({CHINCHILLA_TOKENS_PER_PARAM} × parameters)"

    n = gpus * nodes
    _check_expert_parallel(expert_parallel, cfg, n)
    peak = peak_flops(spec, precision)
    cluster_peak = peak * n
    training_flops = per_token["dense"] * tokens
    attention_flops = per_token["attention"] * tokens
    # MFU is on the standard basis (6·N_active + attention), as the trainer logs it.
    seconds = (training_flops + attention_flops) / (mfu * cluster_peak)
    gpu_hours = seconds * n / 3600

    memory = memory_plan(counts["total"], cfg, seq_len, n, spec.memory_bytes, micro_batch=micro_batch,
                         activation_checkpointing=activation_checkpointing, expert_parallel=expert_parallel,
                         data_parallel=data_parallel, shard_devices=gpus)
    moe = None
    if cfg is not None and cfg.is_moe:
        mb = memory["micro_batch"] or memory["suggested_micro_batch"] or 1
        common = dict(tokens_per_microbatch=mb * seq_len, micro_batches=grad_accum, n_devices=n,
                      full_recompute=bool(memory["activation_checkpointing"]))
        moe = {"micro_batch": mb, "grad_accum": grad_accum,
               "with_ep": moe_traffic(cfg, expert_parallel=expert_parallel, **common),
               "without_ep": moe_traffic(cfg, expert_parallel=1, **common)}
    return {
        "model": {"name": name, "shape": cfg.model_dump(exclude_none=True) if cfg else None,
                  "vocab_size": cfg.vocab_size if cfg else None},
        "params": counts,
        "tokens": {"tokens": tokens, "source": tokens_source, "chinchilla_tokens": chinchilla,
                   "tokens_per_param": tokens / counts["total"]},
        "flops": {
            "per_token": per_token,
            "training": training_flops,
            "attention": attention_flops,
            "total": training_flops + attention_flops,
            "mfu_basis": "6 × active parameters + 12·L·H·Dh·T attention per token (as logged in training)",
        },
        "cluster": {"gpu_type": spec.name, "description": spec.description, "gpus_per_node": gpus,
                    "nodes": nodes, "gpus": n, "precision": precision,
                    "peak_flops_per_gpu": peak, "peak_flops": cluster_peak},
        "time": {
            "mfu": mfu,
            "seconds": seconds,
            "hours": seconds / 3600,
            "days": seconds / DAY,
            "days_at_100pct_mfu": seconds * mfu / DAY,
            "gpu_hours": gpu_hours,
            "tokens_per_second": tokens / seconds,
            "tokens_per_second_per_gpu": tokens / seconds / n,
        },
        "cost": {"price_per_gpu_hour": price, "total": gpu_hours * price if price is not None else None},
        "memory": memory,
        "moe_traffic": moe,
        "notes": notes,
    }


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
        rows.append(("activations", f"{_bytes(act['no_ac'])} per sequence of {m['seq_len']} "
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
    verdict = ("fits" if m["fits"] else "DOES NOT FIT") + f" under {m['data_parallel']}"
    if m["suggested_micro_batch"]:
        verdict += (f"; suggested micro-batch {m['suggested_micro_batch']}"
                    f"{' with activation checkpointing' if m['activation_checkpointing'] else ''}")
    rows.append(("fits", f"{verdict}; total {_bytes(m['total_bytes_per_gpu'])} per GPU"))
    for key, value in rows:
        table.add_row(key, value)
    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, force_terminal=False).print(table)
    text = "\n".join(line.rstrip() for line in buf.getvalue().strip("\n").splitlines()) + "\n"
    for note in plan["notes"]:
        text += f"note: {note}\n"
    return text

