"""Held-out loss, perplexity and bits per byte.

Bits per byte makes models with different tokenizers comparable: the mean loss per token
(nats) divided by ln 2 gives bits per token, times tokens per byte of the held-out text
(recorded by `data prepare` for each split) gives bits per byte.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from lmforge.distributed.dist import all_reduce_sum


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches, device: torch.device, autocast=nullcontext) -> tuple[float, int]:
    """Mean next-token loss (nats) over the given batches, summed across ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with autocast():
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total[0] += loss.double()
        total[1] += batch[:, 1:].numel()
    model.train(was_training)
    all_reduce_sum(total)
    n = int(total[1].item())
    return (total[0].item() / n if n else float("nan")), n


def bits_per_byte(loss_nats: float, bytes_per_token: float | None) -> float | None:
    if not bytes_per_token:
        return None
    return loss_nats / math.log(2) / bytes_per_token
