"""Process groups: one code path for a single process, torchrun on CPU (gloo) and GPUs (nccl)."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as td

from lmforge.distributed.host_memory import keep_freed_memory
from lmforge.errors import UserError


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError("compute.device: cuda was asked for but no CUDA GPU is visible")
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"compute: rank {local_rank} has no GPU ({torch.cuda.device_count()} present)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_kind: str = "auto", timeout_s: int = 600) -> DistInfo:
    """Join the process group when started by torchrun (RANK/WORLD_SIZE set), else single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_kind, local_rank)
    if device.type == "cpu":
        keep_freed_memory()  # a CPU step reallocates the same tensors every step (see host_memory)
    if world > 1 and not td.is_initialized():
        # GPUs: NCCL for the model, gloo beside it for CPU-side collectives (async checkpoints).
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        td.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                              device_id=device if device.type == "cuda" else None,
                              **_elastic_store(rank, world, timedelta(seconds=timeout_s)))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _elastic_store(rank: int, world: int, timeout: timedelta) -> dict:
    """Under torchrun: the store of this rendezvous round.

    lmforge's torchrun gives each round a store of its own, hosted by rank 0 (see
    `distributed.torchrun.agent_main`). Where torchrun shares one store across rounds instead
    (``TORCHELASTIC_USE_AGENT_STORE``), the restarted workers would read the previous attempt's peer
    addresses from it (same keys) and fail to connect ("Connection refused"): a per-attempt key
    prefix keeps them apart — on one node; on several, a node whose ranks did not fail counts its
    attempts differently (pytorch/pytorch#135712), which is why lmforge does not share it.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return {}
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = td.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                        is_master=not agent_hosts and rank == 0, timeout=timeout, multi_tenant=not agent_hosts)
    if agent_hosts:
        store = td.PrefixStore(f"lmforge/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    return {"store": store, "rank": rank, "world_size": world}


def barrier() -> None:
    if td.is_available() and td.is_initialized():
        td.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if td.is_available() and td.is_initialized():
        td.all_reduce(t, op=td.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if td.is_available() and td.is_initialized():
        td.all_reduce(t, op=td.ReduceOp.MAX)
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (one small all-reduce; no pickling)."""
    if not (td.is_available() and td.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from rank ``src`` to every rank (identity when single process)."""
    if not (td.is_available() and td.is_initialized()):
        return obj
    box = [obj]
    td.broadcast_object_list(box, src=src)
    return box[0]


def destroy() -> None:
    """Tear the process group down; call it after the run has dropped its models.

    A DDP reducer holds the group. Were it the last holder, freeing the model would destroy the
    group inside the reducer's deallocation with the GIL held, which joins gloo's worker threads
    — and one may need the GIL to release a finished collective's Python tensors: a deadlock
    (seen once under load: a completed two-rank run's rank 0 never exited, stuck in
    ~ProcessGroupGloo under ~Reducer). Destroyed here, the group's own binding lets the GIL go;
    the pause (sleep releases the GIL) lets gloo's threads finish releasing first."""
    if td.is_available() and td.is_initialized():
        gc.collect()  # models held in reference cycles: free them now, not inside a later allocation
        time.sleep(0.1)
        td.destroy_process_group()
