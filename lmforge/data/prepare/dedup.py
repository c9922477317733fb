"""`lmforge data dedup`: raw text → curated documents as JSONL, without tokenizing.

Layout of ``DEST``: ``documents.jsonl`` (one ``{"text": ...}`` per kept document, in input
order) and ``curation.json`` (inputs, settings, the summary; written last, it marks the output
complete). It runs as a job of work units like `data prepare` (``lmforge.data.prepare.job``: in this
process, or as tasks on datatrove's executors): each unit writes its kept documents to
``DEST/work/parts/U.jsonl``, and the last step joins the parts in order into
``documents.jsonl``. An interrupted run is finished by the same command; a re-run of a finished
one does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from lmforge.data import remote
from lmforge.data.prepare import dest
from lmforge.data.curate import resolve_curation
from lmforge.data.prepare.executors import ExecutorSpec, JobRun, check_executor
from lmforge.data.prepare.job import Job, WorkDir, source_stats, source_summary, unit_markers
from lmforge.data.text.sources import SourceStats, list_files, no_documents_message
from lmforge.data.prepare.units import DEFAULT_UNIT_BYTES, check_on_bad_input
from lmforge.errors import UserError
from lmforge.guard import check_output, check_target

MARKER = "curation.json"


def curate_to_jsonl(inputs: list[str] | str, out: str, curate, *, workers: int = 1, text_field: str = "text",
                    overwrite: bool = False, removed_out: str | None = None, executor: ExecutorSpec | None = None,
                    unit_bytes: int = DEFAULT_UNIT_BYTES, progress: bool = False, on_bad_input: str = "skip") -> dict:
    from lmforge.data.prepare.prepare import input_fingerprint

    inputs = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: expected a positive integer")
    check_on_bad_input(on_bad_input)
    check_executor(executor)
    cfg, index = resolve_curation(curate)
    if cfg is None:
        raise UserError("nothing to do: give --dedup, --filter or --decontaminate")
    if "://" in out:
        raise UserError(f"--out {out}: `data dedup` writes to a local folder")
    if removed_out is not None and os.path.isfile(removed_out):
        raise UserError(f"--removed-out {removed_out}: exists and is not a folder")
    reads = [("the input", i) for i in inputs]
    check_output(out, "--out", "dedup", overwrite=overwrite, reads=reads + [("--removed-out", removed_out)],
                 command="data dedup")
    if removed_out is not None:
        check_target(removed_out, "--removed-out", reads + [("--out", out)])
    stats = SourceStats()
    sources = list_files(inputs, stats)
    identity = {"inputs": inputs, "input_fingerprint": input_fingerprint(sources), "text_field": text_field,
                "curate": cfg.model_dump(mode="json"), "decontaminate_index": index.fingerprint if index else None,
                "unit_bytes": unit_bytes}
    dest_dir = os.path.abspath(out)
    units, dedup = dest.units_and_dedup(sources, unit_bytes, cfg.dedup)
    job = Job(dest_dir, units, text_field, cfg, index, dedup, on_bad_input=on_bad_input, finalize=finalize,
              context={"identity": identity, "marker_name": MARKER, "inputs": inputs,
                       "skipped_inputs": stats.skipped_inputs, "removed_out": removed_out, "workers": workers,
                       "executor": executor.kind if executor else None, "tasks": executor.tasks if executor else None,
                       "unit_bytes": unit_bytes})
    old = _read_marker(dest_dir)
    # Output written before units existed was one stream: what the default unit size makes.
    same = old is not None and {"unit_bytes": DEFAULT_UNIT_BYTES} | old.get("identity", {}) == identity
    resumed = dest.start(job, identity, same, None if old is None else "other `data dedup` output", overwrite,
                         "data dedup")
    if resumed is None:
        return old | {"already_done": True}
    run, summary = dest.run(job, executor, workers, progress)
    if summary is None:
        return {"format": "lmforge-curation-job", "out": out, "resumed": resumed, "submitted": run.submitted}
    return summary


def _read_marker(dest_dir: str) -> dict | None:
    try:
        with open(os.path.join(dest_dir, MARKER)) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def finalize(job: Job, run: JobRun | None = None) -> dict:
    """Every unit done: join the parts into documents.jsonl, then write curation.json."""
    from lmforge.data.curate.curator import Accounting

    ctx = job.context
    markers = unit_markers(job)
    stats = source_stats(markers, ctx["skipped_inputs"])
    if stats.documents == 0:
        raise UserError(no_documents_message(ctx["inputs"], stats))
    acct = Accounting(action=job.curate.action)
    for m in markers:
        acct.add_counts(m["curation"])
    wd = WorkDir(job.out)
    joined = os.path.join(job.out, ".documents.jsonl.part")
    with open(joined, "wb") as f:
        for u in range(len(markers)):
            with open(remote.local_path(wd.uri("parts", f"{u:06d}.jsonl")), "rb") as part:
                shutil.copyfileobj(part, f, 1 << 20)
    os.replace(joined, os.path.join(job.out, "documents.jsonl"))
    summary = acct.summary(job.curate)
    seconds = run.seconds if run is not None else sum(m["seconds"] for m in markers)
    marker = {"format": "lmforge-curation", "identity": ctx["identity"], "curation": summary,
              "documents_written": sum(m["documents_written"] for m in markers), "seconds": round(seconds, 3),
              "mb_per_second": round(summary["bytes_in"] / 1e6 / seconds, 3) if seconds > 0 else None,
              "units": len(markers), "executor": ctx["executor"], "tasks": ctx["tasks"], "workers": ctx["workers"],
              **source_summary(stats),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    removed = dest.write_removed_samples(job, markers)
    remote.write_local_atomic(Path(job.out) / MARKER, (json.dumps(marker, indent=2) + "\n").encode())  # complete
    dest.finish(job)
    if removed is not None:
        marker["curation"]["removed_samples"] = removed
    return marker

