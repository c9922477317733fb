"""Scoring rules of LLM Foundry's ICL metrics: answer matching for generation tasks and the
expected calibration error, on per-example outcomes.

Generation answers: the output is cut at the first match of the stop sequences (joined as one
regular expression, as Foundry does), then after the last ``cot_delimiter``; it is correct
when, normalized, it *starts with* one of the normalized accepted answers. Normalization
(TriviaQA's): lowercase, underscores and punctuation (including curly quotes and the acute
accent) become spaces, the articles a/an/the are dropped, whitespace collapses. Without
normalization both sides are only stripped.
"""

from __future__ import annotations

import re
import string

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation) | {"\u2018", "\u2019", "\u00b4", "`"}
# Characters that make a stop sequence a pattern rather than literal text.
_REGEX_CHARS = set(".^$*+?{}[]\\|()")


def normalize_answer(text: str) -> str:
    text = text.replace("_", " ").lower()
    text = "".join(" " if ch in _PUNCTUATION else ch for ch in text)
    return " ".join(_ARTICLES.sub(" ", text).split())


def stop_pattern(stops: list[str]) -> re.Pattern | None:
    return re.compile("|".join(stops)) if stops else None


def final_answer(output: str, stops: list[str], cot_delimiter: str = "") -> str:
    """The part of a generation that is graded."""
    pattern = stop_pattern(stops)
    if pattern is not None:
        output = pattern.split(output)[0]
    if cot_delimiter:
        output = output.split(cot_delimiter)[-1]
    return output


def answer_matches(answer: str, accepted: list[str], normalize: bool = True) -> bool:
    """True when the graded answer starts with any accepted answer."""
    if normalize:
        answer = normalize_answer(answer)
        return any(answer.startswith(normalize_answer(a)) for a in accepted)
    answer = answer.strip()
    return any(answer.startswith(a.strip()) for a in accepted)


def settled_length(text: str, stops: list[str]) -> bool:
    """True once more generated text can no longer change where `text` is cut.

    Holds when a stop sequence was found and every stop sequence starting before that point
    would already be complete. Only literal stop sequences can be settled early; with regular
    expressions generation runs to its token budget (or EOS), as in Foundry.
    """
    if not stops or any(ch in _REGEX_CHARS for s in stops for ch in s):
        return False
    first = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
    return first >= 0 and len(text) >= first + max(len(s) for s in stops)


def calibration_error(outcomes: list[tuple[float, bool]], buckets: int = 10) -> float:
    """Foundry's expected calibration error: |accuracy - bucket midpoint| averaged over
    `buckets` equal-width confidence buckets, weighted by how many examples fall in each."""
    totals = [0] * buckets
    right = [0] * buckets
    for confidence, correct in outcomes:
        b = min(int(confidence * buckets), buckets - 1)
        totals[b] += 1
        right[b] += bool(correct)
    n = sum(totals)
    return sum(totals[b] / n * abs(right[b] / totals[b] - (b + 0.5) / buckets) for b in range(buckets) if totals[b])


def lm_confidence(logprobs: torch.Tensor) -> float:
    """Confidence of a language-modeling continuation: the lowest top-token probability over its
    positions (logprobs: [tokens, vocab])."""
    return float(logprobs.float().exp().max(dim=-1).values.min())


def choice_confidence(mean_probs: list[float]) -> tuple[int, float]:
    """(chosen option, confidence) for multiple choice calibration: the option with the highest
    mean token probability, and its share of the options' total."""
    probs = torch.tensor(mean_probs, dtype=torch.float32)
    best = max(range(len(mean_probs)), key=mean_probs.__getitem__)
    return best, float(probs.max() / probs.sum())


__all__ = ["normalize_answer", "final_answer", "answer_matches", "settled_length", "calibration_error",
           "lm_confidence", "choice_confidence", "stop_pattern"]
