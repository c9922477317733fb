"""`parameters.micro_batch_size: auto` on GPUs: the micro-batch and the activation-checkpointing
mode (`compute.activation_checkpointing`) chosen together, for the most training tokens/s that
fit in memory.

1. **Memory first** (`plan.memory`). For each checkpointing mode — none, selective, every
   2nd block, full — the largest micro-batch that fits one GPU: one that divides the rank's share
   of the global batch (when it is known, else a power of two), at most
   `memory.MAX_SUGGESTED_MICRO_BATCH`. A mode or a micro-batch the user set is the only one
   tried. Within one mode a larger micro-batch never does less work per token, so each mode
   gives one candidate: a handful in all.
2. **Then speed.** Each candidate's tokens/s, *modelled* where nothing can be measured (the
   estimate, a dry run, a CPU), *measured* where a probe is given (`train.micro_batch`: a few
   compiled steps on the GPU itself, cached per model, device and context), for the
   `PROBED` candidates the model ranks first.
3. **The fastest wins**; within `TIE` of it, the one that recomputes less, then the one that
   needs less memory.

The model: seconds per token = FLOPs per token × (1 + recompute) / (peak × efficiency), with

- FLOPs per token on the standard basis (6·N_active + 12·L·H·Dh·T, `plan.flops`);
- recompute: full checkpointing of a block runs its forward again in backward, 2·N_block +
  4·H·Dh·T more FLOPs per token (the forward third of the attention term); selective
  recomputes only element-wise ops (norms, RoPE, SwiGLU's product), memory-bound work worth
  `SELECTIVE_RECOMPUTE` of the step (llama-3b on an H100: ~20k elements per token and layer
  read and written again at ~3 TB/s against ~45 µs of FLOPs per token: 2–3%);
- efficiency(rows) = `BLOCK_PEAK_MFU` (plan.hardware) · rows / (rows + `HALF_ROWS`), rows = micro-batch × context:
  the M of every GEMM. Dense bf16 GEMMs of K, N ≥ 2048 on an H100 run near their best from a
  few thousand rows, so beyond one or two sequences of 2048 a larger micro-batch gains little
  and checkpointing's recompute costs more than it buys; at short contexts (rows of a few
  hundred) the larger micro-batches that checkpointing frees win.

These constants order the candidates; the probe's measurements replace them where a GPU is at
hand. Everything here is pure (no torch): the throughput of a measured candidate comes in as a
function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.flops import block_counts, mfu_flops_per_token, param_counts
from lmforge.plan.hardware import BLOCK_PEAK_MFU
from lmforge.config.counts import gb, human
from lmforge.plan.context import checkpointing_label
from lmforge.plan.fit import remedy
from lmforge.plan.layout import Sharding
from lmforge.plan.memory import (MAX_SUGGESTED_MICRO_BATCH, activation_bytes, checkpointed_blocks,
                                 fixed_bytes, fixed_parts, usable_bytes)

# The modes tried, least recompute first: none, selective, every 2nd block (full), full.
MODES: tuple = (False, "selective", 2, "full")
HALF_ROWS = 512  # GEMM rows (micro-batch × context) at which the model's efficiency is half its best
SELECTIVE_RECOMPUTE = 0.03  # selective checkpointing's element-wise recompute, as a share of the step
TIE = 0.02  # candidates this close to the fastest count as equally fast
PROBED = 3  # candidates a probe times


@dataclass
class Candidate:
    micro_batch: int
    checkpointing: object  # a compute.activation_checkpointing value: False, "selective", N or "full"
    bytes_per_gpu: float
    recompute: float  # extra work as a share of the step (0 for none)
    modelled_tokens_per_s: float
    tokens_per_s: float | None = None  # measured, when a probe ran

    @property
    def label(self) -> str:
        return f"{checkpointing_label(self.checkpointing)} × {self.micro_batch}"


@dataclass
class Choice:
    micro_batch: int
    checkpointing: object  # what compute.activation_checkpointing resolves to
    reason: str  # the one line printed
    measured: bool
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def recompute_share(cfg: ModelConfig, seq_len: int, checkpointing) -> float:
    """Extra work of a checkpointing mode as a share of the step's FLOPs (see the module docstring)."""
    mode, which = checkpointed_blocks(checkpointing, cfg.n_layers)
    if mode == "selective":
        return SELECTIVE_RECOMPUTE
    if mode is None:
        return 0.0
    forward = 2 * block_counts(cfg)["active"] + 4 * cfg.n_heads * cfg.dim_head * seq_len
    return len(which) * forward / mfu_flops_per_token(cfg, seq_len)


def modelled_tokens_per_s(cfg: ModelConfig, seq_len: int, micro_batch: int, checkpointing, peak_flops: float) -> float:
    rows = micro_batch * seq_len
    efficiency = BLOCK_PEAK_MFU * rows / (rows + HALF_ROWS)
    return efficiency * peak_flops / (mfu_flops_per_token(cfg, seq_len) * (1 + recompute_share(cfg, seq_len,
                                                                                                 checkpointing)))


def _micro_batches(per_rank: int | None) -> list[int]:
    """Micro-batches worth trying, largest first: divisors of the rank's batch, else powers of two."""
    top = MAX_SUGGESTED_MICRO_BATCH
    if per_rank:
        return [m for m in range(min(per_rank, top), 0, -1) if per_rank % m == 0]
    return [1 << i for i in range(top.bit_length() - 1, -1, -1)]


def candidates(cfg: ModelConfig, seq_len: int, *, sharding: Sharding, gpu_memory: float, peak_flops: float,
               per_rank: int | None = None, micro_batch: int | None = None, checkpointing="auto") -> list[Candidate]:
    """One candidate per checkpointing mode: the largest micro-batch of it that fits (see the
    module docstring); empty when nothing fits."""
    fixed = fixed_bytes(param_counts(cfg)["total"], cfg, sharding)
    usable = usable_bytes(gpu_memory)
    out = []
    for mode in _modes(cfg, checkpointing):
        per_sample = activation_bytes(cfg, seq_len, mode)
        for mb in ([micro_batch] if micro_batch else _micro_batches(per_rank)):
            total = fixed + mb * per_sample
            if total <= usable:
                out.append(Candidate(mb, mode, total, recompute_share(cfg, seq_len, mode),
                                     modelled_tokens_per_s(cfg, seq_len, mb, mode, peak_flops)))
                break
    return out


def _modes(cfg: ModelConfig, checkpointing) -> tuple:
    """The checkpointing modes tried: every one for ``auto``, else the one the config sets."""
    if checkpointing != "auto":
        return (checkpointing,)
    return tuple(m for m in MODES if not (m == 2 and cfg.n_layers < 2))


def smallest(cfg: ModelConfig, seq_len: int, micro_batch: int | None, checkpointing) -> tuple[int, object]:
    """(micro-batch, mode) of the least memory the config allows: what a plan that fits nowhere shows."""
    return micro_batch or 1, min(_modes(cfg, checkpointing), key=lambda m: activation_bytes(cfg, seq_len, m))


def _rank(cands: list[Candidate], rate: Callable[[Candidate], float]) -> list[Candidate]:
    """Fastest first; within TIE of the fastest, less recompute and then less memory first."""
    top = max(rate(c) for c in cands)

    def key(c: Candidate):
        near = rate(c) >= (1 - TIE) * top
        return (not near, c.recompute if near else 0.0, -rate(c), c.bytes_per_gpu)

    return sorted(cands, key=key)


def choose(cfg: ModelConfig, seq_len: int, *, sharding: Sharding, gpu_memory: float, peak_flops: float,
           where: str, per_rank: int | None = None, micro_batch: int | None = None, checkpointing="auto",
           measure: Callable[[Candidate], float | None] | None = None, measured_as: str = "measured",
           context_parallel: int = 1) -> Choice:
    """The micro-batch and checkpointing mode with the most tokens/s that fit, and the line that
    says so. ``where`` names the devices ("1 × NVIDIA H100 80GB HBM3"); ``measure`` (a probe)
    returns a candidate's tokens/s, or None when it cannot run it; ``measured_as`` says how.
    ``seq_len``: the tokens of a row one GPU holds (of a row split over ``context_parallel`` GPUs).
    Nothing fits: UserError with the smallest footprint and the remedy (`plan.fit`)."""
    cands = candidates(cfg, seq_len, sharding=sharding, gpu_memory=gpu_memory, peak_flops=peak_flops,
                       per_rank=per_rank, micro_batch=micro_batch, checkpointing=checkpointing)
    if not cands:
        raise UserError(nothing_fits(cfg, seq_len * context_parallel, sharding, gpu_memory, where, micro_batch,
                                     checkpointing, context_parallel))
    ranked = _rank(cands, lambda c: c.modelled_tokens_per_s)
    measured = False
    if measure is not None and len(ranked) > 1:
        for c in ranked[:PROBED]:
            c.tokens_per_s = measure(c)
        timed = [c for c in ranked[:PROBED] if c.tokens_per_s]
        if timed:
            measured = True
            ranked = _rank(timed, lambda c: c.tokens_per_s) + [c for c in ranked if c not in timed]
    best = ranked[0]
    usable = usable_bytes(gpu_memory)
    flops = mfu_flops_per_token(cfg, seq_len)

    def speed(c: Candidate) -> str:
        if measured:
            return f"{human(c.tokens_per_s)} tokens/s" if c.tokens_per_s else "not timed"
        return f"{c.modelled_tokens_per_s * flops / peak_flops:.0%} MFU"

    others = "; ".join(f"{c.label} {speed(c)}" for c in ranked[1:])
    how = measured_as if measured else "modelled"
    reason = (f"parameters.micro_batch_size: auto → {best.micro_batch} with {checkpointing_label(best.checkpointing)}"
              f" ({gb(best.bytes_per_gpu)} of {gb(usable)} usable per GPU): {how} {speed(best)}, the fastest of "
              f"{len(cands)} that fit on {where}" + (f" (then {others})" if others else ""))
    return Choice(best.micro_batch, best.checkpointing, reason, measured, ranked)


def nothing_fits(cfg: ModelConfig, seq_len: int, sharding: Sharding, gpu_memory: float, where: str,
                 micro_batch: int | None, checkpointing, context_parallel: int = 1) -> str:
    """One line: the smallest footprint found, and what would make the run fit (`plan.fit.remedy`).
    ``seq_len``: the whole row, split over ``context_parallel`` GPUs."""
    total_params = param_counts(cfg)["total"]
    local = seq_len // context_parallel
    mb, mode = smallest(cfg, local, micro_batch, checkpointing)
    act = activation_bytes(cfg, local, mode)
    states, _, _ = fixed_parts(total_params, cfg, sharding)
    fix = remedy(cfg, seq_len, sharding, gpu_memory, context_parallel=context_parallel, checkpointing=mode,
                 micro_batch=mb, auto_checkpointing=checkpointing == "auto")
    return (f"parameters.micro_batch_size: auto: nothing fits on {where}: the smallest footprint, micro-batch {mb} "
            f"with {checkpointing_label(mode)}, needs {gb(fixed_bytes(total_params, cfg, sharding) + mb * act)} per "
            f"GPU of {gb(usable_bytes(gpu_memory))} usable (model states {gb(states)}); {fix.text()}")
