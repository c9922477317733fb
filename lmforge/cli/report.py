"""`lmforge report RUN [RUN...] [--out report.html]`: one self-contained HTML file for one or more runs."""

from __future__ import annotations

from lmforge.cli.common import add_command


def register(sub) -> None:
    p = add_command(sub, "report", "an HTML report of one run, or several overlaid",
                    description="RUN is a run name from `lmforge runs list` or a save folder (local or an object-"
                    "store URI). The page has the loss, learning-rate, gradient-norm, throughput, MFU and memory "
                    "curves, held-out loss and bits per byte, ICL/gauntlet scores, the generations at each eval, "
                    "resumptions and events on a timeline, the plan against what happened (time, tokens, cost) and "
                    "the resolved config; several runs share the axes and get a table of config differences. It "
                    "needs no network to open. Every run also keeps its own up-to-date <save_folder>/report.html.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run name or save folder")
    p.add_argument("--out", "-o", default="report.html", metavar="FILE",
                   help="where to write the page (replaces an earlier report there, nothing else); its folder must "
                   "exist")
    p.add_argument("--overwrite", action="store_true",
                   help="replace FILE even if it is not an lmforge report (never a file of a run, a dataset or "
                   "$LMFORGE_HOME)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from lmforge.errors import UserError
    from lmforge.guard import check_output_file
    from lmforge.report import write_report
    from lmforge.report.html import MARK
    from lmforge.runs.registry import RegistryIndex

    if os.path.isdir(args.out):
        raise UserError(f"--out {args.out}: is a folder; give a file name such as {os.path.join(args.out, 'report.html')}")
    check_output_file(args.out, "--out", args.overwrite, same_kind=lambda head: MARK.encode() in head)
    out = write_report(args.runs, args.out, index=RegistryIndex())
    print(f"report: {os.path.abspath(out)} ({os.path.getsize(out) / 1e6:.1f} MB, {len(args.runs)} run(s))")
    return 0
