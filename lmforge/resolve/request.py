"""What a user asked for, before anything is resolved: a config with its overrides applied.

A `RunRequest` is the input of `resolve.run.resolve`: the YAML file (or the SDK's mapping) with
the command line's overrides (``--model``, ``--set key.path=value``, ...) written in, and the
command (``train`` or ``finetune``). `run_config` is resolution's first step: the weights to
continue from fill `model` / `tokenizer` left out, the config is validated, and its `name` and
`save_folder` get their defaults — once, here, for every later step and process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from lmforge.config.identity import with_default_names
from lmforge.config.load import build_config, load_raw
from lmforge.config.schema import RunConfig
from lmforge.errors import UserError
from lmforge.guard import check_run_place, checkpoint_reads
from lmforge.resolve.weights import fill_from_weights

COMMANDS = ("train", "finetune")
# The train_data of a run planned without any (`lmforge estimate` of a preset or `--model auto`):
# resolution then knows nothing of the data's size or vocabulary, and reads no files.
NO_DATA = "(no data: planned by lmforge estimate)"
FINETUNE_DEFAULT_TASK = "instruction_finetune"  # `lmforge finetune` without a task_type
# Command-line flags that set a config key (beside -f, --model, ... and --set).
FLAG_KEYS = (("nnodes", "compute.nodes"), ("node_rank", "compute.node_rank"),
             ("rdzv_endpoint", "compute.rdzv_endpoint"), ("max_retries", "max_retries"),
             ("price_per_gpu_hour", "compute.price_per_gpu_hour"))


@dataclass(frozen=True)
class RunRequest:
    command: str  # "train" | "finetune"
    raw: dict = field(default_factory=dict)  # the config as given, overrides applied, not validated
    source: str | None = None  # the config file (named in errors)

    @classmethod
    def from_args(cls, args) -> RunRequest:
        """A `train` / `finetune` command line."""
        if not args.file and not (args.model and args.train_data and args.training_duration):
            raise UserError(f"{args.command}: give a config with -f FILE (or at least --model, --train-data and "
                            "--training-duration)")
        overrides = {"model": args.model, "custom_weights_path": args.weights, "train_data": args.train_data,
                     "training_duration": args.training_duration, "save_folder": args.save_folder,
                     "name": args.name}
        if args.no_autoresume:
            overrides["autoresume"] = False
        sets = list(args.set) + [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS
                                 if getattr(args, flag, None) is not None]
        return cls(args.command, load_raw(args.file, overrides=overrides, sets=sets), args.file)

    @classmethod
    def from_mapping(cls, command: str, data: dict[str, Any], source: str | None = None) -> RunRequest:
        """A config given as a mapping (the SDK, a pipeline stage)."""
        return cls(command, copy.deepcopy(data), source)


def run_config(request: RunRequest) -> RunConfig:
    """The validated config of ``request``, its names filled in (resolution's first step)."""
    if request.command not in COMMANDS:
        raise UserError(f"unknown command {request.command!r}; expected one of {', '.join(COMMANDS)}")
    raw = dict(request.raw)
    if request.command == "finetune":
        raw.setdefault("task_type", FINETUNE_DEFAULT_TASK)
    if request.command == "finetune" and raw.get("model") is None and not raw.get("custom_weights_path"):
        raise UserError("custom_weights_path: missing; `lmforge finetune` starts from trained weights (a run folder, "
                        "its final/, a checkpoint or hf:/path): set it in the config or pass --weights")
    cfg = with_default_names(build_config(fill_from_weights(raw), source=request.source))
    cfg.compute.check_nodes()  # several nodes need their rendezvous: refused before anything runs, dry run too
    check_run_place(cfg.save_folder, reads=run_reads(cfg))  # a run writes, resumes and prunes there
    return cfg


def run_reads(cfg: RunConfig) -> list:
    """What a run reads, which its save folder must not be, hold or lie inside."""
    reads = [("the training data", d.path) for d in cfg.train_data] + [("eval.data_path", cfg.eval.data_path)]
    if isinstance(cfg.tokenizer, str):
        reads.append(("the tokenizer", cfg.tokenizer))
    return reads + checkpoint_reads(cfg.custom_weights_path)
