"""Policy-gradient losses of reinforcement learning from rewards: GRPO and its successors.

A prompt's G completions (its group) are scored by rewards r_1 … r_G. Each completion's
*advantage* is its reward against its group's (`group_advantages`):

    A_i = (r_i − mean(r)) / (std(r) + ε)        scale_rewards: group (GRPO; std over the group, n − 1)
    A_i = (r_i − mean(r)) / (std_batch + ε)     scale_rewards: batch (the std of every reward of the step)
    A_i =  r_i − mean(r)                        scale_rewards: none (Dr. GRPO)

Each completion token t has the ratio ρ_t = π(y_t | …) / π_old(y_t | …) of the policy being
trained to the one that sampled it (1 on a batch's first update, where they are the same weights;
its gradient is still ∇ log π), and the clipped surrogate

    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε_low, 1 + ε_high) A)   (+ β · k3_t with a KL penalty)

with k3_t = exp(q_t) − q_t − 1, q_t = log π_ref − log π (Schulman's unbiased, positive estimator of
KL(π‖π_ref)). The losses differ in how the ℓ_t of a batch become one number (`aggregate`); with m
the completion tokens (0 where a completion is masked), N the completions of the batch, L_max
``rl.max_new_tokens``:

- ``grpo`` (Shao et al. 2024, eq. 3): each completion's token mean, then the mean over completions;
- ``dapo`` (Yu et al. 2025, eq. 8): the token-level mean over every token of the batch: Σ m ℓ / Σ m;
- ``dr_grpo`` (Liu et al. 2025): the token sum over a constant, Σ m ℓ / (N · L_max);
- ``gspo`` (Zheng et al. 2025, eq. 5–7): one ratio per completion, the geometric mean of its token
  ratios s_i = exp(mean_t log ρ_t), in −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i) (plus β
  times its mean k3), then the mean over completions.

Every function is a plain function of tensors; `tests/test_rl.py` checks each loss against the
papers' formulas written out as loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-4  # added to the standard deviation (TRL's; a flat group's advantages are then 0, not NaN)
LOSSES = ("dapo", "grpo", "dr_grpo", "gspo")


def group_advantages(rewards: torch.Tensor, scale: str, batch_std: float | None = None) -> torch.Tensor:
    """[P, G] rewards of P groups → their advantages (see the module docstring). ``batch_std``: the
    standard deviation of every reward of the step, all ranks (``scale == "batch"``)."""
    adv = rewards - rewards.mean(1, keepdim=True)
    if scale == "group":
        return adv / (rewards.std(1, keepdim=True) + EPS)
    if scale == "batch":
        return adv / (batch_std + EPS)
    if scale == "none":
        return adv
    raise ValueError(f"unknown reward scaling {scale!r}")


@dataclass
class PolicyTerms:
    """The loss of each token [B, T] (gspo: of each completion [B]), whether the clip decided it (its
    gradient is then 0) and each token's k3 estimate of the KL to the reference (None without one)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor | None = None


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float):
    loss = -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    clipped = ((ratio < 1 - low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    return loss, clipped.float()


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    q = ref_logp - logp
    return torch.exp(q) - q - 1


def policy_terms(loss: str, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, *,
                 clip: tuple[float, float], ref_logp: torch.Tensor | None = None, beta: float = 0.0) -> PolicyTerms:
    """The terms of ``loss`` for completions with token log-probs ``logp`` [B, T] under the policy (with
    their graph), ``old_logp`` under the weights that sampled them, ``mask`` [B, T] (1.0 on the tokens
    trained), advantages ``adv`` [B] and the reference's ``ref_logp`` (a KL penalty of weight ``beta``)."""
    low, high = clip
    kl = None if ref_logp is None or beta == 0 else k3(logp, ref_logp)
    log_ratio = (logp - old_logp) * mask
    if loss == "gspo":
        n = mask.sum(-1).clamp(min=1.0)
        value, clipped = _surrogate(torch.exp(log_ratio.sum(-1) / n), adv, low, high)
        if kl is not None:
            value = value + beta * (kl * mask).sum(-1) / n
        return PolicyTerms(value, clipped, kl)
    if loss not in LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}")
    value, clipped = _surrogate(torch.exp(log_ratio), adv[:, None], low, high)
    if kl is not None:
        value = value + beta * kl
    return PolicyTerms(value, clipped, kl)


def row_units(loss: str, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """[B] what each completion counts in the denominator of ``loss``'s mean: its tokens (dapo), one
    (grpo, gspo) or max_new_tokens (dr_grpo). A batch's loss is Σ `aggregate` / Σ row_units — over
    the whole step, every micro-batch and rank."""
    if loss == "dapo":
        return mask.sum(-1)
    if loss == "dr_grpo":
        return torch.full(mask.shape[:1], float(max_new_tokens), device=mask.device)
    return torch.ones(mask.shape[:1], device=mask.device)


def per_unit(values: torch.Tensor, mask: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Σ over completions of (each completion's mean of ``values`` [B, T] over its tokens, or its value
    [B]) × its ``units``: divided by Σ units, the mean the loss takes, of any per-token quantity."""
    if values.dim() == 2:
        values = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return (values * units).sum()


def aggregate(loss: str, terms: PolicyTerms, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The batch's loss summed over its units (`row_units`): ``loss``'s aggregation before the division
    by the step's units."""
    if loss in ("dapo", "dr_grpo"):
        return (terms.loss * mask).sum()
    return per_unit(terms.loss, mask, torch.ones(mask.shape[:1], device=mask.device))
