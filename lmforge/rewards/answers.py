"""The final answer of a text, and whether two answers are the same.

`final_answer` takes, in order: the last ``\\boxed{…}`` (braces nested inside it kept), the text
after the last ``#### `` (GSM8K's answer line), else the last number in the text. `same_answer`
compares two answers as numbers where both read as one (``1,000`` = ``1000.0`` = ``$1000``,
``3/4`` = ``0.75``), else as text with spaces and case ignored.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*(.+)")
_TRIM = " \t\n.$€£%*"  # around an answer: a sentence's full stop, a currency or percent sign, bold


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), nested braces kept; None when there is none
    or it is never closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The answer a text ends with: its last ``\\boxed{}``, else what follows its last ``####``, else its
    last number; None when it has none of them."""
    inside = boxed(text)
    if inside is not None:
        return inside.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip().strip(_TRIM) or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def as_number(text: str) -> Fraction | float | None:
    """``text`` as a number (commas of thousands, a currency or percent sign, spaces and ``\\!`` dropped;
    ``a/b`` and ``\\frac{a}{b}`` as fractions); None when it is not one."""
    t = text.strip().strip(_TRIM).replace(",", "").replace("\\!", "").replace(" ", "")
    frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", t)
    if frac:
        t = f"{frac.group(1)}/{frac.group(2)}"
    try:
        if "/" in t:
            num, den = t.split("/")
            return Fraction(int(num), int(den)) if int(den) else None
        value = float(t)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def same_answer(a: str | None, b: str | None, rel_tol: float = 1e-6) -> bool:
    """Whether two answers agree: numerically where both are numbers, else as text (spaces, case and a
    trailing full stop ignored)."""
    if a is None or b is None:
        return False
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        try:
            return math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=1e-9)
        except OverflowError:  # a fraction past a float's range (a completion of 400 digits): exactly
            return x == y
    norm = lambda s: re.sub(r"\s+", "", s).strip(".").lower()  # noqa: E731
    return norm(a) == norm(b)
