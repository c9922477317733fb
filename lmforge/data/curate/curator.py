"""Running the per-document curation steps, and counting what the steps remove.

* ``DocChecker`` (per process): the per-document steps — C4, FineWeb, the language filter, Gopher
  quality, Gopher repetition (cheap to expensive: C4 and FineWeb run at 40–50 MB/s and remove
  most non-prose early, the fastText model at ~18, the Gopher rules at 3–5; a document stops at
  its first failed rule), then decontamination against the eval tasks on the text that would be
  trained on.
* ``Accounting`` (per work unit, summed at the end): every removal by reason, and a bounded
  sample of removed documents per reason for review.

Dedup (``crossdedup``) runs before these steps, so duplicates cost no filtering and no tokenizing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lmforge.config.curation import CurateConfig
from lmforge.data.curate import filters as F
from lmforge.data.curate.decontaminate import TaskIndex

SAMPLE_CHARS = 2000  # characters of each removed document kept in a sample


def _language(cfg):
    from lmforge.data.curate.language import language  # loads the fastText model: only when asked for

    return language(cfg)


class DocChecker:
    """Per-document filters and decontamination (built once per worker process)."""

    def __init__(self, cfg: CurateConfig, index: TaskIndex | None = None):
        self.flag = cfg.action == "flag"
        f = cfg.filters
        self.steps = []
        for name, make in (("c4", F.c4), ("fineweb", F.fineweb), ("language", _language),
                           ("gopher_quality", F.gopher_quality), ("gopher_repetition", F.gopher_repetition)):
            if getattr(f, name) is not None:
                self.steps.append(make(getattr(f, name)))
        self.index = index

    @property
    def active(self) -> bool:
        return bool(self.steps or self.index is not None)

    def check(self, text: str) -> tuple[str | None, str, list[str]]:
        """(reason or None, the text to keep, contaminating task labels)."""
        for step in self.steps:
            reason, new = step(text)
            if reason is not None:
                return reason, text, []
            text = new
        if self.index is not None:
            tasks = self.index.tasks_in(text)
            if tasks:
                return "decontaminate", text, tasks
        return None, text, []

    def run_chunk(self, texts: list[str]) -> tuple[list[str], list[tuple[int, str, list[str]]]]:
        """The texts to keep (flagged ones too, with action: flag) and (position, reason, tasks) per match."""
        kept, matched = [], []
        for i, t in enumerate(texts):
            reason, new, tasks = self.check(t)
            if reason is not None:
                matched.append((i, reason, tasks))
                if not self.flag:
                    continue
            kept.append(new)
        return kept, matched


@dataclass
class Accounting:
    """Removals by reason, contaminated tasks, and a sample of removed documents per reason."""

    action: str = "remove"
    sample_limit: int = 20
    documents_in: int = 0
    bytes_in: int = 0
    removed: Counter = field(default_factory=Counter)
    removed_bytes: int = 0
    tasks: Counter = field(default_factory=Counter)
    samples: dict = field(default_factory=dict)

    def add(self, doc: int, reason: str, text: str, **extra) -> None:
        self.removed[reason] += 1
        self.removed_bytes += len(text.encode("utf-8", "replace"))
        for t in extra.get("tasks") or []:
            self.tasks[t] += 1
        bucket = self.samples.setdefault(reason, [])
        if len(bucket) < self.sample_limit:
            bucket.append({"doc": doc, "reason": reason, **extra, "chars": len(text), "text": text[:SAMPLE_CHARS]})

    def counts(self) -> dict:
        """Everything but the samples, as JSON (what a work unit reports)."""
        return {"documents_in": self.documents_in, "bytes_in": self.bytes_in, "removed": dict(self.removed),
                "removed_bytes": self.removed_bytes, "tasks": dict(self.tasks)}

    def add_counts(self, c: dict) -> None:
        """Add another unit's ``counts()``."""
        self.documents_in += c["documents_in"]
        self.bytes_in += c["bytes_in"]
        self.removed.update(c["removed"])
        self.removed_bytes += c["removed_bytes"]
        self.tasks.update(c["tasks"])

    def summary(self, cfg: CurateConfig) -> dict:
        by_step = Counter()
        for reason, n in self.removed.items():
            by_step[reason.split("/")[0]] += n
        total = sum(self.removed.values())
        return {
            "action": self.action,
            "steps": ([f"dedup/{k}" for k in ("exact", "near") if cfg.dedup and getattr(cfg.dedup, k)]
                      + cfg.filters.enabled() + (["decontaminate"] if cfg.decontaminate else [])),
            "documents_in": self.documents_in,
            "documents_kept": self.documents_in - (total if self.action == "remove" else 0),
            "documents_matched": total,
            "bytes_in": self.bytes_in,
            "bytes_matched": self.removed_bytes,
            "by_step": dict(sorted(by_step.items())),
            "by_reason": dict(sorted(self.removed.items())),
            "contaminated_tasks": dict(sorted(self.tasks.items())),
        }
