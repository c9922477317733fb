"""Held-out loss, perplexity and bits per byte.

Bits per byte makes models with different tokenizers comparable: the mean loss per token
(nats) divided by ln 2 gives bits per token, times tokens per byte of the held-out text
(recorded by `data prepare` for each split) gives bits per byte.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Iterable

import torch

from lmforge.data.batch import Batch
from lmforge.distributed.dist import all_reduce_sum


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device,
                 autocast=nullcontext) -> tuple[float, int]:
    """Mean next-token loss (nats) per target over the given batches, summed across ranks.

    Uses the model's training forward (`training_loss`), so held-out and training losses are the
    same function; targets marked IGNORE (fine-tuning prompts, padding) do not count.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        batch = batch.to(device)
        with autocast():
            out = model.training_loss(batch.input_ids, batch.targets, doc_ids=batch.doc_ids)
        total[0] += out.ce_sum.double()
        total[1] += batch.num_targets()
    model.train(was_training)
    all_reduce_sum(total)
    n = int(total[1].item())
    return (total[0].item() / n if n else float("nan")), n


def bits_per_byte(loss_nats: float, bytes_per_token: float | None) -> float | None:
    if not bytes_per_token:
        return None
    return loss_nats / math.log(2) / bytes_per_token
