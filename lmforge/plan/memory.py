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

Activations per sequence of T tokens (bf16, 2 bytes/element), counting the tensors
autograd keeps for the backward pass, in the spirit of Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") but for this
architecture — RMSNorm, SwiGLU, GQA, flash/SDPA attention (no T×T score matrix is
stored), no dropout. Per layer and token, in elements (q = H·Dh, kv = KV·Dh):

- attention: residual input d, normed input d, rotated q, k and v, output q
  → 2d + 2q + 2kv;
- dense MLP: residual input d, normed input d, gate, up, silu(gate), product (ffn each)
  → 2d + 4·ffn;
- MoE MLP: 2d, router logits E in fp32 (2E), and per routed expert (top_k of them)
  the gathered input d, gate/up/silu/product (expert_dim each) and the output d
  → 2d + 2E + top_k·(2d + 4·expert_dim).

What the checkpointing modes (`compute.activation_checkpointing`, see `checkpointed_blocks`)
keep per layer and token:

- none: all of the above;
- full (per block): the block's input (d), plus one block recomputed during its backward;
- selective (the outputs of matmuls and attention kept, element-wise ops recomputed): the
  block's input d, q, k and v as projected (q + 2kv), attention's output q, its projection d,
  gate and up (ffn each) and the down projection d → 3d + 2q + 2kv + 2·ffn (MoE: router
  logits E, and per routed expert gate|up 2·expert_dim and the output d), plus one block's
  element-wise tensors during its backward;
- every N-th block (full): those blocks as full, the others as none.
Both add the final norm (2d) and the loss's gradient with respect to its input (d): the
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

import math

from lmforge.config.model import ModelConfig
from lmforge.plan.flops import block_counts, vocab_of
from lmforge.plan.layout import SHARDED, Sharding

STATE_BYTES = {"bf16_params": 2, "fp32_master": 4, "fp32_grads": 4, "adam_m": 4, "adam_v": 4}
BYTES_PER_PARAM = sum(STATE_BYTES.values())
# What every trained parameter holds whatever the precision (fp32 weights, gradients, AdamW m and v):
# the sure lower bound preflight refuses a run on (the bf16 copies and activations come on top).
TRAINED_BYTES_PER_PARAM = BYTES_PER_PARAM - STATE_BYTES["bf16_params"]
ACT_BYTES = 2  # bf16 activations
# Logits per chunk of the loss: the same number as models.loss.CHUNK_ELEMENTS (this module
# stays free of torch so that `lmforge estimate` starts fast; tests/test_loss.py checks).
LOSS_CHUNK_ELEMENTS = 2**25
MARGIN = 0.10
RESERVED_BYTES = 1e9
# Beyond a few tens of sequences per micro-batch a GPU is saturated; suggesting more
# only makes the global batch needlessly large.
MAX_SUGGESTED_MICRO_BATCH = 64
DDP_BUCKET_BYTES = 4  # per parameter: DDP's fp32 gradient buckets


def checkpointed_blocks(value, n_layers: int) -> tuple[str | None, list[int]]:
    """``compute.activation_checkpointing`` → (mode, indices of the blocks to checkpoint): the
    one reading of the setting (`distributed.parallelize` applies it, the memory model counts it).

    ``false``: none; ``true``/``full``: every block; ``selective``: every block, keeping matmul
    and attention outputs (recomputing only the cheap element-wise ops); ``N``: every N-th block
    (full). ``auto`` is resolved before training (`plan.micro_batch`); left unresolved (a
    model built outside a run) it means none.
    """
    if value is False or value is None or value == "auto":
        return None, []
    if value is True or value == "full":
        return "full", list(range(n_layers))
    if value == "selective":
        return "selective", list(range(n_layers))
    return "full", [i for i in range(n_layers) if (i + 1) % int(value) == 0]


def layer_activation_elements(cfg: ModelConfig, mode: str | None = None) -> int:
    """Elements one transformer block keeps for backward, per token: without checkpointing
    (``mode`` None), or under ``selective`` checkpointing (see the module docstring)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head
    if mode == "selective":
        attention = 2 * d + 2 * q + 2 * kv  # input, q k v, attention output, its projection
        if cfg.is_moe:
            return attention + cfg.n_experts + cfg.top_k * (2 * cfg.expert_dim + d) + d
        return attention + 2 * cfg.ffn_dim + d
    attention = 2 * d + 2 * q + 2 * kv
    if cfg.is_moe:
        mlp = 2 * d + 2 * cfg.n_experts + cfg.top_k * (2 * d + 4 * cfg.expert_dim)
    else:
        mlp = 2 * d + 4 * cfg.ffn_dim
    return attention + mlp


def activation_bytes(cfg: ModelConfig, seq_len: int, checkpointing=False) -> float:
    """Activation bytes of one sequence (micro-batch of 1) of ``seq_len`` tokens under
    ``checkpointing`` (any `compute.activation_checkpointing` value; True is full)."""
    mode, which = checkpointed_blocks(checkpointing, cfg.n_layers)
    layer = layer_activation_elements(cfg)
    d = cfg.d_model
    if mode == "selective":
        kept = cfg.n_layers * layer_activation_elements(cfg, "selective") + layer  # + one block's recompute
    elif mode == "full":
        kept = (cfg.n_layers - len(which)) * layer + len(which) * d + (layer if which else 0)
    else:
        kept = cfg.n_layers * layer
    per_token = (kept + 3 * d) * ACT_BYTES  # + final norm input (2d) and the loss's input gradient (d)
    return float(per_token * seq_len)


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
                context_parallel: int = 1) -> dict:
    """Per-GPU memory, fit check and micro-batch suggestion of ``sharding`` (`fixed_parts` plus
    activations). ``cfg`` None (a nominal parameter count) estimates model states only.
    ``activation_checkpointing``: a `compute.activation_checkpointing` value (false, true/full,
    selective, N); None picks: off if micro-batch 1 fits without it, else full.
    ``context_parallel`` N: each GPU holds seq_len / N tokens of a row (its activations)."""
    dp, sharded = sharding.data_parallel, sharding.data_parallel in SHARDED
    shardable = sharded or sharding.devices == 1  # one device: more of them would be sharded (`data_parallel_mode`)
    states_total = float(total_params) * BYTES_PER_PARAM
    states = states_total / sharding.shards
    usable = usable_bytes(gpu_memory)
    out: dict = {
        "data_parallel": dp, "shards": sharding.shards, "devices": sharding.devices,
        "bytes_per_param": dict(STATE_BYTES), "states_bytes_total": states_total, "states_bytes_per_gpu": states,
        "gpu_memory_bytes": gpu_memory, "usable_bytes": usable, "seq_len": seq_len,
        "context_parallel": context_parallel,
    }
    if cfg is None:
        out.update(gathered_bytes_per_gpu=None, loss_workspace_bytes=None, activation_bytes_per_sample=None,
                   max_micro_batch=None, activation_checkpointing=activation_checkpointing,
                   micro_batch=micro_batch, suggested_micro_batch=None, total_bytes_per_gpu=states,
                   fits=states <= usable, min_gpus=math.ceil(states_total / usable) if usable > 0 and shardable else None)
        return out
    _, unsharded, loss = fixed_parts(total_params, cfg, sharding)
    tokens = seq_len // context_parallel
    act = {"no_ac": activation_bytes(cfg, tokens, False), "ac": activation_bytes(cfg, tokens, True)}
    free = usable - states - unsharded - loss
    max_mb = {k: _max_batch(free, v) for k, v in act.items()}
    if activation_checkpointing is None:
        activation_checkpointing = max_mb["no_ac"] < 1
    chosen = activation_bytes(cfg, tokens, activation_checkpointing)  # a rank's share of the row
    suggested = min(_pow2_floor(_max_batch(free, chosen)), MAX_SUGGESTED_MICRO_BATCH) or None
    mb = micro_batch or suggested or 1
    total = states + unsharded + loss + mb * chosen
    # GPUs needed for micro-batch 1 with checkpointing: shards shrink, the rest does not.
    room = usable - unsharded - loss - act["ac"]
    out.update(gathered_bytes_per_gpu=unsharded, loss_workspace_bytes=loss, activation_bytes_per_sample=act,
               max_micro_batch=max_mb, activation_checkpointing=activation_checkpointing, micro_batch=micro_batch,
               suggested_micro_batch=suggested, total_bytes_per_gpu=total, fits=total <= usable,
               min_gpus=math.ceil(states_total / room) if room > 0 and shardable else None)
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
