"""Vocabulary extension for continued pretraining on a new language: new BPE merges learned on
the user's text are appended to the model's tokenizer, new embedding rows start as the mean
of their old pieces, and the exported model and tokenizer load in transformers."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
import transformers  # a required dependency: its absence fails, never skips

from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.data.text.vocab_extension import extend_tokenizer, read_extension
from lmforge.errors import UserError
from lmforge.models.resize import extend_embeddings


# A made-up agglutinative "language" the Python-trained base tokenizer has never seen.
STEMS = ["talo", "kirja", "järvi", "metsä", "ystävä", "kaupunki", "sydän", "ikkuna", "tähti", "lumi"]
ENDINGS = ["ssa", "sta", "lla", "lle", "ksi", "ineen", "ttomana", "kin", "mme", "nsa"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    docs = ["\n".join(" ".join(rng.choice(STEMS) + rng.choice(ENDINGS) for _ in range(12)) + "." for _ in range(10))
            for _ in range(150)]
    path = tmp_path_factory.mktemp("lang") / "kieli.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def corpus_text(path, n: int) -> str:
    return "\n".join(json.loads(line)["text"] for line in path.read_text().splitlines())[:n]


def test_extended_tokenizer_keeps_old_ids_and_loads_in_transformers(tmp_path, tiny_data, corpus):
    base = load_tokenizer(tiny_data.tokenizer)
    ext = extend_tokenizer(str(tiny_data.tokenizer), [str(corpus)], 600, str(tmp_path / "ext"))
    assert ext.vocab_size == 600
    old, new = base.backend.get_vocab(), ext.backend.get_vocab()
    assert all(new[t] == i for t, i in old.items())  # every old token keeps its id
    text = corpus_text(corpus, 2000)
    assert len(ext.encode(text)) < 0.6 * len(base.encode(text))  # the new language costs far fewer tokens
    assert ext.decode(ext.encode(text)) == text
    python = "def main(argv):\n    return sorted(argv)\n"
    assert ext.encode(python) == base.encode(python)  # what the base knew tokenizes as before
    record = read_extension(str(tmp_path / "ext"))
    assert sorted(record["pieces"]) == list(range(512, 600))
    for tid, pieces in record["pieces"].items():
        assert ext.decode([tid]) == base.decode(pieces) and all(p < 512 for p in pieces)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "ext")
    assert hf(text)["input_ids"] == ext.encode(text)
    with pytest.raises(UserError, match="must be larger than the base tokenizer's 512"):
        extend_tokenizer(str(tiny_data.tokenizer), [str(corpus)], 500, str(tmp_path / "x"))


def test_new_rows_are_the_mean_of_their_pieces():
    torch.manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(8, 4), "output.weight": torch.randn(8, 4), "norm.weight": torch.ones(4)}
    ext = {"base_vocab_size": 8, "pieces": {8: [1, 2], 9: [3, 3, 5]}}
    out = extend_embeddings(sd, ext, 12)
    for name in ("tok_embeddings.weight", "output.weight"):
        w, old = out[name], sd[name]
        assert w.shape == (12, 4) and torch.equal(w[:8], old)
        torch.testing.assert_close(w[8], old[[1, 2]].mean(0))
        torch.testing.assert_close(w[9], old[[3, 3, 5]].mean(0))
        torch.testing.assert_close(w[11], old.mean(0))  # padding rows: the mean of all old rows
    assert out["norm.weight"] is sd["norm.weight"]


@pytest.mark.e2e
def test_continued_pretraining_with_extended_vocabulary(tmp_path, tiny_data, corpus):
    """In-process CPT with tokenizer.extend, then the HF export of model and tokenizer."""
    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model, save_pretrained
    from lmforge.train.export import export
    from lmforge.train.locate import load_model
    from train_helpers import train_in_process

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=64, vocab_size=512)
    torch.manual_seed(0)
    source = build_model(cfg)
    save_pretrained(source, cfg, tmp_path / "base", tokenizer_dir=tiny_data.tokenizer)
    raw = {"name": f"ext-{time.time_ns()}", "custom_weights_path": str(tmp_path / "base"),
           "task_type": "continued_pretrain", "tokenizer": {"extend": {"vocab_size": 600}},
           "train_data": str(corpus), "training_duration": "2ba", "save_folder": str(tmp_path / "run"),
           "parameters": {"global_batch_size": 4, "micro_batch_size": 2, "context_length": 64,
                          "learning_rate": 1e-9},  # ~no update: the new rows stay at their initial value
           "eval": {"prompts": [], "holdout_fraction": 0.05}, "experiment_tracker": {"mlflow": None}}
    lines = []
    result = train_in_process(raw, log=lines.append)
    assert any("extending" in line and "600 tokens" in line for line in lines)
    trained, tcfg, _ = load_model(result.final_dir)
    assert tcfg.vocab_size == 640  # 600 rounded up to a multiple of 64
    tok = load_tokenizer(result.final_dir)
    assert tok.vocab_size == 600
    record = read_extension(_cached_tokenizer(lines))
    emb, old = trained.tok_embeddings.weight.detach(), source.tok_embeddings.weight.detach()
    tid, pieces = next(iter(record["pieces"].items()))
    torch.testing.assert_close(emb[tid], old[pieces].mean(0), atol=1e-6, rtol=1e-4)

    export(result.final_dir, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = corpus_text(corpus, 200)
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text) and max(ids) >= 512  # the new tokens are in use
    x = torch.tensor([ids[:60]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, trained(x), atol=1e-5, rtol=1e-4)


def _cached_tokenizer(lines: list[str]) -> str:
    line = next(line for line in lines if line.startswith("tokenizer: extending"))
    return line.rsplit("→ ", 1)[1].strip()
