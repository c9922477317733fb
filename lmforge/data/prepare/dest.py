"""DEST of a `data prepare` / `data dedup` job: claimed by one job, run, and completed in one order.

* **claim**: DEST becomes one job's (its plan in ``DEST/work/plan.json``); a later run of the same
  command finds its own unfinished plan and goes on from it; other content is refused (without
  ``--overwrite``).
* **the last step's order**: the output's index files (``index.json`` of each split, or
  ``documents.jsonl``), then the samples of removed documents (``--removed-out``, each file
  written whole), then the marker — from then on DEST is complete — and last what the job kept
  in ``DEST/work`` goes (``finish``). A kill before the marker leaves a DEST that `train`
  refuses (``unfinished``) and the same command completes; a kill after it leaves ``work/``,
  which the same command removes (``finish_earlier``) instead of only saying it is done.
* **what a failure keeps** (``run``): a dead task or a failing store keeps everything, for the
  same command to go on from; bad input met by a unit (``--on-bad-input fail``) keeps what was
  done (at 16K units one bad object must not cost the job) and says how to go on; bad input
  found by the last step (no documents left, ``--seq-len`` longer than the data) ends a job
  that cannot finish with these arguments: what it wrote goes.
"""

from __future__ import annotations

import json
import os
import sys

from lmforge.data import remote
from lmforge.data.prepare.executors import JobRun, TaskCrashed, TaskDied, idle_tasks_note, run_job
from lmforge.data.prepare.job import WORK, BadInput, Job, WorkDir, removed_samples, unit_offsets, write_removed
from lmforge.errors import UserError
from lmforge.guard import Held, check_replace

OUR_LEFTOVERS = {"train", "val", WORK}  # what a job of ours leaves in DEST before its marker


def listing(out: str) -> list[str] | None:
    """Top-level names in ``out``; None when it does not exist."""
    if remote.is_remote(out):
        fs, p = remote.fs_and_path(out)
        try:
            if not fs.exists(p):
                return None
            return [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False)]
        except FileNotFoundError:
            return None
    p = remote.local_path(out)
    if not os.path.exists(p):
        return None
    if not os.path.isdir(p):
        raise UserError(f"--out {out}: exists and is not a folder")
    return os.listdir(p)


def claim(out: str, plan: dict, other: str | None, overwrite: bool, what: str) -> bool:
    """Make ``out`` this job's: True when it already holds this very job, unfinished (resume);
    otherwise refuse other content (a different complete output of this command, ``other``, or an
    unfinished job of other inputs: without ``overwrite``; anything else always, `guard.check_replace`),
    clear ``out`` and write the plan."""
    names = listing(out)
    wd = WorkDir(out)
    plan = json.loads(json.dumps(plan))
    if names:
        earlier = wd.read_json("plan.json") if WORK in names else None
        if earlier == plan:
            return True
        kind = "dataset" if what == "data prepare" else "dedup"
        if earlier is not None and ("tokenizer" in (earlier.get("identity") or {})) != (kind == "dataset"):
            other_job = "data dedup" if kind == "dataset" else "data prepare"
            check_replace(out, "--out", kind, Held(None, f"an unfinished `{other_job}`"), overwrite=overwrite,
                          command=what)
        # Only leftovers of our own interrupted upload (train/, val/ without a marker) count as ours.
        if other is None and earlier is None and not set(names) <= OUR_LEFTOVERS:
            shown = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            check_replace(out, "--out", kind, Held(None, f"files that are not lmforge output ({shown})"),
                          overwrite=overwrite, command=what)
        if not overwrite:
            if other is not None:
                raise UserError(f"--out {out}: already holds {other}; use --overwrite or another --out")
            if earlier is not None:
                raise UserError(f"--out {out}: holds an unfinished `{what}` of other inputs or arguments; run that "
                                "command again to finish it, or use --overwrite or another --out")
        remote.remove_tree(out)
    wd.write_json("plan.json", plan)
    return False


def units_and_dedup(sources, unit_bytes: int, cfg) -> tuple[list, object]:
    """The job's work units, and its dedup stages' shape for their total size (``cfg``: a DedupConfig or None)."""
    from lmforge.data.curate.crossdedup import dedup_plan
    from lmforge.data.prepare.units import plan_units

    units = plan_units(sources, unit_bytes)
    sizes = [u.bytes for u in units]
    return units, dedup_plan(cfg, sum(sizes) if all(b is not None for b in sizes) else None, len(units))


def start(job: Job, identity: dict, complete: bool, other: str | None, overwrite: bool, what: str) -> bool | None:
    """None when DEST already holds this job's complete output (``complete``; what a kill left after
    its marker is finished); else claim DEST: True when this very job is resumed."""
    if complete:
        finish_earlier(job)
        return None
    plan = {"identity": identity, "unit_bytes": job.context["unit_bytes"], "units": [u.to_json() for u in job.units]}
    return claim(job.out, plan, other, overwrite, what)


def unfinished(path: str) -> bool:
    """``path`` holds a job of ours that has not written its marker (``work/plan.json`` is there)."""
    return remote.exists(remote.join(path, WORK, "plan.json")) if remote.is_remote(path) else \
        os.path.exists(os.path.join(remote.local_path(path), WORK, "plan.json"))


def run(job: Job, spec, workers: int, progress: bool) -> tuple[JobRun, dict | None]:
    """The job's stages, then (unless Slurm runs it as a job of its own) its last step: the run, and
    the summary the last step returns (None when submitted)."""
    note = idle_tasks_note(len(job.units), spec, job.context["unit_bytes"])
    if note:  # at the start: the user sees it while waiting, not after
        print(f"note: {note}", file=sys.stderr, flush=True)
    try:
        done = run_job(job, spec, workers, progress)
    except (TaskDied, TaskCrashed, remote.StoreError):
        raise  # not the data's fault: what the job wrote stays
    except UserError as e:
        wd = WorkDir(job.out)
        units = len(wd.done("units"))
        if not any(wd.done(stage.name) for stage in job.stages()):
            remote.remove_tree(job.out)  # nothing done: nothing worth keeping
            raise
        if not isinstance(e, BadInput):
            raise
        raise BadInput(f"{e}; the {units} units done are kept: run the same command with --on-bad-input skip to "
                       "skip such input and finish") from None
    if done.submitted is not None:
        return done, None
    try:
        return done, job.finalize(job, done)
    except (TaskDied, remote.StoreError):
        raise
    except UserError:
        if not _marker_written(job):  # a complete output stays
            remote.remove_tree(job.out)  # bad input for the job as a whole: it cannot finish; what it wrote goes
        raise


def _marker_written(job: Job) -> bool:
    uri = remote.join(job.out, job.context["marker_name"])
    return remote.exists(uri) if remote.is_remote(uri) else os.path.exists(remote.local_path(uri))


def write_removed_samples(job: Job, markers: list[dict]) -> list[str] | None:
    """The samples of removed documents into ``--removed-out`` (before the marker: a complete DEST has
    them all); None when not asked for."""
    out = job.context.get("removed_out")
    if job.curate is None or not out:
        return None
    return write_removed(removed_samples(job, unit_offsets(markers), job.curate.removed_sample), out)


def finish(job: Job) -> None:
    """After the marker: what the job kept in DEST goes (Slurm's logs stay: the last step's own task
    still writes to its log), and so do half-written files a kill left (``remote.write_local_atomic``'s
    ``.NAME.*.part``: an object store's writes leave none)."""
    if job.after_marker is not None:
        job.after_marker(job)
    WorkDir(job.out).remove(keep_logs=job.context.get("executor") == "slurm")
    if not remote.is_remote(job.out):
        root = remote.local_path(job.out)
        for folder in [root, *(os.path.join(root, n) for n in os.listdir(root))]:
            if os.path.isdir(folder):
                for name in os.listdir(folder):
                    if name.startswith(".") and name.endswith(".part"):
                        os.remove(os.path.join(folder, name))


def finish_earlier(job: Job, markers: list[dict] | None = None) -> None:
    """A complete DEST whose ``work/`` a kill left behind (after the marker): write the removed
    samples again (they may be partly written) and finish."""
    from lmforge.data.prepare.job import unit_markers

    names = WorkDir(job.out).names("")
    if not names or (names == ["logs"] and job.context.get("executor") == "slurm"):  # Slurm's logs stay
        return
    try:
        write_removed_samples(job, markers or unit_markers(job))
    except TaskDied:  # the kill came while work/ was being removed: its samples are gone with it
        pass
    finish(job)
