"""Durations with units: ``200B tok``, ``2_000_000tok``, ``500ba``, ``2ep``, ``10000sp``, ``30min``.

Units: ``tok`` (tokens), ``ba`` (optimizer steps), ``sp`` (samples), ``ep`` (epochs of the
training data), ``flop`` (training FLOPs on the standard 6·N_active-per-token basis, e.g.
``3e15flop``), and wall-clock ``s`` / ``min`` / ``h`` (stored in seconds). Counts accept ``_``
separators and ``K/M/B/T`` suffixes (10^3 … 10^12).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from dataclasses import dataclass

UNITS = {"tok": "tok", "ba": "ba", "sp": "sp", "ep": "ep", "s": "s", "min": "s", "h": "s", "flop": "flop",
         "flops": "flop"}
_SECONDS = {"s": 1, "min": 60, "h": 3600}
COUNTED = {"tok": "tokens", "ba": "steps", "sp": "samples"}  # units that count whole things
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
# Far beyond any real run (10^18 tokens, steps, samples, epochs or seconds), small enough that
# step and token counts stay exact integers: a larger value is a typo, not a plan.
MAX_VALUE = 1e18
_PATTERN = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]+)?(?:e\+?[0-9]+)?)\s*([a-z][a-z ]*?)\s*$", re.I)


@dataclass(frozen=True)
class Duration:
    value: float  # tokens, steps, samples, epochs, FLOPs or seconds
    unit: str  # tok | ba | sp | ep | flop | s

    def __str__(self) -> str:
        if self.unit == "flop":
            return f"{self.value:.4g}flop"
        v = int(self.value) if float(self.value).is_integer() else self.value
        return f"{v}{self.unit}"


def parse_duration(text: str | int | float | Duration, what: str = "duration", *, allow_zero: bool = False) -> Duration:
    """Parse a duration; raises ValueError with a message naming the expected units. ``allow_zero``:
    0 is a duration too (a warmup of none), else it must be positive."""
    if isinstance(text, Duration):
        return text
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"expected a duration string like '10000tok' or '500ba', got {text!r}")
    if isinstance(text, (int, float)):
        raise ValueError(
            f"{text!r} has no unit; write e.g. '{text}tok', '{text}ba', '{text}sp', '{text}ep' or '{text}min'")
    m = _PATTERN.match(text)
    if not m and _PATTERN.match(text.strip().removeprefix("-")):
        raise ValueError(f"{what} must be positive, got {text!r}")
    if not m:
        raise ValueError(f"cannot read {text!r} as a {what}; expected a number and a unit, "
                         "e.g. '10000tok', '200B tok', '500ba', '2ep', '30min'")
    number, rest = m.group(1).replace("_", ""), m.group(2).lower()
    # The unit is the whole rest ("500ba", "30min") or a K/M/B/T suffix then a unit ("200B tok").
    if rest.replace(" ", "") in UNITS:
        suffix, unit = "", rest.replace(" ", "")
    elif rest[0] in _SUFFIX and rest[1:].strip() in UNITS:
        suffix, unit = rest[0], rest[1:].strip()
    else:
        raise ValueError(f"unknown unit {rest!r} in {text!r}; expected one of tok, ba, sp, ep, flop, s, min, h "
                         "(optionally after K/M/B/T, e.g. '200B tok')")
    exact = Decimal(number) * _SUFFIX[suffix]  # '1.1K' is 1100 exactly (in floats, 1100.0000000000002)
    value = float(exact)
    if unit in _SECONDS:
        value *= _SECONDS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'0 or more' if allow_zero else 'positive'}, got {text!r}")
    if not math.isfinite(value) or value > MAX_VALUE:
        raise ValueError(f"{what} {text!r} is too large (at most {MAX_VALUE:.0e} {UNITS[unit]})")
    if UNITS[unit] in COUNTED and exact != exact.to_integral_value():
        # A run cannot take 3.7 optimizer steps: rounding either way would train other than asked.
        raise ValueError(f"{what} {text!r}: {COUNTED[UNITS[unit]]} are counted in whole numbers "
                         f"(e.g. '{math.floor(value) or 1}{UNITS[unit]}'; epochs, FLOPs and times may be fractions)")
    return Duration(value=value, unit=UNITS[unit])
