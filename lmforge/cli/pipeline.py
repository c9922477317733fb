"""`lmforge pipeline -f pipeline.yaml`: run stages (pretrain → sft ...) in order."""

from __future__ import annotations

from lmforge.cli.common import add_command
from lmforge.runs.stages import run_pipeline


def register(sub) -> None:
    p = add_command(sub, "pipeline", "run several stages in order (e.g. pretrain → continued pretraining → SFT)",
                    description="Each stage is a normal run starting from the previous stage's final model; "
                    "stages already completed are skipped when the pipeline is re-run.")
    p.add_argument("-f", "--file", metavar="YAML", required=True, help="pipeline file (see examples/pipeline.yaml)")
    p.set_defaults(func=run)


def run(args) -> int:

    results = run_pipeline(args.file)
    for r in results:
        print(f"{r['name']}: {r['status']} → {r['save_folder']}/final")
    return 0
