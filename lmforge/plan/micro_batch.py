"""`parameters.micro_batch_size: auto` on GPUs: the micro-batch and the way activations are kept
(`compute.activation_checkpointing`, and where set to ``auto`` `activation_compression` and
`activation_offload`, `plan.activations`) chosen together, for the most training tokens/s that fit
in memory.

1. **Memory first** (`plan.memory`). The options tried: with checkpointing ``auto`` no
   checkpointing, and each granularity (block, selective, attention, mlp, and experts for MoE
   models) on the *fewest* leading blocks (``layers: first-N``) that let each micro-batch fit —
   recomputing only as much as the memory asks; fp8 compression where
   ``activation_compression: auto``, offload where ``activation_offload: auto`` (CUDA). A setting
   the user gave is the only one tried. Micro-batches: the divisors of the rank's share of the
   global batch (when known, else powers of two), at most `memory.MAX_SUGGESTED_MICRO_BATCH`. Each
   option keeps its fastest micro-batch (modelled): a handful of candidates in all.
2. **Then speed.** Each candidate's tokens/s, *modelled* where nothing can be measured (the
   estimate, a dry run, a CPU), *measured* where a probe is given (`train.micro_batch`: a few
   compiled steps on the GPU itself, cached per model, device and context), for the
   `PROBED` candidates the model ranks first.
3. **The fastest wins**; within `TIE` of it, the one that costs less extra work (recompute,
   compression, offload), then the one that needs less memory.

The model: seconds per token = compute × (1 + recompute + compression) + offload, with compute =
FLOPs per token / (peak × efficiency) and

- FLOPs per token on the standard basis (6·N_active + 12·L·H·Dh·T, `plan.flops`);
- recompute, per checkpointed block: a block runs its forward again in backward, 2·N_block +
  4·H·Dh·T more FLOPs per token (the forward third of the attention term); attention its own
  part (2·N_attention + 4·H·Dh·T), mlp 2·N_mlp, experts 2·N_experts; selective recomputes only
  element-wise ops (norms, RoPE, SwiGLU's product), memory-bound work worth `SELECTIVE_RECOMPUTE`
  of the step over every block (llama-3b on an H100: ~20k elements per token and layer read and
  written again at ~3 TB/s against ~45 µs of FLOPs per token: 2–3%);
- compression: quantizing what the blocks save and restoring it in backward, memory-bound passes
  over the saved bytes, worth `COMPRESSION_SHARE` of the step when every block compresses
  (llama-3b on an H100: ~9 MB read and written per token at ~3 TB/s against ~40 µs of FLOPs: 6–8%);
- offload: `OFFLOAD_SHARE` of the step (streams, pinned copies), plus whatever of the transfer to
  the host and back (at `HOST_BANDWIDTH`) the compute does not hide;
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

from lmforge.config.counts import gb, human
from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.activations import activation_policy, checkpointing_setting, option_words
from lmforge.plan.fit import remedy
from lmforge.plan.flops import block_counts, mfu_flops_per_token, param_counts
from lmforge.plan.hardware import BLOCK_PEAK_MFU
from lmforge.plan.layout import Sharding
from lmforge.plan.memory import (MAX_SUGGESTED_MICRO_BATCH, activation_bytes, fixed_bytes, fixed_parts,
                                 offloaded_bytes, usable_bytes)

# The checkpointing granularities `auto` tries, each on the fewest leading blocks that fit.
GRANULARITIES: tuple = ("selective", "attention", "mlp", "experts", "block")
HALF_ROWS = 512  # GEMM rows (micro-batch × context) at which the model's efficiency is half its best
SELECTIVE_RECOMPUTE = 0.03  # selective checkpointing's element-wise recompute, as a share of the step
COMPRESSION_SHARE = 0.07  # quantizing and restoring every block's saved tensors, as a share of the step
OFFLOAD_SHARE = 0.03  # offload's streams and pinned copies, as a share of the step (the transfer apart)
HOST_BANDWIDTH = 25e9  # bytes/s one GPU moves to or from pinned host memory (PCIe, shared by a node's GPUs)
TIE = 0.02  # candidates this close to the fastest count as equally fast
PROBED = 3  # candidates a probe times
SAID = 3  # candidates after the choice the reason line names


@dataclass
class Candidate:
    micro_batch: int
    checkpointing: object  # a compute.activation_checkpointing value: False, "selective", "full", N or a mapping
    bytes_per_gpu: float
    recompute: float  # extra work as a share of the step (recompute, compression, offload; 0 for none)
    modelled_tokens_per_s: float
    tokens_per_s: float | None = None  # measured, when a probe ran
    compression: object = "off"  # a compute.activation_compression value
    offload: bool = False

    @property
    def label(self) -> str:
        return f"{option_words(self.checkpointing, self.compression, self.offload)} × {self.micro_batch}"


@dataclass
class Choice:
    micro_batch: int
    checkpointing: object  # what compute.activation_checkpointing resolves to
    reason: str  # the one line printed
    measured: bool
    candidates: list[Candidate] = field(default_factory=list)
    compression: object = "off"  # what compute.activation_compression resolves to
    offload: bool = False  # what compute.activation_offload resolves to

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def _block_forward(cfg: ModelConfig, seq_len: int, granularity: str) -> float:
    """FLOPs per token of what backward recomputes of one block under ``granularity``."""
    counts = block_counts(cfg)
    attention = 2 * (counts["attention"] + counts["norms"] // 2) + 4 * cfg.n_heads * cfg.dim_head * seq_len
    mlp = 2 * (counts["ffn_active"] + counts["norms"] // 2)
    if granularity == "attention":
        return attention
    if granularity == "mlp":
        return mlp
    if granularity == "experts":
        return 2 * (counts["ffn_active"] - cfg.d_model * cfg.n_experts)
    return attention + mlp


def recompute_share(cfg: ModelConfig, seq_len: int, checkpointing, compression="off") -> float:
    """Extra work of checkpointing (and compression) as a share of the step's FLOPs (module docstring)."""
    policy = activation_policy(checkpointing, compression, n_layers=cfg.n_layers, moe=cfg.is_moe)
    total = mfu_flops_per_token(cfg, seq_len)
    share = 0.0
    for b in policy.blocks:
        if b.checkpointing == "selective":
            share += SELECTIVE_RECOMPUTE / cfg.n_layers
        elif b.checkpointing:
            share += _block_forward(cfg, seq_len, b.checkpointing) / total
        if b.compression:
            share += COMPRESSION_SHARE / cfg.n_layers
    return share


def modelled_tokens_per_s(cfg: ModelConfig, seq_len: int, micro_batch: int, checkpointing, peak_flops: float,
                          compression="off", offload: bool = False, precision: str = "bf16") -> float:
    rows = micro_batch * seq_len
    efficiency = BLOCK_PEAK_MFU * rows / (rows + HALF_ROWS)
    compute = mfu_flops_per_token(cfg, seq_len) / (efficiency * peak_flops)
    seconds = compute * (1 + recompute_share(cfg, seq_len, checkpointing, compression))
    if offload:
        sent = offloaded_bytes(cfg, seq_len, checkpointing, compression=compression, precision=precision) / seq_len
        seconds += OFFLOAD_SHARE * compute + max(0.0, 2 * sent / HOST_BANDWIDTH - compute)
    return 1.0 / seconds


def _micro_batches(per_rank: int | None) -> list[int]:
    """Micro-batches worth trying, largest first: divisors of the rank's batch, else powers of two."""
    top = MAX_SUGGESTED_MICRO_BATCH
    if per_rank:
        return [m for m in range(min(per_rank, top), 0, -1) if per_rank % m == 0]
    return [1 << i for i in range(top.bit_length() - 1, -1, -1)]


def _options(cfg: ModelConfig, checkpointing, compression, offload, device: str) -> list[tuple]:
    """(checkpointing, compression, offload) to try: a granularity name stands for its fewest
    leading blocks that fit (resolved per micro-batch in `candidates`); a set value for itself."""
    if checkpointing == "auto":
        ckpts = [False] + [g for g in GRANULARITIES if g != "experts" or cfg.is_moe]
    else:
        ckpts = [("set", checkpointing)]
    comps = ["off", "fp8"] if compression == "auto" else [compression]
    offs = ([False, True] if device == "cuda" else [False]) if offload == "auto" else [bool(offload)]
    return [(c, z, o) for c in ckpts for z in comps for o in offs]


def _fewest(cfg: ModelConfig, seq_len: int, granularity: str, fits: Callable[[object], bool]) -> object | None:
    """The setting of ``granularity`` on the fewest leading blocks for which ``fits``; None if none."""
    n = cfg.n_layers
    if not fits(checkpointing_setting(granularity)):
        return None
    lo, hi = 1, n  # fits(first-hi) holds; the fewest is found by bisection (fewer blocks, more memory)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits({"granularity": granularity, "layers": f"first-{mid}"}):
            hi = mid
        else:
            lo = mid + 1
    return checkpointing_setting(granularity) if hi == n else {"granularity": granularity, "layers": f"first-{hi}"}


def candidates(cfg: ModelConfig, seq_len: int, *, sharding: Sharding, gpu_memory: float, peak_flops: float,
               per_rank: int | None = None, micro_batch: int | None = None, checkpointing="auto",
               compression="off", offload=False, precision: str = "bf16", device: str = "cuda") -> list[Candidate]:
    """One candidate per option (see the module docstring): its fastest micro-batch that fits,
    modelled; empty when nothing fits."""
    fixed = fixed_bytes(param_counts(cfg)["total"], cfg, sharding)
    usable = usable_bytes(gpu_memory)
    out = []
    for ckpt, comp, off in _options(cfg, checkpointing, compression, offload, device):
        best = None
        for mb in ([micro_batch] if micro_batch else _micro_batches(per_rank)):
            def per_sample(setting):
                return activation_bytes(cfg, seq_len, setting, compression=comp, offload=off, precision=precision)

            def fits(setting) -> bool:
                return fixed + mb * per_sample(setting) <= usable

            if isinstance(ckpt, tuple):  # set by the user
                setting = ckpt[1] if fits(ckpt[1]) else None
            elif ckpt is False:
                setting = False if fits(False) else None
            else:
                setting = _fewest(cfg, seq_len, ckpt, fits)
            if setting is None:
                continue
            rate = modelled_tokens_per_s(cfg, seq_len, mb, setting, peak_flops, comp, off, precision)
            if best is None or rate > best.modelled_tokens_per_s:
                extra = recompute_share(cfg, seq_len, setting, comp) + (OFFLOAD_SHARE if off else 0.0)
                best = Candidate(mb, setting, fixed + mb * per_sample(setting), extra, rate, compression=comp,
                                 offload=off)
        if best is not None and all((c.checkpointing, c.compression, c.offload, c.micro_batch) !=
                                    (best.checkpointing, best.compression, best.offload, best.micro_batch)
                                    for c in out):
            out.append(best)
    return out


def smallest(cfg: ModelConfig, seq_len: int, micro_batch: int | None, checkpointing, compression="off",
             offload=False, precision: str = "bf16", device: str = "cuda") -> tuple[int, object, object, bool]:
    """(micro-batch, checkpointing, compression, offload) of the least memory the config allows:
    what a plan that fits nowhere shows."""
    opts = [(c[1] if isinstance(c, tuple) else checkpointing_setting(c or None), z, o)
            for c, z, o in _options(cfg, checkpointing, compression, offload, device)]
    c, z, o = min(opts, key=lambda t: activation_bytes(cfg, seq_len, t[0], compression=t[1], offload=t[2],
                                                       precision=precision))
    return micro_batch or 1, c, z, o


def _rank(cands: list[Candidate], rate: Callable[[Candidate], float]) -> list[Candidate]:
    """Fastest first; within TIE of the fastest, less extra work and then less memory first."""
    top = max(rate(c) for c in cands)

    def key(c: Candidate):
        near = rate(c) >= (1 - TIE) * top
        return (not near, c.recompute if near else 0.0, -rate(c), c.bytes_per_gpu)

    return sorted(cands, key=key)


def choose(cfg: ModelConfig, seq_len: int, *, sharding: Sharding, gpu_memory: float, peak_flops: float,
           where: str, per_rank: int | None = None, micro_batch: int | None = None, checkpointing="auto",
           compression="off", offload=False, precision: str = "bf16",
           measure: Callable[[Candidate], float | None] | None = None, measured_as: str = "measured",
           context_parallel: int = 1) -> Choice:
    """The micro-batch and way of keeping activations with the most tokens/s that fit, and the line
    that says so. ``where`` names the devices ("1 × NVIDIA H100 80GB HBM3"); ``measure`` (a probe)
    returns a candidate's tokens/s, or None when it cannot run it; ``measured_as`` says how.
    ``seq_len``: the tokens of a row one GPU holds (of a row split over ``context_parallel`` GPUs).
    Nothing fits: UserError with the smallest footprint and the remedy (`plan.fit`)."""
    kw = dict(checkpointing=checkpointing, compression=compression, offload=offload, precision=precision)
    cands = candidates(cfg, seq_len, sharding=sharding, gpu_memory=gpu_memory, peak_flops=peak_flops,
                       per_rank=per_rank, micro_batch=micro_batch, **kw)
    if not cands:
        raise UserError(nothing_fits(cfg, seq_len * context_parallel, sharding, gpu_memory, where, micro_batch,
                                     context_parallel=context_parallel, **kw))
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

    others = "; ".join(f"{c.label} {speed(c)}" for c in ranked[1:1 + SAID])
    more = len(ranked) - 1 - SAID
    how = measured_as if measured else "modelled"
    reason = (f"parameters.micro_batch_size: auto → {best.micro_batch} with "
              f"{option_words(best.checkpointing, best.compression, best.offload)}"
              f" ({gb(best.bytes_per_gpu)} of {gb(usable)} usable per GPU): {how} {speed(best)}, the fastest of "
              f"{len(cands)} that fit on {where}" + (f" (then {others}" + (f"; {more} more" if more > 0 else "") + ")"
                                                     if others else ""))
    return Choice(best.micro_batch, best.checkpointing, reason, measured, ranked, best.compression, best.offload)


def nothing_fits(cfg: ModelConfig, seq_len: int, sharding: Sharding, gpu_memory: float, where: str,
                 micro_batch: int | None, checkpointing, *, compression="off", offload=False,
                 precision: str = "bf16", context_parallel: int = 1) -> str:
    """One line: the smallest footprint found, and what would make the run fit (`plan.fit.remedy`).
    ``seq_len``: the whole row, split over ``context_parallel`` GPUs."""
    total_params = param_counts(cfg)["total"]
    local = seq_len // context_parallel
    mb, mode, comp, off = smallest(cfg, local, micro_batch, checkpointing, compression, offload, precision)
    act = activation_bytes(cfg, local, mode, compression=comp, offload=off, precision=precision)
    states, _, _ = fixed_parts(total_params, cfg, sharding)
    fix = remedy(cfg, seq_len, sharding, gpu_memory, context_parallel=context_parallel, checkpointing=mode,
                 micro_batch=mb, auto_checkpointing=checkpointing == "auto")
    return (f"parameters.micro_batch_size: auto: nothing fits on {where}: the smallest footprint, micro-batch {mb} "
            f"with {option_words(mode, comp, off)}, needs {gb(fixed_bytes(total_params, cfg, sharding) + mb * act)} "
            f"per GPU of {gb(usable_bytes(gpu_memory))} usable (model states {gb(states)}); {fix.text()}")
