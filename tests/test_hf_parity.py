"""Numerical parity with Hugging Face transformers (Llama, and Mixtral for MoE), both directions.

The other families (Llama 3 RoPE scaling, Mistral, Qwen2/3, OLMo 2): tests/test_families.py."""

import json

import pytest
import torch

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.models import build_model, load_pretrained, save_hf, save_pretrained
from lmforge.models.generate import generate
from lmforge.models.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict

import transformers  # a required dependency: a broken install fails here, it is not skipped

CASES = [(False, 2), (True, 2), (True, 4)]  # (tie_embeddings, n_kv_heads) with 4 query heads


def hf_llama(tie: bool, kv: int):
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, max_position_embeddings=64, rope_theta=5e5, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1; randomize them so a wrong norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def ours(tie: bool, kv: int, seed: int = 0):
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv, ffn_hidden=96, vocab_size=101,
                      max_seq_len=64, rope_theta=5e5, norm_eps=1e-6, tie_embeddings=tie)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model, cfg


IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 64, 1, 0, 77, 23, 50]])


@pytest.mark.e2e
@pytest.mark.parametrize("tie,kv", CASES)
def test_import_hf_llama(tie, kv, tmp_path):
    hf = hf_llama(tie, kv)
    cfg = from_hf_config(hf.config)
    assert (cfg.tie_embeddings, cfg.kv_heads, cfg.rope_theta, cfg.ffn_dim) == (tie, kv, 5e5, 96)
    model = build_model(cfg, init=False)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    with torch.no_grad():
        expected = hf(IDS).logits
        torch.testing.assert_close(model(IDS), expected)
    # and from a sharded HF folder on disk
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), expected)


@pytest.mark.integration  # builds, exports and loads back a model (about a CPU second each)
@pytest.mark.parametrize("tie,kv", CASES)
def test_export_to_hf_llama(tie, kv, tmp_path):
    model, cfg = ours(tie, kv)
    save_hf(model, cfg, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings == tie
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS))
        hf_new = hf.generate(IDS, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(IDS))[0, IDS.shape[1]:]
    assert hf_new.tolist() == generate(model, IDS[0].tolist(), 10, temperature=0)
    # the pure mapping round-trips
    back = from_hf_state_dict(to_hf_state_dict(model.state_dict(), cfg), cfg)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_config_round_trip_and_rejections():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden=96,
                      vocab_size=101, max_seq_len=64, rope_theta=5e5)
    back = from_hf_config(to_hf_config(cfg))
    assert back.family == "llama"  # imports name their family; a plain shape exports as llama
    assert back.model_dump(exclude={"preset", "family"}) == cfg.model_dump(exclude={"preset", "family"})
    with pytest.raises(UserError, match="supported: llama"):
        from_hf_config(transformers.GPT2Config())
    with pytest.raises(UserError, match="clip_qkv"):
        to_hf_config(cfg.model_copy(update={"clip_qkv": 8.0}))
    scaled = to_hf_config(cfg)
    scaled.rope_parameters = {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(UserError, match="rope_type 'longrope'"):
        from_hf_config(scaled)


def test_save_load_our_layout(tmp_path):
    model, cfg = ours(False, 2)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    out = save_pretrained(model, cfg, tmp_path / "m", tokenizer_dir=tok)
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "lmforge-model.json", "tokenizer.json"}
    assert json.loads((out / "lmforge-model.json").read_text())["n_kv_heads"] == 2
    loaded, cfg2 = load_pretrained(out, dtype=torch.bfloat16)
    assert cfg2 == cfg and loaded.tok_embeddings.weight.dtype == torch.bfloat16
    loaded32, _ = load_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded32(IDS), model(IDS))
    with pytest.raises(UserError, match="neither"):
        load_pretrained(tok)
    (out / "lmforge-model.json").write_text(json.dumps({**cfg.model_dump(), "n_layers": 3}))
    with pytest.raises(UserError, match="missing blocks.2"):
        load_pretrained(out)


def moe_ours(seed: int = 0):
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, max_seq_len=64,
                      rope_theta=5e5, n_experts=4, top_k=2, expansion_ratio=1.5)
    torch.manual_seed(seed)
    return build_model(cfg).eval(), cfg


@pytest.mark.integration
def test_export_moe_to_hf_mixtral(tmp_path):
    model, cfg = moe_ours()
    save_hf(model, cfg, tmp_path)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS))
        hf_new = hf.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(IDS))[0, IDS.shape[1]:]
    assert hf_new.tolist() == generate(model, IDS[0].tolist(), 8, temperature=0)


def test_import_hf_mixtral(tmp_path):
    config = transformers.MixtralConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    cfg = from_hf_config(hf.config)
    assert (cfg.n_experts, cfg.top_k, cfg.expert_dim) == (4, 2, 96)
    model = build_model(cfg, init=False)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))  # in-memory fused expert layout
    with torch.no_grad():
        expected = hf(IDS).logits
        torch.testing.assert_close(model(IDS), expected)
    hf.save_pretrained(tmp_path)  # the on-disk (per-expert) layout
    loaded, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), expected)


def test_generate_adds_bos_once_as_transformers_does(tmp_path, tiny_data):
    """A Mistral/Gemma-style tokenizer: tokenizer_config.json asks for BOS (add_bos_token) and its
    post-processor adds it too (lmforge's own `bos: true` tokenizers are made so). `lmforge generate`
    starts the prompt as transformers' encoding does — one BOS — and so continues it as
    transformers' greedy generate does."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from family_models import hf_model
    from train_helpers import cli

    from lmforge.data.text.tokenizer import load_tokenizer, train_tokenizer

    folder = tmp_path / "mistral"
    train_tokenizer([str(tiny_data.raw / "textwrap.py.txt")], 300, str(folder), add_bos=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "def"  # short: the whole prompt is inside this model's sliding window (8), BOS included
    ids = hf_tok(prompt)["input_ids"]
    assert ids.count(hf_tok.bos_token_id) == 1 and ids[0] == hf_tok.bos_token_id
    assert load_tokenizer(str(folder)).encode_prompt(prompt) == ids
    hf = hf_model("mistral", vocab_size=len(hf_tok), seed=0)  # a model whose continuation a second BOS changes
    hf.save_pretrained(folder)
    with torch.no_grad():
        new = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=hf_tok.eos_token_id,
                          pad_token_id=hf_tok.pad_token_id, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    expected = prompt + hf_tok.decode(new[0, len(ids):], skip_special_tokens=True)
    out = cli("generate", "--checkpoint", f"hf:{folder}", "--prompt", prompt, "--temperature", "0",
              "--max-new-tokens", "12", "--device", "cpu", check=True).stdout
    assert out == expected + "\n", (out, expected)
