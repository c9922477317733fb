"""`lmforge data dedup`: raw text → curated documents as JSONL, without tokenizing.

Layout of ``DEST``: ``documents.jsonl`` (one ``{"text": ...}`` per kept document, in input
order) and ``curation.json`` (inputs, settings, the summary; written last, it marks the output
complete). Written into ``.DEST.tmp-PID`` and renamed into place, so an interrupted run leaves
nothing half-written; a re-run with the same inputs and settings does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from lmforge.data.curate import resolve_curation
from lmforge.data.curate.curator import Curator
from lmforge.data.curate.pipeline import run
from lmforge.data.sources import SourceStats, list_files, no_documents_message, read_source
from lmforge.errors import UserError

MARKER = "curation.json"


def curate_to_jsonl(inputs: list[str] | str, out: str, curate, *, workers: int = 1, text_field: str = "text",
                    overwrite: bool = False, removed_out: str | None = None) -> dict:
    from lmforge.data.prepare import CHUNK_CHARS_POOL, chunk_documents, input_fingerprint

    inputs = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: expected a positive integer")
    cfg, index = resolve_curation(curate)
    if cfg is None:
        raise UserError("nothing to do: give --dedup, --filter or --decontaminate")
    if "://" in out:
        raise UserError(f"--out {out}: `data dedup` writes to a local folder")
    if removed_out is not None and os.path.isfile(removed_out):
        raise UserError(f"--removed-out {removed_out}: exists and is not a folder")
    stats = SourceStats()
    sources = list_files(inputs, stats)
    identity = {"inputs": inputs, "input_fingerprint": input_fingerprint(sources), "text_field": text_field,
                "curate": cfg.model_dump(mode="json"), "decontaminate_index": index.fingerprint if index else None}
    dest = os.path.abspath(out)
    marker_path = os.path.join(dest, MARKER)
    if os.path.isfile(marker_path):
        with open(marker_path) as f:
            old = json.load(f)
        if old.get("identity") == identity:
            return old | {"already_done": True}
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)) and not overwrite:
        raise UserError(f"--out {out}: exists and holds other output; use --overwrite or another --out")

    parent, name = os.path.split(dest.rstrip("/"))
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    curator = Curator(cfg, index)
    start = time.perf_counter()
    try:
        def documents():
            for src in sources:
                stats.files += 1
                for text in read_source(src, text_field, stats):
                    stats.documents += 1
                    yield text

        kept = 0
        with open(os.path.join(stage, "documents.jsonl"), "w") as f:
            for _, texts in run(chunk_documents(documents(), CHUNK_CHARS_POOL), curator, workers=workers):
                for t in texts:
                    f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
                kept += len(texts)
        if stats.documents == 0:
            raise UserError(no_documents_message(inputs, stats))
        seconds = time.perf_counter() - start
        summary = curator.summary()
        marker = {"format": "lmforge-curation", "identity": identity, "curation": summary,
                  "documents_written": kept, "seconds": round(seconds, 3),
                  "mb_per_second": round(summary["bytes_in"] / 1e6 / seconds, 3) if seconds > 0 else None,
                  "workers": workers, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(os.path.join(stage, MARKER), "w") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        if os.path.exists(dest):
            shutil.rmtree(dest) if os.path.isdir(dest) else os.remove(dest)
        os.replace(stage, dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if removed_out:
        marker["curation"]["removed_samples"] = curator.acct.write_samples(removed_out)
    return marker
