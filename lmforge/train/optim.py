"""The optimizer (AdamW, or Muon for the hidden matrices) and the learning rate a resumed run
blends in with (the schedule itself is `resolve.schedule`).
"""

from __future__ import annotations

import torch

from lmforge.resolve.schedule import Schedule


class Optimizers(list):
    """Several optimizers stepped as one (Muon for hidden matrices + AdamW for the rest).

    A list, so `torch.distributed.checkpoint`'s state-dict helpers take it as they are (they
    accept one optimizer or an iterable of them); `param_groups`, `step` and `zero_grad` act on all.
    """

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self for g in opt.param_groups]

    def step(self) -> None:
        for opt in self:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)


def _adamw(groups: list[dict], *, lr: float, betas, eps: float, device_type: str) -> torch.optim.AdamW:
    kwargs = dict(lr=lr, betas=betas, eps=eps)
    try:  # the fused kernel: numerically the same update, one kernel (CUDA, and CPU in recent torch)
        return torch.optim.AdamW(groups, fused=device_type in ("cuda", "cpu"), **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=device_type == "cuda", **kwargs)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D matrices: SGD momentum (Nesterov), each update orthogonalized by five
    Newton–Schulz iterations, scaled by 0.2·√max(rows, cols) so its RMS matches AdamW's and the
    same LR and decoupled weight decay serve both (Jordan et al. 2024; Liu et al. 2025,
    "Muon is scalable for LLM training").

    The same update as `torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`, except that the
    iterations run in bf16 only where bf16 matmuls are native (GPUs): torch's version always
    casts to bf16, which on a CPU without bf16 units is ~5× slower than the whole training step.
    """

    NS = (3.4445, -4.7750, 2.0315)  # quintic coefficients of Jordan et al.

    def __init__(self, params, lr: float, weight_decay: float = 0.0, momentum: float = 0.95, ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))

    @staticmethod
    def orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
        a, b, c = Muon.NS
        x = g.bfloat16() if g.is_cuda else g.float()
        tall = x.size(0) > x.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return (x.T if tall else x).to(g.dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf.lerp_(p.grad, 1 - mom)
                update = self.orthogonalize(p.grad.lerp(buf, mom), group["ns_steps"])
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * 0.2 * max(p.shape) ** 0.5)


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device_type: str, kind: str = "adamw") -> Optimizers:
    """AdamW: decay 2-D+ weights (matmuls, embeddings), never norms or other vectors.

    ``muon``: the transformer blocks' matrices go to `Muon` (orthogonalized momentum, as in
    modded-nanogpt) with the AdamW-matched scale, so one peak LR and weight decay serve both;
    embeddings, the output head and every vector stay on AdamW.
    """
    hidden = set()
    if kind == "muon":
        blocks = getattr(model, "blocks", None) or []
        hidden = {id(p) for p in blocks.parameters() if p.requires_grad and p.dim() == 2}
    decay, no_decay, muon = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in hidden:
            muon.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    adamw = _adamw([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                   lr=lr, betas=betas, eps=eps, device_type=device_type)
    if not muon:
        return Optimizers([adamw])
    return Optimizers([Muon(muon, lr=lr, weight_decay=weight_decay), adamw])


def blended_lr(lr: float, blend: dict | None, schedule: Schedule, step: int, elapsed_s: float,
               ramp: float) -> float:
    """After a resume under a different schedule (a longer training_duration, another LR): move
    linearly from the LR the checkpoint last used to the new schedule's over ``ramp`` (in the
    schedule's unit), instead of jumping to it."""
    if not blend:
        return lr
    since = schedule.position(step, elapsed_s) - schedule.position(blend["step"], blend["elapsed_s"])
    t = min(1.0, max(0.0, since / ramp)) if ramp > 0 else 1.0
    return blend["lr"] + (lr - blend["lr"]) * t
