"""`lmforge eval`: in-context-learning benchmarks and the gauntlet score of a saved model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmforge.cli.common import add_command, add_device_argument, bounded, torch_device
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError

DESCRIPTION = """\
Score a saved model on in-context-learning benchmarks (LLM Foundry's task format: language
modeling, multiple choice, schema, generation with answers) and, with --gauntlet, group the
accuracies into category and average scores.

--tasks and --gauntlet take a YAML file, or `default` for the ones shipped with lmforge
(lmforge/tasks/tasks.yaml, lmforge/eval/gauntlet.yaml). Their data files are LLM Foundry's eval
`local_data` JSONL files (github.com/mosaicml/llm-foundry, scripts/eval/local_data); point
--data-root at that folder."""


def register(subparsers) -> None:
    p = add_command(subparsers, "eval", "evaluate a model on ICL benchmarks and a gauntlet", DESCRIPTION)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run's save folder, its final/, a checkpoints/step_N folder or a Hugging Face folder "
                   "(with its tokenizer)")
    p.add_argument("--tasks", default="default", metavar="TASKS.yaml", help="ICL task definitions, or `default`")
    p.add_argument("--gauntlet", default=None, metavar="G.yaml", help="gauntlet definition, or `default`")
    p.add_argument("--data-root", default=None, metavar="DIR", help="folder that relative dataset_uri paths resolve against")
    p.add_argument("--limit", type=bounded(int, 1), default=None, metavar="N", help="evaluate only the first N examples of each task")
    p.add_argument("--batch-size", type=bounded(int, 1, 1 << 16), default=8, metavar="B", help="sequences per forward pass")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from lmforge.eval.gauntlet import check_benchmarks, gauntlet_scores, load_gauntlet  # torch (lazy: `--help`)
    from lmforge.eval.icl import evaluate_icl, load_tasks
    from lmforge.train.locate import locate

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.data_root is not None and not Path(args.data_root).expanduser().is_dir():
        raise UserError(f"--data-root {args.data_root}: no such folder")
    # Validate every input before loading the (possibly large) model: first the files named on the
    # command line (a wrong --checkpoint or --gauntlet path is named as such), then the tasks' data.
    locate(args.checkpoint)
    gauntlet = load_gauntlet(args.gauntlet) if args.gauntlet else None
    tasks = load_tasks(args.tasks, data_root=args.data_root)
    if gauntlet is not None:
        check_benchmarks(gauntlet, tasks)
    device = torch_device(args.device)
    model, tokenizer = _load_checkpoint(args.checkpoint, device)

    results = evaluate_icl(model, tokenizer, tasks, batch_size=args.batch_size, limit=args.limit,
                           device=device, progress=sys.stderr.isatty())
    scores = gauntlet_scores(results, gauntlet) if gauntlet else None
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "results": results, "gauntlet": scores}, indent=2))
    else:
        _print_tables(results, scores, tasks)
    return 0


def _load_checkpoint(path: str, device):
    """The model and its tokenizer, from anything `train.locate` accepts (a run's save folder, its
    final/, a checkpoints/step_N folder, a Hugging Face folder) — as `generate` and `export` do."""
    from lmforge.resolve.weights import check_tokenizer_fits, locate
    from lmforge.train.locate import load_model  # torch (lazy: `lmforge --help`)

    loc = locate(path)
    # The weights first: a damaged model folder is reported as that, not as a missing tokenizer.
    model, cfg, _ = load_model(path, device=device)
    # The tokenizer is saved next to the weights (save_pretrained copies it), or in tokenizer/.
    candidates = [d for d in (loc.tokenizer_dir, os.path.join(loc.path, "tokenizer")) if d]
    tok_dir = next((d for d in candidates if os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
    if tok_dir is None:
        raise UserError(f"--checkpoint {path}: no tokenizer (tokenizer.json) stored with the model; "
                        "save the model together with its tokenizer")
    tokenizer = load_tokenizer(tok_dir)
    check_tokenizer_fits(tokenizer, cfg, f"--checkpoint {path}")
    return model, tokenizer


def _print_tables(results: dict, scores: dict | None, tasks) -> None:
    console = Console()
    types = {t.label: t.task_type for t in tasks}
    ece = any("calibration_error" in r for r in results.values())
    lm_eval = any("acc" in r for r in results.values())
    rules = next((r["rules"] for r in results.values() if "rules" in r), None)
    caption = None if rules is None else "accuracy: " + rules["accuracy"] + "; " + "; ".join(
        rules[k] for k in ("acc", "acc_norm"))
    table = Table(title="In-context learning", caption=caption)
    columns = [("task", "left"), ("shots", "right"), ("type", "left"), ("accuracy", "right")]
    columns += [("acc (lm-eval)", "right"), ("acc_norm (lm-eval)", "right")] if lm_eval else []
    # names are what a reader looks up: never cut ("multiple_ch…"); the numbers' headers wrap instead
    widest = {"task": max(map(len, (k.rsplit("/", 1)[0] for k in results)), default=4),
              "type": max(map(len, types.values()), default=4)}
    for col, justify in columns + [("n", "right")] + ([("calibration error", "right")] if ece else []):
        table.add_column(col, justify=justify, no_wrap=col in widest, min_width=widest.get(col))

    def rules_of(r: dict) -> list[str]:
        return [f"{r[k]:.4f}" if k in r else "" for k in ("acc", "acc_norm")] if lm_eval else []

    def extra(r: dict) -> list[str]:
        if not ece:
            return []
        return [f"{r['calibration_error']:.4f}" if "calibration_error" in r else ""]

    for key, r in results.items():
        label, shots = key.rsplit("/", 1)
        table.add_row(label, shots.removesuffix("-shot"), types.get(label, ""), f"{r['accuracy']:.4f}", *rules_of(r),
                      f"{r['n']}/{r['size']}" if r["n"] != r["size"] else str(r["n"]), *extra(r))
        for cat, c in r.get("categories", {}).items():
            table.add_row(f"  {cat}", "", "", f"{c['accuracy']:.4f}", *rules_of(c), str(c["n"]), *extra(c))
    console.print(table)
    if scores is None:
        return
    gt = Table(title="Gauntlet", caption="0 = random baseline, 1 = perfect")
    gt.add_column("category / average")
    gt.add_column("score", justify="right")
    for name, value in scores["categories"].items():
        gt.add_row(name, "missing" if value is None else f"{value:.4f}")
    for name, value in scores["averages"].items():
        gt.add_row(f"[bold]{name}[/bold]", "missing" if value is None else f"[bold]{value:.4f}[/bold]")
    console.print(gt)
    if scores["missing"]:
        console.print(f"[yellow]not in the results (add them to --tasks): {', '.join(scores['missing'])}[/yellow]")
