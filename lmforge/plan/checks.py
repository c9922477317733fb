"""The checks a run's layout and batch must pass, each once: every command that plans (`train`,
`--dry-run`, preflight, `estimate`, the ranks themselves) reaches them through `plan.run.make_plan`,
and the torch code that builds the mesh (`distributed.parallelize`) calls `check_mesh` too.

- `check_mesh`: data parallelism, HSDP's shard group, expert and context parallelism fit the ranks;
- `check_batch_split`: the global batch splits over the data-parallel *replicas* (ranks that read
  different rows: context-parallel ranks share theirs) and into whole micro-batches;
- `check_context`: the context fits the prepared samples;
- `check_context_parallel`: what a row split over ranks needs (equal chunks; CUDA's ring attention);
- `check_rl`: what reinforcement learning needs of the context, the ranks and the machine.
"""

from __future__ import annotations

from lmforge.config.model import ModelConfig
from lmforge.config.schema import FINETUNE_TASKS, RL_TASK, ComputeConfig
from lmforge.errors import UserError
from lmforge.plan.layout import SHARDED, shard_group


def check_mesh(compute: ComputeConfig, world_size: int, nodes: int = 1, *, n_experts: int = 0) -> tuple[int, int]:
    """(replicate, shard) sizes for the run's data parallelism over ``world_size`` ranks on ``nodes``
    nodes; raises UserError when they do not fit, or when ``compute.expert_parallel`` does not fit
    them or the model's ``n_experts``."""
    if compute.data_parallel != "hsdp":
        if compute.shard_size is not None and compute.shard_size != world_size and compute.data_parallel == "fsdp":
            raise UserError(f"compute.shard_size: {compute.shard_size} is for data_parallel: hsdp; fsdp shards "
                            f"over all {world_size} ranks (set data_parallel: hsdp or remove shard_size)")
        replicate, shard = 1, world_size
    else:
        shard = shard_group("hsdp", world_size, nodes, compute.shard_size)
        if shard > world_size or world_size % shard:
            raise UserError(f"compute.shard_size: {shard} does not divide the {world_size} ranks; expected a "
                            f"divisor of {world_size} (ranks per shard group)")
        replicate = world_size // shard
    _check_expert_parallel(compute, shard, n_experts)
    _check_context_parallel_ranks(compute, world_size, shard)
    return replicate, shard


def _check_context_parallel_ranks(compute: ComputeConfig, world_size: int, shard: int) -> None:
    """The sizes context parallelism needs (the sequence's own rules: `check_context_parallel`)."""
    cp = compute.context_parallel
    if cp == 1:
        return
    key = f"compute.context_parallel: {cp}"
    if compute.data_parallel == "none":
        raise UserError(f"{key} needs data_parallel ddp, fsdp or hsdp: its gradients are reduced over the ranks "
                        "that share a row (got none)")
    if world_size % cp:
        raise UserError(f"{key} does not divide the {world_size} ranks; expected a divisor of {world_size}")
    if compute.data_parallel == "hsdp" and shard % cp:
        raise UserError(f"{key} does not divide the {shard} ranks of a shard group (compute.shard_size); expected "
                        f"a divisor of {shard}")


def _check_expert_parallel(compute: ComputeConfig, shard: int, n_experts: int) -> None:
    ep = compute.expert_parallel
    if ep == 1:
        return
    key = f"compute.expert_parallel: {ep}"
    if not n_experts:
        raise UserError(f"{key} needs a mixture-of-experts model (model.n_experts > 0); this model is dense "
                        "(remove expert_parallel)")
    if n_experts % ep:
        raise UserError(f"{key} does not divide the model's {n_experts} experts (model.n_experts); expected a "
                        f"divisor of {n_experts}")
    if compute.data_parallel not in SHARDED:
        raise UserError(f"{key} needs data_parallel: fsdp or hsdp (got {compute.data_parallel})")
    if shard % ep:
        what = "ranks of a shard group (compute.shard_size)" if compute.data_parallel == "hsdp" else "ranks"
        raise UserError(f"{key} does not divide the {shard} {what}; expected a divisor of {shard}")


def check_launch(cfg, ranks: int, *, device_type: str) -> None:
    """What a run on ``ranks`` ranks can be refused for from sizes alone, before any process starts
    (the launcher, before torchrun): its mesh, and a context the config gives against context
    parallelism (else the ranks' resolution checks the resolved length)."""
    c = cfg.compute
    n_experts = 0 if cfg.model == "auto" else cfg.model.n_experts  # model: auto chooses a dense shape
    check_mesh(c, ranks, c.nodes, n_experts=n_experts)
    if cfg.model != "auto" and cfg.parameters.context_length:
        check_context_parallel(c.context_parallel, cfg.parameters.context_length, cfg.model,
                               packed_rows=cfg.parameters.document_masking or cfg.task_type in FINETUNE_TASKS,
                               device_type=device_type)


def replicas(ranks: int, context_parallel: int) -> int:
    """Data-parallel replicas: the ranks that read different rows (context-parallel ranks share
    theirs), over which the global batch is split."""
    return max(1, ranks // context_parallel)


def check_batch_split(gbs: int, micro: int | None, ranks: int, context_parallel: int = 1, group: int = 1) -> None:
    """The global batch (samples) splits evenly over the replicas and, ``micro`` given, into whole
    micro-batches on each. ``group`` (task_type rl): ``gbs`` counts prompts, each sampled ``group``
    times by the rank that holds it, and the micro-batches split the completions."""
    n = replicas(ranks, context_parallel)
    who = f"ranks ({n})" if context_parallel == 1 else \
        f"data-parallel replicas ({n}: {ranks} ranks / compute.context_parallel {context_parallel})"
    if group > 1:
        if gbs % n:
            raise UserError(f"parameters.global_batch_size ({gbs} prompts) must be divisible by the number of {who}: "
                            "each rank samples the completions of its own prompts")
        if micro is not None and gbs * group % (micro * n):
            raise UserError(f"parameters.micro_batch_size ({micro}) × {who} = {micro * n} must divide the "
                            f"completions of a step: parameters.global_batch_size ({gbs}) × rl.group_size ({group}) "
                            f"= {gbs * group}")
    elif micro is None:
        if gbs % n:
            raise UserError(f"parameters.global_batch_size ({gbs}) must be divisible by the number of {who}")
    elif gbs % (micro * n):
        raise UserError(f"parameters.global_batch_size ({gbs}) must be divisible by micro_batch_size ({micro}) "
                        f"× {who} = {micro * n}")


def check_context(ctx: int, data_seq_len: int | None) -> None:
    """The context fits in the prepared training samples (None: not known here)."""
    if data_seq_len is not None and ctx > data_seq_len:
        raise UserError(f"parameters.context_length ({ctx}) is longer than the training data's samples "
                        f"({data_seq_len} tokens); prepare the data with --seq-len {ctx} or lower the context")


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


VLLM_NEEDS = "rl.engine: vllm needs CUDA and the vllm extra"


def check_rl(cfg, ctx: int, device_type: str) -> None:
    """Reinforcement learning (task_type rl): a completion of ``rl.max_new_tokens`` leaves room for a
    prompt in the context; whole rows on each rank (the policy samples them); a KL penalty without
    LoRA keeps a frozen copy of the model on every rank, which fsdp/hsdp would have to shard; the vLLM
    engine is CUDA's, and not in this version (docs/rl.md)."""
    if cfg.task_type != RL_TASK:
        return
    rl, c = cfg.rl, cfg.compute
    if rl.max_new_tokens >= ctx:
        raise UserError(f"rl.max_new_tokens ({rl.max_new_tokens}) leaves no room for a prompt within "
                        f"parameters.context_length ({ctx}); expected fewer new tokens or a longer context")
    if c.context_parallel > 1:
        raise UserError("compute.context_parallel: the policy samples and scores whole completions on one rank; "
                        "expected context_parallel 1 for task_type rl")
    if rl.kl and cfg.lora is None and c.data_parallel in SHARDED:
        raise UserError(f"rl.kl: the reference of full fine-tuning is a frozen copy of the starting weights, kept "
                        f"whole on every rank, which data_parallel {c.data_parallel} does not do; use lora: (the "
                        "reference is then the base with its adapters off), data_parallel ddp, or rl.kl: 0")
    if rl.engine == "vllm":
        import importlib.util

        if device_type != "cuda" or importlib.util.find_spec("vllm") is None:
            raise UserError(f"{VLLM_NEEDS} (pip install 'lmforge[vllm]'); this machine: "
                            f"{device_type}{'' if device_type != 'cuda' else ', vllm not installed'}; "
                            "rl.engine: native samples on every device")
        raise UserError("rl.engine: vllm is not available in this version (its weight sync and log-prob check are "
                        "not measured yet, docs/rl.md); rl.engine: native samples on CUDA too")
