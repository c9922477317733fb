"""Traffic of the MoE layers per GPU and optimizer step, with and without expert parallelism.

Without expert parallelism FSDP shards every layer's E experts over all S GPUs and gathers them
whole for each micro-batch's forward and again for its backward (bf16), then reduce-scatters their
fp32 gradients once per step. With ``expert_parallel: N`` a GPU holds E/N experts, gathered only
over the S/N GPUs that hold the same ones, and the tokens travel instead: each MoE layer sends
every routed slot (top_k per token, d values, bf16) to its expert's GPU and back, in forward
(dispatch, combine) and backward (their gradients) — 4 exchanges, 6 with full activation
checkpointing, whose recompute sends again (selective checkpointing keeps the all-to-all
outputs). A GPU keeps 1/N of its slots (its own experts), so it sends (N-1)/N of them.

Bytes *received* per GPU: a ring all-gather or reduce-scatter moves (S-1)/S of the full tensor
through each GPU. Routing is assumed balanced; a skewed router sends more to the hot experts'
GPUs (dropless: nothing is cut).
"""

from __future__ import annotations

from lmforge.config.model import ModelConfig

BF16, FP32 = 2, 4


def expert_params_per_layer(cfg: ModelConfig) -> int:
    return cfg.n_experts * 3 * cfg.d_model * cfg.expert_dim


def moe_traffic(cfg: ModelConfig, *, tokens_per_microbatch: int, micro_batches: int, n_devices: int,
                expert_parallel: int = 1, full_recompute: bool = False) -> dict:
    """Bytes per GPU per optimizer step: all-to-all, expert all-gather, expert reduce-scatter."""
    ep = expert_parallel
    layers = cfg.n_layers
    local = expert_params_per_layer(cfg) / ep
    shard = n_devices // ep  # GPUs sharing the same experts (FSDP over them)
    ring = (shard - 1) / shard
    exchanges = 6 if full_recompute else 4
    all_to_all = exchanges * tokens_per_microbatch * cfg.top_k * cfg.d_model * BF16 * (ep - 1) / ep
    return {
        "expert_parallel": ep,
        "all_to_all_bytes": layers * micro_batches * all_to_all,
        "expert_all_gather_bytes": layers * micro_batches * 2 * BF16 * local * ring,
        "expert_reduce_scatter_bytes": layers * FP32 * local * ring,
    }
