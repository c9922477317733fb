"""LoRA: adapters on a frozen base, trained by the real trainer (in-process), resumed from a
checkpoint, exported merged and as a PEFT adapter that transformers + peft load; FSDP on two
gloo ranks; bad settings as one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import REPO
from lmforge.config.load import read_yaml
from lmforge.config.model import ModelConfig, get_preset
from lmforge.config.schema import LoRAConfig
from lmforge.errors import UserError
from lmforge.models import build_model
from lmforge.models.lora import LoRALinear, apply_lora, merge_lora, trainable_counts
from train_helpers import final_weights, lmforge, train_in_process, train_losses, write_config

import transformers  # a required dependency: a broken install fails here, it is not skipped

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 64, 1, 0, 77, 23, 50]])


@pytest.mark.e2e
def test_trainable_share_on_llama_tiny_and_exact_start():
    """The default adapters (the shipped example's too) train < 2% of llama-tiny (as the
    quickstart builds it, 8192-token vocabulary); at initialization the adapted model computes
    the base model."""
    lora = LoRAConfig()
    assert LoRAConfig(**read_yaml(str(REPO / "examples" / "lora.yaml"))["lora"]) == lora
    cfg = get_preset("llama-tiny").model_copy(update={"vocab_size": 8192})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        before = model(IDS)
    apply_lora(model, lora)
    trainable, total = trainable_counts(model)
    assert trainable / total < 0.02, trainable / total
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 7 * cfg.n_layers
    assert all(n.endswith(("lora_A", "lora_B")) for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        assert torch.equal(model(IDS), before)  # B starts at zero
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.02)
        adapted = model(IDS)
        assert not torch.allclose(adapted, before)
        merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == set(build_model(cfg).state_dict())  # a plain model again


def test_moe_mlp_targets_match_nothing():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=101, n_experts=4, top_k=2)
    model = build_model(cfg)
    with pytest.raises(UserError, match="lora.targets: gate_proj matches no module of this model"):
        apply_lora(model, LoRAConfig(targets=["q_proj", "gate_proj"]))
    apply_lora(model, LoRAConfig(rank=8, targets=["q_proj", "v_proj"]))  # attention is fine
    assert trainable_counts(model)[0] == 2 * (8 * 64 + 8 * 64 + 8 * 64 + 8 * 64)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory, tiny_data):
    """The frozen base: a small Llama pretrained for a few steps (in-process), exported to
    Hugging Face format with its tokenizer."""
    from conftest import tiny_run_config
    from lmforge.train.export import export

    root = tmp_path_factory.mktemp("lora-base")
    raw = tiny_run_config(tiny_data, root / "pre", training_duration="24ba", save_interval="24ba",
                          **{"model.max_seq_len": 128, "eval.prompts": [], "eval.interval": "24ba"})
    train_in_process(raw)
    export(str(root / "pre"), str(root / "hf"))
    return root / "hf"


def lora_config(tmp_path, base, name="lora", **extra):
    cfg = {"name": f"{name}-{abs(hash(str(tmp_path))) % 10**8}", "custom_weights_path": f"hf:{base}",
           "task_type": "instruction_finetune", "train_data": str(REPO / "examples/data/sft/train.jsonl"),
           "training_duration": "24ba", "save_interval": "12ba", "save_folder": str(tmp_path / name),
           "log_interval": 1, "lora": {"rank": 8, "alpha": 16, "dropout": 0.0},
           "parameters": {"global_batch_size": 4, "micro_batch_size": 2, "learning_rate": 1e-2,
                          "context_length": 128, "warmup": "2ba"},
           "eval": {"prompts": []}, "experiment_tracker": {"mlflow": None, "console": True}}
    cfg.update(extra)
    return cfg


@pytest.mark.e2e
def test_lora_run_learns_resumes_and_exports_for_peft(tmp_path, hf_base):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from lmforge.train.export import export

    raw = lora_config(tmp_path, hf_base)
    train_in_process(raw)
    folder = tmp_path / "lora"
    losses = train_losses(folder)
    # a small, barely pretrained base with its embeddings frozen learns slowly, but it learns
    first, last = (sum(losses[s] for s in steps) / 4 for steps in ((1, 2, 3, 4), (21, 22, 23, 24)))
    assert last < first - 0.15, losses
    final = folder / "final"
    merged = load_file(final / "model.safetensors")
    base = load_file(hf_base / "model.safetensors")
    # only the targeted projections moved; embeddings and norms are the base's, bit for bit
    assert torch.equal(merged["tok_embeddings.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(merged["blocks.1.mlp_norm.weight"], base["model.layers.1.post_attention_layernorm.weight"])
    assert not torch.equal(merged["blocks.1.attn.wq.weight"], base["model.layers.1.self_attn.q_proj.weight"])
    adapter_cfg = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(hf_base) and adapter_cfg["r"] == 8

    # resume: drop the last checkpoint and the export; the re-run continues from step 12 to the same weights
    middle, last_ckpt = (folder / "checkpoints" / f"step_{s:08d}" for s in (12, 24))
    adapter_from_ckpt = tmp_path / "adapter-ckpt"
    export(str(last_ckpt), str(adapter_from_ckpt), fmt="peft")
    shutil.rmtree(last_ckpt)
    shutil.rmtree(final)
    again = train_in_process(raw)
    assert again.status == "completed" and middle.is_dir()
    resumed = load_file(final / "model.safetensors")
    assert all(torch.equal(merged[k], resumed[k]) for k in merged)

    # transformers + peft: the adapter on the HF base == the merged HF export
    a = load_file(adapter_from_ckpt / "adapter_model.safetensors")
    b = load_file(final / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # GGUF: a LoRA run (its final/ or a checkpoint) only with --merge, then with the merged weights
    for path in (folder, middle):
        with pytest.raises(UserError, match="a LoRA run; pass --merge"):
            export(str(path), str(tmp_path / "gguf"), fmt="gguf")
    export(str(folder), str(tmp_path / "gguf"), fmt="gguf", dtype="f32", merge=True)
    from gguf import GGUFReader

    gguf = {t.name: t.data for t in GGUFReader(tmp_path / "gguf" / "model-f32.gguf").tensors}
    assert np.array_equal(gguf["blk.1.attn_v.weight"], merged["blocks.1.attn.wv.weight"].numpy())
    export(str(middle), str(tmp_path / "gguf-12"), fmt="gguf", dtype="f32", merge=True)  # a checkpoint's adapters
    at_12 = {t.name: t.data for t in GGUFReader(tmp_path / "gguf-12" / "model-f32.gguf").tensors}
    assert np.array_equal(at_12["token_embd.weight"], base["model.embed_tokens.weight"].numpy())  # frozen
    assert not np.array_equal(at_12["blk.1.attn_v.weight"], gguf["blk.1.attn_v.weight"])  # step 12, not 24
    hf_dir = tmp_path / "merged-hf"
    export(str(folder), str(hf_dir))
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_base),
                                                  str(final / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(IDS).logits, merged_hf(IDS).logits, atol=1e-5, rtol=1e-5)
        kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(IDS))
        assert with_adapter.generate(input_ids=IDS, **kw).tolist() == merged_hf.generate(IDS, **kw).tolist()


@pytest.mark.e2e
def test_lora_under_fsdp_matches_one_process(tmp_path, hf_base, tiny_data, monkeypatch):
    """The multi-rank proof, kept small: two steps of continued pretraining with adapters on two
    gloo ranks with FSDP2 (adapters and frozen base sharded alike, sharded meta-device init,
    gathered merged export) follow the same two steps in one process."""
    from conftest import tiny_run_config

    base = hf_base.parent / "pre" / "final"  # lmforge layout: the ranks need not import transformers

    def config(name, **extra):
        cfg = tiny_run_config(tiny_data, tmp_path / name, training_duration="2ba", save_interval="2ba",
                              custom_weights_path=str(base), lora={"rank": 4, "dropout": 0.0},
                              **{"eval.prompts": [], "eval.interval": "2ba", "eval.max_batches": 1}, **extra)
        del cfg["model"], cfg["tokenizer"]  # both from the weights folder
        return cfg

    train_in_process(config("single"))  # the reference
    monkeypatch.setenv("LMFORGE_NO_SUPERVISOR", "1")  # torchrun's two ranks only, no supervising parent
    lmforge("train", "-f", write_config(tmp_path / "fsdp.yaml", config(
        "fsdp", **{"compute.ranks": 2, "compute.data_parallel": "fsdp"})), check=True)
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert sorted(b) == [1, 2] and a[2] != a[1]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    wa, wb = final_weights(tmp_path / "single"), final_weights(tmp_path / "fsdp")
    assert not torch.equal(wa["blocks.0.attn.wq.weight"], final_weights(base.parent)["blocks.0.attn.wq.weight"])
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)
    assert (tmp_path / "fsdp" / "final" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
@pytest.mark.parametrize("change,needles", [
    ({"lora": {"rank": 0}}, ["lora.rank", "greater than 0"]),
    ({"lora": {"targets": ["qkv"]}}, ["lora.targets", "'qkv'", "q_proj"]),
    ({"custom_weights_path": None}, ["lora: needs custom_weights_path"]),
])
def test_bad_lora_settings_are_one_line(tmp_path, hf_base, change, needles):
    raw = lora_config(tmp_path, hf_base) | change
    if raw["custom_weights_path"] is None:
        raw |= {"model": "llama-tiny", "tokenizer": str(hf_base)}
    from lmforge.cli.main import main

    path = write_config(tmp_path / "bad.yaml", {k: v for k, v in raw.items() if v is not None})
    err = _stderr_of(main, ["finetune", "-f", str(path)])
    assert err.count("\n") == 1 and err.startswith("error: ") and all(n in err for n in needles), err
    assert not (tmp_path / "lora").exists()


def test_lora_target_missing_in_moe_model_is_one_line(tmp_path, tiny_data):
    """An MoE base has no dense MLP projections to adapt: refused when the config is read."""
    from lmforge.cli.main import main
    from lmforge.models import save_pretrained

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=128, n_experts=4, top_k=2)
    save_pretrained(build_model(cfg), cfg, tmp_path / "moe", tokenizer_dir=tiny_data.tokenizer)
    raw = lora_config(tmp_path, "unused", custom_weights_path=str(tmp_path / "moe"),
                      lora={"targets": ["q_proj", "down_proj"]})
    err = _stderr_of(main, ["finetune", "-f", str(write_config(tmp_path / "moe.yaml", raw))])
    assert err.count("\n") == 1 and "lora.targets: down_proj matches no module" in err, err
    assert not (tmp_path / "lora").exists()


def _stderr_of(main, argv) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 2
    return buf.getvalue()


def test_adapter_names_its_base_so_that_it_resolves_from_anywhere(tmp_path, monkeypatch):
    """`custom_weights_path: hf:models/llama` typed relative to where training ran: the adapter records
    the folder's absolute path (PEFT resolves it from any working directory); a hub name stays as is."""
    from lmforge.models.lora import base_model_reference

    (tmp_path / "models" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert base_model_reference("hf:models/llama") == str(tmp_path / "models" / "llama")
    assert base_model_reference("models/llama/") == str(tmp_path / "models" / "llama")
    assert base_model_reference("hf:meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    # an lmforge run (or its final/) is no base transformers can load: None (the run writes the base's HF form)
    (tmp_path / "runs" / "sft" / "final").mkdir(parents=True)
    (tmp_path / "runs" / "sft" / "final" / "lmforge-model.json").write_text("{}")
    assert base_model_reference("runs/sft") is None and base_model_reference("runs/sft/final") is None
