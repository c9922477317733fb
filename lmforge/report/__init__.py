"""The run report: one self-contained HTML file with a run's curves, evals, samples and history.

``lmforge report RUN [RUN...]`` renders one or several runs (overlaid); the trainer's
report tracker rewrites ``<save_folder>/report.html`` at each eval and at the end.
"""

from __future__ import annotations

from lmforge.report.load import REPORT_FILE, RunData, RunIndex, load_run


def write_report(refs: list[str], out: str, index: RunIndex | None = None) -> str:
    """Load each run (a name in ``index``, or a save folder, local or remote) and write the report to ``out``."""
    from lmforge.report.html import write_report as write

    return write([load_run(ref, index=index) for ref in refs], out)


def write_run_report(run_dir: str, name: str, status: str, out: str, index: RunIndex | None = None) -> None:
    """A training run's own report.html, from its folder (the report tracker's renderer); nothing
    before the run has logged a step."""
    from lmforge.errors import UserError
    from lmforge.report.html import write_report as write

    try:
        run = load_run(run_dir, name=name, status=status, index=index)
    except UserError:  # nothing logged yet (a run that failed before its first step): no page
        return
    write([run], out)


__all__ = ["REPORT_FILE", "RunData", "RunIndex", "load_run", "write_report", "write_run_report"]
