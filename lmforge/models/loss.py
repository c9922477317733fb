"""The one next-token loss: output head + cross-entropy over shifted targets.

Everything that trains or evaluates on next-token prediction (the trainer, held-out eval,
fine-tuning eval) comes through here, through `Transformer.training_loss`. The head is applied
inside the loss so that the [tokens, vocabulary] logits never exist whole:

- **chunked** (every device; lmforge's own): the tokens are taken a chunk at a time, so that
  at most `CHUNK_ELEMENTS` logits (fp32) exist at once. The gradient of a summed
  cross-entropy does not depend on anything after it, so each chunk's gradients with respect
  to the hidden states and the head weight are computed right there, in the forward pass
  (softmax − one-hot, two matmuls), and the backward pass only scales them by the incoming
  gradient. No recomputation and no saved logits: what backward keeps is one hidden-sized
  gradient and one head-sized fp32 gradient. A plain cross-entropy at micro-batch 8 × 2048
  with a 128k vocabulary keeps ≈ 35 GB of logits; this keeps 2 chunks' worth (≈ 0.3 GB).
- **liger** (CUDA, with `pip install lmforge[gpu]`): liger-kernel's fused linear +
  cross-entropy, the same idea with Triton kernels that compute the logit gradient in place.
  It reads the number of targets on the host (one sync per micro-batch), so it runs outside
  the compiled region.

Both compute in the autocast dtype when autocast is on (as `F.linear` would) and return the
summed loss in fp32; gradients come back in each input's own dtype (an fp32 master weight gets
an fp32 head gradient). Both take a logit soft-cap (Gemma 2: logits become cap·tanh(logit/cap)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmforge.data.batch import IGNORE

# fp32 logits per chunk: 32M (128 MiB), e.g. 1024 tokens of a 32k vocabulary or 256 of a 128k
# one. Matmuls of that size keep a GPU busy; the estimate's memory model uses the same number.
CHUNK_ELEMENTS = 2**25
KERNELS = ("auto", "chunked", "liger")


@dataclass
class LossOutput:
    """What one training forward returns (a fixed type, whatever the model)."""

    ce_sum: torch.Tensor  # summed next-token cross-entropy (fp32, nats) over the non-ignored targets
    aux_loss: torch.Tensor | None = None  # MoE load-balancing + z losses, weighted; None for dense models
    moe: dict[str, torch.Tensor] = field(default_factory=dict)  # detached MoE statistics for logging
    # With ``per_token``: each target's log-probability [B, T] (fp32, 0 where IGNORE), for losses
    # over whole sequences (preference tuning); ce_sum is then minus its sum.
    token_logp: torch.Tensor | None = None


def next_token_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                    kernel: str = "auto", softcap: float | None = None) -> torch.Tensor:
    """Sum of cross-entropy (fp32) of ``hidden @ head_weight.T`` against ``targets`` (IGNORE skipped).

    hidden [B, T, d], head_weight [V, d], targets [B, T] already shifted (see `data.batch`).
    ``kernel``: "chunked", "liger" (CUDA only), or "auto" (liger where it can run, else chunked).
    ``softcap``: the logits become softcap·tanh(logit/softcap) first.
    """
    h, t = hidden.flatten(0, 1), targets.flatten()
    dtype = compute_dtype(h, head_weight)
    if _use_liger(kernel, h):
        return _liger_loss(h, head_weight, t, dtype, softcap)
    rows = max(1, CHUNK_ELEMENTS // head_weight.shape[0])
    if torch.is_grad_enabled() and (h.requires_grad or head_weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(h, head_weight, t, rows, dtype, softcap)
    return _chunked_loss(h, head_weight.to(dtype), t, rows, None, softcap)[0]


def compute_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(h, w) would compute in: autocast's when it is on, else the inputs'."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, w.dtype)


def _chunked_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rows: int, grads: tuple | None,
                  softcap: float | None = None):
    """Summed CE of h @ w.T (soft-capped), ``rows`` tokens at a time. ``grads`` = (grad_h or None,
    grad_w or None): filled with the gradients of the sum (grad_w accumulated in fp32)."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], rows):
        hc, tc = h[start:start + rows], t[start:start + rows]
        valid = tc != IGNORE
        safe = torch.where(valid, tc, 0)[:, None]
        logits = (hc @ w.T).float()
        if softcap is not None:
            tanh = torch.tanh(logits.div_(softcap))
            logits = tanh * softcap
        # One log-softmax, then its exp in place for the gradient: the [rows, vocab] chunk is
        # the big tensor here, and each pass over it counts (on the CPU, dropping four of them —
        # logsumexp's, a subtract, an out-of-place scatter, a mask — made the head 12–16% faster).
        logp = torch.log_softmax(logits, dim=-1)
        total = total - torch.where(valid, logp.gather(1, safe).squeeze(1), 0.0).sum()
        if grads is None:
            continue
        # d(sum CE)/d(logits) = softmax - one_hot; ignored rows get no gradient, which is
        # masked on the [rows, d] side (their hidden state, and their gradient below) instead
        # of on the [rows, vocab] one. Through the cap: times d(cap·tanh(z/cap))/dz = 1 − tanh².
        g = logp.exp_().scatter_add_(1, safe, torch.full(safe.shape, -1.0, device=h.device))
        if softcap is not None:
            g.mul_(1 - tanh.square_())
        g = g.to(w.dtype)
        mask = valid[:, None].to(w.dtype)
        grad_h, grad_w = grads
        if grad_h is not None:
            grad_h[start:start + rows] = (g @ w).mul_(mask)
        if grad_w is not None:
            grad_w += (g.T @ (hc * mask)).float()
    return total, grads


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Chunked head + cross-entropy whose gradients are computed in forward (see the module
    docstring); backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, h, w, t, rows: int, dtype: torch.dtype, softcap: float | None):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hc, wc = h.to(dtype), w.to(dtype)
        grads = (torch.empty_like(hc) if need_h else None,
                 torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None)
        total, (grad_h, grad_w) = _chunked_loss(hc, wc, t, rows, grads, softcap)
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else (grad_h * grad_out).to(ctx.h_dtype)
        dw = None if grad_w is None else (grad_w * grad_out).to(ctx.w_dtype)
        return dh, dw, None, None, None, None


def token_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                   softcap: float | None = None) -> torch.Tensor:
    """Per-position log-probability (fp32) of ``targets`` under ``hidden @ head_weight.T``: [B, T],
    0 where the target is IGNORE. What preference losses need (a sum per sequence, not per batch).

    Chunked like `next_token_loss`, but a per-token output's gradient depends on the weight each
    token gets downstream, so it cannot be computed in the forward pass: the backward pass
    recomputes each chunk's logits instead (one more head matmul per chunk; no logits are kept).
    """
    B, T = targets.shape
    h, t = hidden.flatten(0, 1), targets.flatten()
    dtype = compute_dtype(h, head_weight)
    rows = max(1, CHUNK_ELEMENTS // head_weight.shape[0])
    return _ChunkedTokenLogprobs.apply(h, head_weight, t, rows, dtype, softcap).view(B, T)


def _chunk_logprobs(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, softcap: float | None):
    """(log-softmax [rows, V], the soft-cap's tanh or None, valid [rows], safe targets [rows, 1]) of one chunk."""
    valid = tc != IGNORE
    safe = torch.where(valid, tc, 0)[:, None]
    logits = (hc @ w.T).float()
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits.div_(softcap))
        logits = tanh * softcap
    return torch.log_softmax(logits, dim=-1), tanh, valid, safe


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """`token_logprobs`: logits a chunk at a time in forward, recomputed a chunk at a time in backward."""

    @staticmethod
    def forward(ctx, h, w, t, rows: int, dtype: torch.dtype, softcap: float | None):
        hc_all, wc = h.to(dtype), w.to(dtype)
        out = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], rows):
            logp, _, valid, safe = _chunk_logprobs(hc_all[start:start + rows], wc, t[start:start + rows], softcap)
            out[start:start + rows] = torch.where(valid, logp.gather(1, safe).squeeze(1), 0.0)
        ctx.save_for_backward(h, w, t)
        ctx.rows, ctx.dtype, ctx.softcap = rows, dtype, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w, t = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hc_all, wc = h.to(ctx.dtype), w.to(ctx.dtype)
        grad_h = torch.empty_like(hc_all) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for start in range(0, h.shape[0], ctx.rows):
            hc, tc = hc_all[start:start + ctx.rows], t[start:start + ctx.rows]
            logp, tanh, valid, safe = _chunk_logprobs(hc, wc, tc, ctx.softcap)
            # d logp[target] / d logits = one_hot − softmax, times the incoming gradient of the token
            # (zero for an ignored one); through the cap, times 1 − tanh².
            g_tok = torch.where(valid, grad_out[start:start + ctx.rows].float(), 0.0)[:, None]
            g = logp.exp_().mul_(-g_tok).scatter_add_(1, safe, g_tok)
            if tanh is not None:
                g.mul_(1 - tanh.square_())
            g = g.to(wc.dtype)
            if grad_h is not None:
                grad_h[start:start + ctx.rows] = g @ wc
            if grad_w is not None:
                grad_w += (g.T @ hc).float()
        dh = None if grad_h is None else grad_h.to(h.dtype)
        dw = None if grad_w is None else grad_w.to(w.dtype)
        return dh, dw, None, None, None, None


def liger_available() -> bool:
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except Exception:  # not installed, or no triton / GPU stack to import it with
        return False
    return True


def _use_liger(kernel: str, h: torch.Tensor) -> bool:
    if kernel == "chunked":
        return False
    if kernel == "liger":
        if not h.is_cuda:
            raise ValueError("the liger loss kernel runs on CUDA only")
        return True
    return h.is_cuda and liger_available()


# Out of compiled graphs: liger reads the target count on the host. (torch's lazy form of
# torch.compiler.disable: that decorator imports torch._dynamo, a second of every start-up.)
@torch._disable_dynamo
def _liger_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, dtype: torch.dtype,
                softcap: float | None = None) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h.to(dtype).contiguous(), w.to(dtype), t, ignore_index=IGNORE,
                                            reduction="sum", softcap=softcap, accum_dtype=torch.float32).float()
