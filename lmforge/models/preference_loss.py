"""Preference losses on whole-sequence log-probabilities: DPO, IPO, SimPO, ORPO.

Each pair is a prompt x with a chosen answer y_w and a rejected one y_l. The inputs are, per
pair, the summed log-probability of each answer under the policy (log π(y|x): its tokens only,
never the prompt's), its token count |y|, and for DPO and IPO the same sums under the reference
model. Each function returns the per-pair losses and the implicit rewards the metrics report
(rewards/chosen, rewards/rejected; their difference is the margin, and the share of pairs whose
chosen reward is higher the accuracy).

- **DPO** (Rafailov et al. 2023, eq. 7): with the log-ratios ρ = log π(y|x) − log π_ref(y|x),
  ``-log σ(β (ρ_w − ρ_l))``; the reward is β ρ. ``label_smoothing`` ε assumes each label is
  flipped with probability ε (conservative DPO): ``-(1−ε) log σ(βΔ) − ε log σ(−βΔ)``.
- **IPO** (Azar et al. 2023, eq. 17): ``(h − 1/(2τ))²`` with h the difference of the answers'
  log-ratios, each averaged over its tokens (the length-normalized form the IPO authors'
  results use, as TRL's DPO trainer computes it); ``beta`` is τ. Rewards as DPO's.
- **SimPO** (Meng et al. 2024, eq. 6): reference-free, the reward is the length-normalized
  log-probability β log π(y|x) / |y|, and ``-log σ(r_w − r_l − γ)`` asks for a margin γ.
- **ORPO** (Hong et al. 2024, eqs. 2–7): reference-free, the chosen answer's mean next-token
  NLL plus λ · ``-log σ(log odds(y_w) − log odds(y_l))``, with odds(y) = P/(1−P) of the
  per-token mean probability P = exp(log π(y|x)/|y|); ``beta`` is λ. The reward is λ log P (as
  TRL reports it).

All in fp32; every function is a plain function of tensors (`tests/test_preference.py` checks
them against TRL's own code and against the papers' formulas written out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PairTerms:
    """Per pair [N]: the loss and the implicit rewards of the chosen and the rejected answer."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor


@dataclass
class PairLogps:
    """Per pair [N]: summed log-probabilities of each answer, their token counts, and the reference's
    sums (None for the reference-free losses)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


def dpo(p: PairLogps, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    chosen = beta * (p.chosen - p.ref_chosen)
    rejected = beta * (p.rejected - p.ref_rejected)
    margin = chosen - rejected
    loss = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return PairTerms(loss, chosen.detach(), rejected.detach())


def ipo(p: PairLogps, beta: float) -> PairTerms:
    h = (p.chosen - p.ref_chosen) / p.chosen_tokens - (p.rejected - p.ref_rejected) / p.rejected_tokens
    loss = (h - 1 / (2 * beta)) ** 2
    return PairTerms(loss, (beta * (p.chosen - p.ref_chosen)).detach(), (beta * (p.rejected - p.ref_rejected)).detach())


def simpo(p: PairLogps, beta: float, gamma: float) -> PairTerms:
    chosen = beta * p.chosen / p.chosen_tokens
    rejected = beta * p.rejected / p.rejected_tokens
    loss = -F.logsigmoid(chosen - rejected - gamma)
    return PairTerms(loss, chosen.detach(), rejected.detach())


def orpo(p: PairLogps, beta: float) -> PairTerms:
    mean_chosen = p.chosen / p.chosen_tokens
    mean_rejected = p.rejected / p.rejected_tokens
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    loss = -mean_chosen - beta * F.logsigmoid(log_odds)
    return PairTerms(loss, (beta * mean_chosen).detach(), (beta * mean_rejected).detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation (Mächler 2012: the branch at −ln 2). x is
    kept below −1e-6 (a sequence of probability 1 would make the odds infinite), and each branch
    sees only inputs it is finite on, so no NaN gradient leaks through the unused one."""
    x = x.clamp(max=-1e-6)
    cut = -math.log(2)
    far = torch.where(x < cut, x, cut)
    near = torch.where(x < cut, cut, x)
    return torch.where(x < cut, torch.log1p(-torch.exp(far)), torch.log(-torch.expm1(near)))


def pair_terms(loss: str, p: PairLogps, *, beta: float, label_smoothing: float = 0.0,
               gamma: float = 0.0) -> PairTerms:
    """The per-pair terms of ``loss`` (`config.schema.PREFERENCE_LOSSES`)."""
    if loss == "dpo":
        return dpo(p, beta, label_smoothing)
    if loss == "ipo":
        return ipo(p, beta)
    if loss == "simpo":
        return simpo(p, beta, gamma)
    if loss == "orpo":
        return orpo(p, beta)
    raise ValueError(f"unknown preference loss {loss!r}")
