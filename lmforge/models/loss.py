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


def head_logits(hidden: torch.Tensor, head_weight: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """``hidden @ head_weight.T``, smoothly capped to ±softcap when given (tanh, as Gemma 2)."""
    logits = F.linear(hidden, head_weight)
    if softcap is not None:
        logits = softcap * torch.tanh(logits.float() / softcap)
    return logits


def next_token_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, *,
                    softcap: float | None = None, with_z: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of cross-entropy (fp32) of the head's logits against ``targets`` (IGNORE skipped), and
    with ``with_z`` the mean of log(Z)² over the same targets (PaLM's z-loss, before its weight).

    hidden [B, T, d], head_weight [V, d], targets [B, T] already shifted (see `data.batch`).
    """
    logits = head_logits(hidden, head_weight, softcap).flatten(0, 1).float()
    flat = targets.flatten()
    ce = F.cross_entropy(logits, flat, ignore_index=IGNORE, reduction="sum")
    if not with_z:
        return ce, None
    keep = flat != IGNORE
    lse = torch.logsumexp(logits[keep], dim=-1)
    return ce, lse.square().sum() / keep.sum().clamp(min=1)
