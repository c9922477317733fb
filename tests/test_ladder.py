"""The customization ladder end to end, as real CLI processes: pretrain → export to Hugging
Face → generate → continued pretraining → SFT → pipeline, plus the bad-input cases."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from conftest import tiny_run_config
from train_helpers import assert_one_line_error, cli, lmforge, metrics, train_losses, write_config

import transformers  # a required dependency: a broken install fails here, it is not skipped


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data):
    """A tiny pretrained run (its save folder)."""
    root = tmp_path_factory.mktemp("ladder")
    folder = root / "base"
    cfg = tiny_run_config(tiny_data, folder, training_duration="30ba", save_interval="15ba",
                          **{"eval.interval": "30ba", "eval.prompts": []})
    lmforge("train", "-f", write_config(root / "base.yaml", cfg), check=True)
    return folder


def sft_rows(n=40):
    # A mapping the base model cannot know: a number word → its digits.
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        rows.append({"prompt": f"# {words[a]} {words[b]}\n", "response": f"x = {a}{b}\n"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def sft_config(tmp_path, weights, **extra):
    cfg = {"name": f"sft-{tmp_path.name}",  # run names are unique in the registry
           "custom_weights_path": str(weights), "task_type": "instruction_finetune",
           "train_data": str(write_jsonl(tmp_path / "train.jsonl", sft_rows())),
           "training_duration": "30ba", "save_folder": str(tmp_path / "sft"), "log_interval": 1,
           "parameters": {"global_batch_size": 4, "micro_batch_size": 2, "learning_rate": 3e-3,
                          "context_length": 64, "warmup": "2ba"},
           "eval": {"data_path": str(write_jsonl(tmp_path / "val.jsonl", sft_rows(8))), "interval": "15ba",
                    "prompts": ["# three four\n"], "max_new_tokens": 6},
           "experiment_tracker": {"mlflow": None, "console": True}}
    cfg.update(extra)
    return write_config(tmp_path / "sft.yaml", cfg)


@pytest.mark.e2e
def test_export_hf_parity_and_generate(base, tmp_path):
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.models.generate import generate
    from lmforge.train.locate import load_model

    out = tmp_path / "hf"
    lmforge("export", "--checkpoint", base, "--format", "hf", "--out", out, "--max-shard-size", "100KB", check=True)
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    ours, cfg, _ = load_model(str(base))  # the run folder resolves to its final/
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    tok = load_tokenizer(out)
    text = "def main(argv):\n    parser = "
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x))
        hf_new = hf.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    assert generate(ours, ids, 12, temperature=0) == hf_new
    # Evaluators call generate() without sampling arguments: the export's defaults must be greedy.
    assert not transformers.GenerationConfig.from_pretrained(out).do_sample
    with torch.no_grad():
        assert hf.generate(x, max_new_tokens=12, eos_token_id=None)[0, len(ids):].tolist() == hf_new
    # `lmforge generate` on the exported HF folder streams the same greedy continuation
    proc = lmforge("generate", "--checkpoint", out, "--prompt", text, "--temperature", "0",
                   "--max-new-tokens", "12", check=True)
    assert proc.stdout.rstrip("\n") == text + tok.decode([t for t in hf_new if t != tok.eos_id])
    # ... and a DCP step folder exports the same weights as the final model (same last step)
    step = sorted((base / "checkpoints").iterdir())[-1]
    out2 = tmp_path / "from-step"
    from safetensors.torch import load_file

    from lmforge.train.export import export

    export(str(step), str(out2), fmt="lmforge")  # same code as the CLI, in-process to save a start-up

    a, b = load_file(out2 / "model.safetensors"), load_file(base / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
def test_export_gguf_continues_like_lmforge_generate_in_llama_cpp(base, tmp_path, llama_cpp):
    """The pretrained run as GGUF: llama.cpp's greedy continuations (its own sampler at temperature 0)
    are lmforge's (`generate`, what `lmforge generate` prints: test_export_hf_parity_and_generate),
    token for token, in f32 and f16. (The CLI itself: test_run_your_model_page.)"""
    from llamacpp import greedy, load
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.models.generate import generate
    from lmforge.train.export import export
    from lmforge.train.locate import load_model

    files = [export(str(base), str(tmp_path / d), fmt="gguf", dtype=d) / f"model-{d}.gguf" for d in ("f32", "f16")]
    ours, _, _ = load_model(str(base))
    tok = load_tokenizer(base / "final")
    for prompt in ("def main(argv):\n    parser = ", "class Fraction(", "        if not isinstance("):
        ids = tok.encode_prompt(prompt)
        want = generate(ours, ids, 16, temperature=0)
        assert [greedy(load(llama_cpp, f), ids, 16) for f in files] == [want, want], prompt


@pytest.mark.e2e
def test_run_your_model_page(base, tmp_path, llama_cpp):
    """docs/run-your-model.md: each `lmforge` command it shows runs on a trained run (its save
    folder for `runs/my-model`), and its llama-cpp-python snippet prints `lmforge generate`'s text."""
    import contextlib
    import io
    import re
    import shlex

    from conftest import REPO

    page = (REPO / "docs" / "run-your-model.md").read_text()
    blocks = re.findall(r"```(bash|python)\n(.*?)```", page, re.S)
    commands = [ln for lang, body in blocks if lang == "bash" for ln in body.splitlines() if ln.startswith("lmforge ")]
    assert [c.split()[1] for c in commands] == ["export", "export", "generate", "export"], commands
    (tmp_path / "my-model").symlink_to(base)
    here = lambda text: text.replace("runs/my-model", str(tmp_path / "my-model"))  # noqa: E731
    printed = [cli(*shlex.split(here(c))[1:], check=True).stdout for c in commands]
    assert (tmp_path / "my-model-q8" / "model-q8_0.gguf").is_file() and (tmp_path / "my-model-hf" / "config.json").is_file()
    snippet = next(body for lang, body in blocks if lang == "python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(here(snippet), {})
    assert out.getvalue() == printed[2]


@pytest.mark.e2e
def test_import_hf_llama_for_continued_pretraining(base, tmp_path, tiny_data):
    """CPT from an imported HF folder: step-1 loss = the source model's loss on that batch."""
    from lmforge.data.stream.tokens import DatasetSpec, TokenStream
    from lmforge.plan.layout import Layout
    from lmforge.train.locate import load_model

    from lmforge.train.export import export

    hf_dir = tmp_path / "hf"
    export(str(base / "final"), str(hf_dir))
    folder = tmp_path / "cpt"
    cfg = tiny_run_config(tiny_data, folder, training_duration="3ba", custom_weights_path=f"hf:{hf_dir}",
                          task_type="continued_pretrain", **{"eval.prompts": []})
    del cfg["model"], cfg["tokenizer"]  # both come from the weights folder
    proc = lmforge("train", "-f", write_config(tmp_path / "cpt.yaml", cfg), check=True)
    assert "fresh optimizer" in proc.stdout
    source, _, _ = load_model(str(hf_dir))
    stream = TokenStream([DatasetSpec("d0", str(tiny_data.dataset), None)], seq_len=64,
                         layout=Layout(global_batch=8, micro_batch=4), rank=0, seed=17, num_workers=0, split="train")
    it = iter(stream)
    with torch.no_grad():
        losses = []
        for _ in range(2):  # one optimizer step = 2 micro-batches
            b = next(it)
            losses.append(source.training_loss(b.input_ids, b.targets).ce_sum / b.num_targets())
    stream.close()
    first = train_losses(folder)[1]
    assert first == pytest.approx(float(sum(losses) / 2), rel=1e-4)
    assert first < math.log(512) - 1  # well below a fresh model's loss
    # fresh schedule: the first step's LR is the warmup's first value, not the source run's last
    lr1 = next(r["train/lr"] for r in metrics(folder) if r.get("step") == 1 and "train/lr" in r)
    assert lr1 == pytest.approx(3e-3 / 2)


@pytest.mark.e2e
def test_sft_run_learns_responses_and_resumes(base, tmp_path):
    cfg = sft_config(tmp_path, base / "final")
    proc = lmforge("finetune", "-f", cfg, "--json", check=True)
    folder = tmp_path / "sft"
    losses = train_losses(folder)
    first, last = losses[1], sum(losses[s] for s in range(26, 31)) / 5
    assert last < first - 2.5, (first, last)
    evals = [r for r in metrics(folder) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [15, 30] and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["generations"][0].startswith("# three four\n")
    final = folder / "final"
    assert "### Assistant" in json.loads((final / "tokenizer_config.json").read_text())["chat_template"]
    resolved = json.loads((folder / "run.json").read_text())["config"]
    assert resolved["eval"]["top_p"] == 0.95 and resolved["eval"]["temperature"] == 1.0
    again = lmforge("finetune", "-f", cfg, check=True)
    assert "already completed" in again.stdout


@pytest.mark.e2e
def test_pipeline_runs_stages_and_skips_completed(tmp_path, tiny_data):
    pre = tiny_run_config(tiny_data, tmp_path / "unused", training_duration="4ba", **{"eval.prompts": []})
    del pre["save_folder"], pre["name"]
    sft = yaml.safe_load(sft_config(tmp_path, "unused", training_duration="4ba").read_text())
    for k in ("custom_weights_path", "save_folder", "name"):
        del sft[k]
    write_config(tmp_path / "pre.yaml", pre)
    spec = {"name": "lad", "save_root": str(tmp_path / "runs"),
            "stages": [{"name": "pretrain", "config": "pre.yaml"}, {"name": "sft", "config": sft}]}
    pipe = write_config(tmp_path / "pipeline.yaml", spec)
    proc = lmforge("pipeline", "-f", pipe, check=True)
    assert "pretrain: completed" in proc.stdout and "sft: completed" in proc.stdout
    stage = yaml.safe_load((tmp_path / "runs" / "sft.yaml").read_text())
    assert stage["custom_weights_path"] == str(tmp_path / "runs" / "pretrain" / "final")
    again = lmforge("pipeline", "-f", pipe, check=True)
    assert "pretrain: skipped" in again.stdout and "sft: skipped" in again.stdout


# --------------------------------------------------------------------------- bad input

@pytest.mark.e2e
@pytest.mark.parametrize("row,needles", [
    ({"prompt": "a"}, ["train.jsonl:2", "'response'"]),
    ({"prompt": "a", "response": "  "}, ["train.jsonl:2", "'response' is empty"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     ["train.jsonl:2", "messages[1].role 'robot'", "system, user, assistant"]),
    ({"text": "a"}, ["train.jsonl:2", "'prompt'", "or messages"]),
])
def test_bad_rows(base, tmp_path, row, needles):
    cfg = sft_config(tmp_path, base / "final")
    write_jsonl(tmp_path / "train.jsonl", [sft_rows(1)[0], row])
    assert_one_line_error(lmforge("finetune", "-f", cfg), *needles)
    assert not (tmp_path / "sft" / "checkpoints").exists()


@pytest.mark.e2e
def test_bad_weights_and_tokenizer(base, tmp_path, tiny_data):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}))
    assert_one_line_error(lmforge("finetune", "-f", sft_config(tmp_path, f"hf:{gpt2}")),
                          "gpt2", "supported: llama, mistral, qwen2, qwen3, olmo2, gemma, gemma2, gemma3_text, mixtral")
    from lmforge.data.text.tokenizer import train_tokenizer

    big = tmp_path / "tok1024"
    train_tokenizer([str(tiny_data.raw)], 1024, str(big))
    assert_one_line_error(lmforge("finetune", "-f", sft_config(tmp_path, base / "final", tokenizer=str(big))),
                          "1024 tokens", "vocabulary has 512")
    assert_one_line_error(cli("generate", "--checkpoint", base, "--tokenizer", big, "--prompt", "x"),
                          "1024 tokens")
    assert_one_line_error(cli("generate", "--checkpoint", tmp_path / "nope", "--prompt", "x"),
                          "no such folder")


@pytest.mark.e2e
def test_export_refuses_to_overwrite(base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):  # not an export: never replaced (issue 59)
        assert_one_line_error(cli("export", "--checkpoint", base, "--out", out, *extra), "keep.txt",
                              "replaces only an export")
        assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_export_moe_as_mixtral(tmp_path, tiny_data):
    """MoE checkpoints export to the Mixtral layout that transformers loads (in-process: fast)."""
    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model, save_pretrained
    from lmforge.train.export import export

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=512,
                      n_experts=4, top_k=2, expansion_ratio=2)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    save_pretrained(model, cfg, tmp_path / "moe", tokenizer_dir=tiny_data.tokenizer)
    export(str(tmp_path / "moe"), str(tmp_path / "hf"), max_shard_size="50KB")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = torch.tensor([[5, 17, 99, 3, 42, 8, 64, 1, 0, 77]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.e2e
def test_sdk_finetune_returns_a_supervised_finetune_run(base, tmp_path):
    import lmforge as sdk

    cfg = yaml.safe_load(sft_config(tmp_path, base / "final", training_duration="4ba").read_text())
    del cfg["task_type"], cfg["name"]  # finetune() implies instruction fine-tuning; model/tokenizer from weights
    run = sdk.finetune(cfg, name="sdk-sft")
    run.wait(timeout=300)
    assert run.status == "COMPLETED" and run.run_type == "finetune"
    assert len(run.metrics()) > 0 and (tmp_path / "sft" / "final" / "model.safetensors").exists()
    listed = lmforge("runs", "list", "--json", check=True).stdout
    assert any(r["name"] == "sdk-sft" and r["run_type"] == "finetune" for r in json.loads(listed))
