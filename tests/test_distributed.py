"""Scale-out on CPU: FSDP2/DDP over real gloo ranks started by real torchrun, resharding resume,
activation checkpointing, two "nodes" on one machine, elastic restarts, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_run_config
from train_helpers import REPO, assert_one_line_error, env, final_weights, lmforge, train_losses, write_config


def run(tmp_path, tiny_data, name, **overrides):
    folder = tmp_path / name
    base = {"eval.prompts": [], "eval.interval": "100ba"}
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_run_config(tiny_data, folder, **(base | overrides)))
    return cfg, folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_two_ranks_match_single_process(tmp_path, tiny_data):
    """FSDP2 over 2 gloo ranks (sharded meta-device init, gradient accumulation, clipping,
    generation in lockstep, gathered export) follows the single-process run with the same global
    batch. Tolerance: the same math, only the order of float sums differs (reduce-scatter
    averages the two ranks' gradients), ~1e-6 relative per step, compounding over 4 steps."""
    common = {"training_duration": "4ba", "parameters.micro_batch_size": 2,  # 2 accumulation steps per rank
              "eval.prompts": ["def main("], "eval.interval": "2ba"}
    single_cfg, single = run(tmp_path, tiny_data, "single", **common)
    lmforge("train", "-f", single_cfg, check=True)
    fsdp_cfg, fsdp = run(tmp_path, tiny_data, "fsdp", **common, **{"compute.ranks": 2, "compute.data_parallel": "fsdp"})
    proc = lmforge("train", "-f", fsdp_cfg, "--json", check=True)
    a, b = train_losses(single), train_losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step
    wa, wb = final_weights(single), final_weights(fsdp)  # the export gathered the full weights
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["generations"][0].startswith("def main(")
    # checkpoints hold one shard file per rank
    ckpt = fsdp / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_checkpoint_from_two_ranks_resumes_on_one_and_two(tmp_path, tiny_data):
    """An (async) FSDP checkpoint written by 2 ranks at step 3 resumes on 2 ranks and on 1 rank
    (DCP reshards; the data stream continues at the same global sample) with the same next-step
    loss as the uninterrupted run. Tolerance as above: only reduction order differs."""
    common = {"training_duration": "5ba", "save_interval": "3ba", "compute.data_parallel": "fsdp"}
    ref_cfg, ref = run(tmp_path, tiny_data, "ref", **common, **{"compute.ranks": 2})
    lmforge("train", "-f", ref_cfg, check=True)
    expected = train_losses(ref)
    for ranks in (2, 1):
        cfg, folder = run(tmp_path, tiny_data, f"resume{ranks}", **common, **{"compute.ranks": ranks})
        folder.mkdir()
        shutil.copy(ref / "run.json", folder / "run.json")
        shutil.copytree(ref / "checkpoints" / "step_00000003", folder / "checkpoints" / "step_00000003")
        proc = lmforge("train", "-f", cfg, check=True)
        assert "resume: continuing from" in proc.stdout and "(step 3," in proc.stdout
        if ranks == 1:
            assert "written by 2 rank(s), resharded onto 1" in proc.stdout
        got = train_losses(folder)
        assert sorted(got) == [4, 5]
        for step in (4, 5):
            assert got[step] == pytest.approx(expected[step], rel=1e-4), (ranks, step)


def test_activation_checkpointing_changes_memory_not_results(tmp_path):
    """In-process on a tiny model: every mode gives the same loss and gradients as no
    checkpointing (recomputation is the same float math, so equality is exact on CPU) while
    the activations kept for backward shrink (measured with saved-tensor hooks, which see what
    autograd stores outside checkpointed regions). Selective keeps matmul outputs inside the
    region, so backward recomputes no matmul there, unlike full (counted with a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmforge.config.model import resolve_model
    from lmforge.config.schema import ComputeConfig
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import parallelize
    from lmforge.models import build_model

    shape = resolve_model({"d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                           "max_seq_len": 64, "vocab_size": 256})
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    class CountMatmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.n += 1
            return func(*args, **(kwargs or {}))

    def measure(mode):
        torch.manual_seed(0)
        model = build_model(shape)
        parallelize(model, ComputeConfig(activation_checkpointing=mode, data_parallel="none"), one)
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(batch).float().logsumexp(-1).mean()
        with CountMatmuls() as counter:
            loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()], sum(saved), counter.n

    base_loss, base_grads, base_bytes, base_mm = measure(False)
    sizes, mms = {}, {}
    for mode in (True, "full", "selective", 2):
        loss, grads, sizes[mode], mms[mode] = measure(mode)
        assert loss == base_loss, mode
        for g, h in zip(grads, base_grads):
            torch.testing.assert_close(g, h, rtol=0, atol=0)
    assert sizes[True] == sizes["full"] < sizes[2] < base_bytes, sizes
    assert sizes["selective"] < base_bytes, sizes
    assert base_mm == mms["selective"] < mms[2] < mms["full"], (base_mm, mms)


def test_two_nodes_on_one_machine_train_together(tmp_path, tiny_data):
    """Two `lmforge train` processes as two "nodes" (torchrun --nnodes 2, c10d rendezvous on
    127.0.0.1), one rank each, DDP: one 2-rank run, same losses as a single process."""
    single_cfg, single = run(tmp_path, tiny_data, "single", training_duration="3ba")
    lmforge("train", "-f", single_cfg, check=True)
    cfg, folder = run(tmp_path, tiny_data, "nodes", training_duration="3ba",
                      **{"compute.nodes": 2, "compute.rdzv_endpoint": f"127.0.0.1:{free_port()}",
                         "compute.rdzv_timeout_s": 60})
    procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--node-rank", str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out[-2000:], err[-3000:])
    assert any("2 rank(s)" in out for out, _ in outs)
    a, b = train_losses(single), train_losses(folder)
    assert sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step


def _descendants(pid: int) -> list[int]:
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _worker_with_rank(pid: int, rank: int) -> int | None:
    for d in _descendants(pid):
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                envs = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in envs and b"TORCHELASTIC_RESTART_COUNT=0" in envs:
            return d
    return None


def test_killed_worker_is_restarted_and_training_completes(tmp_path, tiny_data):
    """SIGKILL one of two DDP workers mid-run: torchelastic (max_retries 1 → --max-restarts 1)
    restarts both, they resume from the latest complete checkpoint and finish; the restart is
    logged and recorded in events.jsonl; the losses equal the uninterrupted run's."""
    common = {"training_duration": "10ba", "save_interval": "2ba", "compute.ranks": 2, "max_retries": 1}
    ref_cfg, ref = run(tmp_path, tiny_data, "ref", **common)
    lmforge("train", "-f", ref_cfg, check=True)
    cfg, folder = run(tmp_path, tiny_data, "victim", **common)
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    deadline = time.time() + 180
    while not list((folder / "checkpoints").glob("step_*")) or max(train_losses(folder), default=0) < 5:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    victim = _worker_with_rank(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "elastic: workers restarted after a failure (restart 1" in out
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["event"] == "elastic_restart"]
    assert len(restart) == 1 and restart[0]["step"] >= 2 and restart[0]["resumed_from"]
    assert (folder / "final" / "model.safetensors").exists()
    expected, got = train_losses(ref), train_losses(folder)
    assert sorted(got) == list(range(1, 11))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.parametrize("sets,needles", [
    (["compute.ranks=2", "compute.data_parallel=hsdp", "compute.shard_size=3"],
     ["compute.shard_size: 3 does not divide the 2 ranks"]),
    (["compute.ranks=4", "compute.data_parallel=fsdp", "compute.shard_size=3"],
     ["compute.shard_size: 3 is for data_parallel: hsdp"]),
    (["compute.device=cuda", "compute.gpus=2"], ["compute.gpus: 2 GPUs requested but only 0 present"]),
    (["compute.nodes=2"], ["compute.nodes: 2 nodes need compute.rdzv_endpoint"]),
    (["compute.nodes=2", "compute.rdzv_endpoint=nohost"], ["is not HOST:PORT"]),
    (["compute.activation_checkpointing=0"], ["activation_checkpointing"]),
])
def test_bad_scale_out_config_is_one_line(tmp_path, tiny_data, sets, needles):
    cfg, folder = run(tmp_path, tiny_data, "bad")
    args = [a for s in sets for a in ("--set", s)]
    proc = lmforge("train", "-f", cfg, *args, timeout=60)
    assert_one_line_error(proc, *needles)
    assert not folder.exists()


def test_unreachable_rendezvous_times_out_with_a_clear_message(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, "lost")
    t0 = time.monotonic()
    proc = lmforge("train", "-f", cfg, "--nnodes", "2", "--node-rank", "1",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--set", "compute.rdzv_timeout_s=2", timeout=60)
    assert_one_line_error(proc, "cannot reach the rendezvous at 127.0.0.1:", "after 2s")
    assert time.monotonic() - t0 < 30
    assert not folder.exists()


def test_launch_slurm_and_k8s_write_valid_job_files(tmp_path, tiny_data):
    import yaml

    cfg, _ = run(tmp_path, tiny_data, "job")
    sbatch = tmp_path / "job.sbatch"
    proc = lmforge("launch", "slurm", "-f", cfg, "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                   "--time", "24:00:00", "--set", "compute.data_parallel=hsdp", "-o", sbatch, check=True)
    assert f"sbatch {sbatch}" in proc.stdout
    text = sbatch.read_text()
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=gpu", "#SBATCH --time=24:00:00"):
        assert line in text.splitlines()
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    for part in (f"-m lmforge train -f {cfg}", "--nnodes 4", "compute.gpus=8", "compute.data_parallel=hsdp",
                 '--node-rank "$SLURM_NODEID"', '--rdzv-endpoint "$LMFORGE_RDZV_ENDPOINT"'):
        assert part in srun, part
    assert os.access(sbatch, os.X_OK)

    manifest = tmp_path / "pytorchjob.yaml"
    proc = lmforge("launch", "k8s", "-f", cfg, "--nodes", "3", "--gpus-per-node", "4", "--image", "reg/lmforge:1",
                   "-o", manifest, check=True)
    assert f"kubectl apply -f {manifest}" in proc.stdout
    config_map, job = list(yaml.safe_load_all(manifest.read_text()))
    assert config_map["kind"] == "ConfigMap" and yaml.safe_load(config_map["data"]["run.yaml"])["name"] == "tiny"
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    pod = specs["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "reg/lmforge:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 4
    script = container["command"][-1]
    assert "--nnodes 3" in script and '--node-rank "$NODE_RANK"' in script and "unset WORLD_SIZE RANK" in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]

    # a mesh that cannot be built is refused before any file is written
    bad = lmforge("launch", "slurm", "-f", cfg, "--nodes", "2", "--gpus-per-node", "3", "--set",
                  "compute.data_parallel=hsdp", "--set", "compute.shard_size=4", "-o", tmp_path / "bad.sbatch")
    assert_one_line_error(bad, "compute.shard_size: 4 does not divide the 6 ranks")
    assert not (tmp_path / "bad.sbatch").exists()
