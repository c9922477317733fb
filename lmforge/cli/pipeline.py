"""`lmforge pipeline -f pipeline.yaml`: stages (e.g. pretrain → SFT → DPO), each from the previous one's final weights."""

from __future__ import annotations

from lmforge.cli.common import add_command
from lmforge.runs.stages import run_pipeline


def register(sub) -> None:
    p = add_command(sub, "pipeline", "stages (e.g. pretrain → SFT → DPO), each starting from the previous stage's final weights",
                    description="Stages (e.g. pretrain → SFT → DPO), each starting from the previous stage's final "
                    "weights; completed stages are skipped (re-running the pipeline resumes an unfinished one). Each "
                    "stage is a normal run.")
    p.add_argument("-f", "--file", metavar="YAML", required=True, help="pipeline file (see examples/pipeline.yaml)")
    p.set_defaults(func=run)


def run(args) -> int:

    results = run_pipeline(args.file)
    for r in results:
        print(f"{r['name']}: {r['status']} → {r['save_folder']}/final")
    return 0
