"""The Trainer in-process: one `train_step`, evaluation, a checkpoint round trip, the callback
protocol. Seconds each; the end-to-end subprocess tests (test_train.py) cover the CLI and kills."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import pytest
import torch

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.data.batch import Batch, BatchStream, TrainingData
from lmforge.distributed.dist import DistInfo
from lmforge.train.callbacks import Callback
from lmforge.resolve import resolve
from lmforge.train.machine import process_machine
from lmforge.train.build import build_trainer
from lmforge.train.trainer import Trainer, TrainingDiverged

ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_trainer(tiny_data, folder, callbacks=(), **overrides) -> Trainer:
    raw = tiny_run_config(tiny_data, folder, **({"compute.async_checkpoint": False, "eval.prompts": []} | overrides))
    cfg = build_config(raw)
    return build_trainer(resolve(cfg, process_machine(ONE_RANK), log=lambda *_: None), ONE_RANK, callbacks=callbacks,
                   log=lambda *_: None)


def next_batches(trainer: Trainer, it) -> list[Batch]:
    return [next(it) for _ in range(trainer.plan.grad_accum)]


def test_data_and_streams_implement_the_protocols(tiny_data, tmp_path):
    trainer = make_trainer(tiny_data, tmp_path / "run")
    assert isinstance(trainer.data, TrainingData) and trainer.data.kind == "pretrain"
    assert isinstance(trainer.stream, BatchStream)
    batch = next(iter(trainer.stream))
    assert isinstance(batch, Batch) and batch.input_ids.shape == (4, 64)


@pytest.mark.e2e
def test_train_step_updates_the_model_and_lowers_the_loss(tiny_data, tmp_path):
    trainer = make_trainer(tiny_data, tmp_path / "run", **{"parameters.warmup": "1ba"})
    batches = next_batches(trainer, iter(trainer.stream))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    losses = [trainer.train_step(batches).loss for _ in range(8)]  # the same batch: it must be learned
    assert trainer.state.step == 8 and trainer.state.tokens == 8 * trainer.plan.tokens_per_step
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.e2e
def test_bf16_autocast_on_the_cpu_keeps_fp32_master_weights_and_learns(tiny_data, tmp_path):
    """precision bf16 (what auto picks on a CPU with AMX; the other tests pin fp32): matmuls in
    bf16, weights and optimizer moments in fp32, and the loss goes down."""
    trainer = make_trainer(tiny_data, tmp_path / "run", **{"parameters.warmup": "1ba", "parameters.precision": "bf16"})
    assert trainer.plan.precision == "bf16"
    seen = set()
    hook = trainer.model.blocks[0].attn.wq.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    batches = next_batches(trainer, iter(trainer.stream))
    losses = [trainer.train_step(batches).loss for _ in range(8)]
    hook.remove()
    assert seen == {torch.bfloat16}
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [v for opt in trainer.optimizer for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)


@pytest.mark.e2e
def test_grad_accumulation_equals_the_full_batch(tiny_data, tmp_path):
    """Micro-batch 2 × 4 accumulation steps == micro-batch 8 × 1 (the same global batch of 8)."""
    results = []
    for mb in (2, 8):
        trainer = make_trainer(tiny_data, tmp_path / f"mb{mb}", **{"parameters.micro_batch_size": mb})
        assert trainer.plan.grad_accum == 8 // mb
        it = iter(trainer.stream)
        losses = [float(trainer.train_step(next_batches(trainer, it)).loss) for _ in range(3)]
        results.append((losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    (l2, w2), (l8, w8) = results
    assert l2 == pytest.approx(l8, rel=1e-5)
    # Only the order of float sums differs; AdamW divides by sqrt(v), which magnifies that
    # difference for elements whose gradient is near zero, hence an absolute tolerance.
    for k in w2:
        torch.testing.assert_close(w2[k], w8[k], rtol=1e-4, atol=5e-5)


@pytest.mark.integration
def test_evaluate_reports_loss_perplexity_and_bits_per_byte(tiny_data, tmp_path):
    trainer = make_trainer(tiny_data, tmp_path / "run")
    metrics = trainer.evaluate()
    assert metrics["eval/loss"] > 5.0  # ≈ ln(512) at init
    assert metrics["eval/bits_per_byte"] > 0 and metrics["eval/tokens"] == 2 * 4 * 63


@pytest.mark.e2e
def test_checkpoint_round_trip_continues_bitwise(tiny_data, tmp_path):
    """Save after 3 steps; a new Trainer on the same folder resumes and its next step is the
    very step the first trainer takes next (weights, optimizer, data position, counters). With a local
    tier: step 2 to the save folder, step 3 to the local tier — the resume takes the newer, local one;
    its copy corrupted, the durable one."""
    local = {"local_checkpoints": {"folder": str(tmp_path / "local"), "interval": "1ba", "keep": 1}}
    a = make_trainer(tiny_data, tmp_path / "run", **local)
    it = iter(a.stream)
    for _ in range(2):
        a.train_step(next_batches(a, it))
    a.save()  # durable: step 2
    a.train_step(next_batches(a, it))
    a.save("local")  # local: step 3
    expected = a.train_step(next_batches(a, it))
    assert [c.name for c in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]

    b = make_trainer(tiny_data, tmp_path / "run", **local)
    assert b.resumed and b.state.step == 3
    got = b.train_step(next_batches(b, iter(b.stream)))
    assert got.loss == expected.loss and got.grad_norm == expected.grad_norm
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), k
    shard = next((tmp_path / "local" / "checkpoints" / "step_00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[::-1])  # the local copy corrupted: the durable tier covers it
    c = make_trainer(tiny_data, tmp_path / "run", **local)
    assert c.resumed and c.state.step == 2


@pytest.mark.e2e
def test_a_resume_reads_each_checkpoint_file_back_once(tiny_data, tmp_path, monkeypatch):
    """Rank 0 checks the digests of the checkpoint it resumes from; loading it does not check them
    again (on every rank that would be ranks × the checkpoint's size in reads). Files rank 0 did
    not check (another node's shards) are still checked where they are loaded."""
    from lmforge import checksums
    from lmforge.run_files import latest_checkpoint, read_state
    from lmforge.train import checkpoint as ckpt

    a = make_trainer(tiny_data, tmp_path / "run")
    it = iter(a.stream)
    for _ in range(2):
        a.train_step(next_batches(a, it))
    a.save()
    path = latest_checkpoint(str(tmp_path / "run"))
    files = ckpt.files_here(path)
    assert files and read_state(path)["files"].keys() == set(files)

    hashed: list[str] = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda p: hashed.append(os.path.basename(p)) or real(p))
    b = make_trainer(tiny_data, tmp_path / "run")
    assert b.resumed and b.state.step == 2
    assert sorted(hashed) == files  # each once: in choosing the checkpoint, not again in loading it

    rng = next(n for n in files if n.startswith("rng_rank"))
    with open(os.path.join(path, rng), "r+b") as f:  # one flipped byte, same size
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    others = [n for n in files if n != rng]
    with pytest.raises(ckpt.CorruptCheckpoint, match=rng):
        ckpt.verify_checkpoint(path, checked=others)
    hashed.clear()
    ckpt.verify_checkpoint(path, checked=files)  # all checked elsewhere: nothing is read
    assert hashed == []


@pytest.mark.integration
def test_files_hashed_in_parallel_have_their_own_digests(tmp_path):
    import hashlib

    from lmforge.checksums import file_digests, sha256_files

    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * (i * 3_000_001))  # one empty, others past a read chunk
    paths = [str(tmp_path / f"f{i}") for i in range(5)]
    want = [hashlib.sha256((tmp_path / f"f{i}").read_bytes()).hexdigest() for i in range(5)]
    assert sha256_files(paths, workers=1) == sha256_files(paths, workers=4) == want
    assert [d["sha256"] for d in file_digests(str(tmp_path), workers=3).values()] == want


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def before_resume(self, save_folder):
        self.calls.append("before_resume")

    def resume_decided(self, save_folder, resume, overwrite):
        self.calls.append(f"resume_decided:{resume}")

    def on_start(self, info):
        self.calls.append(f"start:{info.total_steps}")

    def on_metrics(self, metrics, step):
        self.calls.append(f"metrics:{step}:{'eval/loss' in metrics}")

    def on_checkpoint(self, path):
        self.calls.append(f"checkpoint:{path.rsplit('_', 1)[-1].lstrip('0')}")

    def on_end(self, status, final_dir, error=None):
        self.calls.append(f"end:{status}:{final_dir is not None}")


@pytest.mark.e2e
def test_fit_calls_the_callbacks_in_order(tiny_data, tmp_path):
    rec = Recorder()
    trainer = make_trainer(tiny_data, tmp_path / "run", [rec], training_duration="4ba", save_interval="2ba",
                           log_interval=2, **{"eval.interval": "4ba"})
    # Which part of the goodput ledger each checkpoint's time lands in (the final one too: not evaluation).
    blocked, opened = trainer.telemetry.blocked, []

    @contextmanager
    def spied(kind):
        opened.append(kind)
        try:
            with blocked(kind):
                yield
        finally:
            opened.pop()

    trainer.telemetry.blocked = spied
    rec.on_checkpoint = lambda path: rec.calls.append(f"checkpoint:{path.rsplit('_', 1)[-1].lstrip('0')}:{opened}")
    result = trainer.fit()
    assert result.status == "completed" and result.step == 4 and result.final_dir
    assert rec.calls == ["before_resume", "resume_decided:False", "start:4", "metrics:1:False", "metrics:2:False",
                         "checkpoint:2:['checkpoint']", "metrics:4:False", "metrics:4:True",
                         "checkpoint:4:['checkpoint']", "metrics:4:False", "end:completed:True"]  # (last: goodput)


@pytest.mark.e2e
def test_a_diverged_step_never_reaches_a_checkpoint(tiny_data, tmp_path, monkeypatch):
    """Losses stay on the device between log steps; with a log every 100 steps they are read
    before each checkpoint instead, so a non-finite step stops the run before a save holds it."""
    monkeypatch.setenv("LMFORGE_FAULT", "nan:step=4")  # the weights turn NaN after step 4 (docs/goodput.md)
    trainer = make_trainer(tiny_data, tmp_path / "run", training_duration="30ba", save_interval="3ba",
                           log_interval=100, **{"parameters.learning_rate": 1.0, "parameters.grad_clip": None,
                                                "parameters.warmup": "1ba"})
    with pytest.raises(TrainingDiverged) as err:
        trainer.fit()
    # The message names the value that went non-finite (the loss, or only the gradient norm while the
    # loss stayed finite), the other one with 4 significant digits, and the usual remedies with this
    # run's values.
    msg = str(err.value)
    m = re.match(r"(loss|gradient norm) became (nan|inf|-inf) at step (\d+) \((loss|gradient norm) (\S+)\)", msg)
    assert m and m.group(1) != m.group(4), msg
    other = m.group(5)
    assert other in ("nan", "inf", "-inf") or (m.group(1) == "gradient norm" and float(other) == float(f"{float(other):.4g}"))
    for remedy in ("parameters.learning_rate (1 now)", "parameters.warmup (1 step now)",
                   "parameters.grad_clip (off now)"):
        assert remedy in msg, msg
    assert "parameters.precision" not in msg  # fp32 already
    bad = int(m.group(3))
    saved = [int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*")]
    assert bad == 5 and saved == [3], (bad, saved)


def test_divergence_message_names_the_non_finite_value():
    """The case users met: a finite loss and a NaN gradient norm is not "loss became 7.62"."""
    from lmforge.train.trainer import divergence_message, divergence_remedies

    msg = divergence_message(4, 7.624619007110596, float("nan"), remedies="Try x")
    assert msg.startswith("gradient norm became nan at step 4 (loss 7.625)"), msg
    msg = divergence_message(9, float("inf"), 123456.0, remedies="Try x")
    assert msg.startswith("loss became inf at step 9 (gradient norm 1.235e+05)"), msg
    assert divergence_remedies(3e-3, 100, 1.0, "bf16").endswith(
        "parameters.grad_clip (1 now) or parameters.precision fp32 (bf16 now)")


@pytest.mark.gpu
def test_train_steps_never_wait_for_the_gpu(tiny_data, tmp_path):
    """Between log steps nothing reads the device: CUDA's sync debug mode turns any wait
    (.item(), float(), a copy to the host, a blocking copy from pageable memory) into an error."""
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    raw = tiny_run_config(tiny_data, tmp_path / "run", **{"compute.async_checkpoint": False, "eval.prompts": [],
                                                          "compute.loss_kernel": "chunked"})
    trainer = build_trainer(resolve(build_config(raw), process_machine(cuda), log=lambda *_: None), cuda, log=lambda *_: None)
    it = iter(trainer.stream)
    batches = next_batches(trainer, it)
    assert batches[0].input_ids.is_pinned()
    trainer.train_step(batches)  # the first step creates the optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [trainer.train_step(next_batches(trainer, it)) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert outs[-1].loss.is_cuda and all(torch.isfinite(o.loss) for o in outs)


@pytest.mark.integration
def test_keep_n_never_prunes_an_intact_checkpoint_for_a_damaged_one(tiny_data, tmp_path):
    """Steps 2 and 4 kept (keep 2); step 4 is damaged, so the run resumes from step 2. Its next save
    (step 3) must not prune step 2 and keep the damaged 4: the damaged one is set aside (for
    inspection) and never counts toward keep-N."""
    from lmforge.train.checkpoint import list_checkpoints

    folder = tmp_path / "run"
    small = {"eval.max_batches": 1, "eval.interval": "100ba"}
    make_trainer(tiny_data, folder, training_duration="4ba", save_interval="2ba", **small).fit()
    assert [s for s, _ in list_checkpoints(str(folder))] == [2, 4]
    shard = sorted((folder / "checkpoints" / "step_00000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    class Kept(Callback):
        seen: dict = {}
        aside: dict = {}

        def on_checkpoint(self, path):
            Kept.seen[int(path.rsplit("_", 1)[-1])] = [s for s, _ in list_checkpoints(str(folder))]
            Kept.aside[int(path.rsplit("_", 1)[-1])] = sorted(
                p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("step_00000004"))

    trainer = make_trainer(tiny_data, folder, [Kept()], training_duration="6ba", save_interval="3ba", **small)
    result = trainer.fit()
    assert result.status == "completed" and trainer.resumed
    assert Kept.seen[3] == [2, 3], Kept.seen
    # set aside while no intact checkpoint of its step or later exists; pruned once step 6 is written
    assert len(Kept.aside[3]) == 1 and Kept.aside[3][0].startswith("step_00000004.damaged"), Kept.aside
    assert Kept.aside[6] == [], Kept.aside
