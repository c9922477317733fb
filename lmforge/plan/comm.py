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

**The time it adds to a step** (`step_communication`). Every collective of a step, with the link
it crosses — a node's GPU links (NVLink; PCIe cards: the bus) when its group stays in a node, the
network (one NIC per GPU) when it spans nodes — at the bandwidths of `plan.hardware`:

- data parallelism: FSDP/HSDP all-gather the shard group's weights for each micro-batch's forward
  (and again for its backward with ``reshard_after_forward``) and reduce-scatter the fp32
  gradients once per step; HSDP then all-reduces each shard across the replica groups; DDP
  all-reduces the fp32 gradients once per step (2·(N−1)/N of them through each GPU);
- MoE: with expert parallelism the experts' own gathers (over S/N GPUs) and the all-to-all of
  the routed tokens (`moe_traffic`);
- context parallelism: ring attention passes each layer's K and V (repeated to the query heads)
  around the N ranks of a row in forward, and K, V and their gradients in backward.

The collectives of data and context parallelism run on their own stream while the blocks
compute (FSDP prefetches the next block's weights; gradients are reduced during the backward; the
ring passes the next chunk during attention): up to ``OVERLAP`` of the compute time hides them —
never all of it (the first gather and the last reduce-scatter have nothing to run behind, and
collectives slow the kernels they share the GPU with). The all-to-all is not hidden: the experts
wait for their tokens and the next layer for the experts' output. What is not hidden is added to
the step's compute time.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.model import ModelConfig
from lmforge.plan.flops import param_counts
from lmforge.plan.hardware import GPUSpec
from lmforge.plan.layout import Sharding

BF16, FP32 = 2, 4
OVERLAP = 0.8  # of a step's compute time, at most, that data- and context-parallel collectives run behind


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


@dataclass(frozen=True)
class Collective:
    """One kind of a step's traffic: bytes through each GPU per optimizer step, and the link they cross."""

    what: str
    bytes: float
    network: bool  # crosses nodes (else a node's GPU links)
    hidden: bool  # may run behind compute (`OVERLAP`)

    def seconds(self, spec: GPUSpec) -> float:
        bandwidth = spec.network_bytes_per_s if self.network else spec.link_bytes_per_s
        return self.bytes / bandwidth if bandwidth else 0.0


def step_collectives(cfg: ModelConfig, sharding: Sharding, *, nodes: int, micro_batch: int, grad_accum: int,
                     seq_len: int, context_parallel: int = 1, precision: str = "bf16",
                     reshard_after_forward: bool = True, full_recompute: bool = False) -> list[Collective]:
    """Every collective of one optimizer step of ``cfg`` under ``sharding`` (see the module docstring).
    ``seq_len``: a row's tokens (all its context-parallel ranks together)."""
    n, dp = sharding.devices, sharding.data_parallel
    if n <= 1:
        return []
    per_node = max(1, n // max(1, nodes))
    ep = sharding.expert_parallel if cfg.is_moe else 1
    experts = cfg.n_layers * expert_params_per_layer(cfg) if cfg.is_moe else 0
    dense = param_counts(cfg)["total"] - experts  # every weight FSDP gathers over the whole shard group
    weight = FP32 if precision == "fp32" else BF16
    gathers = (2 if reshard_after_forward else 1) * grad_accum  # per step
    out: list[Collective] = []
    if dp in ("fsdp", "hsdp"):
        s = sharding.shards
        ring = (s - 1) / s
        gathered = dense + (experts if ep == 1 else 0)
        out += [Collective("FSDP all-gather", gathers * weight * gathered * ring, s > per_node, True),
                Collective("FSDP reduce-scatter", FP32 * gathered * ring, s > per_node, True)]
        if ep > 1:
            moe = moe_traffic(cfg, tokens_per_microbatch=micro_batch * seq_len // context_parallel,
                              micro_batches=grad_accum, n_devices=s, expert_parallel=ep,
                              full_recompute=full_recompute)
            wide = s // ep > per_node  # the GPUs holding the same experts span nodes
            out += [Collective("expert all-gather", moe["expert_all_gather_bytes"] * gathers / (2 * grad_accum),
                               wide, True),
                    Collective("expert reduce-scatter", moe["expert_reduce_scatter_bytes"], wide, True),
                    Collective("expert all-to-all", moe["all_to_all_bytes"], ep > per_node, False)]
        if dp == "hsdp" and n > s:
            r = n // s
            out.append(Collective("HSDP all-reduce", 2 * (r - 1) / r * FP32 * (dense + experts) / s, nodes > 1, True))
    elif dp == "ddp":
        out.append(Collective("DDP all-reduce", 2 * (n - 1) / n * FP32 * (dense + experts), nodes > 1, True))
    if context_parallel > 1:
        kv_row = 2 * seq_len * cfg.n_heads * cfg.dim_head * BF16 * micro_batch  # K and V of one row, one layer
        passes = 4 if full_recompute else 3  # forward: K, V; backward: K, V and their gradients
        ring = (context_parallel - 1) / context_parallel
        out.append(Collective("context-parallel K/V ring", cfg.n_layers * grad_accum * passes * kv_row * ring,
                              context_parallel > per_node, True))
    return [c for c in out if c.bytes > 0]


def exposed_seconds(collectives: list[Collective], spec: GPUSpec, compute_s: float) -> float:
    """Seconds of a step's communication that compute does not hide (see the module docstring)."""
    hidden = sum(c.seconds(spec) for c in collectives if c.hidden)
    critical = sum(c.seconds(spec) for c in collectives if not c.hidden)
    return max(0.0, hidden - OVERLAP * compute_s) + critical
