"""Benchmark: data curation throughput, and recall/precision of planted near-duplicates.

    python bench/curate.py [--synthetic-mb 20] [--workers 2]

Corpus: builtin:python-stdlib (≈12.5 MB of code and docs) plus SYNTHETIC MB of English-like prose
(a word-bigram chain fitted on the stdlib's pydoc topics): half of it base documents, the other
half planted near-duplicates of them (0.5–2% of the words substituted, inserted or deleted;
Jaccard of 5-word shingles ≈ 0.82–0.97), plus "hard negatives" that share a quarter of
their text with a base document (Jaccard ≈ 0.1–0.2) and must not be flagged.

Rows: `lmforge data dedup` (exact + near) and the same with every filter on (language, C4,
FineWeb, Gopher quality, Gopher repetition), MB/s of input with --workers processes; then the
planted near-duplicates' recall and precision (dedup decisions on the synthetic part).

Targets (issue [data-curation]): dedup + filters >= 5 MB/s on 2 cores; recall >= 0.95 and
precision >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict


def bigram_model() -> dict[str, list[str]]:
    import re

    from lmforge.data.text.builtin import pydoc_topics

    words = re.findall(r"[A-Za-z][a-z']+|[.,;:!?]", " ".join(t for _, t in pydoc_topics()))
    nxt: dict[str, list[str]] = defaultdict(list)
    for a, b in zip(words, words[1:]):
        nxt[a].append(b)
    return nxt


def prose(rng: random.Random, model: dict, n_words: int) -> str:
    w = rng.choice(list(model))
    out = []
    for i in range(n_words):
        out.append(w)
        w = rng.choice(model.get(w) or list(model))
        if i % 60 == 59:
            out.append("\n")
    text = " ".join(out).replace(" .", ".").replace(" ,", ",").replace(" ;", ";").replace(" :", ":")
    return text.replace(" !", "!").replace(" ?", "?").replace(" \n ", "\n")


def edit(rng: random.Random, text: str, rate: float, vocab: list[str]) -> str:
    w = text.split(" ")
    for _ in range(max(1, int(rate * len(w)))):
        i, op = rng.randrange(len(w)), rng.random()
        if op < 0.4:
            w[i] = rng.choice(vocab)
        elif op < 0.7:
            w.insert(i, rng.choice(vocab))
        elif len(w) > 2:
            del w[i]
    return " ".join(w)


def synthetic(mb: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(documents, role of each: base | planted | negative), shuffled, ≈ mb MB."""
    rng = random.Random(seed)
    model = bigram_model()
    vocab = [w for w in model if w.isalpha()]
    docs, roles = [], []
    size = 0
    while size < mb * 1e6:
        base = prose(rng, model, rng.randint(300, 900))
        docs.append(base)
        roles.append("base")
        variant = edit(rng, base, rng.uniform(0.005, 0.02), vocab)
        docs.append(variant)
        roles.append("planted")
        size += len(base) + len(variant)
        if rng.random() < 0.2:
            cut = len(base) // 4
            docs.append(base[:cut] + prose(rng, model, 600))
            roles.append("negative")
            size += len(docs[-1])
    # Shuffle, keeping each planted copy after its base (the first occurrence is the one kept).
    order = list(range(len(docs)))
    rng.shuffle(order)
    pos = {i: k for k, i in enumerate(order)}
    for i, r in enumerate(roles):
        if r == "planted" and pos[i] < pos[i - 1]:
            a, b = pos[i], pos[i - 1]
            order[a], order[b] = order[b], order[a]
            pos[i], pos[i - 1] = b, a
    return [docs[i] for i in order], [roles[i] for i in order]


def _children_cpu() -> float:
    """CPU seconds (user + system) of finished child processes, their own pool workers included."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic-mb", type=float, default=20)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    from lmforge.config.curation import DedupConfig
    from lmforge.data.curate.dedup import Deduplicator, signatures
    from lmforge.data.text.sources import iter_documents

    docs, roles = synthetic(args.synthetic_mb)
    stdlib = list(iter_documents(["builtin:python-stdlib"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "synthetic.jsonl")
        with open(path, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        total_mb = (sum(len(d.encode()) for d in docs) + sum(len(d.encode()) for d in stdlib)) / 1e6
        rows = []
        for label, flags in (("dedup exact + near", []),
                             ("dedup + all filters", ["--filter", "language,c4,fineweb,gopher_quality,gopher_repetition"])):
            out = os.path.join(tmp, f"out{len(rows)}")
            cmd = [sys.executable, "-m", "lmforge", "data", "dedup", "--input", "builtin:python-stdlib", path, "--out", out,
                   "--workers", str(args.workers), "--json", *flags]
            t, cpu0 = time.perf_counter(), _children_cpu()
            s = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            wall, cpu = time.perf_counter() - t, _children_cpu() - cpu0
            c = s["curation"]
            mb = c["bytes_in"] / 1e6
            rows.append((label, wall, mb / wall, s["mb_per_second"], cpu / mb, c["documents_kept"],
                         c["documents_in"], c["by_step"]))

    # Recall / precision of the planted near-duplicates: the dedup decisions on the whole corpus.
    cfg = DedupConfig()
    d = Deduplicator(cfg)
    flagged = []
    all_docs = stdlib + docs
    for start in range(0, len(all_docs), 2048):
        chunk = all_docs[start:start + 2048]
        keys, sigs = signatures(chunk, cfg)
        flagged += [d.check(start + i, k, s)[0] is not None for i, (k, s) in enumerate(zip(keys, sigs))]
    syn = flagged[len(stdlib):]
    planted = sum(r == "planted" for r in roles)
    tp = sum(f and r == "planted" for f, r in zip(syn, roles))
    fp = sum(f and r != "planted" for f, r in zip(syn, roles))

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}")
    print(f"corpus: builtin:python-stdlib {len(stdlib)} docs + synthetic {len(docs)} docs "
          f"({planted} planted near-duplicates, {roles.count('negative')} hard negatives) = {total_mb:.1f} MB")
    print(f"{'what (--workers %d)' % args.workers:<24}{'wall s':>8}{'MB/s':>8}{'MB/s*':>8}{'core-s/MB':>10}"
          f"{'MB/s 2 cores':>13}{'kept':>12}  removed by step")
    for label, wall, mbs, inner, cpu_mb, kept, n, by_step in rows:
        print(f"{label:<24}{wall:>8.1f}{mbs:>8.2f}{inner or 0:>8.2f}{cpu_mb:>10.3f}{2 / cpu_mb:>13.2f}"
              f"{f'{kept}/{n}':>12}  {by_step}")
    print("(MB/s: wall clock of the whole command incl. start-up; MB/s*: the curation pass itself; core-s/MB: CPU "
          "time of the command and its workers per MB; 'MB/s 2 cores' = 2 / core-s/MB, the rate on two otherwise "
          "idle cores)")
    print(f"planted near-duplicates: recall {tp / planted:.4f} ({tp}/{planted}), precision "
          f"{tp / max(1, tp + fp):.4f} ({fp} other synthetic documents flagged); "
          f"stdlib documents flagged: {sum(flagged[:len(stdlib)])}")


if __name__ == "__main__":
    main()
