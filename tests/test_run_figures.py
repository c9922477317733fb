"""The figures a user steers by, each recomputed from the run's own files (metrics.jsonl, the goodput
ledger, checkpoints, the exported folder, the prepared dataset's shards) or by an independent rule —
never from the code that printed it: throughput without evaluation, the last step shown, one final
evaluation, the plan's parameter count, the exported context, the estimate's communication and
batch, the data-parallel mode every view names, the dataset's counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.config.model import ModelConfig, as_trained
from lmforge.goodput.ledger import account, read_ledger
from lmforge.run_files import MODEL_CONFIG_FILE, latest_checkpoint, read_state
from lmforge.plan.comm import BF16, FP32, OVERLAP
from lmforge.plan.evaluation import DEFAULT_EVAL_BATCHES, EVAL_SHARE, plan_evaluation
from lmforge.plan.machine import nominal_machine
from lmforge.resolve import resolve
from train_helpers import cli, metrics

QUIET = {"log": lambda *_: None}


# --------------------------------------------------------------------------- throughput and the last step

def harmonic_rate(records: list[dict], start_tokens: float = 0.0) -> tuple[float, float]:
    """(tokens, seconds) the logged throughput implies: each log interval's tokens over its rate."""
    tokens, seconds, last = 0.0, 0.0, start_tokens
    for r in records:
        done = r["train/tokens"] - last
        tokens, seconds, last = tokens + done, seconds + done / r["throughput/tokens_per_s"], r["train/tokens"]
    return tokens, seconds


def assert_throughput_is_the_steps_own(folder) -> None:
    """tokens/s as logged, against tokens ÷ the ledger's step time (the goodput split: evaluation,
    checkpoints and generations apart): within 10%."""
    train = [r for r in metrics(folder) if "throughput/tokens_per_s" in r]
    acc = account(read_ledger(str(folder)))
    assert acc is not None and not acc["resumptions"]
    tokens, seconds = harmonic_rate(train)
    assert tokens == train[-1]["train/tokens"]
    assert tokens / seconds == pytest.approx(tokens / acc["parts"]["productive"], rel=0.10), (acc, train)
    assert acc["parts"]["evaluation"] > 0  # there was evaluation to leave out


@pytest.mark.integration
def test_logged_throughput_leaves_evaluation_out(finished_runs):
    """The session's finished runs evaluate at steps 4 and 8 (generations too): a step after an
    evaluation used to report a rate with the evaluation's time in it."""
    for run in finished_runs:
        assert_throughput_is_the_steps_own(run.folder)


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory, tiny_data):
    """A tiny run bounded by wall-clock time, as the quickstart is, that evaluates after every step
    and logs only its first and last: its budget runs out during an evaluation. Trained at a context
    of 32 on a model built for 64, with the tokenizer its prepared data was made with (no
    `tokenizer:` key)."""
    from lmforge.runs.job import run_job

    folder = tmp_path_factory.mktemp("timed") / "run"
    raw = tiny_run_config(tiny_data, folder, name="timed-run", training_duration="6s", log_interval=1000,
                          save_interval="1000ba", **{"eval.interval": "1ba", "eval.max_batches": 4,
                                                     "parameters.context_length": 32,
                                                     "experiment_tracker.console": True})
    raw.pop("tokenizer")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run_job(build_config(raw), log=print)
    assert result.status == "completed", out.getvalue()[-3000:]
    return raw, folder, result, out.getvalue()


@pytest.mark.integration
def test_a_timed_run_logs_its_last_step_and_evaluates_it_once(timed_run):
    raw, folder, result, out = timed_run
    records = metrics(folder)
    train = [r for r in records if "train/loss" in r]
    state = read_state(latest_checkpoint(str(folder)))
    assert train[-1]["step"] == result.step == state["step"] > 1  # the registry and the report end here
    assert train[-1]["train/progress"] == 1.0 and train[-1]["train/tokens"] == state["tokens"]
    evals = [r["step"] for r in records if "eval/loss" in r]
    assert evals[-1] == result.step and len(evals) == len(set(evals))  # one evaluation per step, the last once
    assert out.count(f"--- generation_0 at step {result.step} ---") == 1
    assert_throughput_is_the_steps_own(folder)


# --------------------------------------------------------------------------- the model planned and exported

@pytest.mark.integration
def test_the_dry_run_plans_the_model_that_trained(timed_run):
    """With no `tokenizer:` the run takes its prepared data's; the dry run's plan must too (it
    assumed a 32,000-token vocabulary: 12.9M parameters planned for a 5.0M model)."""
    from lmforge.train.machine import planned_machine

    raw, folder, result, _ = timed_run
    cfg = build_config(raw)
    planned = resolve(cfg, planned_machine(cfg.compute, measure=False), until="plan", **QUIET).plan
    with safe_open(str(folder / "final" / "model.safetensors"), "pt") as f:
        trained = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    tied = ModelConfig(**json.loads((folder / "final" / MODEL_CONFIG_FILE).read_text())).tie_embeddings
    assert tied is False and planned.params["total"] == trained


@pytest.mark.integration
def test_the_export_says_the_context_it_was_trained_at(timed_run, tmp_path):
    """`max_position_embeddings` is the context of the run's checkpoint (32), not the model's 64:
    lm-eval and vLLM would otherwise score past what it learned."""
    raw, folder, result, _ = timed_run
    checkpoint = latest_checkpoint(str(folder))
    state = read_state(checkpoint)
    trained_at = state["config"]["parameters"]["context_length"]
    assert trained_at == 32 < state["config"]["model"]["max_seq_len"] == 64 and state["step"] == result.step
    for source in (folder / "final", Path(checkpoint)):
        out = tmp_path / source.name
        cli("export", "--checkpoint", source, "--out", out, check=True)
        assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == trained_at, source


def test_weights_continued_from_keep_their_length():
    base = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=64)
    assert as_trained(base, 32, from_scratch=True).max_seq_len == 32
    assert as_trained(base, 32, from_scratch=False).max_seq_len == 64  # fine-tuning a longer model
    assert as_trained(base, 128, from_scratch=True).max_seq_len == 64  # (longer: built for it at resolution)


# --------------------------------------------------------------------------- evaluation sized to the run

EVAL = dict(eval_sets=1, micro_batch=8, context=256, replicas=1, tokens_per_s=1290.0, generated_tokens=3 * 48,
            n_layers=4, rate_source="measured")


def test_evaluation_left_unset_fits_its_share_of_the_run():
    """The quickstart at 60 s: it evaluated at every step (57 s of 79); now at most EVAL_SHARE of the
    run, the final evaluation always, each evaluation's cost recomputed here by hand."""
    forward = 8 * 256 / 1290.0 / 3  # a held-out batch: a forward pass, a third of a training step's work
    generate = 3 * 48 * 4 * 0.0005
    for seconds, nominal in ((60.0, 9), (180.0, 28), (3600.0, 560)):
        e = plan_evaluation(interval=None, batches=None, nominal_steps=nominal, run_seconds=seconds, **EVAL)
        assert e.seconds == pytest.approx(e.batches * forward + generate)
        assert e.evals * e.seconds <= EVAL_SHARE * seconds and e.evals >= 1
        assert e.evals == (nominal - 1) // e.interval + 1
        assert f"{e.evals} × {e.batches} held-out batch(es)" in e.line
    short = plan_evaluation(interval=None, batches=None, nominal_steps=9, run_seconds=60.0, **EVAL)
    assert (short.interval, short.evals) == (9, 1) and short.batches < DEFAULT_EVAL_BATCHES  # the end only
    long = plan_evaluation(interval=None, batches=None, nominal_steps=560, run_seconds=3600.0, **EVAL)
    assert (long.batches, long.evals) == (DEFAULT_EVAL_BATCHES, 10)


def test_evaluation_values_the_user_set_are_kept():
    given = plan_evaluation(interval=1, batches=8, nominal_steps=9, run_seconds=60.0, **EVAL)
    assert (given.interval, given.batches, given.evals) == (1, 8, 9) and given.share > EVAL_SHARE  # said, not changed
    every = plan_evaluation(interval=3, batches=None, nominal_steps=9, run_seconds=60.0, **EVAL)
    assert every.interval == 3 and every.evals * every.seconds <= EVAL_SHARE * 60 + every.seconds  # batches sized


def test_the_plan_writes_its_evaluation_into_the_resolved_config(tiny_data, tmp_path):
    raw = tiny_run_config(tiny_data, tmp_path / "r", training_duration="200ba")
    for key in ("interval", "max_batches"):
        raw["eval"].pop(key)
    run = resolve(build_config(raw), nominal_machine("h100-sxm", 1), until="plan", **QUIET)
    assert run.config.eval.interval.value == run.plan.eval_interval and run.config.eval.max_batches == \
        run.plan.eval_batches == run.plan.evaluation.batches
    assert run.plan.evaluation.line.startswith("evaluation: "), run.plan.evaluation.line


# --------------------------------------------------------------------------- the estimate's communication and batch

def _estimate(*args):
    proc = cli("estimate", "--json", *args, check=True)
    return json.loads(proc.stdout)


def test_the_estimate_adds_the_communication_it_cannot_hide():
    """moe-73b on 384 nodes of 8 H100s: FSDP's gathers over the network cost more than the
    compute; expert parallelism trades most of them for an all-to-all within a node, and the two
    estimates differ where their traffic does (14.7 days either way before)."""
    base = ("--model", "moe-73b", "--tokens", "12T", "--gpus", "8", "--nodes", "384")
    plain, ep = _estimate(*base), _estimate(*base, "--expert-parallel", "8")
    for view in (plain, ep):
        comm = view["communication"]
        hidden = sum(c["seconds"] for c in comm["collectives"] if c["hidden"])
        exposed = max(0.0, hidden - OVERLAP * comm["compute_s"]) + sum(
            c["seconds"] for c in comm["collectives"] if not c["hidden"])
        assert comm["exposed_s"] == pytest.approx(exposed) and comm["step_s"] == pytest.approx(
            comm["compute_s"] + exposed)
        tokens_per_step = view["batch"]["global_batch"] * view["batch"]["context_length"]
        assert view["time"]["tokens_per_second"] == pytest.approx(tokens_per_step / comm["step_s"])
    params = plain["params"]["total"]
    gather = next(c for c in plain["communication"]["collectives"] if c["what"] == "FSDP all-gather")
    assert gather["bytes"] == pytest.approx(2 * BF16 * params * 3071 / 3072) and gather["network"]
    assert gather["seconds"] == pytest.approx(gather["bytes"] / 50e9)
    scatter = next(c for c in plain["communication"]["collectives"] if c["what"] == "FSDP reduce-scatter")
    assert scatter["bytes"] == pytest.approx(FP32 * params * 3071 / 3072)
    assert "expert all-to-all" in {c["what"] for c in ep["communication"]["collectives"]}
    assert plain["time"]["days"] > 2 * ep["time"]["days"]


def test_the_estimate_names_a_batch_other_than_asked():
    """The README's rule gives 4M tokens per step above 20B parameters; 3,072 replicas of one row of
    4,096 tokens each are 12.6M: said, with why."""
    view = _estimate("--model", "moe-73b", "--tokens", "12T", "--gpus", "8", "--nodes", "384")
    b = view["batch"]
    assert b["global_batch"] * b["context_length"] == 3072 * 4096 != 4 * 2 ** 20
    line = next(n for n in view["notes"] if n.startswith("batch "))
    assert "raised to 12.6M tokens per step (3,072 × 4,096) from the 4.19M" in line
    assert "4.19M tokens per step for models of above 20B non-embedding parameters" in line
    assert "each of the 3,072 data-parallel replicas" in line
    asked = _estimate("--model", "llama-7b", "--tokens", "1T", "--gpus", "8", "--nodes", "16")
    assert not any(n.startswith("batch ") for n in asked["notes"])  # 2M = 512 × 4,096 on 128 replicas: as asked


# --------------------------------------------------------------------------- one data-parallel mode everywhere

def test_estimate_dry_run_and_train_resolve_one_data_parallel_mode(tiny_data, tmp_path):
    """`auto` (the default of every command) is resolved once, by the planner, into the resolved
    config and the layout; `estimate` shows the same mode."""
    raw = tiny_run_config(tiny_data, tmp_path / "r", **{"parameters.global_batch_size": 32})
    assert build_config(raw).compute.data_parallel == "auto"
    for machine, mode in ((nominal_machine("h100-sxm", 1), "none"), (nominal_machine("h100-sxm", 8), "ddp"),
                          (nominal_machine("cpu", 2), "ddp")):
        run = resolve(build_config(raw), machine, until="plan", **QUIET)
        assert run.plan.layout.data_parallel == run.config.compute.data_parallel == mode, machine.where
    for args, mode in ((("--model", "llama-7b", "--gpus", "8"), "fsdp"), (("--model", "llama-125m", "--gpus", "8"), "ddp"),
                       (("--model", "llama-7b", "--gpus", "8", "--nodes", "2"), "hsdp")):
        assert _estimate(*args, "--tokens", "1B")["memory"]["data_parallel"] == mode, args


def test_a_verdict_under_ddp_never_asks_for_more_gpus_alone():
    """More GPUs do not help a replicated model: the long-context line names sharding."""
    text = cli("estimate", "--model", "llama-7b", "--tokens", "1B", "--gpus", "8", "--data-parallel", "ddp",
               "--seq-len", "131072").stdout
    line = text[text.index("long context"):text.index("fits  ")]
    assert "under ddp" in line and "--data-parallel fsdp" in line and "needs at least" not in line


# --------------------------------------------------------------------------- the dataset's counts

@pytest.mark.integration  # (the statistics load fastText's language model, as test_curate's do)
def test_data_stats_counts_as_the_dataset_card_does(tiny_data):
    """`data stats` of a prepared dataset says the documents and tokens its marker (the card) says,
    and what its samples hold of them — recounted here from the shards."""
    import numpy as np

    from lmforge.data.prepare.stats import corpus_stats, stat_rows
    from lmforge.data.mds import MDSReader
    from lmforge.data.prepare.prepare import read_summary

    card = read_summary(str(tiny_data.dataset))
    split = card["splits"]["train"]
    stats = corpus_stats([str(tiny_data.dataset)])
    assert (stats["documents"], stats["tokens"]) == (split["documents"], split["tokens"])
    reader = MDSReader(str(tiny_data.dataset / "train"))
    flat = np.concatenate([reader.get_tokens(i) for i in range(len(reader))])
    ends = np.flatnonzero(flat == card["tokenizer"]["eos_id"])
    packed = stats["in_samples"]
    assert packed["stored_tokens"] == len(flat) == split["samples"] * card["args"]["seq_len"]
    assert packed["documents"] == len(ends) and packed["tokens"] == ends[-1] + 1
    assert packed["stored_tokens"] + split["dropped_tokens"] == split["tokens"]
    assert ("whole documents in the samples", f"{len(ends):,}") in stat_rows(stats)


def test_per_core_throughput_counts_the_cores_used(tiny_data):
    """The prepared dataset's marker: tokens per CPU-second the work used, not per core of the machine."""
    from lmforge.data.prepare.prepare import read_summary

    card = read_summary(str(tiny_data.dataset))
    said = re.search(r"([\d,]+) tokens/s per core \(([\d.]+) of (\d+) cores busy on average: ([\d.,]+) CPU-seconds\)",
                     card["throughput"])
    assert said, card["throughput"]
    per_core = card["tokens_per_second"] * card["seconds"] / card["cpu_seconds"]
    assert float(said[1].replace(",", "")) == pytest.approx(per_core, rel=0.01)
    assert float(said[2]) == pytest.approx(card["cpu_seconds"] / card["seconds"], rel=0.05)


def test_runs_list_names_the_shape_model_auto_chose():
    from lmforge.runs.progress import resolved_model_label

    record = {"identity": {}, "config": {"model": {"d_model": 128, "n_layers": 4}}}
    assert resolved_model_label(record, auto=True) == "auto 4×128"
    assert resolved_model_label({"config": {"model": {"preset": "llama-1b", "d_model": 2048}}}, auto=False) == "llama-1b"
    assert resolved_model_label(None, auto=True) is None


def test_rows_say_packed_only_where_items_share_a_row():
    from lmforge.data.rows.sft import packing_note

    assert packing_note(240, 240, True, "pair") == " (one pair a row: sft.packing is on, but no two fit in one)"
    assert packing_note(240, 100, True, "pair") == " (packed: 2.4 pairs a row)"
    assert packing_note(240, 240, False, "pair") == ""
