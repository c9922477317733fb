"""The one next-token loss: output head + cross-entropy over shifted targets.

Everything that trains or evaluates on next-token prediction (the trainer, held-out eval,
fine-tuning eval) comes through here, through `Transformer.training_loss`. The head is applied
inside the loss so that a chunked or fused linear + cross-entropy can replace the two steps
without the callers noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmforge.data.batch import IGNORE


@dataclass
class LossOutput:
    """What one training forward returns (a fixed type, whatever the model)."""

    ce_sum: torch.Tensor  # summed next-token cross-entropy (fp32, nats) over the non-ignored targets
    aux_loss: torch.Tensor | None = None  # MoE load-balancing + z losses, weighted; None for dense models
    moe: dict[str, torch.Tensor] = field(default_factory=dict)  # detached MoE statistics for logging


def next_token_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy (fp32) of ``hidden @ head_weight.T`` against ``targets`` (IGNORE skipped).

    hidden [B, T, d], head_weight [V, d], targets [B, T] already shifted (see `data.batch`).
    """
    logits = F.linear(hidden, head_weight)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
