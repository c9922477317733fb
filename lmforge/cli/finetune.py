"""`lmforge finetune -f sft.yaml [overrides]`: supervised fine-tuning (or continued pretraining)."""

from __future__ import annotations

import sys

from lmforge.cli.common import add_command


def register(sub) -> None:
    p = add_command(sub, "finetune", "fine-tune a model on prompt/response or chat JSONL (SFT)",
                    description="Fine-tune from a run config with task_type instruction_finetune (default), "
                    "chat_completion or continued_pretrain. `model` and `tokenizer` default to those of "
                    "custom_weights_path. Re-running the same command resumes (autoresume).")
    p.add_argument("-f", "--file", metavar="YAML", required=True, help="run config (see examples/sft.yaml)")
    p.add_argument("--weights", metavar="PATH", help="override `custom_weights_path` (run folder, final/, step "
                   "folder or Hugging Face folder)")
    p.add_argument("--train-data", action="append", metavar="JSONL", help="override `train_data` (repeatable)")
    p.add_argument("--training-duration", metavar="DUR", help="override, e.g. 3ep, 200ba")
    p.add_argument("--save-folder", metavar="DIR", help="override `save_folder`")
    p.add_argument("--name", help="override `name`")
    p.add_argument("--price-per-gpu-hour", type=float, metavar="P",
                   help="override `compute.price_per_gpu_hour`: show the cost so far and to finish")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any key, e.g. --set parameters.learning_rate=2e-5 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace checkpoints of a different run in save_folder")
    p.add_argument("--no-autoresume", action="store_true", help="do not continue from an existing checkpoint")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (logs in <save_folder>/logs); print the run name and return")
    p.set_defaults(func=run)


def run(args) -> int:
    from lmforge.cli.train import train_here
    from lmforge.distributed.launch import launch as launch_ranks, needs_launch
    from lmforge.train.finetune import finetune, load_run_config

    overrides = {"custom_weights_path": args.weights, "train_data": args.train_data,
                 "training_duration": args.training_duration, "save_folder": args.save_folder, "name": args.name}
    if args.no_autoresume:
        overrides["autoresume"] = False
    sets = list(args.set)
    if args.price_per_gpu_hour is not None:
        sets.append(f"compute.price_per_gpu_hour={args.price_per_gpu_hour}")
    cfg = load_run_config(args.file, overrides=overrides, sets=sets)
    if cfg.task_type == "pretrain":  # `finetune` means instruction fine-tuning unless the config says otherwise
        cfg = cfg.model_copy(update={"task_type": "instruction_finetune"})
    # Registered and supervised like `lmforge train` (retries, logs, `lmforge runs ...`).
    from lmforge.runs.launch import launch, should_supervise

    nproc = needs_launch(cfg)  # several GPUs or compute.ranks: N → torchrun (mesh checked here)
    if should_supervise():
        return launch(cfg, args)
    if nproc:
        return launch_ranks(cfg, nproc, sys.argv[1:])
    return train_here(finetune, cfg, args)
