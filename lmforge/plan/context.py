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
and a network, full recomputation a third more compute). `plan.fit` turns it into the one line a
run (or an estimate) gets when its own pair cannot fit. Pure (no torch), with the one memory model
of `plan.memory` (`fixed_bytes` + micro-batch × `activation_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from lmforge.config.model import ModelConfig
from lmforge.plan.activations import canonical_checkpointing, checkpointing_words
from lmforge.plan.flops import param_counts
from lmforge.plan.layout import REPLICATED, Sharding
from lmforge.plan.memory import activation_bytes, fixed_bytes, usable_bytes

MODES = ("none", "selective", "full")
MAX_GPUS = 4096  # where the search for "how many GPUs would it take" gives up


def checkpointing_mode(value) -> str | int | dict:
    """`compute.activation_checkpointing` → none | selective | full | N (every N-th block, full) |
    {granularity, layers}."""
    value = canonical_checkpointing(value)
    if value is False or value is None or value == "none":
        return "none"
    if value is True or value == "full":
        return "full"
    if value == "selective" or isinstance(value, dict):
        return value
    return int(value)


def checkpointing_label(value) -> str:
    """A `compute.activation_checkpointing` value in words: "full checkpointing", "no checkpointing"
    (`plan.activations.checkpointing_words`)."""
    return checkpointing_words(False if value == "none" else value)


def setting(mode: str | int):
    """A mode as `compute.activation_checkpointing` writes it (none → false)."""
    return False if mode == "none" else mode


def per_gpu_bytes(cfg: ModelConfig, seq_len: int, sharding: Sharding, context_parallel: int, mode: str | int,
                  micro_batch: int = 1) -> float:
    """Bytes one GPU holds: the fixed part of ``sharding`` and ``micro_batch`` rows of
    seq_len / context_parallel tokens under checkpointing ``mode``."""
    return (fixed_bytes(param_counts(cfg)["total"], cfg, sharding)
            + micro_batch * activation_bytes(cfg, seq_len // context_parallel, setting(mode)))


def degrees(seq_len: int, sharding: Sharding) -> list[int]:
    """Context-parallel degrees a run may use: powers of two dividing the GPUs (and HSDP's shard
    group), each cutting the row into 2N equal chunks."""
    group = sharding.shards if sharding.data_parallel == "hsdp" else sharding.devices
    out, cp = [], 1
    while cp <= sharding.devices:
        if sharding.devices % cp == 0 and group % cp == 0 and seq_len % (2 * cp if cp > 1 else 1) == 0:
            out.append(cp)
        cp *= 2
    return out


def context_plan(cfg: ModelConfig, seq_len: int, sharding: Sharding, gpu_memory: float, *,
                 micro_batch: int = 1) -> dict:
    """Per-GPU memory of every (context parallel, checkpointing) pair ``sharding``'s GPUs of
    ``gpu_memory`` bytes allow at ``seq_len`` tokens, and the first that fits (module docstring);
    ``choice`` None when none does, with ``min_gpus``: how many GPUs would (fully sharded)."""
    usable = usable_bytes(gpu_memory)
    options = [{"context_parallel": cp, "checkpointing": mode,
                "bytes_per_gpu": per_gpu_bytes(cfg, seq_len, sharding, cp, mode, micro_batch)}
               for cp in degrees(seq_len, sharding) for mode in MODES]
    for o in options:
        o["fits"] = o["bytes_per_gpu"] <= usable
    choice = next((o for o in options if o["fits"]), None)
    more = None if choice else min_gpus(cfg, seq_len, sharding, usable, micro_batch)
    out = {"seq_len": seq_len, "gpus": sharding.devices, "micro_batch": micro_batch, "usable_bytes": usable,
           "options": options, "choice": choice, "min_gpus": more[0] if more else None,
           "data_parallel": sharding.data_parallel}
    if choice is None and sharding.data_parallel in REPLICATED and sharding.devices > 1:
        # More GPUs do not help a replicated model: what sharding it over these GPUs would fit first.
        sharded = replace(sharding, data_parallel="fsdp", shard_size=None)
        out["sharded_choice"] = next((o for o in (
            {"context_parallel": cp, "checkpointing": mode,
             "bytes_per_gpu": per_gpu_bytes(cfg, seq_len, sharded, cp, mode, micro_batch)}
            for cp in degrees(seq_len, sharded) for mode in MODES) if o["bytes_per_gpu"] <= usable), None)
    return out


def min_gpus(cfg: ModelConfig, seq_len: int, sharding: Sharding, usable: float, micro_batch: int = 1
             ) -> tuple[int, int] | None:
    """(GPUs, context parallel) of the fewest GPUs (a power of two above today's count) on which
    the rows fit fully sharded with full checkpointing; None beyond MAX_GPUS."""
    n = 2 ** math.ceil(math.log2(sharding.devices + 1))
    while n <= MAX_GPUS:
        more = replace(sharding, data_parallel="fsdp", devices=n, shard_size=None)
        fits = [cp for cp in degrees(seq_len, more)
                if per_gpu_bytes(cfg, seq_len, more, cp, "full", micro_batch) <= usable]
        if fits:
            return n, fits[0]
        n *= 2
    return None
