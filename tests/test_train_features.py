"""Trainer features beyond the dense basics: MoE runs, ICL during training, the quickstart."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, tiny_run_config
from train_helpers import final_weights, lmforge, metrics, train_killed_at, train_losses, write_config

MOE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
       "n_experts": 4, "top_k": 2, "expansion_ratio": 1.0}


@pytest.mark.e2e
def test_moe_run_trains_logs_router_stats_and_resumes_bitwise(tmp_path, tiny_data):
    common = {"model": MOE, "training_duration": "10ba", "save_interval": "3ba", "eval.interval": "5ba",
              "eval.prompts": ["def "]}
    ref = write_config(tmp_path / "ref.yaml", tiny_run_config(tiny_data, tmp_path / "ref", **common))
    lmforge("train", "-f", ref, check=True)
    rows = [r for r in metrics(tmp_path / "ref") if "train/loss" in r]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.5
    assert all(r["train/moe_lb_loss"] >= 1.0 - 1e-4 for r in rows)  # 1.0 at perfectly uniform routing
    assert all(0 < r["train/moe_max_expert_share"] <= 1 for r in rows)
    # MFU is computed from *active* parameters (shared with `lmforge estimate`)
    from lmforge.config.model import ModelConfig
    from lmforge.plan.flops import param_counts

    counts = param_counts(ModelConfig(**MOE, vocab_size=512))
    assert counts["active"] < counts["total"]

    cfg = write_config(tmp_path / "victim.yaml", tiny_run_config(tiny_data, tmp_path / "victim", **common))
    train_killed_at(cfg, tmp_path / "victim", step=7)
    lmforge("train", "-f", cfg, check=True)
    a, b = final_weights(tmp_path / "ref"), final_weights(tmp_path / "victim")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert train_losses(tmp_path / "ref") == train_losses(tmp_path / "victim")


@pytest.mark.e2e
def test_icl_tasks_and_gauntlet_during_training(tmp_path, tiny_data):
    rows = [{"query": f"def f{i}(x): return x", "choices": [" + 1", " * 2", " - 3"], "gold": i % 3}
            for i in range(12)]
    task_file = tmp_path / "mc.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = [{"label": "toy_mc", "dataset_uri": str(task_file), "num_fewshot": [0, 1],
              "icl_task_type": "multiple_choice"}]
    gauntlet = tmp_path / "g.yaml"
    gauntlet.write_text(
        "eval_gauntlet:\n  weighting: EQUAL\n  subtract_random_baseline: true\n  rescale_accuracy: true\n"
        "  categories:\n  - name: toy\n    benchmarks:\n    - {name: toy_mc, num_fewshot: 0, random_baseline: 0.333}\n")
    cfg = write_config(tmp_path / "icl.yaml", tiny_run_config(
        tiny_data, tmp_path / "icl", training_duration="4ba",
        **{"eval.icl_tasks": tasks, "eval.gauntlet": str(gauntlet), "eval.icl_interval": "2ba",
           "eval.prompts": []}))
    lmforge("train", "-f", cfg, check=True)
    icl_rows = [r for r in metrics(tmp_path / "icl") if "icl/toy_mc/0-shot" in r]
    assert [r["step"] for r in icl_rows] == [2, 4]  # at icl_interval, and at the end
    assert all(0 <= r["icl/toy_mc/1-shot"] <= 1 for r in icl_rows)
    assert "gauntlet/toy" in icl_rows[-1]


@pytest.mark.e2e
def test_bad_icl_task_file_fails_before_training(tmp_path, tiny_data):
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(
        tiny_data, tmp_path / "bad", **{"eval.icl_tasks": [{"label": "x", "dataset_uri": str(tmp_path / "no.jsonl"),
                                                            "num_fewshot": [0], "icl_task_type": "multiple_choice"}]}))
    proc = lmforge("train", "-f", cfg)
    assert proc.returncode == 2 and "no.jsonl" in proc.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.e2e
def test_quickstart_runs_end_to_end_shortened(tmp_path):
    """The real quickstart config (built-in corpus, tokenizer training, preparation, model: auto),
    with fewer steps. A second run reuses the cached tokenizer and data."""
    args = ["train", "-f", REPO / "examples" / "quickstart.yaml", "--training-duration", "3ba",
            "--save-folder", tmp_path / "qs", "--set", "eval.interval=3ba", "--set", "eval.max_batches=1",
            "--set", "eval.max_new_tokens=8"]
    home = {"LMFORGE_HOME": str(tmp_path / "home")}  # its own caches: another test may have trained this tokenizer
    proc = lmforge(*args, timeout=600, check=True, env=home)
    out = proc.stdout
    assert out.startswith("model: auto → 4×128") or "\nmodel: auto → 4×128" in out  # 3 steps: the smallest
    assert "tokenizer: training a 1024-token BPE" in out and "data: preparing builtin:python-stdlib" in out
    assert "eval step 3 | loss " in out and "| bpb " in out and "final model:" in out
    assert "mlflow ui --backend-store-uri" in out
    assert [out.count(f"--- generation_{i} at step 3 ---") for i in range(3)] == [1, 1, 1] and "def fibonacci(n):" in out
    row = next(ln for ln in lmforge("runs", "list", check=True, env=home).stdout.splitlines()
               if ln.startswith("quickstart "))
    assert "COMPLETED" in row and "auto 4×128" in row and "100% step 3" in row, row  # the shape chosen, the end
    args[args.index("--save-folder") + 1] = tmp_path / "qs2"
    again = lmforge(*args, "--name", "qs2", timeout=600, check=True, env=home).stdout
    assert "tokenizer: reusing" in again and "data: preparing" not in again


@pytest.mark.e2e
def test_compiled_blocks_train_like_eager(tmp_path, tiny_data):
    """The one test with torch.compile on (inductor on CPU): same losses as eager, within
    float tolerance (fused kernels reorder sums), and the same checkpoint layout."""
    common = {"training_duration": "3ba", "eval.interval": "3ba", "eval.max_new_tokens": 4}
    eager = write_config(tmp_path / "eager.yaml", tiny_run_config(tiny_data, tmp_path / "eager", **common))
    lmforge("train", "-f", eager, check=True)
    compiled = write_config(tmp_path / "compiled.yaml", tiny_run_config(
        tiny_data, tmp_path / "compiled", **common, **{"compute.compile": True}))
    lmforge("train", "-f", compiled, timeout=600, check=True)
    a, b = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-3)
    assert final_weights(tmp_path / "eager").keys() == final_weights(tmp_path / "compiled").keys()


@pytest.mark.e2e
def test_moe_under_fsdp_two_ranks_matches_single_process(tmp_path, tiny_data):
    """MoE blocks shard per block like dense ones: 2 gloo ranks with FSDP2 follow the single
    process (same global batch) within float-summation tolerance."""
    common = {"model": MOE, "training_duration": "3ba", "eval.prompts": [], "save_interval": "3ba"}
    single = write_config(tmp_path / "one.yaml", tiny_run_config(tiny_data, tmp_path / "one", **common))
    lmforge("train", "-f", single, check=True)
    sharded = write_config(tmp_path / "fsdp.yaml", tiny_run_config(
        tiny_data, tmp_path / "fsdp", **common, **{"compute.ranks": 2, "compute.data_parallel": "fsdp"}))
    lmforge("train", "-f", sharded, check=True)
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4)
    wa, wb = final_weights(tmp_path / "one"), final_weights(tmp_path / "fsdp")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)
