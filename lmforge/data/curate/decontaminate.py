"""Decontamination: find training documents that share a long word n-gram with an eval task.

The index holds the hashed ``n``-grams (``text.ngram_hashes``; 13 normalized words by default,
as GPT-3 did) of every example of every ICL task the run evaluates on: each text field on its
own, and the prompt followed by its correct answer (how the text would appear in the wild). A
document is contaminated by a task when one of its n-grams is in the task's part of the index.
Examples shorter than ``n`` words contribute nothing: a short phrase in common would flag
innocent text.
"""

from __future__ import annotations

import hashlib

import numpy as np

from lmforge.data.curate.text import ngram_hashes, word_hashes
from lmforge.tasks.icl import load_tasks


def _segments(ex: dict) -> list[str]:
    out = []
    for v in ex.values():
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, list):
            out.extend(x for x in v if isinstance(x, str))
    prompt = ex.get("context") if isinstance(ex.get("context"), str) else ex.get("query")
    gold = ex.get("gold")
    answer = ex.get("continuation") or ex.get("answer")
    if answer is None and isinstance(gold, int) and isinstance(ex.get("choices"), list) and gold < len(ex["choices"]):
        answer = ex["choices"][gold]
    if isinstance(prompt, str) and isinstance(answer, str):
        out.append(f"{prompt} {answer}")
    return out


class TaskIndex:
    """Sorted n-gram hashes of the tasks, with the task each came from."""

    def __init__(self, hashes: np.ndarray, task_ids: np.ndarray, labels: list[str], ngram: int, fingerprint: str):
        self.hashes, self.task_ids, self.labels, self.ngram, self.fingerprint = hashes, task_ids, labels, ngram, fingerprint

    @classmethod
    def from_tasks(cls, tasks, ngram: int) -> TaskIndex:
        """``tasks``: lmforge.eval.icl.ICLTask objects (already loaded and validated)."""
        parts, ids, labels = [], [], []
        fp = hashlib.sha256(str(ngram).encode())
        for t in tasks:
            labels.append(t.label)
            fp.update(t.label.encode())
            for ex in t.examples:
                for seg in _segments(ex):
                    fp.update(seg.encode("utf-8", "replace"))
                    h = ngram_hashes(word_hashes(seg), ngram)
                    if len(h):
                        parts.append(h)
                        ids.append(np.full(len(h), len(labels) - 1, np.int32))
        hashes = np.concatenate(parts) if parts else np.empty(0, np.uint64)
        task_ids = np.concatenate(ids) if ids else np.empty(0, np.int32)
        order = np.argsort(hashes, kind="stable")
        return cls(hashes[order], task_ids[order], labels, ngram, fp.hexdigest()[:16])

    def tasks_in(self, text: str) -> list[str]:
        """Labels of the tasks sharing an n-gram with ``text`` (empty: clean)."""
        if not len(self.hashes):
            return []
        h = ngram_hashes(word_hashes(text), self.ngram)
        if not len(h):
            return []
        pos = np.searchsorted(self.hashes, h)
        pos[pos == len(self.hashes)] = 0
        hit = self.hashes[pos] == h
        if not hit.any():
            return []
        # Every task holding one of the hit n-grams (an n-gram may occur in several tasks).
        found: set[int] = set()
        for x in np.unique(h[hit]):
            lo, hi = np.searchsorted(self.hashes, x, "left"), np.searchsorted(self.hashes, x, "right")
            found.update(self.task_ids[lo:hi].tolist())
        return [self.labels[i] for i in sorted(found)]


def load_index(tasks: str | list, ngram: int, data_root: str | None = None) -> TaskIndex:
    return TaskIndex.from_tasks(load_tasks(tasks, data_root=data_root), ngram)
