"""Counts as people write and read them: ``7B``, ``2.6B tok``, ``1.4e11``, ``125M`` in; ``1.23M`` out.

One reading (`parse_count`: `lmforge estimate`'s flags, a scaling ladder's tokens and FLOPs) and one
writing (`human`: the estimate, the progress line, `runs`, the scaling tables), so a number a
command prints reads back as the same number. The suffixes are durations' (`config.durations`).
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.config.durations import MAX_VALUE, parse_duration

UNITS = ("tokens", "tok", "flops", "flop")  # a count may name what it counts


def parse_count(value: Any, what: str) -> float:
    """``7B``, ``2.6B``, ``200B tok``, ``1.4e11``, ``125M``, ``10_000``, ``1e18flop`` (or a number) →
    a positive, finite float at most 10^18; ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what}: expected a count such as 7B, 125M, 200B or 1.4e11, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = value.strip()
        for unit in UNITS:
            if text.lower().endswith(unit):
                text = text[: -len(unit)].strip()
                break
        if text.startswith("-"):
            raise ValueError(f"{what}: expected a count above 0, got {value!r}")
        try:
            number = parse_duration(f"{text}tok", what).value
        except ValueError as e:
            if "too large" in str(e):
                raise ValueError(f"{what}: {value!r} is too large (at most {MAX_VALUE:.0e})") from None
            raise ValueError(f"{what}: expected a count such as 7B, 125M, 200B or 1.4e11, got {value!r}") from None
    if not math.isfinite(number) or number > MAX_VALUE:
        raise ValueError(f"{what}: {value!r} is too large (at most {MAX_VALUE:.0e})")
    if number <= 0:
        raise ValueError(f"{what}: expected a count above 0, got {value!r}")
    return number


def human(x: float) -> str:
    """A count for people, three significant digits: 43.2K, 1.67M, 2B, 999, 0.5."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div * 0.9995:  # 999.7 reads 1K, not 1e+03
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def gb(n: float) -> str:
    """Bytes in decimal gigabytes, one decimal: 47.2 GB."""
    return f"{n / 1e9:,.1f} GB"
