"""Long context: which context-parallel degree and activation-checkpointing mode a run needs.

Activations grow with the sequence (per token they are a fixed size: flash attention keeps no
T×T scores), so at 32k tokens they, not the model states, decide what fits. A run has two knobs:

- **activation checkpointing** (`compute.activation_checkpointing`): ``none`` keeps every
  block's tensors for backward; ``selective`` keeps the matmul and attention outputs and
  recomputes the element-wise ops (norms, activations, RoPE: cheap); ``full`` keeps each block's
  input and recomputes the whole block (about a third more compute);
- **context parallelism** (`compute.context_parallel: N`): each GPU holds T/N of every row, so
  its activations shrink N-fold; it costs attention traffic between the N GPUs and needs N of
  them per row.

`context_plan` tries every pair a cluster allows, from the fewest GPUs per row and the least
recomputation up: CP 1 without checkpointing, then selective, then full, then CP 2, … — the
first that fits is the choice (selective recomputation costs little; sharding rows needs GPUs
and a network, full recomputation a third more compute). `context_fit_error` is the one line a
run gets when its own pair cannot fit, with the pair to use instead. Both are pure (no torch),
with the memory model of `estimate.memory` (states sharded over every GPU, the gathered FSDP
units, the loss workspace, bf16 activations per token). `check_context_parallel` holds the rules
a split row follows (equal chunks; on CUDA, rows ring attention can take).
"""

from __future__ import annotations

import math

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.memory import (ACT_BYTES, BYTES_PER_PARAM, largest_unit_params, layer_activation_elements,
                                     loss_workspace_bytes, usable_bytes)
from lmforge.plan.flops import param_counts

MODES = ("none", "selective", "full")
MAX_GPUS = 4096  # where the search for "how many GPUs would it take" gives up


def checkpointing_mode(value) -> str | int:
    """`compute.activation_checkpointing` → none | selective | full | N (every N-th block, full)."""
    if value is False or value is None:
        return "none"
    if value is True or value == "full":
        return "full"
    if value == "selective":
        return "selective"
    return int(value)


def selective_layer_elements(cfg: ModelConfig) -> int:
    """Elements one block keeps per token under selective checkpointing: its input (d), the
    matmul outputs — q, k, v (q + 2kv), attention's output (q), the attention projection (d), the
    MLP's gate and up (2·ffn, or top_k of each expert's) and down (d) — not the norms,
    activations, RoPE or products recomputed from them."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head
    if cfg.is_moe:
        mlp = 2 * cfg.n_experts + cfg.top_k * (2 * cfg.expert_dim + d) + d
    else:
        mlp = 2 * cfg.ffn_dim + d
    return d + 2 * q + 2 * kv + d + mlp


def activation_bytes(cfg: ModelConfig, tokens: int, mode: str | int) -> float:
    """Activation bytes for ``tokens`` tokens (on one GPU) under checkpointing ``mode``; a
    checkpointed block's own tensors exist again while its backward runs (one block at a time)."""
    layers, d = cfg.n_layers, cfg.d_model
    whole = layer_activation_elements(cfg)
    if mode == "none":
        kept = layers * whole
    elif mode == "selective":
        kept = layers * selective_layer_elements(cfg) + whole - selective_layer_elements(cfg)
    else:
        checkpointed = layers if mode == "full" else layers // int(mode)
        kept = (layers - checkpointed) * whole + checkpointed * d + (whole if checkpointed else 0)
    return float((kept + 3 * d) * ACT_BYTES * tokens)  # + final norm input and the loss's input gradient


def per_gpu_bytes(cfg: ModelConfig, seq_len: int, n_gpus: int, context_parallel: int, mode: str | int,
                  micro_batch: int = 1, expert_parallel: int = 1, state_shards: int | None = None) -> float:
    """Bytes one GPU holds: states sharded over ``state_shards`` GPUs (default all ``n_gpus``:
    FSDP; HSDP: a shard group; DDP: 1), two gathered units, the loss workspace and
    ``micro_batch`` rows of seq_len / context_parallel tokens."""
    states = param_counts(cfg)["total"] * BYTES_PER_PARAM / (state_shards or n_gpus)
    fixed = 2 * 4 * largest_unit_params(cfg, expert_parallel) + loss_workspace_bytes(cfg)
    return states + fixed + micro_batch * activation_bytes(cfg, seq_len // context_parallel, mode)


def degrees(seq_len: int, n_gpus: int) -> list[int]:
    """Context-parallel degrees a run may use: powers of two dividing the GPUs, each cutting the
    row into 2N equal chunks."""
    out, cp = [], 1
    while cp <= n_gpus:
        if n_gpus % cp == 0 and seq_len % (2 * cp if cp > 1 else 1) == 0:
            out.append(cp)
        cp *= 2
    return out


def context_plan(cfg: ModelConfig, seq_len: int, n_gpus: int, gpu_memory: float, *, micro_batch: int = 1,
                 expert_parallel: int = 1, state_shards: int | None = None) -> dict:
    """Per-GPU memory of every (context parallel, checkpointing) pair ``n_gpus`` GPUs of
    ``gpu_memory`` bytes allow at ``seq_len`` tokens, and the first that fits (module docstring);
    ``choice`` None when none does, with ``min_gpus``: how many GPUs would (fully sharded).
    ``state_shards``: see `per_gpu_bytes`."""
    usable = usable_bytes(gpu_memory)
    options = [{"context_parallel": cp, "checkpointing": mode,
                "bytes_per_gpu": per_gpu_bytes(cfg, seq_len, n_gpus, cp, mode, micro_batch, expert_parallel,
                                               state_shards)}
               for cp in degrees(seq_len, n_gpus) for mode in MODES]
    for o in options:
        o["fits"] = o["bytes_per_gpu"] <= usable
    choice = next((o for o in options if o["fits"]), None)
    return {"seq_len": seq_len, "gpus": n_gpus, "micro_batch": micro_batch, "usable_bytes": usable,
            "options": options, "choice": choice,
            "min_gpus": None if choice else _min_gpus(cfg, seq_len, n_gpus, usable, micro_batch, expert_parallel)}


def _min_gpus(cfg, seq_len, n_gpus, usable, micro_batch, expert_parallel) -> int | None:
    n = 2 ** math.ceil(math.log2(n_gpus + 1))
    while n <= MAX_GPUS:
        if any(per_gpu_bytes(cfg, seq_len, n, cp, "full", micro_batch, expert_parallel) <= usable
               for cp in degrees(seq_len, n)):
            return n
        n *= 2
    return None


def describe(cp: int, mode: str | int, *, was: tuple[int, str | int] | None = None) -> str:
    """How a pair reads in a config (``compute.context_parallel: 2, compute.activation_checkpointing:
    selective``); given the pair it replaces (``was``), only the settings that change."""
    ac = {"none": "false"}.get(mode, mode) if isinstance(mode, str) else str(mode)
    parts = [f"compute.context_parallel: {cp}" if was is None or was[0] != cp else None,
             f"compute.activation_checkpointing: {ac}" if was is None or was[1] != mode else None]
    return ", ".join(p for p in parts if p)


def context_fit_error(cfg: ModelConfig, seq_len: int, n_gpus: int, gpu_memory: float, gpu_name: str, *,
                      context_parallel: int = 1, activation_checkpointing=False, micro_batch: int = 1,
                      expert_parallel: int = 1, state_shards: int | None = None) -> str | None:
    """None when the run's own pair fits; else the one line that says so and what to set (the
    pair `context_plan` chooses), or how many GPUs it would take. ``state_shards``: GPUs the run's states are sharded over (`per_gpu_bytes`). For
    preflight and --dry-run."""
    mode = checkpointing_mode(activation_checkpointing)
    need = per_gpu_bytes(cfg, seq_len, n_gpus, context_parallel, mode, micro_batch, expert_parallel, state_shards)
    usable = usable_bytes(gpu_memory)
    if need <= usable:
        return None
    plan = context_plan(cfg, seq_len, n_gpus, gpu_memory, micro_batch=micro_batch, expert_parallel=expert_parallel,
                        state_shards=state_shards)
    where = f"{n_gpus} × {gpu_name}"
    head = (f"{cfg.label()} does not fit at {seq_len} tokens per row (micro-batch {micro_batch}) on {where}: "
            f"{_gb(need)} per GPU with {describe(context_parallel, mode)}, {_gb(usable)} usable")
    choice = plan["choice"]
    if choice is not None:
        change = describe(choice["context_parallel"], choice["checkpointing"], was=(context_parallel, mode))
        return f"{head}; set {change} ({_gb(choice['bytes_per_gpu'])} per GPU)"
    if micro_batch > 1:
        return f"{head}; use parameters.micro_batch_size: 1"
    more = f"at least {plan['min_gpus']} GPUs" if plan["min_gpus"] else "more GPUs"
    return f"{head}; even full checkpointing on every context-parallel degree is too large: use {more} or a shorter context"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_context_parallel(context_parallel: int, seq_len: int, model: ModelConfig, *, packed_rows: bool,
                           device_type: str) -> None:
    """What a sharded row needs, one line each: whole, equal chunks (T a multiple of 2N), and on
    CUDA rows ring attention can take (plain causal: no documents, window or soft-cap)."""
    cp = context_parallel
    if cp == 1:
        return
    key = f"compute.context_parallel: {cp}"
    if seq_len % (2 * cp):
        raise UserError(f"{key} does not divide the context length {seq_len} into {2 * cp} equal chunks "
                        f"(2 per rank, for causal load balancing); expected a context length that is a multiple "
                        f"of {2 * cp} (parameters.context_length)")
    if device_type != "cuda":
        return
    unsupported = [what for what, present in (
        ("packed documents (parameters.document_masking, or fine-tuning rows)", packed_rows),
        ("model.sliding_window", model.sliding_window is not None),
        ("model.attn_softcap", model.attn_softcap is not None)) if present]
    if unsupported:
        raise UserError(f"{key}: on CUDA the sequence is sharded by torch's ring attention, which is plain causal "
                        f"and cannot take {unsupported[0]}; use context_parallel: 1 for this run (the CPU path "
                        "all-gathers keys and values and takes every mask)")
