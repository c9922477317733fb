"""The published heuristic quality filters: C4, FineWeb, Gopher quality, Gopher repetition.

The rules, their order, thresholds and reason names follow datatrove's implementations (the
references: ``C4QualityFilter``, ``FineWebQualityFilter``, ``GopherQualityFilter``,
``GopherRepetitionFilter``), and ``tests/test_curate.py`` checks that the verdicts agree with
datatrove's on real text. They are written again here for speed: datatrove's run at 0.7–2 MB/s
per core on this project's CPU machines (a Python object per n-gram, spaCy word splitting),
these at tens of MB/s — n-gram statistics are computed on hashed words in numpy.

Words are what a word tokenizer gives (runs of letters/digits with inner apostrophes, and each
punctuation character on its own) — a regex here, instead of spaCy's English tokenizer. Each
filter returns ``None`` to keep a document or the reason it is removed; C4 may also drop lines
(as in C4 itself), so filters return the (possibly shorter) text too.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from lmforge.config.curation import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*|[^\w\s]|_+")
_ALNUM = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_ALPHA = re.compile(r"[^\W\d_]")
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_SENTENCE_END = re.compile(r"[.!?]+['\"”’)\]]*(?=\s|$)")
STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])
END_PUNCTUATION = (".", "?", "!", '"', "'")
# Sentence terminals (Unicode's Sentence_Terminal class, the common scripts): what FineWeb's
# line_punct rule counts as a line that ends a sentence. Quotes, colons and semicolons are not:
# code and headings end with them.
TERMINAL_PUNCTUATION = tuple(".!?‼‽⁇⁈⁉。！？｡．؟؞۔܀܁܂।॥။၊።፧፨᙮᠃᠉᥄᥅។៕៖៙៚꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗")
POLICY_SUBSTRINGS = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
                     "use cookies")

Filter = Callable[[str], tuple[str | None, str]]


def words_of(text: str) -> list[str]:
    return _WORD.findall(text)


def find_duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items equal to an earlier one, their total characters)."""
    seen: set[str] = set()
    dup = chars = 0
    for x in items:
        if x in seen:
            dup += 1
            chars += len(x)
        else:
            seen.add(x)
    return dup, chars


# ----------------------------------------------------------------------------- C4


def c4(cfg: C4Config) -> Filter:
    def run(text: str) -> tuple[str | None, str]:
        sentences = 0
        kept = []
        for line in text.splitlines():
            line = line.strip()
            words = line.split()
            if len(line) > cfg.max_word_length and max(map(len, words)) > cfg.max_word_length:
                continue
            line = _CITATION.sub("", line)
            if cfg.terminal_punct and (not line.endswith(END_PUNCTUATION) or line.endswith("...")):
                continue
            if len(words) < cfg.min_words_per_line:
                continue
            low = line.lower()
            if cfg.lorem_ipsum and "lorem ipsum" in low:
                return "c4/lorem_ipsum", text
            if cfg.javascript and "javascript" in low:
                continue
            if cfg.curly_bracket and "{" in line:
                return "c4/curly_bracket", text
            if cfg.policy and any(p in low for p in POLICY_SUBSTRINGS):
                continue
            sentences += max(1, len(_SENTENCE_END.findall(line)))
            kept.append(line)
        if sentences < cfg.min_sentences:
            return "c4/too_few_sentences", text
        return None, "\n".join(kept).strip()

    return run


# ----------------------------------------------------------------------------- FineWeb


def fineweb(cfg: FineWebConfig) -> Filter:
    def run(text: str) -> tuple[str | None, str]:
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if not lines:
            return "fineweb/empty", text
        if sum(ln.endswith(TERMINAL_PUNCTUATION) for ln in lines) / len(lines) < cfg.line_punct_thr:
            return "fineweb/line_punct_ratio", text
        if sum(len(ln) <= cfg.short_line_length for ln in lines) / len(lines) > cfg.short_line_thr:
            return "fineweb/short_line_ratio", text
        if find_duplicates(lines)[1] / max(1, len(text) - text.count("\n")) > cfg.char_dup_ratio:
            return "fineweb/char_dup_ratio", text
        if text.count("\n") / max(1, len(words_of(text))) > cfg.new_line_ratio:
            return "fineweb/list_ratio", text
        return None, text

    return run


# ----------------------------------------------------------------------------- Gopher quality


def gopher_quality(cfg: GopherQualityConfig) -> Filter:
    def run(text: str) -> tuple[str | None, str]:
        n_words = len(_WORD.findall(text))
        alnum = _ALNUM.findall(text)  # the words that are not punctuation
        n = len(alnum)
        if cfg.min_doc_words and n < cfg.min_doc_words:
            return "gopher_quality/short_doc", text
        if cfg.max_doc_words and n > cfg.max_doc_words:
            return "gopher_quality/long_doc", text
        if n:
            avg = sum(map(len, alnum)) / n
            if cfg.min_avg_word_length and avg < cfg.min_avg_word_length:
                return "gopher_quality/below_avg_word_length", text
            if cfg.max_avg_word_length and avg > cfg.max_avg_word_length:
                return "gopher_quality/above_avg_word_length", text
        if not n_words:
            return "gopher_quality/no_words", text
        if cfg.max_symbol_word_ratio:
            if text.count("#") / n_words > cfg.max_symbol_word_ratio:
                return "gopher_quality/too_many_hashes", text
            if (text.count("...") + text.count("…")) / n_words > cfg.max_symbol_word_ratio:
                return "gopher_quality/too_many_ellipsis", text
        lines = text.splitlines() or [""]
        if cfg.max_bullet_lines_ratio is not None and sum(
                ln.lstrip().startswith(("•", "-")) for ln in lines) / len(lines) > cfg.max_bullet_lines_ratio:
            return "gopher_quality/too_many_bullets", text
        if cfg.max_ellipsis_lines_ratio is not None and sum(
                ln.rstrip().endswith(("...", "…")) for ln in lines) / len(lines) > cfg.max_ellipsis_lines_ratio:
            return "gopher_quality/too_many_end_ellipsis", text
        if cfg.min_alpha_words_ratio and sum(1 for w in alnum if _ALPHA.search(w)) / n_words < cfg.min_alpha_words_ratio:
            return "gopher_quality/below_alpha_threshold", text
        if cfg.min_stop_words and len(STOP_WORDS.intersection(alnum)) < cfg.min_stop_words:
            return "gopher_quality/not_enough_stop_words", text
        return None, text

    return run


# ----------------------------------------------------------------------------- Gopher repetition


class _Grams:
    """Hashed n-grams of one document's words (a process-local string hash is enough: one document)."""

    def __init__(self, words: list[str]):
        self.h = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
        self.cum = np.concatenate([[0], np.cumsum(np.fromiter(map(len, words), np.int64, count=len(words)))])
        self.mult = np.random.default_rng(7).integers(1, 2**63, size=16, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def of(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(hash, characters without separators) of every n-gram."""
        m = len(self.h) - n + 1
        g = self.h[:m] * self.mult[0]
        for j in range(1, n):
            g = g + self.h[j:j + m] * self.mult[j]
        return g, self.cum[n:n + m] - self.cum[:m]


def _top_ngram_chars(g: np.ndarray, chars: np.ndarray, n: int) -> int:
    """Characters of the most frequent n-gram (joined with spaces) times its count; ties: the earliest."""
    _, first, counts = np.unique(g, return_index=True, return_counts=True)
    top = counts.max()
    i = first[counts == top].min()
    return int((chars[i] + n - 1) * top)


def _duplicate_ngram_chars(g: np.ndarray, chars: np.ndarray, n: int) -> int:
    """Characters in repeated n-grams, scanning left to right and skipping past each repeat."""
    m = len(g)
    _, inv = np.unique(g, return_inverse=True)
    first = np.full(inv.max() + 1, m, np.int64)
    np.minimum.at(first, inv, np.arange(m))
    repeats = np.flatnonzero(first[inv] < np.arange(m))  # positions whose n-gram occurred earlier
    if not len(repeats):
        return 0
    seen = np.zeros(len(first), bool)
    total, idx, k = 0, 0, 0
    while idx < m:
        while k < len(repeats) and repeats[k] < idx:
            k += 1
        nxt = int(repeats[k]) if k < len(repeats) else m
        seen[inv[idx:nxt]] = True  # first occurrences: never already seen, all added
        if nxt >= m:
            break
        if seen[inv[nxt]]:
            total += int(chars[nxt])
            idx = nxt + n
        else:
            seen[inv[nxt]] = True
            idx = nxt + 1
    return total


def gopher_repetition(cfg: GopherRepetitionConfig) -> Filter:
    def run(text: str) -> tuple[str | None, str]:
        if not text:
            return "gopher_repetition/empty", text
        paragraphs = _PARAGRAPHS.split(text.strip())
        dup, chars = find_duplicates(paragraphs)
        if cfg.dup_para_frac and dup / len(paragraphs) > cfg.dup_para_frac:
            return "gopher_repetition/dup_para_frac", text
        if cfg.dup_para_char_frac and chars / len(text) > cfg.dup_para_char_frac:
            return "gopher_repetition/dup_para_char_frac", text
        lines = _LINES.split(text)
        dup, chars = find_duplicates(lines)
        if cfg.dup_line_frac and dup / len(lines) > cfg.dup_line_frac:
            return "gopher_repetition/dup_line_frac", text
        if cfg.dup_line_char_frac and chars / len(text) > cfg.dup_line_char_frac:
            return "gopher_repetition/dup_line_char_frac", text
        words = words_of(text)
        grams = _Grams(words)
        for n, frac in sorted(cfg.top_ngram_fracs.items()):
            if len(words) < n:
                continue
            g, c = grams.of(n)
            if _top_ngram_chars(g, c, n) / len(text) > frac:
                return f"gopher_repetition/top_{n}_gram", text
        for n, frac in sorted(cfg.dup_ngram_fracs.items()):
            if len(words) < n:
                continue
            g, c = grams.of(n)
            dup_chars = _duplicate_ngram_chars(g, c, n)
            if dup_chars / len(text) > frac:
                return f"gopher_repetition/duplicated_{n}_n_grams", text
            if dup_chars == 0:
                break  # no repeated n-gram: no longer one repeats either
        return None, text

    return run
