"""Muon for the hidden weight matrices: orthogonalized momentum, whole matrices at any sharding.

The update of one weight matrix W (A × B) with gradient G, as `torch.optim.Muon` with
``nesterov=True`` and ``adjust_lr_fn="match_rms_adamw"`` (Jordan et al. 2024, "Muon: an optimizer
for hidden layers"; Liu et al. 2025, "Muon is scalable for LLM training")::

    M ← μ·M + (1 − μ)·G                      momentum (EMA form, as torch's)
    U ← NS₅((1 − μ)·G + μ·M)                 Nesterov, then five quintic Newton–Schulz iterations
    W ← W·(1 − lr·wd) − lr · 0.2·√max(A, B) · U

NS₅ maps the update to (roughly) the nearest semi-orthogonal matrix; its entries then have an RMS
of about 1/√max(A, B). **The learning-rate rule is Moonshot's RMS matching** (Liu et al. 2025,
§2.2): scaling by 0.2·√max(A, B) gives every matrix's update the RMS ≈ 0.2 of a typical AdamW
update, so one peak learning rate and one decoupled weight decay serve the Muon matrices and the
AdamW parameters alike (not Keller Jordan's √max(1, A/B), which needs its own, much larger LR:
0.02 in his recipe against AdamW's ~3e-4).

Whole matrices, whatever the layout:

- a stacked parameter [..., A, B] (the MoE experts' ``w2`` [E, h, d]) is that many separate
  matrices; a parameter holding k matrices side by side in its last dimension (the experts'
  fused gate | up ``w13`` [E, d, 2h], declared by `GroupedExperts.FUSED_COLUMNS`) is k·E of them —
  each orthogonalized on its own, as the same projections of a dense model are;
- under FSDP2/HSDP a parameter is a DTensor sharded on its first dimension. Where that dimension
  is one of the matrix's own (every 2-D weight), the matrices are spread over the W ranks of the
  shard group (`orthogonalize_spread`): matrix i goes whole to rank i mod W (one all-to-all for
  all of them), which orthogonalizes it and sends every rank its rows back (one more) — each
  rank does 1/W of the Newton–Schulz work, as in Dion and torchtitan's distributed Muon. (Any
  other layout that splits a matrix is all-gathered and orthogonalized on every rank,
  `orthogonalize_sharded`; both give the bits a single process gives.) Where the shards only
  split the stack (expert weights, sharded on the expert dimension by FSDP and by expert
  parallelism), every rank already holds whole matrices and orthogonalizes its own, with no
  communication at all;
- the momentum buffer has the parameter's layout, so DCP saves and reshards it as it does
  AdamW's moments.

The iterations run in ``ns_dtype``: bf16 where the run's matmuls are bf16 (GPUs, as torch's and
modded-nanogpt's always do), fp32 otherwise — torch's version always casts to bf16, which on a CPU
without bf16 units costs ~5× a whole training step.
"""

from __future__ import annotations

import torch
import torch.distributed as td
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP's shard of an already-sharded dim (EP)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Jordan et al. (torch.optim.Muon's default)
NS_EPS = 1e-7


def rms_matching_scale(rows: int, cols: int) -> float:
    """Moonshot's rule: 0.2·√max(A, B) (Liu et al. 2025; torch's ``match_rms_adamw``)."""
    return 0.2 * max(rows, cols) ** 0.5


def newton_schulz(x: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Approximately orthogonalize each matrix of ``x`` ([A, B] or a batch [n, A, B]), in ``dtype``.

    The same operations as torch's ``_zeropower_via_newtonschulz`` (the result is bitwise equal to
    it for one bf16 matrix), batched: each matrix normalized by its own Frobenius norm."""
    a, b, c = NS_COEFFICIENTS
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype, column_blocks: int = 1) -> torch.Tensor:
    """NS of every matrix in a plain tensor [..., A, k·B] (k = ``column_blocks``), same shape and dtype."""
    if update.dim() == 2 and column_blocks == 1:
        return newton_schulz(update, steps, dtype).to(update.dtype)
    *stack, rows, cols = update.shape
    k = column_blocks
    # Contiguous whatever the stack size: the batched matmuls then give each matrix the same bits
    # whether a rank holds one expert or all of them (a resharded run stays bitwise comparable).
    mats = update.reshape(-1, rows, k, cols // k).transpose(1, 2).reshape(-1, rows, cols // k).contiguous()
    out = newton_schulz(mats, steps, dtype).to(update.dtype)
    return out.reshape(-1, k, rows, cols // k).transpose(1, 2).reshape(update.shape)


def whole_matrix_placements(t: DTensor) -> tuple:
    """``t``'s placements with every shard of a matrix dimension (the last two) replaced by
    Replicate: the layout in which each rank holds whole matrices. Shards of the stack dimensions
    (experts) stay."""
    return tuple(Replicate() if isinstance(p, (Shard, _StridedShard)) and p.dim % t.dim() >= t.dim() - 2 else p
                 for p in t.placements)


def orthogonalize_sharded(update: torch.Tensor, steps: int, dtype: torch.dtype, column_blocks: int = 1
                          ) -> torch.Tensor:
    """`orthogonalize` for a plain tensor or a DTensor of any layout: whole matrices are gathered
    where they are split across ranks, orthogonalized, and the result has ``update``'s layout."""
    if not isinstance(update, DTensor):
        return orthogonalize(update, steps, dtype, column_blocks)
    whole = whole_matrix_placements(update)
    full = update.redistribute(placements=whole) if whole != tuple(update.placements) else update
    local = orthogonalize(full.to_local(), steps, dtype, column_blocks)
    out = DTensor.from_local(local, full.device_mesh, full.placements, run_check=False, shape=full.shape,
                             stride=full.stride())
    # Replicate → Shard keeps each rank's own slice: no communication.
    return out.redistribute(placements=update.placements) if full is not update else out


def row_shards(rows: int, ranks: int) -> list[int]:
    """Rows each rank holds of a dimension of ``rows`` sharded over ``ranks`` (DTensor's and FSDP2's
    `torch.chunk` split: ⌈rows/ranks⌉ each, the last ones short or empty)."""
    per = -(-rows // ranks)
    return [max(0, min(per, rows - r * per)) for r in range(ranks)]


def spread_dim(update: torch.Tensor) -> int | None:
    """The mesh dimension to spread a DTensor matrix's work over: where ``update`` is 2-D and split
    by rows over exactly one mesh dimension (FSDP2's and HSDP's layout), else None."""
    if not isinstance(update, DTensor) or update.dim() != 2:
        return None
    dims = [i for i, p in enumerate(update.placements) if not isinstance(p, Replicate)]
    if len(dims) != 1 or type(update.placements[dims[0]]) is not Shard or update.placements[dims[0]].dim != 0:
        return None
    return dims[0]


def orthogonalize_spread(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`orthogonalize_sharded` for row-sharded DTensor matrices on one mesh dimension (`spread_dim`),
    with the work spread over its W ranks instead of repeated on each: matrix i belongs to rank
    i mod W, which receives its rows from every rank, orthogonalizes it whole, and sends each rank
    its rows back — one all-to-all each way for all the matrices, each rank doing 1/W of the
    Newton–Schulz work (the scheme of Dion and torchtitan's distributed Muon). The same bits as
    gathering everywhere."""
    first = updates[0]
    mesh, dim = first.device_mesh, spread_dim(first)
    group, ranks, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    owner = [i % ranks for i in range(len(updates))]
    mine = [i for i in range(len(updates)) if owner[i] == me]
    split = [row_shards(u.shape[0], ranks) for u in updates]
    local = [u.to_local() for u in updates]
    for i, t in enumerate(local):
        if t.shape[0] != split[i][me]:
            raise RuntimeError(f"unexpected shard of a {tuple(updates[i].shape)} matrix: {t.shape[0]} rows here")
    # Out: my rows of every matrix, grouped by owner. In: every rank's rows of my matrices.
    send = torch.cat([local[i].reshape(-1) for r in range(ranks) for i in range(len(updates)) if owner[i] == r])
    send_sizes = [sum(local[i].numel() for i in range(len(updates)) if owner[i] == r) for r in range(ranks)]
    recv_sizes = [sum(split[i][r] * updates[i].shape[1] for i in mine) for r in range(ranks)]
    recv = send.new_empty(sum(recv_sizes))
    td.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    pieces = [iter(chunk.split([split[i][r] * updates[i].shape[1] for i in mine]))
              for r, chunk in enumerate(recv.split(recv_sizes))]
    done = {}
    for i in mine:
        whole = torch.cat([next(pieces[r]).view(split[i][r], -1) for r in range(ranks)])
        done[i] = orthogonalize(whole, steps, dtype)
    # Back: each rank's rows of my matrices; in: my rows of every matrix, grouped by owner.
    back = torch.cat([done[i][sum(split[i][:r]):sum(split[i][:r + 1])].reshape(-1) for r in range(ranks)
                      for i in mine]) if mine else send.new_empty(0)
    mine_back = send.new_empty(send.numel())
    td.all_to_all_single(mine_back, back, send_sizes, recv_sizes, group=group)
    rows = iter(mine_back.split([local[i].numel() for r in range(ranks) for i in range(len(updates))
                                 if owner[i] == r]))
    order = [i for r in range(ranks) for i in range(len(updates)) if owner[i] == r]
    out: list[torch.Tensor | None] = [None] * len(updates)
    for i in order:
        u = updates[i]
        out[i] = DTensor.from_local(next(rows).view(local[i].shape), mesh, u.placements, run_check=False,
                                    shape=u.shape, stride=u.stride())
    return out


class Muon(torch.optim.Optimizer):
    """Muon (see the module docstring) for ≥2-D parameters whose last two dimensions are matrices.

    A param group may set ``column_blocks`` (default 1): its parameters hold that many matrices
    side by side in their last dimension.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32, spread: bool = True):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                                      column_blocks=1))
        self.ns_dtype = ns_dtype
        self.spread = spread  # row-sharded matrices: each rank orthogonalizes 1/W of them (else all, gathered)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2 or p.shape[-1] % group["column_blocks"]:
                    raise ValueError(f"Muon takes matrices (≥2-D, last dimension a multiple of "
                                     f"{group['column_blocks']}); got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mom, k = group["lr"], group["weight_decay"], group["momentum"], group["column_blocks"]
            steps = group["ns_steps"]
            spread: dict[tuple, list] = {}  # row-sharded matrices, by (mesh, mesh dim, dtype)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom)
                dim = spread_dim(update) if k == 1 and self.spread else None
                if dim is None:
                    self._apply(p, orthogonalize_sharded(update, steps, self.ns_dtype, k), lr, wd, k)
                else:
                    spread.setdefault((update.device_mesh, dim, update.dtype), []).append((p, update))
            for items in spread.values():
                updates = orthogonalize_spread([u for _, u in items], steps, self.ns_dtype)
                for (p, _), update in zip(items, updates):
                    self._apply(p, update, lr, wd, k)

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, lr: float, wd: float, k: int) -> None:
        p.mul_(1 - lr * wd)
        p.add_(update, alpha=-lr * rms_matching_scale(p.shape[-2], p.shape[-1] // k))
