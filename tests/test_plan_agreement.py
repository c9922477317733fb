"""Every command plans a run the same way: `train --dry-run`, `lmforge estimate --model run.yaml`,
preflight and the run's own ranks agree on micro-batch, accumulation, replicas, activation
checkpointing and the memory verdict — and nothing one of them accepts is refused by another.

Each case calls the functions the commands call, in this process: preflight's `plan_run`, the
dry run's `resolve(cfg, planned_machine(...), until="plan")`, estimate's `planned(args)` (its own
argument parser and flags) and a rank's `resolve(cfg, machine, until="run")` on the real prepared
data. CPU cases run on this machine as described (compute.ranks); GPU cases on described H100s (a
dry run or a rank on a GPU host describes its cards the same way, measured where it can). The
process checks that these are the functions the commands really call are in test_context_parallel
(a 2-rank run's printed plan against its dry run) and test_estimate (estimate --model run.yaml
against `train --dry-run --json`).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_run_config
from lmforge.errors import UserError
from lmforge.plan.estimate import plan_view
from lmforge.plan.machine import nominal_machine
from lmforge.resolve import resolve
from lmforge.resolve.request import RunRequest

MOE = {"preset": "moe-tiny", "d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "max_seq_len": 64}


def _case(name, ranks=1, cp=1, dp="ddp", micro=4, gbs=8, gpus=None, nodes=1, **more):
    return pytest.param(dict(ranks=ranks, cp=cp, dp=dp, micro=micro, gbs=gbs, gpus=gpus, nodes=nodes,
                             refused=name.endswith("refused"), **more), id=name)


CASES = [
    # CPU ranks (compute.ranks) × context parallel × data parallel × micro-batch given / auto
    _case("cpu-1"),
    _case("cpu-2-cp2-gbs4-mb4", ranks=2, cp=2, gbs=4, micro=4),  # one replica: refused by main's preflight
    _case("cpu-2-fsdp-auto", ranks=2, dp="fsdp", micro="auto"),
    _case("cpu-4-cp2-hsdp", ranks=4, cp=2, dp="hsdp", micro=2),
    _case("cpu-4-cp4-fsdp-auto", ranks=4, cp=4, dp="fsdp", micro="auto", gbs=4),
    _case("cpu-8-cp2-ddp-auto", ranks=8, cp=2, micro="auto", gbs=16),
    _case("cpu-8-cp4-hsdp", ranks=8, cp=4, dp="hsdp", micro=1),
    _case("cpu-8-fsdp", ranks=8, dp="fsdp", micro=1),
    _case("cpu-4-gbs6-refused", ranks=4, gbs=6, micro="auto"),
    _case("cpu-2-cp2-mb8-refused", ranks=2, cp=2, gbs=4, micro=8),
    _case("cpu-moe-ep2", ranks=2, dp="fsdp", model=MOE, ep=2),
    _case("cpu-moe-ep2-cp2-hsdp", ranks=4, cp=2, dp="hsdp", model=MOE, ep=2),
    _case("cpu-lora", task="lora", micro=2, gbs=4),
    _case("cpu-lora-2-fsdp-auto", ranks=2, dp="fsdp", task="lora", micro="auto", gbs=4),
    _case("cpu-preference", task="preference"),
    _case("cpu-preference-2-auto", ranks=2, task="preference", micro="auto"),
    # described GPUs: micro-batch and checkpointing chosen from memory, and verdicts that refuse
    _case("h100-1-llama1b-auto", gpus=1, dp="fsdp", micro="auto", model="llama-1b", gbs=16),
    _case("h100-1-llama7b-mb2-refused", gpus=1, dp="fsdp", micro=2, model="llama-7b"),
    _case("h100-8-llama7b-ddp-auto-refused", gpus=8, micro="auto", model="llama-7b", gbs=64),
    _case("h100-8-llama7b-fsdp-cp2-auto", gpus=8, cp=2, dp="fsdp", micro="auto", model="llama-7b", gbs=64),
    _case("h100-16-llama7b-hsdp-auto", gpus=8, nodes=2, dp="hsdp", micro="auto", model="llama-7b", gbs=64),
    _case("h100-8-llama3b-selective", gpus=8, dp="fsdp", micro=4, model="llama-3b", gbs=64, ac="selective"),
    _case("h100-8-moe-ep8-auto", gpus=8, dp="fsdp", micro="auto", model=MOE, ep=8, gbs=64),
    _case("h100-8-lora-auto", gpus=8, dp="fsdp", task="lora", micro="auto", gbs=16),
    _case("h100-2-preference-ddp-auto", gpus=2, task="preference", micro="auto"),
    # compute.data_parallel: auto (the default), resolved once by the planner: every path the same mode
    _case("cpu-2-dp-auto", ranks=2, dp="auto", micro="auto"),
    _case("h100-8-llama7b-dp-auto", gpus=8, dp="auto", micro="auto", model="llama-7b", gbs=64),
    _case("h100-16-llama7b-dp-auto", gpus=8, nodes=2, dp="auto", micro="auto", model="llama-7b", gbs=64),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data):
    """Weights to fine-tune from: a fresh tiny model with the session's tokenizer."""
    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model, save_pretrained

    shape = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64, vocab_size=512)
    folder = tmp_path_factory.mktemp("agreement-base") / "base"
    torch.manual_seed(0)
    save_pretrained(build_model(shape), shape, folder, tokenizer_dir=tiny_data.tokenizer)
    return folder


def _config(case: dict, tiny_data, base, tmp_path) -> dict:
    c = {"compute.data_parallel": case["dp"], "compute.context_parallel": case["cp"],
         "parameters.micro_batch_size": case["micro"], "parameters.global_batch_size": case["gbs"],
         "compute.expert_parallel": case.get("ep", 1), "compute.activation_checkpointing": case.get("ac", "auto"),
         "parameters.precision": "auto"}
    if case["gpus"] is None:
        c["compute.ranks"] = case["ranks"]
    if case["nodes"] > 1:
        c |= {"compute.nodes": case["nodes"], "compute.rdzv_endpoint": "localhost:29500"}
    if "model" in case:
        c["model"] = case["model"]
    task = case.get("task")
    if task == "lora":
        c |= {"custom_weights_path": str(base), "task_type": "instruction_finetune", "model": None, "tokenizer": None,
              "train_data": str(tmp_path / "sft.jsonl"), "lora": {"rank": 4}, "eval.prompts": []}
        (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}?", "response": f" a{i}."}) + "\n"
                                                    for i in range(16)))
    elif task == "preference":
        c |= {"custom_weights_path": str(base), "task_type": "preference", "model": None, "tokenizer": None,
              "train_data": str(tmp_path / "pairs.jsonl"), "eval.prompts": []}
        (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"# {i}", "chosen": f" {i}\n",
                                                                  "rejected": f" {i + 1}\n"}) + "\n"
                                                      for i in range(16)))
    cfg = tiny_run_config(tiny_data, tmp_path / "run", **c)
    return {k: v for k, v in cfg.items() if v is not None}


def _outcome(fn):
    """(what the plan decided, or the refusal's line)."""
    try:
        config, plan = fn()
    except UserError as e:
        return "refused: " + str(e).split(":")[0]
    view = plan_view(config, plan)
    decided = (plan.micro_batch, plan.grad_accum, plan.replicas, plan.activation_checkpointing,
               bool(plan.memory["fits"]), plan.global_batch, plan.context_length, plan.layout.data_parallel)
    shown = (view["batch"]["micro_batch"], view["batch"]["grad_accum"], view["batch"]["replicas"],
             view["memory"]["activation_checkpointing"], bool(view["memory"]["fits"]), view["batch"]["global_batch"],
             view["batch"]["context_length"], view["memory"]["data_parallel"])
    assert shown == decided, (shown, decided)  # the view shows the plan as it is
    assert config.compute.data_parallel == plan.layout.data_parallel  # `auto` resolved once, written in
    return decided + (plan.eval_interval, plan.eval_batches)


@pytest.mark.parametrize("case", CASES)
def test_dry_run_estimate_preflight_and_the_run_agree(case, tiny_data, base, tmp_path):
    from lmforge.cli.estimate import planned
    from lmforge.cli.main import build_parser
    from lmforge.runs.preflight import plan_run
    from lmforge.train.machine import planned_machine
    from train_helpers import write_config

    raw = _config(case, tiny_data, base, tmp_path)
    yaml = write_config(tmp_path / "run.yaml", raw)
    command = "finetune" if case.get("task") else "train"
    cfg = resolve(RunRequest(command, raw, str(yaml)), until="config").config
    ranks = case["ranks"] if case["gpus"] is None else case["gpus"] * case["nodes"]
    machine = planned_machine(cfg.compute) if case["gpus"] is None else nominal_machine("h100-sxm", ranks)
    quiet = dict(log=lambda *_: None)

    def dry_run():  # `train --dry-run`: resolve up to the plan on the machine the run trains on
        run = resolve(cfg, machine, until="plan", **quiet)
        return run.config, run.plan

    def estimate():  # `lmforge estimate --model run.yaml` on the same cluster
        flags = ["--gpu-type", "cpu"] if case["gpus"] is None else \
            ["--gpus", str(case["gpus"]), "--nodes", str(case["nodes"])]
        return planned(build_parser().parse_args(["estimate", "--model", str(yaml), *flags]), **quiet)

    def preflight():  # the user's process, before anything is registered (on GPUs: as the dry run)
        if case["gpus"] is None:
            plan_run(cfg, ranks)
        return dry_run()

    def the_run():  # what every rank resolves, on the prepared data
        run = resolve(cfg, machine, until="run", **quiet)
        return run.config, run.plan

    outcomes = {name: _outcome(fn) for name, fn in
                (("dry-run", dry_run), ("estimate", estimate), ("preflight", preflight), ("run", the_run))}
    assert len(set(outcomes.values())) == 1, outcomes
    assert str(outcomes["run"]).startswith("refused") == case["refused"], outcomes
