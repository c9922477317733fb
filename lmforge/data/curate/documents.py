"""`lmforge data dedup`: raw text → curated documents as JSONL, without tokenizing.

Layout of ``DEST``: ``documents.jsonl`` (one ``{"text": ...}`` per kept document, in input
order) and ``curation.json`` (inputs, settings, the summary; written last, it marks the output
complete). It runs as a job of work units like `data prepare` (``lmforge.data.job``: in this
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

from lmforge.data import remote
from lmforge.data.curate import resolve_curation
from lmforge.data.executors import ExecutorSpec, JobRun, TaskDied, check_executor, run_job
from lmforge.data.job import Job, WorkDir, removed_samples, source_stats, unit_markers, unit_offsets, write_removed
from lmforge.data.sources import SourceStats, list_files, no_documents_message
from lmforge.data.units import DEFAULT_UNIT_BYTES, plan_units
from lmforge.errors import UserError
from lmforge.guard import check_target

MARKER = "curation.json"


def curate_to_jsonl(inputs: list[str] | str, out: str, curate, *, workers: int = 1, text_field: str = "text",
                    overwrite: bool = False, removed_out: str | None = None, executor: ExecutorSpec | None = None,
                    unit_bytes: int = DEFAULT_UNIT_BYTES, progress: bool = False) -> dict:
    from lmforge.data.curate.crossdedup import dedup_plan
    from lmforge.data.prepare import input_fingerprint

    inputs = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs]
    if not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: expected a positive integer")
    check_executor(executor)
    cfg, index = resolve_curation(curate)
    if cfg is None:
        raise UserError("nothing to do: give --dedup, --filter or --decontaminate")
    if "://" in out:
        raise UserError(f"--out {out}: `data dedup` writes to a local folder")
    if removed_out is not None and os.path.isfile(removed_out):
        raise UserError(f"--removed-out {removed_out}: exists and is not a folder")
    check_target(out, "--out", [("the input", i) for i in inputs] + [("--removed-out", removed_out)])
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
    units = plan_units(sources, unit_bytes)
    sizes = [u.bytes for u in units]
    dedup = dedup_plan(cfg.dedup, sum(sizes) if all(b is not None for b in sizes) else None)
    plan = json.loads(json.dumps({"identity": identity, "unit_bytes": unit_bytes, "units": [u.to_json() for u in units]}))
    wd = WorkDir(dest)
    if not (os.path.isdir(dest) and wd.read_json("plan.json") == plan):  # else: finish the interrupted run
        if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)) and not overwrite:
            raise UserError(f"--out {out}: exists and holds other output; use --overwrite or another --out")
        if os.path.exists(dest):
            shutil.rmtree(dest) if os.path.isdir(dest) else os.remove(dest)
        wd.write_json("plan.json", plan)
    job = Job(dest, units, text_field, cfg, index, dedup, finalize=finalize,
              context={"identity": identity, "inputs": inputs, "skipped_inputs": stats.skipped_inputs,
                       "removed_out": removed_out, "workers": workers,
                       "executor": executor.kind if executor else None, "tasks": executor.tasks if executor else None})
    try:
        run = run_job(job, executor, workers, progress)
        if run.submitted is not None:
            return {"format": "lmforge-curation-job", "out": out, "submitted": run.submitted}
        return finalize(job, run)
    except (TaskDied, remote.StoreError):
        raise  # not the data's fault: what the job wrote stays, and the same command finishes it
    except UserError:
        shutil.rmtree(dest, ignore_errors=True)  # bad input: the job cannot finish; what it wrote goes
        raise


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
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(os.path.join(job.out, MARKER), "w") as f:
        json.dump(marker, f, indent=2)
        f.write("\n")
    if ctx["removed_out"]:
        marker["curation"]["removed_samples"] = write_removed(
            removed_samples(job, unit_offsets(markers), job.curate.removed_sample), ctx["removed_out"])
    wd.remove(keep_logs=ctx["executor"] == "slurm")
    return marker

