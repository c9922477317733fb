"""`lmforge train -f run.yaml` and `lmforge finetune -f sft.yaml`: one command path for both.

Both load the config with the same overrides, check object-store credentials once, then run
in one of three ways: register and supervise the run (the first process), start torchrun
(several ranks), or train in this process (a supervised child or a torchrun rank).
`finetune` differs only in its default `task_type` (instruction_finetune) and its help.
"""

from __future__ import annotations

import json
import os
import sys

from lmforge.cli.common import add_command
from lmforge.config.reference import render_text
from lmforge.errors import UserError

SFT_DEFAULT_TASK = "instruction_finetune"


def register(sub) -> None:
    p = add_command(sub, "train", "pretrain (or continue pretraining) a model from a YAML config",
                    description="Train from a run config. Re-running the same command continues from the latest "
                    "checkpoint in save_folder (autoresume).")
    add_run_arguments(p)
    p.epilog = render_text()
    p.set_defaults(func=run)
    p = add_command(sub, "finetune", "fine-tune a model on prompt/response or chat JSONL (SFT)",
                    description="Fine-tune from a run config with task_type instruction_finetune (default), "
                    "chat_completion or continued_pretrain. `model` and `tokenizer` default to those of "
                    "custom_weights_path. Re-running the same command resumes (autoresume).")
    add_run_arguments(p)
    p.set_defaults(func=run)


def add_run_arguments(p) -> None:
    p.add_argument("-f", "--file", metavar="YAML", help="run config (see examples/)")
    p.add_argument("--model", help="override `model` (a preset name)")
    p.add_argument("--weights", metavar="PATH", help="override `custom_weights_path` (run folder, final/, step "
                   "folder or Hugging Face folder)")
    p.add_argument("--train-data", action="append", metavar="PATH", help="override `train_data` (repeatable)")
    p.add_argument("--training-duration", metavar="DUR", help="override, e.g. 10000tok, 500ba, 2ep, 30min")
    p.add_argument("--save-folder", metavar="DIR", help="override `save_folder`")
    p.add_argument("--name", help="override `name`")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any key, e.g. --set parameters.learning_rate=3e-4 (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan, then exit")
    p.add_argument("--overwrite", action="store_true", help="replace checkpoints of a different run in save_folder")
    p.add_argument("--no-autoresume", action="store_true", help="do not continue from an existing checkpoint")
    p.add_argument("--json", action="store_true", help="print the final summary (or the dry-run plan) as JSON")
    # multi-node (docs/scale-out.md): same as compute.nodes / node_rank / rdzv_endpoint and max_retries
    p.add_argument("--nnodes", type=int, metavar="N", help="override `compute.nodes`")
    p.add_argument("--node-rank", type=int, metavar="R", help="override `compute.node_rank` (0 … N-1)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="override `compute.rdzv_endpoint` (node 0's address)")
    p.add_argument("--max-restarts", type=int, metavar="N", help="override `max_retries` (torchrun restarts)")
    p.add_argument("--check-credentials", action="store_true",
                   help="only check read access to remote data and write access to a remote save_folder, then exit")
    p.add_argument("--skip-credentials-check", action="store_true",
                   help="do not run the object-store credentials check before training")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (logs in <save_folder>/logs); print the run name and return")


def load_from_args(args):
    """The run config of a `train` / `finetune` command line (overrides applied, validated)."""
    from lmforge.config.load import build_config, load_raw
    from lmforge.train.locate import fill_from_weights

    finetune = args.command == "finetune"
    if not args.file and not (args.model and args.train_data and args.training_duration):
        raise UserError(f"{args.command}: give a config with -f FILE (or at least --model, --train-data and "
                        "--training-duration)")
    overrides = {"model": args.model, "custom_weights_path": args.weights, "train_data": args.train_data,
                 "training_duration": args.training_duration, "save_folder": args.save_folder, "name": args.name}
    if args.no_autoresume:
        overrides["autoresume"] = False
    sets = list(args.set)
    for flag, key in (("nnodes", "compute.nodes"), ("node_rank", "compute.node_rank"),
                      ("rdzv_endpoint", "compute.rdzv_endpoint"), ("max_restarts", "max_retries")):
        if getattr(args, flag, None) is not None:
            sets.append(f"{key}={getattr(args, flag)}")
    raw = load_raw(args.file, overrides=overrides, sets=sets)
    if finetune:
        raw.setdefault("task_type", SFT_DEFAULT_TASK)
    # `model` and `tokenizer` may come from custom_weights_path.
    return build_config(fill_from_weights(raw), source=args.file)


def run(args) -> int:
    from lmforge import secrets

    try:
        return _run(args)
    except UserError as e:  # no secret may reach the terminal, whatever raised the error
        raise type(e)(secrets.redact(str(e))) from None


def _run(args) -> int:
    from lmforge import secrets

    cfg = load_from_args(args)
    secrets.apply(cfg)  # credentials named by `secrets:` → env (torchrun's ranks inherit it)
    if args.dry_run:
        return dry_run(cfg, args)
    # Object-store access is checked once, before anything is registered or started; the
    # supervised child, torchrun's ranks and relaunched processes skip it.
    if args.check_credentials or not (args.skip_credentials_check or int(os.environ.get("RANK", "0")) != 0
                                      or os.environ.get("LMFORGE_LAUNCHED") or os.environ.get("LMFORGE_SUPERVISED_CHILD")):
        checked = secrets.check_credentials(cfg, log=print)  # a local save_folder: nothing to check
        if args.check_credentials:
            print("credentials: ok" if checked else "credentials: nothing remote to check")
            return 0
    # [runs] the first process registers the run and supervises a child `lmforge train`
    # (retries, logs, `lmforge runs ...`); the child, and torchrun ranks, come through here and just train.
    from lmforge.distributed.torchrun import launch as launch_ranks, needs_launch
    from lmforge.runs.start import start, should_supervise

    nproc = needs_launch(cfg)  # several GPUs, compute.ranks: N or several nodes → torchrun (mesh checked here)
    if should_supervise() and cfg.compute.node_rank == 0:  # other nodes: torchrun's agent restarts workers
        return start(cfg, args)
    if nproc:
        return launch_ranks(cfg, nproc, sys.argv[1:])
    return train_here(cfg, args)


def train_here(cfg, args) -> int:
    """Train in this process (a supervised child or a torchrun rank); report the outcome to the
    supervisor and print the summary on rank 0."""
    from lmforge.runs.job import run_job
    from lmforge.runs.supervisor import report_status

    try:
        result = run_job(cfg, overwrite=args.overwrite)
    except UserError as e:
        report_status("failed", error=str(e), exit_code=e.exit_code)
        raise
    report_status(result.status, step=result.step, tokens=result.tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(result, as_json=args.json)
    return 0 if result.status in ("completed", "stopped") else 1


def print_summary(result, as_json: bool = False) -> None:
    if as_json:
        from lmforge.secrets import redact

        print(redact(json.dumps({"status": result.status, "step": result.step, "tokens": result.tokens,
                          "save_folder": result.save_folder, "final": result.final_dir,
                          "eval": result.eval, "generations": result.generations,
                          "mlflow_ui": result.mlflow_ui}, indent=1, default=str)))
        return
    from rich.console import Console

    c = Console(highlight=False)
    c.print()
    c.print(f"[bold]{result.status}[/bold] after {result.step:,} steps ({result.tokens:,} tokens)")
    ev = result.eval
    keys = [k for k in ev if k.endswith(("/loss", "/bits_per_byte", "/perplexity")) or k.startswith(("icl/", "gauntlet/"))]
    for k in keys:
        c.print(f"  {k:32s} {ev[k]:.4f}")
    for text in result.generations[:3]:
        c.print("[dim]--- sample ---[/dim]")
        c.print(text, markup=False)
    c.print("[dim]---[/dim]")
    c.print(f"checkpoints: {os.path.join(result.save_folder, 'checkpoints')}")
    if result.final_dir:
        c.print(f"final model: {result.final_dir}  (lmforge generate --checkpoint {result.final_dir})")
    c.print(f"metrics:     {os.path.join(result.save_folder, 'metrics.jsonl')}")
    if result.mlflow_ui:
        c.print(f"MLflow:      {result.mlflow_ui}")


def dry_run(cfg, args) -> int:
    """Resolve every default without training; data preparation is not started for this."""
    import yaml

    from lmforge.config.identity import with_default_names
    from lmforge.config.model import padded_vocab
    from lmforge.config.schema import TokenizerSpec
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.distributed.dist import pick_device
    from lmforge.estimate.plan import estimate_run, format_plan
    from lmforge.train.plan import make_plan, resolved_config

    cfg = with_default_names(cfg)
    if cfg.model.vocab_size is None:
        vocab = cfg.tokenizer.train.vocab_size if isinstance(cfg.tokenizer, TokenizerSpec) else None
        if isinstance(cfg.tokenizer, str) and os.path.exists(cfg.tokenizer):
            vocab = load_tokenizer(cfg.tokenizer).vocab_size
        if vocab:
            cfg.model.vocab_size = padded_vocab(vocab)
    device = pick_device(cfg.compute.device, 0)
    world = cfg.compute.ranks or 1
    if device.type == "cuda":
        import torch

        world = (torch.cuda.device_count() if cfg.compute.gpus == "auto" else cfg.compute.gpus) * cfg.compute.nodes
    plan = make_plan(cfg, world_size=world, device=device, samples_per_epoch=None, data_seq_len=None)
    from lmforge.secrets import redact_config

    resolved = redact_config(resolved_config(cfg, plan).model_dump(mode="json"))
    gpu_type = "cpu"
    if device.type == "cuda":
        from lmforge.estimate.hardware import GPU_TYPES, detect_device_spec

        name = detect_device_spec(device).name
        gpu_type = name if name in GPU_TYPES else "h100-sxm"
    est = estimate_run(cfg.model, tokens=plan.total_tokens, gpus=world if device.type == "cuda" else 1,
                        gpu_type=gpu_type, seq_len=plan.context_length, micro_batch=plan.micro_batch,
                        grad_accum=plan.grad_accum, expert_parallel=cfg.compute.expert_parallel
                        if device.type == "cuda" else 1)
    if args.json:
        print(json.dumps({"config": resolved, "plan": est}, indent=1, default=str))
        return 0
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
    print("---")
    print(f"steps: {plan.total_steps}  batch: {plan.global_batch} × {plan.context_length} tokens "
          f"(micro-batch {plan.micro_batch} × {plan.grad_accum} accumulation × {world} rank(s))")
    print(format_plan(est))
    return 0
