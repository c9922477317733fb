"""`lmforge estimate`: FLOPs, tokens, time, cost and memory of a training run, before it runs."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from lmforge.cli.common import add_command, positive_int
from lmforge.config.load import load_yaml_text, read_text_file
from lmforge.config.model import PRESETS, resolve_model
from lmforge.errors import UserError
from lmforge.plan.hardware import gpu_type_names
from lmforge.plan.estimate import EstimateInputs, check_fits, estimate_run, format_plan

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_COUNT = re.compile(r"^\s*([0-9][0-9_]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*(?:tok|tokens)?\s*$", re.I)


def parse_count(text: str, what: str) -> float:
    """``7B``, ``2.6B``, ``200B tok``, ``1.4e11``, ``125M``, ``10_000`` -> a number."""
    m = _COUNT.match(str(text))
    if not m:
        raise UserError(f"{what}: expected a count such as 7B, 125M, 200B or 1.4e11, got {text!r}")
    return float(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).upper()]


def _load_model(value: str):
    """A preset name, or a run YAML whose `model:` key is taken. Returns (cfg, seq_len or None)."""
    looks_like_file = value.endswith((".yaml", ".yml")) or "/" in value or Path(value).is_file()
    if value in PRESETS or not looks_like_file:
        return resolve_model(value), None
    path = Path(value)
    if not path.is_file():
        raise UserError(f"--model: no such file {value!r} (expected a preset name or a run YAML)")
    doc = load_yaml_text(read_text_file(value, "--model"), value)
    if not isinstance(doc, dict) or "model" not in doc:
        raise UserError(f"{value}: expected a run config with a `model:` key")
    try:
        cfg = resolve_model(doc["model"])
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise UserError(f"{value}: model{'.' + loc if loc else ''}: {err['msg']}") from None
    params = doc.get("parameters")
    seq = params.get("context_length") if isinstance(params, dict) else None
    return cfg, (int(seq) if isinstance(seq, int) else None)


def _run_yaml(value: str) -> dict | None:
    """The mapping of ``value`` when it names a run config (a YAML with ``train_data``): `estimate`
    then plans that run as `lmforge train` resolves it. None for a preset or a model-only YAML."""
    if value in PRESETS or not value.endswith((".yaml", ".yml")) or not Path(value).is_file():
        return None
    from lmforge.config.load import load_raw

    doc = load_raw(value)  # as `lmforge train -f` reads it (the run's name from the file's stem, ...)
    return doc if "train_data" in doc else None


def _resolved_inputs(doc: dict, source: str, args) -> EstimateInputs:
    """A run config resolved (`resolve`, up to the plan) for the cluster the flags name, measuring
    nothing: its model, tokens, context, batch, precision and data-parallel mode; the flags given
    override them."""
    from lmforge.resolve import resolve
    from lmforge.plan.machine import nominal_machine
    from lmforge.plan.run import estimate_inputs
    from lmforge.resolve.request import RunRequest

    cpu = args.gpu_type == "cpu"
    cfg = resolve(RunRequest("train", doc, source), until="config").config
    if cpu:  # this machine, measured as `train --dry-run` measures it (model: auto times its candidates)
        import torch

        from lmforge.train.machine import local_machine

        machine = local_machine(torch.device("cpu"), cfg.compute.ranks or 1)
    else:
        machine = nominal_machine(args.gpu_type, args.gpus * args.nodes)
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print  # --json: stdout is the JSON alone
    run = resolve(cfg, machine, until="plan", log=log)
    given = {"tokens": parse_count(args.tokens, "--tokens") if args.tokens is not None else None}
    if args.tokens is None and not args.chinchilla:
        given.pop("tokens")  # the run's own
    flags = {"seq_len": args.seq_len, "price": args.price_per_gpu_hour, "precision": args.precision,
             "micro_batch": args.micro_batch, "data_parallel": args.data_parallel,
             "vocab_size": args.vocab_size, "expert_parallel": args.expert_parallel,
             "context_parallel": args.context_parallel}
    given |= {k: v for k, v in flags.items() if v is not None}
    if args.seq_len is not None or args.micro_batch is not None:
        given |= {"grad_accum": 1}  # the run's accumulation was for its own micro-batch and context
    return replace(estimate_inputs(run.config, run.plan, machine), gpus=1 if cpu else args.gpus,
                   nodes=1 if cpu else args.nodes, mfu=args.mfu, **given)


def _micro_batch(text: str):
    """--micro-batch: a positive integer or auto."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def _precision(args) -> str:
    """--precision, else bf16 on a GPU type; on this CPU the precision training would choose
    (`config.defaults.auto_precision`: bf16 only with AMX), since without AMX a run trains in fp32
    and a bf16 peak (2× fp32 with AVX512-BF16) would halve the time estimate."""
    if args.precision is not None:
        return args.precision
    if args.gpu_type != "cpu":
        return "bf16"
    import torch

    from lmforge.config.defaults import auto_precision
    from lmforge.train.machine import local_machine

    return auto_precision(local_machine(torch.device("cpu")).bf16)


def _auto(args, tokens: float | None):
    """`--model auto`: the shape for a budget of --tokens, --flops or --time (see estimate.auto).
    A --time budget on `--gpu-type cpu` times candidates on this machine; on a GPU type it
    assumes --mfu of that GPU's peak on every GPU."""
    from lmforge.config.durations import parse_duration
    from lmforge.config.defaults import default_batch_tokens
    from lmforge.plan.auto import Budget, candidates, choose
    from lmforge.plan.flops import flops_per_token, param_counts
    from lmforge.plan.hardware import get_gpu_type, peak_flops

    if tokens is not None:
        budget = Budget("tok", tokens)
    elif args.flops is not None:
        budget = Budget("flop", parse_count(args.flops, "--flops"))
    elif args.time is not None:
        try:
            d = parse_duration(args.time, "--time")
        except ValueError as e:
            raise UserError(f"--time: {e}") from None
        if d.unit != "s":
            raise UserError(f"--time: expected a wall-clock duration such as 70s, 5min or 2h, got {args.time!r}")
        budget = Budget("s", d.value)
    else:
        raise UserError("--model auto: give a budget to size the model for: --tokens, --flops or --time")
    cands = candidates(args.vocab_size, None, args.seq_len,
                       lambda m, ctx: default_batch_tokens(param_counts(m)["non_embedding"]))
    spec = get_gpu_type(args.gpu_type)
    precision = _precision(args)
    sustained = args.mfu * peak_flops(spec, precision) * (1 if args.gpu_type == "cpu" else args.gpus * args.nodes)
    measure = None
    if budget.kind == "s":
        if args.gpu_type == "cpu":
            from lmforge.config.defaults import micro_batch_for
            from lmforge.train.throughput import measure_tokens_per_s

            def measure(c):
                micro = micro_batch_for(max(1, c.batch_tokens // c.context_length), 8)
                return measure_tokens_per_s(c.model, c.context_length, micro)
        else:
            def measure(c):
                return sustained / flops_per_token(c.model, c.context_length)["total"]
    note = "measured here" if args.gpu_type == "cpu" else f"{args.mfu:.0%} MFU on {args.gpus * args.nodes} × {spec.name}"
    best, reason = choose(budget, cands, tokens_per_s=measure, flops_per_s_guess=sustained, rate_note=note)
    print(reason)
    return best.model, best.tokens, best.context_length


def run(args) -> int:
    if (args.model is None) == (args.params is None):
        raise UserError("estimate: give exactly one of --model PRESET_OR_YAML or --params COUNT")
    if args.tokens is not None and args.chinchilla:
        raise UserError("estimate: give --tokens or --chinchilla, not both")
    budgets = [x for x in (args.flops, args.time) if x is not None]
    if budgets and (args.model != "auto" or args.tokens is not None or len(budgets) > 1):
        raise UserError("estimate: --flops and --time size a model: use one of them, with --model auto "
                        "(and without --tokens)")
    seq_len = args.seq_len
    tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
    run_doc = _run_yaml(args.model) if args.model is not None else None
    if run_doc is not None:
        return _print_plan(_resolved_inputs(run_doc, args.model, args), args)
    if args.model == "auto":
        model, tokens, seq_len = _auto(args, tokens)
    elif args.model is not None:
        model, yaml_seq = _load_model(args.model)
        seq_len = seq_len or yaml_seq
    else:
        model = parse_count(args.params, "--params")
    inputs = EstimateInputs(
        model,
        tokens=tokens,
        gpus=args.gpus,
        nodes=args.nodes,
        gpu_type=args.gpu_type,
        mfu=args.mfu,
        price=args.price_per_gpu_hour,
        seq_len=seq_len,
        active_params=parse_count(args.active_params, "--active-params") if args.active_params else None,
        vocab_size=args.vocab_size,
        precision=_precision(args),
        micro_batch=args.micro_batch,
        expert_parallel=args.expert_parallel or 1,
        context_parallel=args.context_parallel or 1,
        data_parallel=args.data_parallel or "fsdp",
    )
    return _print_plan(inputs, args)


def _print_plan(inputs: EstimateInputs, args) -> int:
    plan = estimate_run(inputs)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan), end="\n" if args.json else "")
    check_fits(plan)
    return 0


def register(subparsers) -> None:
    p = add_command(
        subparsers, "estimate", "plan a run: FLOPs, tokens, time, cost and memory per GPU",
        description="Plan a training run before spending: parameters (total/active), FLOPs "
        "(6·N_active·D plus attention), Chinchilla tokens, time and cost at a given MFU on a "
        "given cluster, memory per GPU (for --data-parallel, full sharding by default), the context-parallel "
        "degree and activation checkpointing the context length needs, and for MoE models the expert traffic "
        "per GPU with and without expert parallelism.",
    )
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
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    p.add_argument("--gpu-type", default="h100-sxm", help=f"one of: {', '.join(gpu_type_names())}")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "fp32"],
                   help="peak FLOP/s used; unset = bf16 on GPUs, and on `--gpu-type cpu` what `lmforge train` "
                   "uses on this CPU (bf16 with AMX, else fp32)")
    p.add_argument("--mfu", type=float, default=0.4, help="model-FLOPs utilization to assume, in (0, 1]")
    p.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="P", help="price for the cost line")
    p.add_argument("--seq-len", type=positive_int, default=None, help="context length; unset = the model's max_seq_len (or the YAML's context_length)")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="vocabulary; unset = the model's, or 32000 where the model leaves it to the tokenizer")
    p.add_argument("--micro-batch", type=_micro_batch, default=None, metavar="N|auto",
                   help="micro-batch per GPU; unset = the largest power of two that fits; auto = the micro-batch "
                   "and activation-checkpointing mode `micro_batch_size: auto` chooses for speed (modelled)")
    p.add_argument("--data-parallel", default=None, choices=["fsdp", "hsdp", "ddp"],
                   help="how the GPUs share the model, which the memory verdict is for: fsdp shards the model "
                   "states over every GPU, hsdp over a node's, ddp keeps them whole on each (what `lmforge "
                   "train` uses unless compute.data_parallel says otherwise); unset = a run YAML's own, else fsdp")
    p.add_argument("--expert-parallel", type=positive_int, default=None, metavar="N",
                   help="MoE: GPUs each layer's experts are split over (memory and all-to-all traffic)")
    p.add_argument("--context-parallel", type=positive_int, default=None, metavar="N",
                   help="GPUs each row's tokens are split over (activation memory); the `long context` line says "
                   "which degree and checkpointing mode --seq-len needs")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
