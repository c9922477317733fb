"""`lmforge train -f run.yaml` and `lmforge finetune -f sft.yaml`: one command path for both.

Both load the config with the same overrides and check object-store credentials once; then the
launch plan (`runs.launch_plan`) says what this process is — it supervises the run (the first
process), becomes torchrun (several ranks), or trains here (a supervised child or a rank).
`finetune` differs only in its default `task_type` (instruction_finetune) and its help.

Everything up to the launch — resolving the config, preflight, registering and supervising — runs
without torch; the job a process trains (`runs.job`) and the dry run, which measures this
machine, import it where they start, so that `lmforge --help` stays light.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml
from rich.console import Console

from lmforge import secrets
from lmforge.cli.common import add_command, bounded
from lmforge.config.limits import MAX_NODES, MAX_RETRIES
from lmforge.errors import UserError
from lmforge.plan.estimate import batch_rows, batch_split, format_plan
from lmforge.resolve import resolve
from lmforge.resolve.request import RunRequest
from lmforge.runs.launch_plan import launch_plan, started_by_user
from lmforge.runs.preflight import preflight
from lmforge.runs.start import start
from lmforge.runs.store import staging_dir


def register(sub) -> None:
    p = add_command(sub, "train", "pretrain (or continue pretraining) a model from a YAML config",
                    description="Train from a run config. Re-running the same command continues from the latest "
                    "checkpoint in save_folder (autoresume).")
    add_run_arguments(p)
    p.set_defaults(func=run)
    p = add_command(sub, "finetune", "fine-tune a model on prompt/response or chat JSONL (SFT), on "
                    "preference pairs (DPO, IPO, SimPO, ORPO), or from rewards (RL: GRPO, DAPO, Dr. GRPO, GSPO)",
                    description="Fine-tune from a run config with task_type instruction_finetune (default), "
                    "chat_completion, preference (prompt/chosen/rejected rows; preference.loss), rl (prompt rows "
                    "whose sampled completions rl.reward scores; docs/rl.md) or continued_pretrain. `model` and "
                    "`tokenizer` default to those of custom_weights_path. Re-running the same command resumes "
                    "(autoresume).")
    add_run_arguments(p)
    p.set_defaults(func=run)


class _ConfigKeys(argparse.Action):
    """``--config-keys``: every config key with its default and meaning, then exit (as --help)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from lmforge.config.reference import render_text

        print(render_text())
        parser.exit()


CONFIG_KEYS_EPILOG = "Every config key with its default and meaning: --config-keys (or README.md's Config reference)."


def add_run_arguments(p) -> None:
    p.epilog = CONFIG_KEYS_EPILOG  # `train --help` and `finetune --help` alike; the ~200 keys on request
    p.add_argument("--config-keys", action=_ConfigKeys, help="print every config key with its default, then exit")
    p.add_argument("-f", "--file", metavar="YAML", help="run config (see examples/)")
    p.add_argument("--model", help="override `model` (a preset name)")
    p.add_argument("--weights", metavar="PATH", help="override `custom_weights_path` (run folder, final/, step "
                   "folder or Hugging Face folder)")
    p.add_argument("--train-data", action="append", metavar="PATH", help="override `train_data` (repeatable)")
    p.add_argument("--training-duration", metavar="DUR", help="override, e.g. 10000tok, 500ba, 2ep, 30min")
    p.add_argument("--save-folder", metavar="DIR", help="override `save_folder`")
    p.add_argument("--name", help="override `name`")
    p.add_argument("--price-per-gpu-hour", type=bounded(float, 0, 1e6), metavar="P",
                   help="override `compute.price_per_gpu_hour`: show the cost so far and to finish")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any key, e.g. --set parameters.learning_rate=3e-4 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan, then exit")
    p.add_argument("--overwrite", action="store_true",
                   help="replace checkpoints of a different run of the same name (another model or data) in "
                   "save_folder; a run of another name is never replaced")
    p.add_argument("--no-autoresume", action="store_true", help="do not continue from an existing checkpoint")
    p.add_argument("--json", action="store_true", help="print the final summary (or the dry-run plan) as JSON")
    # multi-node (docs/scale-out.md): same as compute.nodes / node_rank / rdzv_endpoint and max_retries
    p.add_argument("--nnodes", type=bounded(int, 1, MAX_NODES), metavar="N", help="override `compute.nodes`")
    p.add_argument("--node-rank", type=bounded(int, 0, MAX_NODES - 1), metavar="R", help="override `compute.node_rank` (0 … N-1)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="override `compute.rdzv_endpoint` (node 0's address)")
    p.add_argument("--max-retries", "--max-restarts", dest="max_retries", type=bounded(int, 0, MAX_RETRIES), metavar="N",
                   help="override `max_retries` (restarts after a failure, in all)")
    p.add_argument("--check-credentials", action="store_true",
                   help="only check read access to remote data and write access to a remote save_folder, then exit")
    p.add_argument("--skip-credentials-check", action="store_true",
                   help="do not run the object-store credentials check before training")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (logs in <save_folder>/logs); print the run name and return")
    p.add_argument("--no-supervisor", action="store_true",
                   help="train in this process: no run registry, no automatic restarts (torchrun's aside)")
    p.add_argument("--plan", help=argparse.SUPPRESS)  # set by lmforge for the processes it starts (runs.launch_plan)


def run(args) -> int:
    request = RunRequest.from_args(args)
    cfg = resolve(request, until="config").config  # validated, names filled (torch-free)
    secrets.apply(cfg)  # credentials named by `secrets:` → env (torchrun's ranks inherit it)
    if args.dry_run:
        return dry_run(request, args)
    if args.check_credentials:
        checked = secrets.check_credentials(cfg, log=print)  # a local save_folder: nothing to check
        print("credentials: ok" if checked else "credentials: nothing remote to check")
        return 0
    # Object-store access is checked once, in the process the user started, before anything is
    # registered or started (and before torch is imported: a wrong key fails in seconds).
    if started_by_user(args) and not args.skip_credentials_check:
        secrets.check_credentials(cfg, log=print)
    plan = launch_plan(args, cfg)  # (checks the device mesh)
    if started_by_user(args):  # a config that cannot work is refused before it becomes a run
        world = int(os.environ.get("WORLD_SIZE", 0)) or (plan.nproc or 1) * cfg.compute.nodes  # torchrun by hand: its own
        preflight(cfg, args.command, world_size=world, overwrite=args.overwrite)
    if plan.role in ("detach", "supervise"):
        return start(cfg, args, plan)
    if plan.role == "launch":
        from lmforge.runs.launcher import launch

        return launch(cfg, plan, sys.argv[1:])
    return train_here(cfg, args, plan)


def train_here(cfg, args, plan) -> int:
    """Role "train": train in this process; print the summary on rank 0."""
    from lmforge.runs.job import PeerLost, run_job

    try:
        result = run_job(cfg, plan, overwrite=args.overwrite)
    except PeerLost as e:  # another rank's end: one line, no traceback (torchrun or the supervisor restarts)
        print(e, file=sys.stderr, flush=True)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(result, as_json=args.json, console=cfg.experiment_tracker.console)
    return 0 if result.status in ("completed", "stopped") else 1


# The held-out metrics the end-of-run summary lists (with ICL and gauntlet scores): the loss and its
# forms, for preference tuning how often the chosen answer wins and by how much, for reinforcement
# learning the greedy completions' reward.
SUMMARY_METRICS = ("/loss", "/bits_per_byte", "/perplexity", "/rewards/accuracy", "/rewards/margin", "/reward")


def print_summary(result, as_json: bool = False, console: bool = False) -> None:
    """The end of a run's output: how it ended, its final results and where everything is. With the
    ``console`` tracker on, the last evaluation and its generations were printed just above (at the
    last step): they are not printed again, only what the console does not show (ICL, gauntlet)."""
    if as_json:
        print(secrets.redact(json.dumps({"status": result.status, "step": result.step, "tokens": result.tokens,
                          "save_folder": result.save_folder, "final": result.final_dir,
                          "eval": result.eval, "generations": result.generations,
                          "mlflow_ui": result.mlflow_ui}, indent=1, default=str)))
        return
    c = Console(highlight=False, soft_wrap=True)  # a path is one line (a terminal wraps it; a log keeps it)
    c.print()
    tokens = f" ({result.tokens:,} tokens)" if result.tokens is not None else ""
    c.print(f"[bold]{result.status}[/bold] after {result.step:,} steps{tokens}")
    ev = result.eval
    keys = [k for k in ev if (k.endswith(SUMMARY_METRICS) and not console) or k.startswith(("icl/", "gauntlet/"))]
    for k in keys:
        c.print(f"  {k:32s} {ev[k]:.4f}")
    for text in [] if console else result.generations[:3]:
        c.print("[dim]--- sample ---[/dim]")
        c.print(text, markup=False)
    if keys or (result.generations and not console):
        c.print("[dim]---[/dim]")
    remote = "://" in result.save_folder
    join = (lambda *p: "/".join([result.save_folder.rstrip("/"), *p])) if remote else \
        (lambda *p: os.path.join(result.save_folder, *p))
    c.print(f"checkpoints: {join('checkpoints')}")
    if result.final_dir and remote:
        local = os.path.join(staging_dir(result.save_folder), "final")
        c.print(f"final model: {result.final_dir}  (local copy: lmforge generate --checkpoint {local})")
    elif result.final_dir:
        c.print(f"final model: {result.final_dir}  (lmforge generate --checkpoint {result.final_dir})")
    c.print(f"metrics:     {join('metrics.jsonl')}")
    report = join("report.html")
    if remote or os.path.exists(report):
        c.print(f"report:      {report}")
    if result.mlflow_ui:
        c.print(f"MLflow:      {result.mlflow_ui}")


def dry_run(request: RunRequest, args) -> int:
    """Resolve every default for this machine without training; data preparation is not started.
    The plan is the one the run's ranks will make (its machine: `compute.ranks` on a CPU, every GPU
    of every node); one that does not fit is shown, then refused with what makes it fit."""
    from lmforge.plan.estimate import plan_view
    from lmforge.plan.fit import KEYS
    from lmforge.plan.run import DoesNotFit
    from lmforge.train.machine import planned_machine  # torch (lazy: `lmforge --help` stays light)

    cfg = resolve(request, until="config").config
    try:
        run = resolve(cfg, planned_machine(cfg.compute), until="plan")  # the config above: its default name kept
    except DoesNotFit as e:
        _print_dry_run(e.config, e.plan, plan_view(e.config, e.plan, names=KEYS), args.json)
        raise UserError(str(e)) from None
    _print_dry_run(run.config, run.plan, plan_view(run.config, run.plan, names=KEYS), args.json)
    return 0


def _print_dry_run(config, plan, view: dict, as_json: bool) -> None:
    resolved = secrets.redact_config(config.model_dump(mode="json"))
    if as_json:
        print(json.dumps({"config": resolved, "plan": view}, indent=1, default=str))
        return
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
    print("---")
    steps = plan.total_steps or f"≈{plan.time_limit_s / plan.step_time_s:,.0f} in {plan.time_limit_s:g}s"
    print(f"steps: {steps}  batch: {batch_rows(view['batch'])} ({batch_split(view['batch'])})")
    print(format_plan(view), end="")
