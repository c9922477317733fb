"""Memory per GPU of a training run, for the way its GPUs share the model (`compute.data_parallel`):
``fsdp`` shards the model states over every GPU, ``hsdp`` over the GPUs of a shard group (a node),
``ddp`` and ``none`` keep all of them on every GPU; ``auto`` (the default of `train`, its dry run
and `estimate` alike) is resolved by `data_parallel_mode`.

Model states, in bytes per parameter (sharded evenly over the shard group's GPUs, or whole):

| what                              | bytes |
|-----------------------------------|------:|
| bf16 parameters (compute copy)    |     2 |
| fp32 master parameters            |     4 |
| fp32 gradients                    |     4 |
| AdamW first moment (fp32)         |     4 |
| AdamW second moment (fp32)        |     4 |
| total                             |    18 |

Unsharded working set: FSDP all-gathers one unit (a block, or the embedding, or the
output head) at a time in bf16 and prefetches the next one, and each unit's bf16
gradient exists before it is reduce-scattered: 2 units × (2 + 2) bytes × the largest
unit's parameters. With expert parallelism N a GPU gathers only its E/N experts of a
block (model states stay sharded over all GPUs either way). DDP instead keeps its gradient
buckets: a second fp32 copy of the gradients (4 bytes per parameter).

Activations per sequence of T tokens: the tensors autograd keeps for backward, counted as this
model saves them when it runs eagerly (measured: `distributed.activations.Meter`,
`memory/activations_saved`; a compiled block saves as much or less), in the spirit of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") but for this
architecture — RMSNorm, SwiGLU, GQA, flash/SDPA attention (no T×T score matrix is stored), no
dropout. Elements are in the run's activation dtype (`activation_dtype_bytes`: 4 in fp32, else 2)
unless said. Per layer and token (q = H·Dh, kv = KV·Dh, `layer_tensors`):

- each RMSNorm: its input, the normalized product and the output → 3d (in bf16 the input is kept
  as its fp32 copy: 8d bytes, not 6d), and 1/rms (fp32, a statistic);
- attention: a norm, rotated q and k, v, and the output → 2q + 2kv, and the log-sum-exp (H, fp32);
- dense MLP: a norm, gate, up, silu(gate), product → 4·ffn;
- MoE MLP: a norm, the router's probabilities (E, fp32), its top-k weights and sums (2k + 3,
  fp32) and indices (3k, int64), and per routed expert (top_k of them) the gathered input d, gate
  and up (2·expert_dim, one tensor), silu(gate) and the product (expert_dim each) and the output d
  → top_k·(2d + 4·expert_dim).

What checkpointing (`compute.activation_checkpointing`, `plan.activations`) keeps of a block:

- none: all of the above;
- block (full): the block's input (d);
- attention / mlp: that sublayer's input (d), the other sublayer as none;
- experts (MoE): the experts' input and output (2·top_k·d) instead of their tensors, the rest as none;
- selective (the outputs of matmuls and attention kept, element-wise ops recomputed): the block's
  input d, q, k and v as projected (q + 2kv), attention's output q and log-sum-exp H, its
  projection d, gate and up (2·ffn) and the down projection d (MoE: router logits E, top-k values
  and indices, gate|up 2·expert_dim and the output d per routed expert — the grouped GEMM's
  outputs; the CPU's expert loop keeps silu(gate) and the product too);

plus, during backward, one checkpointed region recomputed (a block, or a sublayer). Compression
(`compute.activation_compression`) stores each compressible tensor (floating, `MIN_ROW` wide or
more; not a statistic or an index, nor what selective checkpointing keeps in its own cache) in one
byte per element plus an fp32 scale per `SCALE_BLOCK` elements, and holds one block uncompressed
in flight (the one computing). Offload (`compute.activation_offload`, CUDA) leaves
`OFFLOAD_IN_FLIGHT` blocks' offloadable tensors on the GPU (the one being sent, the one fetched
back), and one block in flight as compression does; the rest waits in pinned host memory. The
final norm (3d) and the loss's gradient with respect to its input (d) come on top of the blocks: the
loss (`models.loss`) works through the tokens in chunks and never keeps logits, so nothing
per token scales with the vocabulary. What it does hold is per micro-batch, not per token
(`loss_workspace_bytes`): the output head's fp32 gradient (4 bytes per head parameter, from
forward to backward), a bf16 copy of the head weight and one chunk's bf16 gradient
contribution (2 + 2), and one chunk of `LOSS_CHUNK_ELEMENTS` logits as fp32 logits, fp32
probabilities, fp32 gradient and its bf16 copy (14 bytes each). liger-kernel's fused loss
(CUDA) holds about the same.

Usable memory is the GPU's memory less a 10% margin (allocator fragmentation) and
1 GB (CUDA context, NCCL buffers).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from lmforge.config.model import ModelConfig
from lmforge.plan.activations import (MIN_ROW, OFFLOAD_IN_FLIGHT, SCALE_BLOCK, SCALE_BYTES, activation_options,
                                      activation_policy, canonical_checkpointing, canonical_compression,
                                      option_words)
from lmforge.plan.flops import block_counts, vocab_of
from lmforge.plan.layout import SHARDED, Sharding

STATE_BYTES = {"bf16_params": 2, "fp32_master": 4, "fp32_grads": 4, "adam_m": 4, "adam_v": 4}
BYTES_PER_PARAM = sum(STATE_BYTES.values())
# What every trained parameter holds whatever the precision (fp32 weights, gradients, AdamW m and v):
# the sure lower bound preflight refuses a run on (the bf16 copies and activations come on top).
TRAINED_BYTES_PER_PARAM = BYTES_PER_PARAM - STATE_BYTES["bf16_params"]
ACT_BYTES = 2  # bf16 activations (`activation_dtype_bytes`: fp32 runs keep 4)
# Logits per chunk of the loss: the same number as models.loss.CHUNK_ELEMENTS (this module
# stays free of torch so that `lmforge estimate` starts fast; tests/test_loss.py checks).
LOSS_CHUNK_ELEMENTS = 2**25
MARGIN = 0.10
RESERVED_BYTES = 1e9
# Beyond a few tens of sequences per micro-batch a GPU is saturated; suggesting more
# only makes the global batch needlessly large.
MAX_SUGGESTED_MICRO_BATCH = 64
DDP_BUCKET_BYTES = 4  # per parameter: DDP's fp32 gradient buckets


def activation_dtype_bytes(precision: str) -> int:
    """Bytes of one activation element: fp32 runs keep fp32 activations, bf16 and fp8 runs bf16."""
    return 4 if precision == "fp32" else ACT_BYTES


@dataclass(frozen=True)
class Saved:
    """Tensors one block keeps for backward, per token: ``elements`` of ``size`` bytes each;
    ``kind`` act (compressible and offloadable), stat (a per-token statistic), index (int64), or
    cached (what selective checkpointing keeps in its own cache: stored as it is)."""

    elements: float
    size: int
    kind: str = "act"


def _norm(d: int, a: int) -> list[Saved]:
    # In fp32 the input, the normalized product and the output; in bf16 the input's fp32 copy instead
    return ([Saved(3 * d, a)] if a == 4 else [Saved(d, 4), Saved(2 * d, a)]) + [Saved(1, 4, "stat")]


def layer_tensors(cfg: ModelConfig, granularity: str | None, precision: str = "bf16") -> list[Saved]:
    """What one block keeps for backward under checkpointing ``granularity`` (None: none), per
    token (see the module docstring)."""
    d, q, kv, a = cfg.d_model, cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head, activation_dtype_bytes(precision)
    k, e, h = cfg.top_k, cfg.n_experts, cfg.expert_dim
    attention = _norm(d, a) + [Saved(2 * q + 2 * kv, a), Saved(cfg.n_heads, 4, "stat")]
    if cfg.is_moe:
        router = [Saved(e, 4, "act" if e >= MIN_ROW else "stat"), Saved(2 * k + 3, 4, "stat"), Saved(3 * k, 8, "index")]
        mlp = _norm(d, a) + router + [Saved(k * (2 * d + 4 * h), a)]
    else:
        mlp = _norm(d, a) + [Saved(4 * cfg.ffn_dim, a)]
    if granularity is None:
        return attention + mlp
    if granularity == "block":
        return [Saved(d, a)]
    if granularity == "attention":
        return [Saved(d, a)] + mlp
    if granularity == "mlp":
        return attention + [Saved(d, a)]
    if granularity == "experts":
        return attention + mlp[:-1] + [Saved(2 * k * d, a)]
    # selective: the block's input (through the hooks), the rest in SAC's cache
    kept = d + 2 * q + 2 * kv + (e + k * (2 * h + d) if cfg.is_moe else 2 * cfg.ffn_dim + d)
    out = [Saved(d, a), Saved(kept, a, "cached"), Saved(cfg.n_heads, 4, "cached")]
    return out + ([Saved(k, 4, "cached"), Saved(k, 8, "cached")] if cfg.is_moe else [])


def _region(cfg: ModelConfig, granularity: str | None, precision: str) -> float:
    """Bytes per token of what backward recomputes (or restores) of one block at once."""
    full = _bytes(layer_tensors(cfg, None, precision))
    if granularity == "attention":
        return full - _bytes(layer_tensors(cfg, "attention", precision)) + cfg.d_model * activation_dtype_bytes(precision)
    if granularity == "mlp":
        return full - _bytes(layer_tensors(cfg, "mlp", precision)) + cfg.d_model * activation_dtype_bytes(precision)
    if granularity == "experts":
        return full - _bytes(layer_tensors(cfg, "experts", precision))
    return full


def _bytes(saved: list[Saved], compression: str | None = None, scale: str = "block", offload: bool = False) -> float:
    """Bytes per token that stay on the device of ``saved``: compressed (one byte per element and
    its scales) and/or offloaded (none) where the tensor's kind allows."""
    total = 0.0
    for s in saved:
        if s.kind == "act" and offload:
            continue
        if s.kind == "act" and compression:
            total += s.elements * (1 + (SCALE_BYTES / SCALE_BLOCK if scale == "block" else 0))
        else:
            total += s.elements * s.size
    return total


def _offloaded(saved: list[Saved], compression: str | None, scale: str) -> float:
    """Bytes per token of ``saved`` that offload sends to the host."""
    return _bytes([s for s in saved if s.kind == "act"], compression, scale)


@functools.lru_cache(maxsize=4096)
def _per_token(cfg: ModelConfig, checkpointing, compression, offload: bool, precision: str) -> tuple[float, float, float]:
    """(bytes the blocks keep, the peak during the step, bytes on the host) per token. The peak: a
    block's backward (or forward) holds what the blocks before it keep, and its own in flight —
    its checkpointed region recomputed, its compressed or offloaded tensors restored."""
    policy = activation_policy(_unfrozen(checkpointing), _unfrozen(compression), offload, n_layers=cfg.n_layers,
                               moe=cfg.is_moe)
    before = peak = host = 0.0
    for b in policy.blocks:
        saved = layer_tensors(cfg, b.checkpointing, precision)
        kept = _bytes(saved, b.compression, policy.scale, policy.offload)
        if b.checkpointing:  # its region recomputed
            flight = kept + _region(cfg, b.checkpointing, precision)
        elif b.compression or policy.offload:  # its tensors in their own dtype: the originals, or restored
            flight = kept + _bytes(saved)
        else:
            flight = kept
        if policy.offload:
            sent = _offloaded(saved, b.compression, policy.scale)
            host += sent
            flight += OFFLOAD_IN_FLIGHT * sent  # this block's and the next one's, fetched back
        peak = max(peak, before + flight)
        before += kept
    return before, peak, host


def _frozen(value):
    """A setting as a hashable key (mappings as sorted tuples)."""
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def _unfrozen(value):
    return dict(value) if isinstance(value, tuple) else value


def blocks_saved_bytes(cfg: ModelConfig, seq_len: int, checkpointing=False, *, compression="off",
                       offload: bool = False, precision: str = "bf16") -> float:
    """Bytes the blocks keep on the device for backward over one sequence of ``seq_len`` tokens:
    what the meter measures (``memory/activations_saved`` over a micro-batch of 1)."""
    kept, _, _ = _per_token(cfg, *_keys(checkpointing, compression), bool(offload), precision)
    return kept * seq_len


def offloaded_bytes(cfg: ModelConfig, seq_len: int, checkpointing=False, *, compression="off",
                    precision: str = "bf16") -> float:
    """Bytes of one sequence's saved activations that offload keeps in pinned host memory."""
    _, _, host = _per_token(cfg, *_keys(checkpointing, compression), True, precision)
    return host * seq_len


def _keys(checkpointing, compression) -> tuple:
    return _frozen(canonical_checkpointing(checkpointing)), _frozen(canonical_compression(compression))


def activation_bytes(cfg: ModelConfig, seq_len: int, checkpointing=False, *, compression="off",
                     offload: bool = False, precision: str = "bf16") -> float:
    """Activation bytes on the device of one sequence (micro-batch of 1) of ``seq_len`` tokens under
    ``checkpointing`` (any `compute.activation_checkpointing` value; True is full), ``compression``
    and ``offload``: what the blocks keep, one block in flight, the final norm and the loss's input
    gradient."""
    _, peak, _ = _per_token(cfg, *_keys(checkpointing, compression), bool(offload), precision)
    return float((peak + 3 * cfg.d_model * activation_dtype_bytes(precision)) * seq_len)


def fixed_parts(total_params: int | float, cfg: ModelConfig, sharding: Sharding) -> tuple[float, float, float]:
    """(model states, unsharded working set, loss workspace): the bytes per GPU that do not grow
    with the micro-batch. The unsharded set is FSDP's two gathered units (sharded modes) or DDP's
    fp32 gradient buckets (several replicas wrapped in DDP; one process is not wrapped)."""
    states = float(total_params) * BYTES_PER_PARAM / sharding.shards
    if sharding.data_parallel in SHARDED:
        unsharded = 2 * 4 * largest_unit_params(cfg, sharding.expert_parallel)
    elif sharding.data_parallel == "ddp" and sharding.devices > 1:
        unsharded = DDP_BUCKET_BYTES * float(total_params)
    else:
        unsharded = 0.0
    return states, float(unsharded), loss_workspace_bytes(cfg)


def fixed_bytes(total_params: int | float, cfg: ModelConfig, sharding: Sharding) -> float:
    """Bytes per GPU that do not depend on the micro-batch (`fixed_parts` summed): every memory
    verdict adds micro-batch × `activation_bytes` to this."""
    return sum(fixed_parts(total_params, cfg, sharding))


def loss_workspace_bytes(cfg: ModelConfig) -> float:
    """Bytes the chunked loss holds per micro-batch, whatever its size (see the module docstring)."""
    return float(vocab_of(cfg) * cfg.d_model * (4 + 2 + 2) + LOSS_CHUNK_ELEMENTS * (4 + 4 + 4 + 2))


def largest_unit_params(cfg: ModelConfig, expert_parallel: int = 1) -> int:
    """Parameters of the largest FSDP unit: a block (its E/N experts under expert parallelism N),
    the embedding or the output head."""
    block = block_counts(cfg)
    experts = block["ffn"] - cfg.d_model * cfg.n_experts if cfg.is_moe else 0  # less the router
    return max(block["total"] - experts + experts // expert_parallel, vocab_of(cfg) * cfg.d_model)


def usable_bytes(gpu_memory: float) -> float:
    return gpu_memory * (1 - MARGIN) - RESERVED_BYTES


def _max_batch(free: float, per_sample: float) -> int:
    return max(0, int(free // per_sample)) if per_sample > 0 else 0


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def memory_plan(total_params: int | float, cfg: ModelConfig | None, seq_len: int, sharding: Sharding,
                gpu_memory: float, micro_batch: int | None = None, activation_checkpointing=None,
                context_parallel: int = 1, *, compression="off", offload: bool = False,
                precision: str = "bf16", device: str = "cuda") -> dict:
    """Per-GPU memory, fit check and micro-batch suggestion of ``sharding`` (`fixed_parts` plus
    activations). ``cfg`` None (a nominal parameter count) estimates model states only.
    ``activation_checkpointing``: a `compute.activation_checkpointing` value (false, true/full,
    selective, N, {granularity, layers}); None picks: off if micro-batch 1 fits without it, else full.
    ``compression``, ``offload``: `compute.activation_compression` and `activation_offload` values.
    ``context_parallel`` N: each GPU holds seq_len / N tokens of a row (its activations).
    ``activation_options``: the per-GPU memory of each way of keeping activations, by the way in
    words (`plan.activations.activation_options`; offload on ``device`` cuda only), at the same
    micro-batch."""
    dp, sharded = sharding.data_parallel, sharding.data_parallel in SHARDED
    shardable = sharded or sharding.devices == 1  # one device: more of them would be sharded (`data_parallel_mode`)
    states_total = float(total_params) * BYTES_PER_PARAM
    states = states_total / sharding.shards
    usable = usable_bytes(gpu_memory)
    out: dict = {
        "data_parallel": dp, "shards": sharding.shards, "devices": sharding.devices,
        "bytes_per_param": dict(STATE_BYTES), "states_bytes_total": states_total, "states_bytes_per_gpu": states,
        "gpu_memory_bytes": gpu_memory, "usable_bytes": usable, "seq_len": seq_len,
        "context_parallel": context_parallel, "activation_compression": canonical_compression(compression),
        "activation_offload": bool(offload), "precision": precision,
    }
    if cfg is None:
        out.update(gathered_bytes_per_gpu=None, loss_workspace_bytes=None, activation_bytes_per_sample=None,
                   max_micro_batch=None, activation_checkpointing=activation_checkpointing,
                   micro_batch=micro_batch, suggested_micro_batch=None, total_bytes_per_gpu=states,
                   fits=states <= usable, min_gpus=math.ceil(states_total / usable) if usable > 0 and shardable else None,
                   activation_options=None)
        return out
    _, unsharded, loss = fixed_parts(total_params, cfg, sharding)
    tokens = seq_len // context_parallel
    act = {"no_ac": activation_bytes(cfg, tokens, False, precision=precision),
           "ac": activation_bytes(cfg, tokens, True, precision=precision)}
    free = usable - states - unsharded - loss
    max_mb = {k: _max_batch(free, v) for k, v in act.items()}
    if activation_checkpointing is None:
        activation_checkpointing = max_mb["no_ac"] < 1
    activation_checkpointing = canonical_checkpointing(activation_checkpointing)
    # a rank's share of the row
    chosen = activation_bytes(cfg, tokens, activation_checkpointing, compression=compression, offload=offload,
                              precision=precision)
    act["chosen"] = chosen
    suggested = min(_pow2_floor(_max_batch(free, chosen)), MAX_SUGGESTED_MICRO_BATCH) or None
    mb = micro_batch or suggested or 1
    total = states + unsharded + loss + mb * chosen
    # GPUs needed for micro-batch 1 with checkpointing: shards shrink, the rest does not.
    room = usable - unsharded - loss - act["ac"]
    options = {}  # by the way in words
    own = (activation_checkpointing, canonical_compression(compression), bool(offload))
    ways = activation_options(cfg, offload=device == "cuda")
    for ckpt, comp, off in ways + ([own] if own not in ways else []):  # the run's own way too
        per = activation_bytes(cfg, tokens, ckpt, compression=comp, offload=off, precision=precision)
        options[option_words(ckpt, comp, off)] = {
            "checkpointing": ckpt, "compression": comp, "offload": off, "bytes_per_sample": per,
            "total_bytes_per_gpu": states + unsharded + loss + mb * per,
            "fits": states + unsharded + loss + mb * per <= usable, "chosen": (ckpt, comp, off) == own}
    out.update(gathered_bytes_per_gpu=unsharded, loss_workspace_bytes=loss, activation_bytes_per_sample=act,
               max_micro_batch=max_mb, activation_checkpointing=activation_checkpointing, micro_batch=micro_batch,
               suggested_micro_batch=suggested, total_bytes_per_gpu=total, fits=total <= usable,
               min_gpus=math.ceil(states_total / room) if room > 0 and shardable else None,
               activation_options=options)
    return out


def data_parallel_mode(mode: str, total_params: int | float, cfg: ModelConfig | None, seq_len: int, *,
                       devices: int, nodes: int, gpu: bool, gpu_memory: float, expert_parallel: int = 1,
                       shard_size: int | None = None, context_parallel: int = 1) -> str:
    """``compute.data_parallel`` with ``auto`` resolved — the one rule, planned once (`plan.run`):

    - one device: ``none`` (nothing to share); ``compute.shard_size`` given: ``hsdp``;
    - CPU ranks: ``ddp`` (one machine's memory either way; nothing to gather);
    - expert parallelism: ``fsdp`` (the experts are split within a shard group);
    - GPUs: ``ddp`` where a whole copy of the model states, a micro-batch of one row and no
      activation checkpointing fit on each (no weights to gather, one all-reduce a step); else
      ``hsdp`` on several nodes where a node's GPUs hold a copy that way (its gathers stay on the
      node's links), else ``fsdp`` (the states over every GPU).
    """
    if mode != "auto":
        return mode
    if devices <= 1:
        return "none"
    if shard_size is not None:  # a shard group asked for: HSDP's
        return "hsdp"
    if not gpu:
        return "ddp"
    if expert_parallel > 1:
        return "fsdp"

    def fits(sharding: Sharding) -> bool:
        return memory_plan(total_params, cfg, seq_len, sharding, gpu_memory, micro_batch=1,
                           activation_checkpointing=False, context_parallel=context_parallel)["fits"]

    if fits(Sharding("ddp", devices)):
        return "ddp"
    if nodes > 1 and fits(Sharding("hsdp", devices, shard_size or max(1, devices // nodes))):
        return "hsdp"
    return "fsdp"
