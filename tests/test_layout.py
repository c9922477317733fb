"""Every layout the planner accepts, through the runtime's consumers, without torch.distributed.

The planner makes one `Layout` (`plan.run.make_plan` → ``TrainPlan.layout``); the mesh, the token
stream, the fine-tuning rows, RL's prompts and goodput's scored sections read it and never split a
batch again. Here a grid of meshes and batch splits goes through the planner; for each it accepts,
every rank's share is worked out by the consumers' own code and checked against what the layout
promises: each step reads the global batch once, each replica its own part, a row's context-parallel
ranks the same rows, micro-batches × accumulation = a rank's part; the mesh covers the ranks once.
"""

from __future__ import annotations

import itertools

import pytest

from lmforge.config.load import build_config
from lmforge.data.batch import StreamLayout
from lmforge.data.rows.rl import PromptStream
from lmforge.data.rows.sft import SFTStream
from lmforge.data.stream.tokens import _MicroBatches
from lmforge.distributed.parallelize import mesh_dims
from lmforge.errors import UserError
from lmforge.goodput.conditions import scored_sections
from lmforge.plan.machine import nominal_machine
from lmforge.plan.run import make_plan

# ~400 plans (a few seconds together): the integration tier, though nothing here trains or starts a process
pytestmark = pytest.mark.integration

MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "vocab_size": 256,
         "n_experts": 4, "top_k": 2}
RANKS = (1, 2, 4, 8)
MODES = ("none", "ddp", "fsdp", "hsdp")


def grid():
    for ranks, nodes, mode, cp, ep, gbs, micro, group in itertools.product(
            RANKS, (1, 2), MODES, (1, 2), (1, 2), (8, 12), (1, 2), (1, 4)):
        if (nodes > 1 and ranks < 4) or (mode == "none" and ranks > 1) or (group > 1 and cp > 1) or \
                (group > 1 and micro == 1):
            continue
        yield ranks, nodes, mode, cp, ep, gbs, micro, group


def plan_layout(ranks, nodes, mode, cp, ep, gbs, micro, group):
    """The planner's layout for one point of the grid, or None where it refuses it (one line)."""
    raw = {"model": MODEL, "train_data": "x", "training_duration": "10ba", "save_interval": "5ba",
           "parameters": {"global_batch_size": gbs, "micro_batch_size": micro, "context_length": 64},
           "compute": {"nodes": nodes, "data_parallel": mode, "context_parallel": cp, "expert_parallel": ep,
                       **({"rdzv_endpoint": "h:1"} if nodes > 1 else {})}}
    if group > 1:
        raw |= {"task_type": "rl", "rl": {"group_size": group, "max_new_tokens": 8, "reward": ["exact_match"]}}
    try:
        cfg = build_config(raw)
        return make_plan(cfg, nominal_machine("h100-sxm", ranks), samples_per_epoch=None, data_seq_len=64).layout
    except UserError:
        return None


@pytest.fixture(scope="module")
def layouts():
    out = {point: plan_layout(*point) for point in grid()}
    accepted = {p: lay for p, lay in out.items() if lay is not None}
    # the grid holds both: what the planner accepts, and what it refuses in one line
    assert len(accepted) > 100 and len(out) - len(accepted) > 20, (len(accepted), len(out))
    return accepted


def test_the_layout_is_what_was_asked_for(layouts):
    for (ranks, nodes, mode, cp, ep, gbs, micro, group), lay in layouts.items():
        assert (lay.ranks, lay.nodes, lay.data_parallel, lay.context_parallel, lay.expert_parallel) == \
            (ranks, nodes, mode, cp, ep)
        assert (lay.global_batch, lay.micro_batch, lay.group_size) == (gbs, micro, group)
        assert lay.micro_batch * lay.grad_accum * lay.replicas == lay.global_batch * lay.group_size


def test_the_mesh_covers_every_rank_once(layouts):
    for point, lay in layouts.items():
        scored = scored_sections(lay)
        assert scored[0] == "data" and ("forward" in scored) == (not lay.sharded and lay.context_parallel == 1
                                                                 and lay.expert_parallel == 1), point
        if not lay.sharded:
            continue
        names, sizes = mesh_dims(lay)
        assert names[-1] == "shard" and sizes[-1] == lay.shard_group and sizes[-1] % lay.expert_parallel == 0
        assert sizes[0] * (sizes[1] if len(sizes) == 2 else 1) == lay.ranks, point


def _steps_read(lay, read):
    """{step: {rank: rows}} over two steps: ``read(stream_layout, step)`` is a rank's rows of a step."""
    return {step: {rank: read(StreamLayout(seq_len=64, layout=lay, rank=rank, seed=1), step)
                   for rank in range(lay.ranks)} for step in (0, 1)}


def _check_split(lay, per_step, point):
    for step, by_rank in per_step.items():
        by_replica = {}
        for rank, rows in by_rank.items():
            replica = lay.replica(rank)
            assert by_replica.setdefault(replica, rows) == rows, f"{point}: rank {rank} reads its own rows"
        assert sorted(by_replica) == list(range(lay.replicas)), point
        everything = [r for rows in by_replica.values() for r in rows]
        assert len(everything) == len(set(everything)) == lay.global_batch, point  # each sample once


def test_token_streams_read_each_global_batch_once(layouts):
    for point, lay in layouts.items():
        if lay.group_size > 1:
            continue

        def read(sl, step):
            mb = _MicroBatches([], [], None, seq_len=64, layout=sl.layout, replica=sl.replica, base=0, first=0,
                               pieces=[])
            rows = [int(i) for m in range(step * lay.grad_accum, (step + 1) * lay.grad_accum)
                    for i in mb.samples_of(m)]
            assert all(step * lay.global_batch <= i < (step + 1) * lay.global_batch for i in rows)
            return rows

        _check_split(lay, _steps_read(lay, read), point)


def test_fine_tuning_rows_read_each_global_batch_once(layouts):
    rows = list(range(1000))  # more rows than two steps read: no epoch wraps inside them
    for point, lay in layouts.items():
        if lay.group_size > 1:
            continue

        def read(sl, step):
            stream = SFTStream(rows, sl)
            return [i for m in range(step * lay.grad_accum, (step + 1) * lay.grad_accum) for i in stream._indices(m)]

        _check_split(lay, _steps_read(lay, read), point)


class _Prompts(list):
    ids = property(lambda self: list(self))


def test_rl_ranks_sample_their_own_prompts_and_train_on_every_completion(layouts):
    prompts = _Prompts(range(1000))
    rl = {p: lay for p, lay in layouts.items() if lay.group_size > 1}
    assert rl
    for point, lay in rl.items():

        def read(sl, step):
            stream = iter(PromptStream(prompts, sl))
            batch = next(itertools.islice(stream, step, None))
            assert batch.step == step
            # the rank samples group_size completions of each; its micro-batches split them exactly
            assert len(batch) * lay.group_size == lay.micro_batch * lay.grad_accum
            return batch.index

        _check_split(lay, _steps_read(lay, read), point)
