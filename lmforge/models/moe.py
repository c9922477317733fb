"""Dropless mixture-of-experts feed-forward layer (DBRX/Mixtral style).

Routing: a linear router gives logits over E experts; softmax (fp32), top-k, and the k weights
renormalized to sum to 1 (the same math as HF Mixtral, so exported weights behave the same).
Dropless: every (token, expert) slot is computed — there is no capacity factor. Slots are sorted
by expert so each expert sees one contiguous slice, and the experts run as one grouped GEMM
(`grouped_mm`) on GPU in bf16, or as a loop over the slices otherwise.

The layer is three steps kept apart on purpose — `dispatch` (permute tokens by expert),
`GroupedExperts` (the compute), `combine` (un-permute and weight) — so expert parallelism can
later put an all-to-all between them without touching the math.

Losses (returned as unweighted per-layer scalars; the model averages layers and applies the
coefficients): Switch/DBRX load balancing E·Σ_i f_i·P_i (f_i = share of slots routed to expert
i, P_i = mean router probability of i; equals 1 at perfectly uniform routing and grows with
imbalance), and the router z-loss mean(logsumexp(logits)²), which keeps logits small so the fp32
softmax stays well conditioned. Optional jitter multiplies the router input by U(1-ε, 1+ε)
during training (Switch), leaving the expert inputs untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.model import ModelConfig

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Grouped GEMM kernels want each group's rows to start at an aligned offset.
ALIGN = 16


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] renormalized, expert ids [N, k], probs [N, E] fp32)."""
    probs = logits.float().softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts, probs


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """E · Σ_i f_i · P_i; probs [N, E], counts [E] = slots routed to each expert."""
    n_experts = probs.shape[-1]
    frac = counts.float() / counts.sum().clamp(min=1)
    return n_experts * (frac * probs.mean(dim=0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int):
    """Sort the N·k token slots by expert.

    Returns (x_sorted [N·k, d], expert id of each sorted row [N·k], counts [E], order [N·k])
    where order[r] is the flat (token·k + slot) index that sorted row r came from.
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: deterministic, token order kept per expert
    counts = torch.bincount(flat, minlength=n_experts)
    return x[order // experts.shape[1]], flat[order], counts, order


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `dispatch`: un-permute rows, then weighted sum over each token's k slots.

    A gather plus a sum over k (rather than a scatter-add into tokens) keeps the result
    deterministic on every device.
    """
    n, k = weights.shape
    y = y_sorted[torch.argsort(order)].view(n, k, -1)
    return (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w1/w3 [E, d, h] (gate/up), w2 [E, h, d] (down)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor,
                grouped: bool | None = None) -> torch.Tensor:
        """x: rows sorted by expert; counts [E]. grouped=None picks grouped GEMM on CUDA bf16."""
        if grouped is None:
            grouped = _grouped_mm is not None and x.is_cuda and _compute_dtype(x) == torch.bfloat16
        return self._grouped(x, expert_ids, counts) if grouped else self._loop(x, counts)

    # Data-dependent slice sizes would recompile a compiled block on every new routing; the
    # loop is the CPU/fallback path anyway, so keep it out of the graph.
    @torch.compiler.disable
    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # unbind, not w[e]: its backward stacks the per-expert grads once, where indexing would
        # allocate and accumulate a full [E, ...] gradient per expert.
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):  # host sync: free on CPU
            if n:
                xs = x[start:start + n]
                out.append((F.silu(xs @ w1[e]) * (xs @ w3[e])) @ w2[e])
                start += n
        return torch.cat(out) if out else x.new_zeros(0, self.w2.shape[-1])

    def _grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Place each expert's rows at an ALIGN-multiple offset in a padded buffer, with no host
        # sync: the buffer size is a static upper bound (N + E·ALIGN), so this also compiles.
        n_rows, n_experts = x.shape[0], counts.shape[0]
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        pad_end = padded.cumsum(0)
        starts = counts.cumsum(0) - counts
        dest = (pad_end - padded)[expert_ids] + torch.arange(n_rows, device=x.device) - starts[expert_ids]
        size = n_rows + n_experts * ALIGN
        dtype = _compute_dtype(x)
        buf = x.new_zeros(size, x.shape[1], dtype=dtype).index_copy(0, dest, x.to(dtype))
        offs = pad_end.to(torch.int32)
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        h = F.silu(_grouped_mm(buf, w1, offs=offs)) * _grouped_mm(buf, w3, offs=offs)
        return _grouped_mm(h, w2, offs=offs)[dest]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class MoE(nn.Module):
    """Router + dropless dispatch + grouped experts + combine. forward -> (y, stats)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.jitter = cfg.n_experts, cfg.top_k, cfg.moe_jitter
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.expert_dim)
        self.grouped: bool | None = None  # None = auto; tests force either path

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, 0.0, std)
        nn.init.normal_(self.experts.w1, 0.0, std)
        nn.init.normal_(self.experts.w3, 0.0, std)
        nn.init.normal_(self.experts.w2, 0.0, out_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_in = x
        if self.training and self.jitter > 0:
            router_in = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = self.router(router_in)
        weights, experts, probs = route(logits, self.top_k)
        x_sorted, expert_ids, counts, order = dispatch(x, experts, self.n_experts)
        y_sorted = self.experts(x_sorted, expert_ids, counts, self.grouped)
        y = combine(y_sorted, order, weights)
        stats = {"lb_loss": load_balancing_loss(probs, counts), "z_loss": z_loss(logits),
                 "tokens_per_expert": counts}
        return y.view(shape), stats
