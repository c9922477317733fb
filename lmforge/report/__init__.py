"""The run report: one self-contained HTML file with a run's curves, evals, samples and history.

``lmforge report RUN [RUN...]`` renders one or several runs (overlaid); the trainer's
report tracker rewrites ``<save_folder>/report.html`` at each eval and at the end.
"""

from __future__ import annotations

from lmforge.report.load import REPORT_FILE, RunData, load_run


def write_report(refs: list[str], out: str) -> str:
    """Load each run (a registry name or a save folder, local or remote) and write the report to ``out``."""
    from lmforge.report.html import write_report as write

    return write([load_run(ref) for ref in refs], out)


__all__ = ["REPORT_FILE", "RunData", "load_run", "write_report"]
