"""Dropless mixture-of-experts feed-forward layer (DBRX/Mixtral style), with expert parallelism.

Routing: a linear router gives logits over E experts; softmax (fp32), top-k, and the k weights
renormalized to sum to 1 (the same math as HF Mixtral, so exported weights behave the same).
Dropless: every (token, expert) slot is computed — there is no capacity factor, whatever the load.

The layer is kept in three steps, with the expert-parallel exchange between them:

1. `dispatch` sorts the N·k token slots by expert (each expert then sees one contiguous slice);
2. with expert parallelism, `send_to_experts` moves each slice to the rank that owns its expert
   (`all_to_all_single`), `GroupedExperts` computes, `return_from_experts` sends the rows back;
   without it `GroupedExperts` computes locally;
3. `combine` un-permutes and takes each token's weighted sum over its k slots.

Compile-clean: routing, counting and sorting have static shapes (no `bincount`, no host sync),
and the experts run as grouped GEMMs (`models.grouped_mm`, CPU and CUDA) on the unpadded sorted
rows, so one MoE block is one graph. FP8 experts (`GroupedExperts.fp8`, torchao's rowwise
grouped GEMM on sm90) want each expert's rows in a multiple of 16: `dispatch` then pads each
group in the same gather that sorts the rows (``MoE.align``), to a static bound, still without a
host sync. (Eager on the CPU a loop of plain per-expert GEMMs is
faster, and is used there.) Only expert parallelism breaks it: `all_to_all_single` takes
its split sizes as Python ints (one host sync) and the rows a rank receives vary, so the
exchange and the experts' GEMMs on the received rows run eagerly between two compiled graphs.

Experts are SwiGLU with the gate and up projections fused: ``w13 [E, d, 2h]`` (gate columns
first, then up) — one grouped GEMM instead of two — and ``w2 [E, h, d]`` (down).

Losses (returned as unweighted per-layer scalars; the model averages layers and applies the
coefficients): Switch/DBRX load balancing E·Σ_i f_i·P_i (f_i = share of slots routed to expert
i, P_i = mean router probability of i; equals 1 at perfectly uniform routing and grows with
imbalance), and the router z-loss mean(logsumexp(logits)²), which keeps logits small so the fp32
softmax stays well conditioned. Optional jitter multiplies the router input by U(1-ε, 1+ε)
during training (Switch), leaving the expert inputs untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as td
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.config.model import ModelConfig
from lmforge.models import grouped_mm as gmm


# --------------------------------------------------------------------------- routing

class Routing(NamedTuple):
    weights: torch.Tensor  # [N, k]: the chosen experts' probabilities, renormalized to sum to 1
    experts: torch.Tensor  # [N, k]: expert ids
    probs: torch.Tensor  # [N, E] fp32: the router's softmax
    log_z: torch.Tensor  # [N] fp32: logsumexp of the logits (the softmax's normalizer; z-loss)


def route(logits: torch.Tensor, top_k: int) -> Routing:
    """logits [N, E] -> softmax (fp32), top-k, and the k weights renormalized.

    The softmax is written out so that its normalizer serves the z-loss and the entropy as well,
    and because on the CPU `softmax` and `logsumexp` over a short last dimension are slow:
    1,024 × 8 fp32, 2 threads: 90 and 37 µs, where `exp` takes 3 (moe-tiny's routing and its
    losses, forward and backward: 580 → 490 µs a layer)."""
    logits = logits.float()
    shift = logits.detach().amax(dim=-1, keepdim=True)  # any constant cancels; the max can't overflow
    exp = (logits - shift).exp()
    total = exp.sum(dim=-1, keepdim=True)
    probs = exp / total
    weights, experts = probs.topk(top_k, dim=-1)
    log_z = (shift + total.log()).squeeze(-1)
    return Routing(weights / weights.sum(dim=-1, keepdim=True), experts, probs, log_z)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots routed to each expert, [E] int64. A scatter-add into a fixed-size vector: unlike
    `bincount` its shape never depends on the data, so it traces into a compiled graph."""
    flat = experts.reshape(-1)
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """E · Σ_i f_i · P_i; probs [N, E], counts [E] = slots routed to each expert."""
    n_experts = probs.shape[-1]
    frac = counts.float() / counts.sum().clamp(min=1)
    return n_experts * (frac * probs.mean(dim=0)).sum()


def z_loss(log_z: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)²), from `Routing.log_z`."""
    return log_z.pow(2).mean()


@torch.no_grad()
def router_entropy(routing: Routing, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the router distribution's entropy (nats): log E when undecided, → 0
    when each token is sure of its experts. Logged per layer as a health signal.
    −Σ p·log p with log p = logits − log_z: no log of a probability that may be 0."""
    return (routing.log_z - (routing.probs * logits.float()).sum(-1)).mean()


# --------------------------------------------------------------------------- dispatch / combine

class Slots(NamedTuple):
    """Where `dispatch` put the N·k token slots (flat slot = token·k + j) when it sorted them by expert."""

    order: torch.Tensor  # [R]: sorted row r holds flat slot order[r] (N·k: a padding row, zeros)
    inverse: torch.Tensor  # [N·k]: flat slot s is sorted row inverse[s]
    sizes: torch.Tensor  # [E]: rows of each expert's group, padding included; they sum to R
    padded: bool  # whether there are padding rows (R > N·k)


def dispatch(x: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, align: int = 1
             ) -> tuple[torch.Tensor, Slots]:
    """Sort the N·k token slots by expert: -> (x_sorted [R, d], where the slots went).

    Stable: deterministic, token order kept within each expert. ``align`` > 1 (FP8 grouped GEMMs
    want groups of a multiple of 16 rows) starts each expert's group at a multiple of ``align``
    and pads it with zero rows, in the same gather (no second pass, no host sync): R is the
    static bound N·k + E·(align − 1) rounded up to ``align``, and the last group takes the rows
    left over, so every row belongs to a group and none is left uninitialized.
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    k = experts.shape[1]
    if align == 1:
        # The inverse permutation is a scatter of positions (linear, no second sort).
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return _SlotRows.apply(x, order, inverse, k, False), Slots(order, inverse, counts, False)
    n_slots, n_experts = flat.numel(), counts.numel()
    rows = -(-(n_slots + n_experts * (align - 1)) // align) * align
    padded = (counts + align - 1) // align * align
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # each group's start moves by this
    position = torch.arange(n_slots, device=flat.device) + shift.index_select(0, flat.index_select(0, order))
    inverse = torch.empty_like(order).scatter_(0, order, position)
    row_order = torch.full((rows,), n_slots, dtype=order.dtype, device=order.device).scatter_(0, position, order)
    sizes = torch.cat([padded[:-1], (rows - padded[:-1].sum()).view(1)])
    return _SlotRows.apply(x, row_order, inverse, k, True), Slots(row_order, inverse, sizes, True)


def _gather_sum(rows: torch.Tensor, inverse: torch.Tensor, k: int, weights: torch.Tensor | None = None,
                fused: bool | None = None) -> torch.Tensor:
    """out[t] = Σ_j weights[t, j] · rows[inverse[t·k + j]] (unweighted without weights): each
    token's k sorted rows, gathered and summed.

    fused (default: on the CPU) is exactly `embedding_bag` (mode "sum", one bag of k rows per
    token), whose fused kernel reads each row once and writes each output once: moe-tiny's combine,
    4,096 tokens × top-2, d 256, 2 threads: 0.67 against 1.64 ms for the gathers and adds of the
    other form, one gather of N rows per slot summed in place (kept where a compiled graph fuses
    them, on GPUs)."""
    slots = inverse.view(-1, k)  # [N, k]
    if fused is None:
        fused = rows.device.type == "cpu"
    if fused:
        return F.embedding_bag(slots, rows, per_sample_weights=weights, mode="sum")
    out = rows.index_select(0, slots[:, 0])
    if weights is not None:
        out.mul_(weights[:, :1])
    for j in range(1, k):
        if weights is None:
            out.add_(rows.index_select(0, slots[:, j]))
        else:
            out.addcmul_(rows.index_select(0, slots[:, j]), weights[:, j:j + 1])
    return out


class _SlotRows(torch.autograd.Function):
    """x [N, d] -> x[order // k], its rows for the N·k slots in sorted order (padded: a padding
    row's slot N·k is token N, a zero row appended to x).

    Autograd's own backward for that gather is an accumulating scatter of N·k rows into N, which
    on the CPU runs serially — and with two threads several times slower than with one (2.6 ms
    against 0.36 ms for 2048 × 256 fp32). Since `order` is a permutation of the slots, the
    gradient is instead a gather by the inverse permutation summed over each token's k slots:
    parallel, and deterministic on every device, compiled or not (no atomic adds)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int,
                padded: bool) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return _with_zero_row(x, padded).index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(grad, inverse, ctx.k), None, None, None, None


def _with_zero_row(t: torch.Tensor, padded: bool) -> torch.Tensor:
    """``t`` with one zero row (a zero element, for a vector) appended where padding rows index it."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))]) if padded else t


def combine(y_sorted: torch.Tensor, slots: Slots, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `dispatch`: un-permute rows, then each token's weighted sum over its k slots."""
    return _Combine.apply(y_sorted, slots.order, slots.inverse, weights, slots.padded)


class _Combine(torch.autograd.Function):
    """y [N, d] = Σ_j weights[:, j] · y_sorted[inverse[token·k + j]].

    Gathers and sums over k (rather than a scatter-add into tokens) keep the result deterministic
    everywhere, and so does the backward, which works on the sorted side: one gather of the
    output gradient by token gives both the rows' gradient (scaled by each slot's weight) and
    the weights' (a row-wise dot with y_sorted). Written by hand because autograd's version of
    the same math makes several more passes over the N·k rows on the CPU (a zero-filled gradient
    and a scatter for the gather, broadcast multiplies, a slow sum over k). One moe-tiny layer
    (1,024 tokens × top-2, d 256, 2 threads): combine's backward 360 → 290 µs."""

    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                weights: torch.Tensor, padded: bool) -> torch.Tensor:
        k = weights.shape[1]
        w = weights.to(y_sorted.dtype)
        ctx.save_for_backward(y_sorted, order, inverse, w)
        ctx.weights_dtype, ctx.padded = weights.dtype, padded
        return _gather_sum(y_sorted, inverse, k, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y_sorted, order, inverse, w = ctx.saved_tensors
        n, k = w.shape
        padded = ctx.padded  # padding rows: token N and weight 0 (appended), so their gradient is 0
        grad_sorted = _with_zero_row(grad, padded).index_select(0, order // k)  # each row's token's gradient
        grad_w = torch.linalg.vecdot(y_sorted, grad_sorted).index_select(0, inverse).view(n, k)
        row_w = _with_zero_row(w.reshape(-1), padded).index_select(0, order)
        grad_y = grad_sorted.mul_(row_w.unsqueeze(1))
        return grad_y, None, None, grad_w.to(ctx.weights_dtype), None


# --------------------------------------------------------------------------- expert parallelism

@dataclass
class Exchange:
    """How rows travelled in `send_to_experts`, to send them back the same way."""

    group: td.ProcessGroup
    send_splits: list[int]  # rows this rank sent to each EP rank
    recv_splits: list[int]  # rows this rank received from each EP rank
    to_expert_major: torch.Tensor  # received (rank-major) row index of each expert-major row


def send_to_experts(x_sorted: torch.Tensor, counts: torch.Tensor, group: td.ProcessGroup
                    ) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Move the expert-sorted rows to the ranks owning their experts (E/N consecutive experts per
    rank of the EP group) with `all_to_all_single`; any split is allowed, zero included (dropless).

    Returns (rows for this rank's experts, sorted by local expert [R, d], local counts [E/N], the
    `Exchange` to reverse it).
    """
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    ep = td.get_world_size(group)
    per_rank = counts.view(ep, -1)  # [EP, E/N]: slots for each rank's experts
    # Each rank learns how many rows it gets for each of its experts from every rank: [EP, E/N].
    received = all_to_all_single(per_rank.contiguous(), None, None, group).view(ep, -1)
    # The one host sync: the collective takes its split sizes as Python ints.
    send_splits = per_rank.sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
    # Rows arrive rank-major (from rank 0: its rows for my expert 0, 1, …; then from rank 1 …);
    # the grouped GEMM wants them expert-major: a stable sort by local expert id.
    n_local = received.shape[1]
    local_ids = torch.arange(n_local, device=counts.device).repeat(ep)
    row_expert = torch.repeat_interleave(local_ids, received.reshape(-1), output_size=x_recv.shape[0])
    to_expert_major = torch.argsort(row_expert, stable=True)
    return x_recv[to_expert_major], received.sum(0), Exchange(group, send_splits, recv_splits, to_expert_major)


def return_from_experts(y_local: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """Inverse of `send_to_experts`: rows back to rank-major order, then home by the same splits."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    y_recv = torch.empty_like(y_local).index_copy(0, ex.to_expert_major, y_local)
    return all_to_all_single_autograd(y_recv, ex.send_splits, ex.recv_splits, ex.group)


# --------------------------------------------------------------------------- the experts

def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts: expert-parallel weights are DTensors sharded on the expert dim."""
    return w.to_local() if isinstance(w, DTensor) else w


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w13 [E, d, 2h] (gate | up), w2 [E, h, d] (down).

    Under expert parallelism the parameters are DTensors sharded on dim 0 and this module
    computes the rank's own E/N experts; it never communicates.
    """

    # Parameters holding several matrices side by side in their last dimension (w13: gate | up).
    # Optimizers that treat each matrix as a whole (Muon) split them there.
    FUSED_COLUMNS = {"w13": 2}

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.fp8 = False  # FP8 grouped GEMMs (`distributed.float8`, parameters.fp8_experts)

    def takes_grouped(self, dtype: torch.dtype, device_type: str) -> bool:
        """Whether the grouped kernel takes these experts in this compute dtype on this device
        (else they loop, eagerly: a compiled block then breaks its graph around them)."""
        d, hidden = self.w13.shape[1], self.w2.shape[1]  # rows of x, w13, the SwiGLU output and w2
        return gmm.supported(dtype, device_type, d, 2 * hidden, hidden, d)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x [R, d]: rows sorted by expert, ``counts[e]`` of them for local expert e.

        grouped=None: the grouped GEMM on CUDA and in compiled graphs wherever it takes these
        shapes, else the per-expert loop; False: the loop (the reference, and the fallback where
        the grouped kernel is unavailable)."""
        w13, w2 = _local(self.w13), _local(self.w2)
        dtype = _compute_dtype(x)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        if grouped is None:
            # Eager on the CPU, plain per-expert GEMMs beat torch._grouped_mm's CPU kernel (moe-tiny
            # layer forward + backward: 38.9 against 42.9 ms on one thread, 48.5 against 55.0 on two);
            # a compiled graph needs the one op (no data-dependent slicing).
            grouped = (x.is_cuda or torch.compiler.is_compiling()) and self.takes_grouped(dtype, x.device.type)
        if not grouped:
            return _loop(x, counts, w13, w2)
        # Expert e's rows are offs[e-1]:offs[e], whatever their alignment (16 for FP8, `dispatch`).
        offs = counts.cumsum(0).to(torch.int32)
        mm = _fp8_grouped_mm if self.fp8 else gmm.grouped_mm
        gate, up = mm(x, w13, offs).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, w2, offs)


FP8_ROW_ALIGN = 16  # rows of an expert's group for FP8 grouped GEMMs (torch._scaled_grouped_mm)


def _fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm.grouped_mm` in FP8 with rowwise scales (torchao's prototype, sm90): x [R, k] in
    groups of a multiple of 16 rows, w [G, k, n] -> [R, n] bf16. The kernel wants the weight
    column-major: one copy in that layout (fused with the cast to bf16 when compiled)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    w_col = w.transpose(-2, -1).contiguous().transpose(-2, -1)
    return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_col, offs, out_dtype=torch.bfloat16,
                                                  pad_token_groups_for_grouped_mm=False)


@torch._disable_dynamo  # data-dependent slice sizes: kept out of compiled graphs (lazily: see models.loss)
def _loop(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return _ExpertLoop.apply(x, counts, w13, w2)


class _ExpertLoop(torch.autograd.Function):
    """The experts as a loop of plain per-expert GEMMs, with a hand-written backward.

    The GEMMs write straight into buffers that hold every expert's rows, so the SwiGLU's
    elementwise work (forward and backward) runs once over all rows instead of once per expert:
    at moe-tiny's ~256 rows an expert, per-op overhead outweighs keeping each expert's
    temporaries in cache (its 8 experts' forward + backward on 2 threads: 0.95× the time of a
    loop that did the SwiGLU per expert and concatenated the outputs). Autograd's own backward of such a
    loop would also glue the pieces with a copy at every seam (the backward of `split`, `chunk`
    and `unbind`); here every gradient is written in place (`out=`).
    An expert with no rows still gets a (zero) gradient: sharded weights need one on every rank.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        sizes = counts.tolist()  # host sync
        y, h13, act, h = torch.ops.lmforge.expert_loop(x, sizes, w13, w2)
        ctx.sizes = sizes
        ctx.save_for_backward(x, w13, w2, h13, act, h)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w13, w2, h13, act, h = ctx.saved_tensors
        sizes, hidden = ctx.sizes, w2.shape[1]
        grad = grad.contiguous()
        gx, gw13, gw2, gh = torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2), torch.empty_like(h)
        for e, (he, ge, ghe) in enumerate(zip(h.split(sizes), grad.split(sizes), gh.split(sizes))):
            torch.mm(he.t(), ge, out=gw2[e])
            torch.mm(ge, w2[e].t(), out=ghe)
        g13 = torch.empty_like(h13)  # gate | up gradients
        torch.mul(gh, act, out=g13[:, hidden:])
        torch.ops.aten.silu_backward.grad_input(gh.mul_(h13[:, hidden:]), h13[:, :hidden], grad_input=g13[:, :hidden])
        for e, (xe, g13e, gxe) in enumerate(zip(x.split(sizes), g13.split(sizes), gx.split(sizes))):
            torch.mm(xe.t(), g13e, out=gw13[e])
            torch.mm(g13e, w13[e].t(), out=gxe)
        return gx, None, gw13, gw2


@torch.library.custom_op("lmforge::expert_loop", mutates_args=())
def _expert_loop_forward(x: torch.Tensor, sizes: list[int], w13: torch.Tensor, w2: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_ExpertLoop`'s forward -> (y, gate|up, silu(gate), silu(gate)·up). One op because its
    GEMMs write into shared buffers (`out=`), which selective activation checkpointing cannot
    keep one by one; it keeps this op's outputs instead (`distributed.parallelize`)."""
    hidden = w2.shape[1]
    h13 = x.new_empty(x.shape[0], 2 * hidden)
    for xe, w, out in zip(x.split(sizes), w13.unbind(0), h13.split(sizes)):
        torch.mm(xe, w, out=out)
    act = F.silu(h13[:, :hidden])
    h = act * h13[:, hidden:]
    y = x.new_empty(x.shape[0], w2.shape[2])
    for he, w, out in zip(h.split(sizes), w2.unbind(0), y.split(sizes)):
        torch.mm(he, w, out=out)
    return y, h13, act, h


# --------------------------------------------------------------------------- the layer

class MoE(nn.Module):
    """Router + dispatch + (exchange) + grouped experts + (exchange back) + combine.

    forward -> (y, stats). ``ep_group`` is set by `distributed.parallelize` for expert
    parallelism; None computes every expert here.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.jitter = cfg.n_experts, cfg.top_k, cfg.moe_jitter
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.grouped: bool | None = None  # None = auto; tests force either path
        self.align = 1  # rows of each expert's group padded to a multiple of this (FP8 experts: 16)
        self.ep_group: td.ProcessGroup | None = None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, 0.0, std)
        nn.init.normal_(self.experts.w13, 0.0, std)
        nn.init.normal_(self.experts.w2, 0.0, out_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_in = x
        if self.training and self.jitter > 0:
            router_in = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = self.router(router_in)
        routing = route(logits, self.top_k)
        counts = expert_counts(routing.experts, self.n_experts)
        x_sorted, slots = dispatch(x, routing.experts, counts, self.align)
        if self.ep_group is None:
            y_sorted = self.experts(x_sorted, slots.sizes, self.grouped)
        else:
            y_sorted = self._expert_parallel(x_sorted, counts)
        y = combine(y_sorted, slots, routing.weights)
        stats = {"lb_loss": load_balancing_loss(routing.probs, counts), "z_loss": z_loss(routing.log_z),
                 "tokens_per_expert": counts, "router_entropy": router_entropy(routing, logits)}
        return y.view(shape), stats

    # How many rows arrive is data: the exchange and the expert GEMMs on those rows stay out of
    # compiled graphs (which keep static shapes); routing, dispatch and combine still compile.
    @torch._disable_dynamo  # (lazily: see models.loss)
    def _expert_parallel(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x_local, local_counts, exchange = send_to_experts(x_sorted, counts, self.ep_group)
        return return_from_experts(self.experts(x_local, local_counts, self.grouped), exchange)


def fuse_legacy_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights saved before gate and up were fused (``experts.w1`` and ``experts.w3``, [E, d, h]
    each) → ``experts.w13`` [E, d, 2h]; other state dicts are returned unchanged."""
    for name in [k for k in sd if k.endswith(".experts.w1")]:
        prefix = name[: -len("w1")]
        sd[prefix + "w13"] = torch.cat([sd.pop(name), sd.pop(prefix + "w3")], dim=-1)
    return sd
