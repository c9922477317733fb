"""Planning rules as units, against `resolve()` and the planner's pure functions: what a run's plan
decides and says, each rule once (lmforge/plan)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.errors import UserError
from lmforge.plan.checks import check_batch_split
from lmforge.plan.flops import param_counts
from lmforge.plan.machine import nominal_machine
from lmforge.plan.layout import Sharding
from lmforge.plan.memory import BYTES_PER_PARAM, fixed_parts
from lmforge.resolve import resolve

QUIET = {"log": lambda *_: None}


def _cpu(ranks: int = 1):
    from lmforge.train.machine import planned_machine
    from lmforge.config.schema import ComputeConfig

    return planned_machine(ComputeConfig(device="cpu"), ranks, measure=False)


def test_a_resolved_config_is_frozen(tiny_data, tmp_path):
    """Nothing changes a config once resolved: neither the run's config nor any part of it."""
    run = resolve(build_config(tiny_run_config(tiny_data, tmp_path / "r")), _cpu(), until="plan", **QUIET)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.config = run.config  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        run.config.parameters.learning_rate = 1.0
    with pytest.raises(ValidationError, match="frozen"):
        run.config.compute.context_parallel = 2
    changed = run.config.model_copy(update={"name": "other"})  # a copy is how a config changes
    assert changed.name == "other" and run.config.name != "other"


def test_mutating_anything_inside_a_resolved_run_raises():
    """Deep-frozen: the plan's dicts, the config's lists and mappings, the layout — nothing inside a
    resolved run changes in place, so no view or rank can come to read another plan than the others."""
    cfg = build_config({"model": "llama-125m", "train_data": ["a", "b"], "training_duration": "10ba",
                        "eval": {"prompts": ["def f("]}, "compute": {"data_parallel": "fsdp"},
                        "parameters": {"context_length": 512, "global_batch_size": 16}})
    run = resolve(cfg, nominal_machine("h100-sxm", 8), until="plan", **QUIET)
    plan, config = run.plan, run.config
    changes = [lambda: plan.params.__setitem__("total", 1), lambda: plan.memory.__setitem__("fits", False),
               lambda: plan.memory.update(fits=False), lambda: plan.memory["activation_bytes_per_sample"].clear(),
               lambda: config.train_data.append(config.train_data[0]), lambda: config.eval.prompts.append("x"),
               lambda: config.goodput.health.fatal_xids.append(1), lambda: config.model.model_copy().__setattr__("d_model", 1)]
    for change in changes:
        with pytest.raises((TypeError, AttributeError, ValidationError)):
            change()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout.global_batch = 1  # type: ignore[misc]
    assert plan.fits and plan.params["total"] > 1 and len(config.train_data) == 2 and config.eval.prompts == ("def f(",)
    assert pickle.loads(pickle.dumps(plan)) == plan  # a plan still travels from rank 0 to the others
    assert json.loads(json.dumps(plan.memory)) == plan.memory


def test_the_batch_splits_over_replicas_not_ranks():
    check_batch_split(4, 4, ranks=2, context_parallel=2)  # one replica of two context-parallel ranks
    with pytest.raises(UserError, match=r"micro_batch_size \(4\) × ranks \(2\) = 8"):
        check_batch_split(4, 4, ranks=2)
    with pytest.raises(UserError, match=r"data-parallel replicas \(2: 4 ranks / compute.context_parallel 2\)"):
        check_batch_split(6, 4, ranks=4, context_parallel=2)


def test_hsdp_shards_the_states_over_a_shard_group():
    """One fixed-memory function for every verdict, with HSDP's shard group (a node by default)."""
    from lmforge.config.model import get_preset

    llama = get_preset("llama-1b")
    total = param_counts(llama)["total"]
    states = {dp: fixed_parts(total, llama, Sharding(dp, 16, shard_size=8))[0] for dp in ("fsdp", "hsdp", "ddp")}
    assert states["fsdp"] == pytest.approx(total * BYTES_PER_PARAM / 16)
    assert states["hsdp"] == pytest.approx(total * BYTES_PER_PARAM / 8) and states["ddp"] == total * BYTES_PER_PARAM
    cfg = build_config({"model": "llama-1b", "train_data": "data", "training_duration": "10ba",
                        "compute": {"data_parallel": "hsdp", "nodes": 2, "rdzv_endpoint": "n0:29500"},
                        "parameters": {"context_length": 2048, "global_batch_size": 32}})
    plan = resolve(cfg, nominal_machine("h100-sxm", 16), until="plan", **QUIET).plan
    assert plan.sharding.shards == 8 and plan.memory["states_bytes_per_gpu"] == pytest.approx(states["hsdp"])


def test_rope_scaling_is_said_in_the_plans_first_lines(tiny_data, tmp_path):
    from lmforge.models import build_model, save_pretrained

    base = build_config(tiny_run_config(tiny_data, tmp_path / "b", **{"model.vocab_size": 512})).model  # weights to extend
    save_pretrained(build_model(base, device="cpu"), base, str(tmp_path / "w"), tokenizer_dir=str(tiny_data.tokenizer))
    rope = {"type": "llama3", "factor": 4.0, "original_max_seq_len": 16}
    raw = tiny_run_config(tiny_data, tmp_path / "r", custom_weights_path=str(tmp_path / "w"),
                          **{"model.rope_scaling": rope})
    lines: list[str] = []
    run = resolve(build_config(raw), _cpu(), until="run", log=lines.append)
    said = "RoPE scaling: llama3 × 4 of a model trained at 16 tokens (model.rope_scaling), training at a context of 64"
    assert run.plan.notes == (said + " tokens",) and lines[0].startswith(said), lines
    plain = resolve(build_config(tiny_run_config(tiny_data, tmp_path / "p")), _cpu(), until="plan", **QUIET)
    assert plain.plan.notes == ()


def test_the_plan_says_where_its_speed_comes_from(tiny_data, tmp_path):
    """Described GPUs run at the assumed MFU; the view's time is the plan's speed, and says so."""
    from lmforge.plan.estimate import plan_view

    cfg = build_config(tiny_run_config(tiny_data, tmp_path / "r", **{"compute.data_parallel": "fsdp"}))
    run = resolve(cfg, nominal_machine("h100-sxm", 2, mfu=0.25), until="plan", **QUIET)
    plan = run.plan
    assert plan.rate_source.startswith("assumed 25% of the peak, nothing measured here")
    view = plan_view(run.config, plan)
    assert view["time"]["mfu"] == pytest.approx(0.25) and view["time"]["rate_source"] == plan.rate_source
    assert view["time"]["seconds"] == pytest.approx(plan.total_tokens / plan.tokens_per_s)


@pytest.mark.integration
def test_a_cpu_plan_takes_this_machines_measured_speed(tiny_data, tmp_path, monkeypatch):
    """Where this machine has timed the run's shape (`model: auto` does), the plan, its step time and
    the report's planned training time use that speed, not an assumed MFU of the CPU's peak."""
    from lmforge.plan.estimate import run_record
    from lmforge.train.throughput import measure_tokens_per_s

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))  # this test's measurement is for no other test
    cfg = build_config(tiny_run_config(tiny_data, tmp_path / "r"))
    first = resolve(cfg, _cpu(), until="plan", **QUIET)
    assert first.plan.rate_source.startswith("assumed")
    p = first.plan
    measured = measure_tokens_per_s(first.config.model, p.context_length, p.micro_batch, precision=p.precision,
                                    optimizer=p.optimizer, steps=2, warmup=1)
    run = resolve(cfg, _cpu(), until="plan", **QUIET)
    assert run.plan.rate_source == "measured on this machine" and run.plan.tokens_per_s == pytest.approx(measured)
    assert run.plan.step_time_s == pytest.approx(run.plan.tokens_per_step / measured)
    saved = run_record(run.config, run.plan)
    assert saved["estimate"]["rate_source"] == "measured on this machine"
    assert saved["estimate"]["seconds"] == pytest.approx(run.plan.total_tokens / measured)


def test_the_dry_run_plans_with_the_prepared_samples(tiny_data, tmp_path):
    """Stage "plan" reads what is already prepared: a context longer than the samples is refused by the
    dry run and preflight as by the run, and an unset context is the samples' length."""
    raw = tiny_run_config(tiny_data, tmp_path / "r", **{"parameters.context_length": 128})
    with pytest.raises(UserError, match=r"context_length \(128\) is longer than the training data's samples \(64"):
        resolve(build_config(raw), _cpu(), until="plan", **QUIET)
    unset = tiny_run_config(tiny_data, tmp_path / "r", **{"parameters.context_length": None,
                                                           "model.max_seq_len": 256})
    assert resolve(build_config(unset), _cpu(), until="plan", **QUIET).plan.context_length == 64


def test_preflight_plans_as_the_run_does_and_knows_no_memory_model_of_its_own(tiny_data, tmp_path):
    from lmforge.runs import preflight

    big = {"d_model": 65536, "n_layers": 256, "n_heads": 512, "vocab_size": 65536, "max_seq_len": 64}
    cfg = build_config(tiny_run_config(tiny_data, tmp_path / "big", model=big))
    with pytest.raises(UserError, match=r"model does not fit: .* more than this machine's memory .*--dry-run"):
        preflight.preflight(cfg, "train", world_size=1)
    assert not (tmp_path / "big").exists()
    source = Path(preflight.__file__).read_text()
    assert "torch.cuda" not in source and "memory" not in source.split('"""', 2)[2].replace("memory verdict", "")
    family = build_config(tiny_run_config(tiny_data, tmp_path / "f", **{"model.family": "gemma2"}))
    with pytest.raises(UserError, match="model.family gemma2"):
        preflight.preflight(family, "train", world_size=1)


def test_an_epoch_of_raw_text_is_planned_once_it_is_prepared(tiny_data, tmp_path):
    """Preflight cannot know an epoch of raw text: it leaves that plan to the ranks (the dry run says why)."""
    from lmforge.plan.run import NotKnownYet
    from lmforge.runs.preflight import plan_run

    raw = tiny_run_config(tiny_data, tmp_path / "r", training_duration="1ep", train_data=str(tiny_data.raw))
    cfg = build_config(raw)
    with pytest.raises(NotKnownYet, match="epochs need the dataset size"):
        resolve(cfg, _cpu(), until="plan", **QUIET)
    plan_run(cfg, 1)  # no refusal


def test_a_warmup_of_0ba_plans_no_warmup_and_the_resolved_config_keeps_it(tiny_data, tmp_path):
    run = resolve(build_config(tiny_run_config(tiny_data, tmp_path / "r", **{"parameters.warmup": "0ba"})), _cpu(),
                  until="plan", **QUIET)
    assert run.plan.schedule.warmup == 0 and run.plan.warmup_steps == 0
    assert str(run.config.parameters.warmup) in ("0ba", "0.0ba") and run.plan.schedule.factor(0, 0.0, 1.0) == 1.0


def test_one_eta_and_one_time_formula():
    """The ETA every view shows is the training time so far scaled by what is left (`plan.cost.eta_s`),
    and a modelled speed is `mfu`'s inverse (`plan.hardware.tokens_per_s_at`): each written once."""
    from lmforge.plan.cost import eta_s
    from lmforge.plan.hardware import mfu, tokens_per_s_at

    assert eta_s(0.25, 60.0) == 180.0 and eta_s(1.0, 60.0) == 0.0 and eta_s(1.2, 60.0) == 0.0
    assert eta_s(None, 60.0) is None and eta_s(0.5, None) is None and eta_s(0.0, 10.0) is None
    rate = tokens_per_s_at(0.4, 6e9, 8, 989e12)
    assert rate == 0.4 * 8 * 989e12 / 6e9 and abs(mfu(rate, 6e9, 8, 989e12) - 0.4) < 1e-12
