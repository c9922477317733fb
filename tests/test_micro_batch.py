"""`parameters.micro_batch_size: auto` on GPUs: the micro-batch and the checkpointing mode chosen
together from the memory model, then by measured speed (`plan.micro_batch`, `train.micro_batch`)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lmforge.config.model import ModelConfig, get_preset
from lmforge.errors import UserError
from lmforge.plan.hardware import GPU_TYPES
from lmforge.plan.flops import param_counts
from lmforge.plan.layout import Sharding
from lmforge.plan.memory import MARGIN, RESERVED_BYTES, activation_bytes, fixed_bytes, usable_bytes
from lmforge.plan.micro_batch import GRANULARITIES, PROBED, candidates, choose
from train_helpers import cli

H100 = GPU_TYPES["h100-sxm"]
LLAMA_3B = get_preset("llama-3b").model_copy(update={"vocab_size": 32000})
LLAMA_8B = ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
                       max_seq_len=8192)


def _choose(cfg=LLAMA_3B, seq=2048, n=1, dp="fsdp", **kw):
    return choose(cfg, seq, sharding=Sharding(dp, n), gpu_memory=H100.memory_bytes, peak_flops=H100.bf16,
                  where=f"{n} × h100", **kw)


MODES = (False, "selective", 2, "full")


def test_each_checkpointing_mode_keeps_less():
    none, selective, every2, full = (activation_bytes(LLAMA_3B, 2048, m) for m in MODES)
    assert none > max(selective, every2) and min(selective, every2) > full > 0
    assert activation_bytes(LLAMA_3B, 2048, "auto") == none  # unresolved auto: no checkpointing
    assert activation_bytes(LLAMA_3B, 2048, 64) == none  # every 64th of 28 blocks: none of them
    assert activation_bytes(LLAMA_3B, 2048, True) == full
    first = [activation_bytes(LLAMA_3B, 2048, {"granularity": "block", "layers": f"first-{n}"}) for n in (1, 14, 28)]
    assert none > first[0] > first[1] > first[2] == full  # the fewer blocks recomputed, the more kept


def _granularity(c) -> str | None:
    """A candidate's checkpointing granularity (block for full and every-N)."""
    value = c.checkpointing
    if value is False:
        return None
    return value["granularity"] if isinstance(value, dict) else "block" if value in ("full", True) or \
        isinstance(value, int) else value


def test_auto_takes_the_fastest_candidate_that_fits():
    choice = _choose()
    usable = usable_bytes(H100.memory_bytes)
    grains = {_granularity(c) for c in choice.candidates}
    assert grains <= {None, *GRANULARITIES} and len(grains) == len(choice.candidates) >= 4  # one per option
    assert all(c.bytes_per_gpu <= usable for c in choice.candidates)
    by_mode = {_granularity(c): c for c in choice.candidates}
    # Each option checkpoints only the leading blocks its micro-batch needs: never more than every block.
    assert by_mode["block"].micro_batch >= by_mode[None].micro_batch >= 1
    assert (choice.micro_batch, choice.checkpointing) == (choice.best.micro_batch, choice.best.checkpointing)
    assert choice.best.modelled_tokens_per_s >= max(c.modelled_tokens_per_s for c in choice.candidates) * 0.98
    assert not choice.measured and "modelled" in choice.reason and "\n" not in choice.reason
    # Where memory leaves room for one short sequence without checkpointing (1,024 GEMM rows),
    # a checkpointing mode's larger micro-batch wins despite its recompute.
    fixed = fixed_bytes(param_counts(LLAMA_3B)["total"], LLAMA_3B, Sharding("fsdp", 1))
    tight = (fixed + 1.5 * activation_bytes(LLAMA_3B, 1024, False) + RESERVED_BYTES) / (1 - MARGIN)
    choice = choose(LLAMA_3B, 1024, sharding=Sharding("fsdp", 1), gpu_memory=tight, peak_flops=H100.bf16,
                    where="1 × h100")
    assert {_granularity(c): c.micro_batch for c in choice.candidates}[None] == 1
    assert choice.checkpointing is not False and choice.micro_batch > 1, choice.reason


def test_ddp_replicas_leave_room_for_their_gradient_buckets():
    """Several DDP replicas hold fp32 gradient buckets (4 B per parameter) beside their whole
    states: every candidate's footprint counts them, as `lmforge estimate`'s verdict does."""
    alone = _choose()
    params = param_counts(LLAMA_3B)["total"]
    for c in alone.candidates:  # the same option and micro-batch on 8 replicas: 4 B per parameter more, or no fit
        same = dict(checkpointing=c.checkpointing, micro_batch=c.micro_batch, compression=c.compression)
        replicated = candidates(LLAMA_3B, 2048, sharding=Sharding("ddp", 8), gpu_memory=H100.memory_bytes,
                                peak_flops=H100.bf16, **same)
        assert all(r.bytes_per_gpu == c.bytes_per_gpu + 4 * params for r in replicated)
        assert replicated or c.bytes_per_gpu + 4 * params > usable_bytes(H100.memory_bytes)
    assert fixed_bytes(params, LLAMA_3B, Sharding("ddp", 8)) - fixed_bytes(params, LLAMA_3B, Sharding("ddp", 1)) \
        == 4 * params  # one process is not wrapped in DDP


def test_a_probe_decides_among_the_models_first_candidates():
    ranked = [c.checkpointing for c in _choose().candidates]
    timed = []

    def probe(c):  # as if the GPU ran the model's third choice fastest, the rest at the model's rate
        timed.append(c.label)
        return c.modelled_tokens_per_s * (3.0 if c.checkpointing == ranked[PROBED - 1] else 1.0)

    choice = _choose(measure=probe, measured_as="measured here")
    assert len(timed) == PROBED
    assert choice.checkpointing == ranked[PROBED - 1] and choice.measured and "measured here" in choice.reason
    # a candidate the probe cannot run (out of memory) is never chosen
    choice = _choose(measure=lambda c: None if c.checkpointing == ranked[0] else c.modelled_tokens_per_s)
    assert choice.checkpointing != ranked[0]


def test_what_the_config_sets_is_kept():
    assert {c.checkpointing for c in _choose(checkpointing="full").candidates} == {"full"}
    mlp = {"granularity": "mlp", "layers": "range(2,6)"}
    assert [c.checkpointing for c in _choose(checkpointing=mlp).candidates] == [mlp]
    assert {c.compression for c in _choose(compression="int8").candidates} == {"int8"}
    assert all(c.micro_batch == 1 for c in _choose(micro_batch=1).candidates)
    assert all(12 % c.micro_batch == 0 for c in _choose(per_rank=12).candidates)  # divides the rank's batch


def test_nothing_fits_says_the_smallest_footprint_and_the_remedy():
    with pytest.raises(UserError, match=r"nothing fits on 1 × h100: the smallest footprint, micro-batch 1 with full "
                                        r"checkpointing, needs .* GB per GPU .*use at least \d+ GPUs"):
        _choose(LLAMA_8B)
    with pytest.raises(UserError, match=r"set compute.activation_checkpointing: (selective|full) \("):
        _choose(checkpointing=False, seq=16384)


def test_estimate_shows_the_choice_without_a_gpu():
    from lmforge.plan.estimate import EstimateInputs, estimate_run, format_plan

    plan = estimate_run(EstimateInputs(LLAMA_3B, 1e9, gpus=1, gpu_type="h100-sxm", seq_len=2048, micro_batch="auto",
                                       data_parallel="fsdp"))
    choice = choose(LLAMA_3B, 2048, sharding=Sharding("fsdp", 1), gpu_memory=H100.memory_bytes,
                    peak_flops=H100.bf16, where="1 × h100-sxm")
    assert plan["memory"]["micro_batch"] == choice.micro_batch
    assert plan["memory"]["activation_checkpointing"] == choice.checkpointing and plan["memory"]["fits"]
    assert plan["micro_batch_choice"] == choice.reason and choice.reason in format_plan(plan)


def test_estimate_cli_micro_batch_auto():
    proc = cli("estimate", "--model", "llama-3b", "--gpu-type", "h100-sxm", "--gpus", "1", "--seq-len", "2048",
               "--micro-batch", "auto", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["micro_batch_choice"].startswith("parameters.micro_batch_size: auto → ")
    proc = cli("estimate", "--model", "llama-3b", "--micro-batch", "many")
    assert proc.returncode == 2 and "expected a positive integer or auto" in proc.stderr


def test_a_cpu_run_keeps_todays_rule():
    from lmforge.config.schema import RunConfig
    from lmforge.plan.run import micro_batch_and_checkpointing
    from lmforge.train.machine import local_machine

    cpu = local_machine(torch.device("cpu"))
    cfg = RunConfig.model_validate({"model": "llama-tiny", "train_data": "data",
                                    "training_duration": "10ba"})
    chosen = micro_batch_and_checkpointing(cfg, 64, 24, cpu, "fp32")
    assert (chosen.micro_batch, chosen.checkpointing, chosen.reason) == (8, False, None) and chosen.memory["fits"]
    cfg = cfg.model_copy(update={"compute": cfg.compute.model_copy(update={"activation_checkpointing": "selective"})})
    chosen = micro_batch_and_checkpointing(cfg, 64, 12, cpu, "fp32")
    assert (chosen.micro_batch, chosen.checkpointing) == (6, "selective")


def test_a_described_gpu_machine_models_its_choice():
    """`--dry-run` planned for GPUs that are only described: the choice is modelled, said in one line,
    and written into the resolved config's compute.activation_checkpointing."""
    from lmforge.config.schema import RunConfig
    from lmforge.plan.machine import nominal_machine
    from lmforge.plan.run import make_plan, resolved_config

    cfg = RunConfig.model_validate({"model": {"preset": "llama-3b", "vocab_size": 32000}, "train_data": "data",
                                    "training_duration": "100ba",
                                    "parameters": {"global_batch_size": 16, "context_length": 2048}})
    plan = make_plan(cfg, nominal_machine("h100-sxm", 1), samples_per_epoch=None, data_seq_len=None)
    assert plan.micro_batch_reason.startswith("parameters.micro_batch_size: auto → ")
    assert "modelled" in plan.micro_batch_reason and 16 % plan.micro_batch == 0
    assert resolved_config(cfg, plan).compute.activation_checkpointing == plan.activation_checkpointing


@pytest.mark.integration
def test_the_probe_times_a_slice_and_caches_it():
    """The probe's real path on the CPU (the GPU runs the same code compiled): a slice of the
    model, forward + backward, scaled to the whole model; a second call reads the cache."""
    from lmforge.home import cache_dir
    from lmforge.train.micro_batch import probe_tokens_per_s

    cfg = ModelConfig(d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64)
    first = probe_tokens_per_s(cfg, 64, 2, "selective", precision="fp32", compile_=False, device="cpu", layers=2,
                               steps=2, warmup=1)
    assert first > 0
    folder = cache_dir("micro-batch")
    (record,) = [json.load(open(os.path.join(folder, f))) for f in os.listdir(folder)]
    assert record["layers"] == 2 and record["slice_tokens_per_s"] > first  # 6 blocks do more work than 2
    assert probe_tokens_per_s(cfg, 64, 2, "selective", precision="fp32", compile_=False, device="cpu", layers=2,
                              steps=2, warmup=1) == first


@pytest.mark.gpu
def test_a_gpu_run_probes_its_candidates():
    """On CUDA: the candidates are timed (bf16; eager here, to keep the test short: a run compiles
    them as it will train) and the choice says it was measured."""
    from lmforge.config.schema import RunConfig
    from lmforge.plan.run import micro_batch_and_checkpointing
    from lmforge.train.machine import local_machine

    cfg = RunConfig.model_validate({"model": {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                              "ffn_hidden": 512, "vocab_size": 512, "max_seq_len": 512},
                                    "train_data": "data", "training_duration": "10ba", "compute": {"compile": False}})
    chosen = micro_batch_and_checkpointing(cfg, 512, 64, local_machine(torch.device("cuda")), "bf16")
    assert "measured" in chosen.reason and 64 % chosen.micro_batch == 0, chosen.reason
    assert torch.cuda.memory_allocated() < 2**30  # the probe's models are gone


def _on_main_worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as td

    from lmforge.distributed.dist import DistInfo
    from lmforge.errors import PeerUserError, UserError
    from lmforge.train.machine import LocalProbe

    td.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    probe = LocalProbe(torch.device("cpu"), DistInfo(rank=rank, world_size=2, local_rank=rank,
                                                     device=torch.device("cpu")))
    seen = []
    for fail in (None, UserError("bad data"), RuntimeError("kernel failed")):
        def fn():
            if fail is not None:
                raise fail
            return 42
        try:
            seen.append(probe.on_main(fn))
        except (UserError, PeerUserError, RuntimeError) as e:
            seen.append(f"{type(e).__name__}: {e}")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)
    td.destroy_process_group()


@pytest.mark.integration
def test_what_rank_0_decides_or_fails_at_reaches_every_rank(tmp_path):
    """`LocalProbe.on_main` on 2 gloo ranks: rank 0's result, its bad-input line, and any other
    failure reach rank 1 (which would otherwise wait at the broadcast until the timeout)."""
    import torch.multiprocessing as mp

    mp.spawn(_on_main_worker, args=(f"file://{tmp_path}/store", str(tmp_path / "seen")), nprocs=2)
    zero, one = (json.loads((tmp_path / f"seen.{r}").read_text()) for r in (0, 1))
    assert zero == [42, "UserError: bad data", "RuntimeError: kernel failed"]
    assert one[0] == 42 and one[1] == "PeerUserError: bad data"
    assert one[2].startswith("RuntimeError: rank 0 failed") and "kernel failed" in one[2]
