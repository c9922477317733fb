"""Rotary position embeddings: inverse frequencies (plain or long-context scaled) and cos/sin tables.

The tables use the rotate-half layout (dimension i pairs with i + d/2, each half repeated), the
same as Hugging Face's Llama family, so imported q/k weights need no row permutation. Scaling
follows the published recipes, which change only the frequencies (and, for YaRN, multiply
cos/sin by an attention factor); positions and the rotation itself stay the same:

- ``linear``: every frequency divided by ``factor`` (position interpolation);
- ``llama3``: low frequencies (wavelength above original/low_freq_factor) divided by ``factor``,
  high ones (below original/high_freq_factor) kept, a smooth blend in between (Llama 3.1+);
- ``yarn``: interpolated and extrapolated frequencies blended by a linear ramp over the
  dimensions between the beta_fast/beta_slow rotation counts, cos/sin scaled by
  0.1·ln(factor)+1 (Qwen 2.5 / Qwen 3 long-context configs).
"""

from __future__ import annotations

import math

import torch

from lmforge.config.model import RopeScaling


def inv_frequencies(dim_head: int, theta: float, scaling: RopeScaling | None = None,
                    device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim_head/2] in fp32, factor that cos/sin are multiplied by)."""
    exponents = torch.arange(0, dim_head, 2, dtype=torch.int64, device=device).float() / dim_head
    inv = 1.0 / theta ** exponents
    if scaling is None:
        return inv, 1.0
    s = scaling
    if s.type == "linear":
        return inv / s.factor, 1.0
    if s.type == "llama3":
        low_wavelen = s.original_max_seq_len / s.low_freq_factor
        high_wavelen = s.original_max_seq_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    # yarn
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim_head * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim_head - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim_head // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies unchanged), 0: interpolate (divided by factor)
    inv = (inv / s.factor) * (1 - keep) + inv * keep
    attention = s.attention_factor if s.attention_factor is not None else (
        0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
    return inv, attention


def rope_tables(dim_head: int, max_len: int, theta: float, device=None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, dim_head] in fp32, rotate-half layout (each half repeated)."""
    inv, attention = inv_frequencies(dim_head, theta, scaling, device=device)
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    emb = torch.outer(pos, inv)
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos() * attention, emb.sin() * attention
