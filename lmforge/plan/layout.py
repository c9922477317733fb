"""The one layout of a run: how its ranks split the work, and how a global batch splits over them.

The planner makes it once (`plan.run.make_plan` → ``TrainPlan.layout``), after the mesh and batch
checks (`plan.checks`) have passed; everything at run time that needs to know how ranks are
arranged — building and wrapping the model (`train.build`, `distributed.parallelize`), the data
streams and fine-tuning rows, the trainer's step, its MFU, torchrun — reads this object instead of
`compute.*` or a batch size, and never derives one of its numbers again. Like torchtitan's
``ParallelDims``: built once, checked once, passed everywhere. No torch here.

The mesh, outermost first::

    ranks = replicate × shard            (data parallelism: hsdp replicates shard groups;
                                          fsdp is one group of every rank; ddp/none replicate all)
    ranks = replicas × context_parallel  (consecutive ranks share each row under context parallelism)

and the batch: ``global_batch = micro_batch × grad_accum × replicas`` samples per optimizer step.
Reinforcement learning (task_type rl) samples ``group_size`` completions of each of its
``global_batch`` prompts, every rank for its own prompts; its update splits the completions:
``global_batch × group_size = micro_batch × grad_accum × replicas`` (every other task: a group of 1).
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDED = ("fsdp", "hsdp")  # the data-parallel modes that shard the model states
REPLICATED = ("ddp", "none")  # the modes that keep every model state on every rank


@dataclass(frozen=True)
class Sharding:
    """How a run's devices hold the model states — the part of a layout the memory model,
    `micro_batch_size: auto` and the long-context search count with (a `Layout`'s ``sharding``, or
    one described for `lmforge estimate`)."""

    data_parallel: str = "fsdp"  # fsdp | hsdp | ddp | none
    devices: int = 1  # every device, all nodes
    shard_size: int | None = None  # hsdp: the shard group (`shard_group`); None: every device
    expert_parallel: int = 1

    @property
    def shards(self) -> int:
        """Devices one copy of the model states is split over."""
        if self.data_parallel == "fsdp":
            return self.devices
        if self.data_parallel == "hsdp":
            return self.shard_size or self.devices
        return 1


@dataclass(frozen=True)
class Layout:
    """A run's ranks and batch split, as planned (immutable)."""

    ranks: int = 1  # every rank of every node
    nodes: int = 1
    data_parallel: str = "none"  # none | ddp | fsdp | hsdp
    shard_group: int = 1  # ranks one copy of the model states is split over (fsdp: all; hsdp: a group; else 1)
    context_parallel: int = 1  # consecutive ranks that split each row's tokens
    expert_parallel: int = 1  # ranks of a shard group that split each MoE layer's experts
    global_batch: int = 1  # samples per optimizer step, all ranks (task_type rl: prompts)
    micro_batch: int = 1  # samples per forward pass, per rank (task_type rl: completions)
    group_size: int = 1  # task_type rl: completions sampled per prompt; 1 otherwise
    device: str = "cpu"  # "cpu" | "cuda"
    peak_flops: float = 0.0  # one device's peak FLOP/s at the run's precision (MFU's denominator)

    def __post_init__(self):
        if self.ranks % self.context_parallel or self.global_batch % self.replicas or \
                self.sequences % (self.micro_batch * self.replicas):
            raise ValueError(f"layout: an unchecked split reached the layout ({self})")  # `plan.checks` failed to

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: ranks that read different rows (a row's context-parallel ranks share it)."""
        return self.ranks // self.context_parallel

    @property
    def sequences(self) -> int:
        """Rows trained on per optimizer step, all ranks: the samples (task_type rl: every completion)."""
        return self.global_batch * self.group_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank and optimizer step."""
        return self.sequences // (self.micro_batch * self.replicas)

    @property
    def per_replica(self) -> int:
        """Samples (task_type rl: prompts) one replica reads per optimizer step."""
        return self.global_batch // self.replicas

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.ranks // self.nodes)

    @property
    def sharded(self) -> bool:
        """The model states are sharded (fsdp/hsdp): every rank takes part in every forward."""
        return self.data_parallel in SHARDED

    @property
    def replicate(self) -> int:
        """HSDP's replica groups (the outer mesh dimension); 1 for fsdp, every rank for ddp."""
        return self.ranks // self.shard_group

    @property
    def distributed(self) -> bool:
        return self.ranks > 1

    @property
    def sharding(self) -> Sharding:
        return Sharding(self.data_parallel, self.ranks, self.shard_group, self.expert_parallel)

    def replica(self, rank: int) -> int:
        """Which data-parallel replica ``rank`` belongs to (which rows it reads)."""
        return rank // self.context_parallel

    def describe(self) -> str:
        """The ranks in words, for a run's first lines."""
        if self.context_parallel == 1:
            return f"{self.ranks} rank(s)"
        return f"{self.replicas} replica(s) of {self.context_parallel} context-parallel ranks"


def shard_group(data_parallel: str, ranks: int, nodes: int, shard_size: int | None) -> int:
    """The ranks one copy of the model states is split over — the one rule: fsdp shards over every
    rank; hsdp over ``compute.shard_size``, by default a node's ranks; ddp and none keep whole copies."""
    if data_parallel == "fsdp":
        return ranks
    if data_parallel == "hsdp":
        return shard_size or max(1, ranks // max(1, nodes))
    return 1
