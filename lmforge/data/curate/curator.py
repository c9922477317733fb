"""Running the curation steps over a document stream, and counting what they remove.

Two halves, so that the expensive work runs in worker processes while every decision that
depends on other documents is taken once, in input order, in the parent:

* ``DocChecker`` (per process): the per-document steps — C4, FineWeb, the language filter, Gopher
  quality, Gopher repetition (cheap to expensive: C4 and FineWeb run at 40–50 MB/s and remove
  most non-prose early, the fastText model at ~18, the Gopher rules at 3–5; a document stops at
  its first failed rule), then decontamination against the eval tasks on the text that would be
  trained on.
* ``Curator`` (the parent): exact and near dedup from the signatures the workers computed
  (``dedup.py``), the accounting of every removal by reason, and a bounded sample of removed
  documents per reason for review.

Dedup runs first, so duplicates cost no filtering and no tokenizing.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from lmforge.config.curation import CurateConfig
from lmforge.data.curate import filters as F
from lmforge.data.curate.decontaminate import TaskIndex
from lmforge.data.curate.dedup import Deduplicator, signatures
from lmforge.errors import UserError

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

    def write_samples(self, out_dir: str) -> list[str]:
        """One JSONL per reason (``dedup-near.jsonl``, ``c4-curly_bracket.jsonl``, ...)."""
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for reason, rows in sorted(self.samples.items()):
            path = os.path.join(out_dir, reason.replace("/", "-") + ".jsonl")
            with open(path, "w") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            written.append(path)
        return written


class Curator:
    """Parent-side state of one curation pass (dedup memory and the accounting)."""

    def __init__(self, cfg: CurateConfig, index: TaskIndex | None = None):
        if cfg.decontaminate is not None and index is None:
            raise UserError("curate.decontaminate: no ICL tasks to decontaminate against (set eval.icl_tasks, "
                            "decontaminate.tasks, or --decontaminate TASKS)")
        self.cfg = cfg
        self.index = index
        self.dedup = Deduplicator(cfg.dedup) if cfg.dedup and (cfg.dedup.exact or cfg.dedup.near) else None
        self.acct = Accounting(action=cfg.action, sample_limit=cfg.removed_sample)
        self.flag = cfg.action == "flag"

    def checker(self) -> DocChecker:
        return DocChecker(self.cfg, self.index)

    def signatures(self, texts: list[str]):
        return signatures(texts, self.cfg.dedup)

    def count_in(self, texts: list[str]) -> None:
        self.acct.documents_in += len(texts)
        self.acct.bytes_in += sum(len(t.encode("utf-8", "replace")) for t in texts)

    def dedup_chunk(self, texts: list[str], ids: list[int], sigs) -> tuple[list[str], list[int]]:
        """Keep the documents not seen before (in input order); count the rest."""
        if self.dedup is None:
            return texts, ids
        keys, mh = sigs
        kept, kept_ids = [], []
        for t, doc, k, s in zip(texts, ids, keys, mh):
            reason, first = self.dedup.check(doc, k, s)
            if reason is not None:
                self.acct.add(doc, f"dedup/{reason}", t, duplicate_of=first)
                if not self.flag:
                    continue
            kept.append(t)
            kept_ids.append(doc)
        return kept, kept_ids

    def count_checked(self, texts: list[str], ids: list[int], matched) -> None:
        for i, reason, tasks in matched:
            extra = {"tasks": tasks} if tasks else {}
            self.acct.add(ids[i], reason, texts[i], **extra)

    def summary(self) -> dict:
        return self.acct.summary(self.cfg)
