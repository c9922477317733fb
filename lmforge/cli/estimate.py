"""`lmforge estimate`: FLOPs, tokens, time, cost and memory of a training run, before it runs.

Every form with a model shape is a run planned as `lmforge train` plans it: the flags build a run
config (a preset or a model YAML with the tokens given, `--model auto` with its budget, or a run
YAML with the flags given written over it), `resolve` plans it on the cluster the flags name
(`plan.machine.nominal_machine`; `--gpu-type cpu`: this machine, as `train --dry-run` sees it), and
the table is a view of that plan (`plan.estimate.plan_view`). Only a nominal `--params` count,
which has no shape to plan, is estimated from the count alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from lmforge.cli.common import add_command, bounded, positive_int
from lmforge.config.limits import MAX_PRICE_PER_HOUR
from lmforge.config.counts import parse_count
from lmforge.config.durations import parse_duration
from lmforge.config.load import load_raw, load_yaml_text, read_text_file
from lmforge.config.model import PRESETS
from lmforge.errors import UserError
from lmforge.plan.hardware import ASSUMED_MFU, gpu_type_names

# Flags that set a run's config keys: a refusal of the key names the flag the user gave.
FLAG_KEYS = {"seq_len": ("--seq-len", "parameters.context_length"),
             "micro_batch": ("--micro-batch", "parameters.micro_batch_size"),
             "activation_checkpointing": ("--activation-checkpointing", "compute.activation_checkpointing"),
             "activation_compression": ("--activation-compression", "compute.activation_compression"),
             "activation_offload": ("--activation-offload", "compute.activation_offload"),
             "data_parallel": ("--data-parallel", "compute.data_parallel"),
             "context_parallel": ("--context-parallel", "compute.context_parallel"),
             "expert_parallel": ("--expert-parallel", "compute.expert_parallel"),
             "precision": ("--precision", "parameters.precision"),
             "vocab_size": ("--vocab-size", "model.vocab_size"),
             "price_per_gpu_hour": ("--price-per-gpu-hour", "compute.price_per_gpu_hour")}
# argparse reads "-7B" or "-5min" as an unknown option (its own test takes only plain numbers such
# as -7): a value that starts like a number is a value here, refused by the flag's name.
NEGATIVE_VALUE = re.compile(r"^-\.?\d")
GPUS_PER_NODE = 8  # --gpus when not given, on a GPU type
RENDEZVOUS = "localhost:29500"  # a plan for several nodes needs one; an estimate never connects


def count(text: str, what: str) -> float:
    """A count flag (--tokens, --params, --flops, --active-params): one line naming the flag."""
    try:
        return parse_count(text, what)
    except ValueError as e:
        raise UserError(str(e)) from None


def run(args) -> int:
    _check_args(args)
    if args.params is not None:
        return _nominal(args)
    from lmforge.plan.estimate import plan_view
    from lmforge.plan.fit import FLAGS
    from lmforge.plan.run import DoesNotFit

    log = (lambda line: print(line, file=sys.stderr)) if args.json else print  # --json: stdout is the JSON alone
    try:
        config, plan = planned(args, log)
    except DoesNotFit as e:  # shown in full, then refused with the change that makes it fit
        _print(plan_view(e.config, e.plan), args)
        raise UserError(e.text(FLAGS)) from None
    _print(plan_view(config, plan), args)
    return 0


def planned(args, log=print):
    """(resolved config, plan) of the run the flags describe, planned as `lmforge train` plans it:
    `resolve` up to the plan on `estimate_machine` (DoesNotFit, with the plan, when it cannot fit)."""
    from lmforge.resolve import resolve
    from lmforge.resolve.request import RunRequest

    doc, source = run_document(args)
    with _flags_named(args):
        cfg = resolve(RunRequest("train", doc, source), until="config").config
        run = resolve(cfg, estimate_machine(args, cfg), until="plan", log=log)
    return run.config, run.plan


def _print(view: dict, args) -> None:
    from lmforge.plan.estimate import format_plan

    print(json.dumps(view, indent=2) if args.json else format_plan(view), end="\n" if args.json else "")


def _check_args(args) -> None:
    if (args.model is None) == (args.params is None):
        raise UserError("estimate: give exactly one of --model PRESET_OR_YAML or --params COUNT")
    if args.tokens is not None and args.chinchilla:
        raise UserError("estimate: give --tokens or --chinchilla, not both")
    budgets = [x for x in (args.flops, args.time) if x is not None]
    if budgets and (args.model != "auto" or args.tokens is not None or len(budgets) > 1):
        raise UserError("estimate: --flops and --time size a model: use one of them, with --model auto "
                        "(and without --tokens)")
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu: expected a fraction in (0, 1], got {args.mfu}")
    if args.price_per_gpu_hour is not None and not args.price_per_gpu_hour >= 0:
        raise UserError(f"--price-per-gpu-hour: expected a number >= 0, got {args.price_per_gpu_hour}")
    for value, what in ((args.tokens, "--tokens"), (args.flops, "--flops"), (args.params, "--params"),
                        (args.active_params, "--active-params")):
        if value is not None:
            count(value, what)
    if args.gpu_type not in gpu_type_names():
        from lmforge.plan.hardware import get_gpu_type

        get_gpu_type(args.gpu_type)  # one line with the known types


def run_document(args) -> tuple[dict, str | None]:
    """The run config the flags describe (see the module docstring), and the file it came from."""
    value = args.model
    if value == "auto":
        doc = {"model": "auto", "tokenizer": {"train": {"vocab_size": args.vocab_size or "auto"}},
               "training_duration": _budget(args), "autoresume": False}
        return _with_flags(doc | {"train_data": _no_data()}, args, skip=("vocab_size",)), None
    doc = _run_yaml(value)
    if doc is not None:
        if args.tokens is not None:
            doc["training_duration"] = f"{int(count(args.tokens, '--tokens'))}tok"
        elif args.chinchilla:
            doc["training_duration"] = _chinchilla(doc.get("model"), args)
        return _with_flags(doc, args), value
    model, seq = _model_of(value)
    doc = {"model": model, "train_data": _no_data(), "autoresume": False}
    if seq and args.seq_len is None:
        doc["parameters"] = {"context_length": seq}
    doc["training_duration"] = f"{int(count(args.tokens, '--tokens'))}tok" if args.tokens is not None else \
        _chinchilla(model, args)
    return _with_flags(doc, args), None


def _no_data() -> str:
    from lmforge.resolve.request import NO_DATA

    return NO_DATA


def _with_flags(doc: dict, args, skip: tuple = ()) -> dict:
    """``doc`` with the flags given written over its keys (--gpus × --nodes are the machine's); what
    they leave unset keeps the run's default, as `lmforge train` plans it (``compute.data_parallel:
    auto`` among them)."""
    from lmforge.config.load import set_path

    values = {k: getattr(args, k) for k in FLAG_KEYS if k not in skip and getattr(args, k) is not None}
    for name, value in values.items():
        set_path(doc, FLAG_KEYS[name][1], value)
    doc.setdefault("name", "estimate")
    nodes = args.nodes if args.gpu_type != "cpu" else 1
    set_path(doc, "compute.nodes", nodes)
    set_path(doc, "compute.node_rank", 0)
    if nodes > 1 and not (doc.get("compute") or {}).get("rdzv_endpoint"):
        set_path(doc, "compute.rdzv_endpoint", RENDEZVOUS)
    return doc


def _gpus(args) -> int:
    return args.gpus or (1 if args.gpu_type == "cpu" else GPUS_PER_NODE)


def estimate_machine(args, cfg):
    """The cluster the flags name, described (nothing measured); `--gpu-type cpu`: this machine
    with the run's ranks, as `train --dry-run` sees it."""
    from lmforge.plan.machine import nominal_machine

    if args.gpu_type != "cpu":
        return nominal_machine(args.gpu_type, _gpus(args) * args.nodes, mfu=args.mfu)
    import torch

    from lmforge.train.machine import local_machine

    return replace(local_machine(torch.device("cpu"), cfg.compute.ranks or _gpus(args)), assumed_mfu=args.mfu)


class _flags_named:
    """A refusal of a config key a flag set names the flag (``--context-parallel 3 does not divide …``)."""

    def __init__(self, args):
        self.given = [FLAG_KEYS[k] for k in FLAG_KEYS if getattr(args, k, None) is not None]

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, UserError) and type(e) is UserError:
            text = str(e)
            for flag, key in self.given:
                text = re.sub(re.escape(key) + r"(\.\w+)?: ", f"{flag} ", text).replace(key, flag)  # (a part of it too)
            if text != str(e):
                raise UserError(text) from None
        return False


def _budget(args) -> str:
    """`--model auto`'s budget as a training_duration: --tokens, --flops or --time."""
    if args.tokens is not None:
        return f"{int(count(args.tokens, '--tokens'))}tok"
    if args.flops is not None:
        return f"{count(args.flops, '--flops'):.6g}flop"
    if args.time is not None:
        try:
            d = parse_duration(args.time, "--time")
        except ValueError:
            d = None
        if d is None or d.unit != "s":
            raise UserError(f"--time: expected a wall-clock duration above 0 such as 70s, 5min or 2h, got {args.time!r}")
        return f"{d.value:g}s"
    raise UserError("--model auto: give a budget to size the model for: --tokens, --flops or --time")


def _chinchilla(model, args) -> str:
    """Compute-optimal tokens for ``model`` (a preset name or mapping): 20 per parameter."""
    from lmforge.config.model import resolve_model
    from lmforge.plan.auto import TOKENS_PER_PARAM
    from lmforge.plan.flops import param_counts

    if model in (None, "auto"):
        raise UserError("--chinchilla: needs a model shape (give --tokens, or a config with a model)")
    shape = resolve_model(model)
    if args.vocab_size:
        shape = shape.model_copy(update={"vocab_size": args.vocab_size})
    return f"{int(TOKENS_PER_PARAM * param_counts(shape)['total'])}tok"


def _model_of(value: str):
    """A preset name, or a YAML whose `model:` key is taken: (model, its context_length or None)."""
    looks_like_file = value.endswith((".yaml", ".yml")) or "/" in value or Path(value).is_file()
    if value in PRESETS or not looks_like_file:
        return value, None
    if not Path(value).is_file():
        raise UserError(f"--model: no such file {value!r} (expected a preset name or a run YAML)")
    doc = load_yaml_text(read_text_file(value, "--model"), value)
    if not isinstance(doc, dict) or "model" not in doc:
        raise UserError(f"{value}: expected a run config with a `model:` key")
    params = doc.get("parameters")
    seq = params.get("context_length") if isinstance(params, dict) else None
    return doc["model"], (int(seq) if isinstance(seq, int) else None)


def _run_yaml(value: str) -> dict | None:
    """The mapping of ``value`` when it names a run config (a YAML with ``train_data``), read as
    `lmforge train -f` reads it (its name from the file's stem, ...): `estimate` then plans that run.
    None for a preset or a model-only YAML."""
    if value in PRESETS or not value.endswith((".yaml", ".yml")) or not Path(value).is_file():
        return None
    doc = load_raw(value)
    return doc if "train_data" in doc else None


def _nominal(args) -> int:
    """`--params COUNT`: no shape to plan, so the estimate of the count alone."""
    from lmforge.plan.estimate import EstimateInputs, check_fits, estimate_run

    if args.model is not None or args.micro_batch == "auto":
        raise UserError("--micro-batch auto: needs a model shape (--model), not a nominal --params")
    plan = estimate_run(EstimateInputs(
        count(args.params, "--params"), tokens=count(args.tokens, "--tokens") if args.tokens else None,
        gpus=_gpus(args), nodes=args.nodes, gpu_type=args.gpu_type, mfu=args.mfu, price=args.price_per_gpu_hour,
        seq_len=args.seq_len, active_params=count(args.active_params, "--active-params") if args.active_params else None,
        precision=args.precision or "bf16", micro_batch=args.micro_batch, data_parallel=args.data_parallel or "auto"))
    _print(plan, args)
    check_fits(plan)
    return 0


def _micro_batch(text: str):
    """--micro-batch: a positive integer or auto."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def _checkpointing(text: str):
    """--activation-checkpointing: auto, none/false, selective, full/true, N (every N-th block), or
    GRANULARITY[:LAYERS] (block, attention, mlp, experts, selective; LAYERS as the config's)."""
    value = {"none": False, "false": False, "true": "full"}.get(text.lower(), text.lower())
    if value in (False, "auto", "selective", "full"):
        return value
    granularity, _, layers = value.partition(":")
    if granularity in ("block", "attention", "mlp", "experts", "selective"):
        from lmforge.config.activations import parse_layers

        try:
            return {"granularity": granularity, "layers": str(parse_layers(layers or "all"))}
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, none, selective, full, a whole number N above 0 or "
                                         f"GRANULARITY:LAYERS such as mlp:first-8, got {text!r}") from None


def _offload(text: str):
    """--activation-offload: true, false or auto."""
    value = {"true": True, "false": False, "auto": "auto"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}")
    return value


def register(subparsers) -> None:
    p = add_command(
        subparsers, "estimate", "plan a run: FLOPs, tokens, time, cost and memory per GPU",
        description="Plan a training run before spending, as `lmforge train` plans it: parameters (total/active), "
        "FLOPs (6·N_active·D plus attention), Chinchilla tokens, the batch split (and why, where it differs from "
        "the batch asked for), time and cost at a given MFU on a given cluster with the communication compute "
        "cannot hide, memory per GPU (for --data-parallel, auto by default as `train` resolves it) with one verdict "
        "that names the flags that make a run fit, the context-parallel degree and activation checkpointing the "
        "context length needs, and for MoE models the expert traffic per GPU with and without expert parallelism.",
    )
    p._negative_number_matcher = NEGATIVE_VALUE  # (see NEGATIVE_VALUE)
    p.add_argument("--model", metavar="PRESET_OR_YAML", help="preset name; a run YAML with train_data (the run "
                   "planned as `lmforge train` resolves it, on the cluster named here: its model, tokens, context, "
                   "batch and data-parallel mode, which the flags given override); a YAML's model: key; or auto "
                   "(the shape for the budget given by --tokens, --flops or --time)")
    p.add_argument("--params", metavar="COUNT", help="nominal parameter count instead of a shape, e.g. 7B")
    p.add_argument("--active-params", metavar="COUNT", help="nominal active parameters (MoE), with --params")
    p.add_argument("--tokens", metavar="COUNT", help="training tokens, e.g. 200B; unset = a run YAML's "
                   "training_duration, else Chinchilla, 20 × params")
    p.add_argument("--flops", metavar="COUNT", help="--model auto: a budget of training FLOPs, e.g. 1e18")
    p.add_argument("--time", metavar="DURATION", help="--model auto: a wall-clock budget, e.g. 70s or 5min "
                   "(--gpu-type cpu: timed on this machine)")
    p.add_argument("--chinchilla", action="store_true", help="use the compute-optimal 20 tokens per parameter")
    p.add_argument("--gpus", type=positive_int, default=None,
                   help=f"GPUs per node; unset = {GPUS_PER_NODE} (--gpu-type cpu: ranks, unset = a run YAML's "
                   "compute.ranks, else 1)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    p.add_argument("--gpu-type", default="h100-sxm", help=f"one of: {', '.join(gpu_type_names())}")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "fp32"],
                   help="what the run trains in (its peak FLOP/s); unset = what `lmforge train` picks: bf16 on "
                   "GPUs, and on `--gpu-type cpu` bf16 with AMX, else fp32")
    p.add_argument("--mfu", type=bounded(float, 0, 1, above=True), default=ASSUMED_MFU, help="model-FLOPs utilization to assume where nothing is "
                   "measured, in (0, 1]")
    p.add_argument("--price-per-gpu-hour", type=bounded(float, 0, MAX_PRICE_PER_HOUR), default=None, metavar="P", help="price for the cost line")
    p.add_argument("--seq-len", type=positive_int, default=None, help="context length; unset = the model's "
                   "max_seq_len (or the YAML's context_length)")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="vocabulary; unset = the model's, or "
                   "32000 where the model leaves it to the tokenizer")
    p.add_argument("--micro-batch", type=_micro_batch, default=None, metavar="N|auto",
                   help="micro-batch per GPU; unset = a run YAML's, else auto: the micro-batch and "
                   "activation-checkpointing mode `micro_batch_size: auto` chooses for speed (modelled)")
    p.add_argument("--activation-checkpointing", type=_checkpointing, default=None, metavar="MODE",
                   help="auto, none, selective, full, N (every N-th block) or GRANULARITY:LAYERS (block, attention, "
                   "mlp, experts or selective on all, first-N, last-N, range(M,K) or every-N blocks, e.g. "
                   "mlp:first-8); unset = a run YAML's, else auto")
    p.add_argument("--activation-compression", default=None, choices=["off", "auto", "fp8", "int8"],
                   help="store what blocks save for backward in one byte per element; auto: --micro-batch auto may "
                   "choose it; unset = a run YAML's, else off")
    p.add_argument("--activation-offload", type=_offload, default=None, metavar="true|false|auto",
                   help="CUDA: keep what blocks save for backward in pinned host memory; unset = a run YAML's, "
                   "else false")
    p.add_argument("--data-parallel", default=None, choices=["auto", "fsdp", "hsdp", "ddp"],
                   help="how the GPUs share the model, which the memory verdict is for: fsdp shards the model "
                   "states over every GPU, hsdp over a node's, ddp keeps them whole on each; unset = a run YAML's "
                   "own, else auto, as `lmforge train` resolves it (ddp where a whole copy fits each GPU, else hsdp "
                   "on several nodes where a node holds one, else fsdp)")
    p.add_argument("--expert-parallel", type=positive_int, default=None, metavar="N",
                   help="MoE: GPUs each layer's experts are split over (memory and all-to-all traffic)")
    p.add_argument("--context-parallel", type=positive_int, default=None, metavar="N",
                   help="GPUs each row's tokens are split over (activation memory); the `long context` line says "
                   "which degree and checkpointing mode --seq-len needs")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
