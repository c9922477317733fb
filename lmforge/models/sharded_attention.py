"""Attention over rows whose tokens are split across ranks (context parallelism).

Under ``compute.context_parallel: N`` each rank of a group of N holds part of every row: its
tokens and their *global* positions (the layout is `distributed.context_parallel`'s, with causal
load balancing). RoPE reads its tables at those positions; attention must see the whole row.
Two ways, both exact:

- **all-gathered keys and values** (the CPU, gloo): each rank gathers the group's K and V (an
  autograd function whose backward reduce-scatters the K/V gradients back to the ranks that own
  them) and attends with its own queries over the whole row, under a mask built from global
  positions: causal, within a sliding window, and within a packed document (document ids travel
  with the tokens; the keys' ids and positions are gathered once per forward). Every mask the
  unsharded model has works here, soft-capping too. K/V of the whole row exist on each rank, one
  layer at a time: the queries, scores and outputs stay local.
- **ring attention** (CUDA, plain causal rows): inside torch's `context_parallel`, SDPA becomes
  ring attention (K/V chunks pass around the group while each rank computes). Its kernels take
  equal head counts, so grouped-query K/V are repeated to the query heads first.

`Transformer._attention_inputs` builds a `ShardedMask` per layer kind; `Attention` asks it for
the keys and values to attend over (`ShardedMask.keys_and_values`) and then runs its usual
kernels. Nothing else in the model knows about other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td
from torch.distributed.device_mesh import DeviceMesh

# torch 2.13 renamed the single-tensor collectives (the old names warn there); older torch has only those.
_all_gather = getattr(td, "all_gather_single", td.all_gather_into_tensor)
_reduce_scatter = getattr(td, "reduce_scatter_single", td.reduce_scatter_tensor)


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks one row is split over, as the model sees them (set by `distributed.parallelize`)."""

    mesh: DeviceMesh  # 1-D: the group's ranks
    ring: bool  # torch's ring attention (CUDA, plain causal); else all-gathered K/V

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


@dataclass(frozen=True)
class ShardedMask:
    """What one layer kind's attention needs on a shard: the gather path's boolean mask of the
    local queries over the gathered keys ([Tq, T] or [B, 1, Tq, T]) and group, or neither
    (ring attention: plain causal, the group is torch's)."""

    mask: torch.Tensor | None
    group: td.ProcessGroup | None

    def keys_and_values(self, k: torch.Tensor, v: torch.Tensor, heads: int):
        """(keys, values, mask) for the local queries ([B, heads, Tq, Dh]) from the local k, v
        [B, KV, Tq, Dh]: the whole row's K/V and the mask (gather path), or K/V with their heads
        repeated to the query heads and no mask (ring attention: SDPA with is_causal, which
        torch's `context_parallel` turns into ring attention; its kernels take equal head
        counts)."""
        if self.group is None:
            groups = heads // k.shape[1]
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            return k, v, None
        return _GatherSequence.apply(k, self.group), _GatherSequence.apply(v, self.group), self.mask


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([B, H, T_local, Dh] → [B, H, N·T_local, Dh], ranks in order);
    backward: the sum of every rank's gradient for this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: td.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, 2, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = td.get_world_size(ctx.group)
        whole = grad.movedim(2, 0).contiguous()
        part = whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))
        _reduce_scatter(part, whole, op=td.ReduceOp.SUM, group=ctx.group)
        return part.movedim(0, 2), None


def _gather(x: torch.Tensor, dim: int, group: td.ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` (no autograd)."""
    size = td.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((size * local.shape[0], *local.shape[1:]))
    _all_gather(out, local, group=group)
    return out.movedim(0, dim)


@dataclass(frozen=True)
class ShardKeys:
    """The local queries' and the whole row's positions and document ids, gathered once per
    forward; `mask` gives each layer kind its `ShardedMask`."""

    group: SequenceGroup
    positions: torch.Tensor  # [Tq] global positions of this rank's tokens
    key_positions: torch.Tensor | None  # [T] of every rank's tokens, in gathered order (gather path)
    doc_ids: torch.Tensor | None  # [B, Tq]
    key_doc_ids: torch.Tensor | None  # [B, T]

    @classmethod
    def gather(cls, group: SequenceGroup, positions: torch.Tensor, doc_ids: torch.Tensor | None) -> "ShardKeys":
        if group.ring:
            return cls(group, positions, None, None, None)
        pg = group.mesh.get_group()
        keys = _gather(positions, 0, pg)
        key_docs = None if doc_ids is None else _gather(doc_ids, 1, pg)
        return cls(group, positions, keys, doc_ids, key_docs)

    def mask(self, window: int | None) -> ShardedMask:
        """Query i may see key j when j's global position is not after i's, is within ``window``
        positions (itself included), and j is in i's document: the unsharded rule
        (`transformer.attention_mask`) on global positions."""
        if self.group.ring:
            return ShardedMask(None, None)
        q, k = self.positions[:, None], self.key_positions[None, :]
        mask = k <= q
        if window is not None:
            mask = mask & (q - k < window)
        if self.doc_ids is not None:
            mask = (mask & (self.doc_ids[:, :, None] == self.key_doc_ids[:, None, :]))[:, None]
        return ShardedMask(mask, self.group.mesh.get_group())
