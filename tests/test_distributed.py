"""Scale-out on CPU: FSDP2/DDP over real gloo ranks started by real torchrun, resharding resume,
activation checkpointing, two "nodes" on one machine, elastic restarts, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import tiny_run_config
from train_helpers import (REPO, assert_one_line_error, cli, communicate, env, final_weights, free_port, lmforge,
                           train_here, train_losses, worker_with_rank, write_config)


def run(tmp_path, tiny_data, name, **overrides):
    folder = tmp_path / name
    base = {"eval.prompts": [], "eval.interval": "100ba"}
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_run_config(tiny_data, folder, **(base | overrides)))
    return cfg, folder


# One reference for the multi-rank runs below: a single process, same global batch (8), 6 steps.
COMMON = {"training_duration": "6ba", "parameters.micro_batch_size": 2, "save_interval": "3ba"}


@pytest.fixture(scope="module")
def single_ref(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("single")
    cfg, folder = run(tmp, tiny_data, "single", **COMMON)
    lmforge("train", "-f", cfg, check=True)
    return folder


def assert_same_losses(expected: dict, got: dict, steps) -> None:
    """Tolerance: the same math on every rank count; only the order of float sums differs
    (gradients averaged over ranks by all-reduce / reduce-scatter), ~1e-6 relative per step,
    compounding over a few steps of Adam."""
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.e2e
def test_fsdp_two_ranks_match_single_and_reshard_on_resume(tmp_path, tiny_data, single_ref):
    """FSDP2 over 2 gloo ranks (sharded meta-device init, gradient accumulation, clipping,
    generation in lockstep, async checkpoints, gathered export) follows the single process.
    Its step-3 checkpoint then resumes on 2 ranks and on 1 rank (DCP reshards; the data stream
    continues at the same global sample) with the same next-step losses."""
    fsdp_cfg, fsdp = run(tmp_path, tiny_data, "fsdp", **COMMON, **{
        "compute.ranks": 2, "compute.data_parallel": "fsdp", "eval.prompts": ["def main("], "eval.interval": "4ba"})
    proc = lmforge("train", "-f", fsdp_cfg, "--json", check=True)
    assert_same_losses(train_losses(single_ref), train_losses(fsdp), range(1, 7))
    wa, wb = final_weights(single_ref), final_weights(fsdp)  # the export gathered the full weights
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["generations"][0].startswith("def main(")
    ckpt = fsdp / "checkpoints" / "step_00000003"  # one shard file per rank
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    expected = train_losses(fsdp)
    for ranks in (2, 1):
        cfg, folder = run(tmp_path, tiny_data, f"resume{ranks}", **COMMON, **{
            "compute.ranks": ranks, "compute.data_parallel": "fsdp"})
        folder.mkdir()  # a copy of the checkpoint alone (run.json names the other run: not copied)
        shutil.copytree(ckpt, folder / "checkpoints" / ckpt.name)
        proc = lmforge("train", "-f", cfg, check=True)
        assert "resume: continuing from" in proc.stdout and "(step 3," in proc.stdout
        if ranks == 1:
            assert "written by 2 rank(s), resharded onto 1" in proc.stdout
        assert_same_losses(expected, train_losses(folder), range(4, 7))


@pytest.mark.e2e
def test_activation_checkpointing_changes_memory_not_results(tmp_path):
    """In-process on a tiny model: every mode gives the same loss and gradients as no
    checkpointing (recomputation is the same float math, so equality is exact on CPU) while
    the activations kept for backward shrink (measured with saved-tensor hooks, which see what
    autograd stores outside checkpointed regions). Selective keeps matmul outputs inside the
    region, so backward recomputes no matmul there, unlike full (counted with a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmforge.config.model import resolve_model
    from lmforge.plan.layout import Layout
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
        parallelize(model, Layout(), one, checkpointing=mode)
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


@pytest.mark.e2e
def test_two_nodes_on_one_machine_train_together(tmp_path, tiny_data, single_ref):
    """Two `lmforge train` processes as two "nodes" (torchrun --nnodes 2, c10d rendezvous on
    127.0.0.1), one rank each, HSDP (shard within a node — the default shard_size is the ranks
    per node, here 1 — replicate across the nodes: a 2×1 mesh): one 2-rank run with the single
    process's losses."""
    cfg, folder = run(tmp_path, tiny_data, "nodes", **COMMON, **{
        "compute.data_parallel": "hsdp", "compute.nodes": 2, "compute.rdzv_endpoint": f"127.0.0.1:{free_port()}", "compute.rdzv_timeout_s": 60})
    procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--node-rank", str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
             for r in (0, 1)]
    outs = [communicate(p, 240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out[-2000:], err[-3000:])
    assert any("2 rank(s)" in out for out, _ in outs)
    assert_same_losses(train_losses(single_ref), train_losses(folder), range(1, 7))


@pytest.mark.e2e
def test_slow_node_flagged_cordoned_and_the_nodes_left_resume_together(tmp_path, tiny_data):
    """Three "nodes" on localhost (LMFORGE_NODE names them), one gloo DDP rank each, global batch 6. Fault
    injection makes node2's device 4× slower (its forward, backward and optimizer). Its own time per step
    (the sections without a collective, in CPU time) stands out past 2.5× the others', two log intervals
    in a row, whatever the box's load: the run waits for that, with no step fixed in advance (and no
    healthy rank comes near that threshold). The straggler's action (cordon) checkpoints,
    cordons node2 and stops every rank at that step S; node 0's supervisor restarts on 2 nodes, node1
    rejoins by itself (its own `lmforge train` again, as node 1 of 2) and node2 leaves. The resumed 2-rank
    run (3 micro-batches per step) follows one process resumed in-process from the same checkpoint; the
    goodput ledger's parts add up to its wall time and the action counts against goodput.max_actions, not
    max_retries (0 here)."""
    from lmforge.goodput.ledger import PARTS, account, read_ledger

    steps = 8
    cfg, folder = run(tmp_path, tiny_data, "cordon", **{
        "training_duration": f"{steps}ba", "save_interval": "100ba", "parameters.global_batch_size": 6,
        "parameters.micro_batch_size": 1, "compute.data_parallel": "ddp", "compute.nodes": 3,
        "compute.rdzv_endpoint": f"127.0.0.1:{free_port()}", "compute.rdzv_timeout_s": 60, "max_retries": 0,
        "compute.async_checkpoint": False, "goodput.straggler": {"intervals": 2, "threshold": 2.5, "action": "cordon"}})
    procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--node-rank", str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=env(LMFORGE_NODE=f"node{r}", LMFORGE_FAULT="slow:node=node2:factor=4",
                                      LMFORGE_RETRY_DELAY="0"))
             for r in (0, 1, 2)]
    outs = [communicate(p, 300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out[-2000:], err[-3000:])
    cordon = json.loads((folder / "cordon.json").read_text())["nodes"]
    assert list(cordon) == ["node2"] and "a straggler for 2 interval(s)" in cordon["node2"]["reason"]
    step = cordon["node2"]["step"]
    assert 2 < step < steps  # (the first interval is not scored; then two in a row)
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert [(e["node"], e["score"] > 2.5) for e in events if e["event"] == "straggler"] == [("node2", True)]
    assert [(e["cordoned"], e["step"]) for e in events if e["event"] == "goodput_action"] == [(["node2"], step)]
    assert "rejoins the run on 2 node(s) as node 1" in outs[1][0] and "rejoins" not in outs[2][0]
    assert "this node (node2) leaves the run: it is cordoned" in outs[2][0]

    # One process from the same checkpoint, in this process: the same global batch, the same losses.
    one_cfg, one = run(tmp_path, tiny_data, "one", **{
        "training_duration": f"{steps}ba", "save_interval": "100ba", "parameters.global_batch_size": 6,
        "parameters.micro_batch_size": 1})
    ckpt = folder / "checkpoints" / f"step_{step:08d}"
    shutil.copytree(ckpt, one / "checkpoints" / ckpt.name)
    train_here(yaml.safe_load(one_cfg.read_text()))
    assert_same_losses(train_losses(one), {k: v for k, v in train_losses(folder).items() if k > step},
                       range(step + 1, steps + 1))

    from lmforge import get_run

    record = get_run(json.loads((folder / "run.json").read_text())["identity"]["name"])
    assert [r["status"] for r in record.resumptions] == ["STOPPED", "COMPLETED"]
    assert "cordoned node2" in record.resumptions[0]["reason"]
    acc = account(read_ledger(str(folder)))
    assert abs(sum(acc["parts"][k] for k in PARTS) - acc["wall_s"]) < 0.01
    assert acc["parts"]["recovery"] > 0 and acc["parts"]["lost"] == 0  # resumed at the step it stopped
    assert [(r["step"], r["steps_redone"]) for r in acc["resumptions"]] == [(step, 0)]
    described = cli("runs", "describe", record.name, check=True).stdout
    assert "goodput    " in described and f"cordoned   node2 at step {step}: rank" in described
    from lmforge.report.html import goodput_table
    from lmforge.report.load import load_run

    assert f"resumed at step {step} (0 step(s) redone) after rank" in goodput_table([load_run(str(folder))])


@pytest.mark.e2e
def test_killed_worker_is_restarted_and_training_completes(tmp_path, tiny_data, single_ref):
    """SIGKILL one of two DDP workers mid-run: torchelastic (max_retries 1 → --max-restarts 1)
    restarts both, they resume from the latest complete checkpoint and finish; the restart is
    logged, recorded in events.jsonl and in the registry as a resumption; the losses equal the
    uninterrupted single process's."""
    # Checkpoints written in the foreground and rank 1 held after step 4 of the first attempt: step 3
    # is the latest checkpoint when the kill lands, whatever the machine's load.
    cfg, folder = run(tmp_path, tiny_data, "victim", **COMMON, **{"compute.ranks": 2, "max_retries": 1,
                                                                   "compute.async_checkpoint": False})
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(LMFORGE_TEST_HANG="1:4:0"), cwd=REPO)
    deadline = time.time() + 180
    victim = None
    while victim is None:  # find rank 1's process first, so that the kill itself is immediate
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        victim = worker_with_rank(proc.pid, 1)
    while not (folder / "checkpoints" / "step_00000003").exists() or max(train_losses(folder), default=0) < 4:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    out, err = communicate(proc, 240)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "elastic: workers restarted after a failure (restart 1" in out
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["event"] == "elastic_restart"]
    assert len(restart) == 1 and restart[0]["step"] == 3 and restart[0]["resumed_from"].endswith("step_00000003")
    assert (folder / "final" / "model.safetensors").exists()
    assert_same_losses(train_losses(single_ref), train_losses(folder), range(1, 7))
    # torchrun's restart is one of the run's resumptions, with its reason (max_retries counts it)
    import lmforge

    record = lmforge.get_run(json.loads((folder / "run.json").read_text())["identity"]["name"])
    assert [(r["status"], r["reason"]) for r in record.resumptions] == [
        ("FAILED", "rank 1 killed by SIGKILL"), ("COMPLETED", None)]
    assert "restart 1 of 1 (by torchrun)" in next(e["message"] for e in record.events if e["type"] == "retry")
    # The supervisor splits the log where it sees the restart (it polls every 0.5 s), so the
    # restarted rank's first line may still land at the end of resumption 0's log.
    assert (record.logs(0) + record.logs(1)).count("elastic: workers restarted") == 1
    assert "completed after 6 steps" in record.logs(1) and "completed after" not in record.logs(0)
    assert "Traceback" not in out + err  # a fault the run recovers from is lines, not rank 0's gloo traceback
    # Killed k steps after its checkpoint, the run reports k steps lost (recomputed here from its own files:
    # the last step logged before the restart, metrics.jsonl, and the step resumed from, events.jsonl), as
    # lost work with the cause the registry knows, not inside recovery.
    from lmforge.goodput.ledger import PARTS, account, read_ledger

    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
             if '"train/loss"' in line]
    before = steps[:next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])]
    k = before[-1] - restart[0]["step"]
    acc = account(read_ledger(str(folder)))
    (resumed,) = acc["resumptions"]
    assert k >= 1 and resumed["steps_redone"] == k == acc["steps_lost"] and resumed["from_step"] == before[-1]
    assert resumed["cause"] == "rank 1 killed by SIGKILL" and acc["parts"]["lost"] > 0
    assert abs(sum(acc["parts"][p] for p in PARTS) - acc["wall_s"]) < 0.01
    described = cli("runs", "describe", record.name, check=True).stdout
    assert f"resumed    at step 3 after rank 1 killed by SIGKILL: {k} step(s) redone" in described
    assert "restarted  by torchrun (restart 1) from step 3" in described


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_unreachable_rendezvous_times_out_with_a_clear_message(tmp_path, tiny_data):
    cfg, folder = run(tmp_path, tiny_data, "lost")
    proc = lmforge("train", "-f", cfg, "--nnodes", "2", "--node-rank", "1",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--set", "compute.rdzv_timeout_s=2", timeout=60)
    assert_one_line_error(proc, "cannot reach the rendezvous at 127.0.0.1:", "after 2s")  # the 2 s timeout, not torchrun's
    assert not folder.exists()


@pytest.mark.e2e
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
    assert config_map["kind"] == "ConfigMap" and yaml.safe_load(config_map["data"]["run.yaml"])["name"].startswith("tiny-")
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
