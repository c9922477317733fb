"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, device_type: str) -> torch.optim.AdamW:
    """Decay 2-D+ weights (matmuls, embeddings); never norms or other vectors.

    The fused kernel is used where the installed torch has it for the device (CUDA, and CPU
    in recent releases); it is numerically the same update, just one kernel.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=lr, betas=betas, eps=eps)
    try:
        return torch.optim.AdamW(groups, fused=device_type in ("cuda", "cpu"), **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=device_type == "cuda", **kwargs)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float,
              progress: float | None = None) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps``, then ``cosine`` or ``linear`` decay to ``min_ratio`` at
    ``total_steps`` (or ``constant``). ``progress`` overrides the decay position (wall-clock runs).
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if progress is None:
        span = max(1, total_steps - warmup_steps)
        progress = (step - warmup_steps) / span
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
