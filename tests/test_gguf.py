"""`lmforge export --format gguf`: the rules (units), then llama.cpp itself (llama-cpp-python)
reading the files: the same token ids as lmforge's tokenizers, the same logits as our models
within a stated tolerance per dtype, and the same chat prompt.

Tolerances, as max |Δlogit| over every position of 24 tokens in units of the standard deviation of
our fp32 logits (llama.cpp's KV cache in fp32, tests/llamacpp.py): f32 ≤ 1e-4 (seen ≤ 3e-6: float sums
in another order), and 1e-2 more for the GeGLU (Gemma) models (seen 5e-3): llama.cpp's CPU GELU
reads a table of fp16 values. f16, bf16 and q8_0 ≤ 2.5 × the deviation of our own model with its
matrices rounded as the file stores them, plus the f32 bound: the rounding is the format's, the
rest would be the export's. Seen (2026-11-27, seven model kinds): ≤ 1.74× for f16 and bf16, ≤ 1.93×
for q8_0, where llama.cpp also rounds the activations to 8 bits for its matrix products.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from family_models import family_tokenizer, hf_model
from lmforge.config.model import ModelConfig
from lmforge.models.gguf_vocab import CONTROL, NORMAL, UNUSED, gguf_vocab, pre_tokenizer_name
from lmforge.errors import UserError
from lmforge.models.gguf import check
from train_helpers import assert_one_line_error, cli

DTYPES = ("f32", "f16", "bf16", "q8_0")
F32, GELU, ROUNDING = 1e-4, 1e-2, 2.5  # see the module's docstring
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# What a tokenizer meets: code, prose, runs of spaces and newlines, contractions, digits, non-ASCII
# letters and symbols, and special tokens inside text.
SAMPLES = [
    "Hello   world\n\n\n\tx  = 1\r\n",
    "don't I'll WE'RE they've   'quoted'",
    "12345 3.14159 1,000,000 2026-11-27",
    "naïve café – 東京 😀 Ünïcödé ελληνικά",
    "<|endoftext|>def f(a, b):\n    return a ** b<|endoftext|>",
    "  leading and trailing spaces   ",
]


def corpus_sample() -> list[str]:
    """SAMPLES plus pieces of source the tokenizers were not trained on."""
    text = (STDLIB / "json" / "decoder.py").read_text() + (STDLIB / "this.py").read_text()
    return SAMPLES + [text[i:i + 700] for i in range(0, len(text), 700)]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    # numbers too, so that merges of digits exist and a pre-tokenizer that splits digits apart shows
    numbers = " ".join(f"{i * 37} {1990 + i % 40}-11-{i % 28 + 1}" for i in range(1500))
    return [(STDLIB / n).read_text()[:20000] for n in ("textwrap.py", "fractions.py", "argparse.py")] + [numbers]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, texts):
    """kind → a saved tokenizer: lmforge's own (with and without BOS), Llama 3's and Qwen 2's kinds."""
    from lmforge.data.text.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gguf-tok")
    for t in texts:
        (root / f"{len(t)}.txt").write_text(t)
    toks = {"gpt-2": train_tokenizer([str(root)], 400, str(root / "gpt-2")),
            "gpt-2-bos": train_tokenizer([str(root)], 400, str(root / "gpt-2-bos"), add_bos=True)}
    for kind in ("llama-bpe", "qwen2"):
        toks[kind] = family_tokenizer(kind, texts, root / kind)
    return toks


# --------------------------------------------------------------------------------------------- units

def test_each_kind_of_tokenizer_gets_its_llama_cpp_pre_tokenizer(tokenizers):
    for kind, tok in tokenizers.items():
        assert pre_tokenizer_name(json.loads(tok.to_json())) == kind.removesuffix("-bos")


def test_vocabulary_fields(tokenizers):
    tok = tokenizers["gpt-2"]
    v = gguf_vocab(tok, 448)
    assert len(v.tokens) == len(v.types) == 448  # the model's rows, past the tokenizer's 400
    assert v.tokens[400:] == [f"[PAD{i}]" for i in range(400, 448)] and set(v.types[400:]) == {UNUSED}
    assert v.types[tok.eos_id] == v.types[tok.pad_id] == CONTROL and v.types[300] == NORMAL
    assert len(v.merges) == 400 - 256 - 2 and all(len(m.split(" ")) == 2 for m in v.merges)
    # no BOS of its own: texts start with the end-of-text token, nothing added
    assert (v.bos_id, v.add_bos, v.add_eos) == (tok.eos_id, False, False)
    bos = gguf_vocab(tokenizers["gpt-2-bos"], 400)
    assert bos.add_bos and bos.tokens[bos.bos_id] == "<|bos|>"
    llama = gguf_vocab(tokenizers["llama-bpe"], 400)
    assert llama.add_bos and llama.tokens[llama.bos_id] == "<|begin_of_text|>"
    with pytest.raises(UserError, match="more than the model's vocabulary of 300"):
        gguf_vocab(tok, 300)


def test_tokenizers_llama_cpp_would_read_differently_are_refused(tokenizers):
    spec = json.loads(tokenizers["gpt-2"].to_json())
    cases = {
        "adds a prefix space": spec | {"pre_tokenizer": spec["pre_tokenizer"] | {"add_prefix_space": True}},
        "Metaspace": spec | {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}},
        "Whitespace then Digits": spec | {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"}, {"type": "Digits", "individual_digits": True}]}},
    }
    for needle, broken in cases.items():
        with pytest.raises(UserError, match=needle):
            pre_tokenizer_name(broken)
    from tokenizers import Tokenizer as Backend

    from lmforge.data.text.tokenizer import Tokenizer

    def wrap(spec):
        return Tokenizer(Backend.from_str(json.dumps(spec)), eos_token="<|endoftext|>")

    with pytest.raises(UserError, match="byte fallback"):
        gguf_vocab(wrap(spec | {"model": spec["model"] | {"byte_fallback": True}}), 400)
    with pytest.raises(UserError, match="normalizer .Lowercase."):
        gguf_vocab(wrap(spec | {"normalizer": {"type": "Lowercase"}}), 400)


def test_llama_arch_rows_turn_rotate_half_into_adjacent_pairs():
    """llama.cpp's llama architecture rotates (x[2i], x[2i+1]); ours (x[i], x[i+d/2]). With the
    export's q/k row order, the adjacent-pair rotation of the reordered projection equals the
    reordered rotate-half one, so q·k (what attention sees) is unchanged."""
    from lmforge.models.gguf import _layout

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64)
    rng = np.random.default_rng(0)
    wq, x = rng.normal(size=(32, 32)), rng.normal(size=32)
    angles = rng.uniform(0, 6, size=8)  # one per pair of a 16-dim head
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate_half(v):  # ours, per head
        a, b = v[:8], v[8:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    def rotate_pairs(v):  # llama.cpp's "normal" RoPE, per head
        a, b = v[0::2], v[1::2]
        out = np.empty_like(v)
        out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    ours = (wq @ x).reshape(2, 16)
    theirs = (_layout("attn.wq.weight", wq, cfg, "llama") @ x).reshape(2, 16)
    for h in range(2):
        expected = rotate_half(ours[h])
        np.testing.assert_allclose(rotate_pairs(theirs[h]), np.stack([expected[:8], expected[8:]], 1).ravel())
    assert _layout("attn.wq.weight", wq, cfg, "qwen2") is wq  # NeoX RoPE is rotate-half: no reorder


def model_config(**kw) -> ModelConfig:
    return ModelConfig(**dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64) | kw)


def test_models_llama_cpp_cannot_compute_are_refused():
    from lmforge.config.model import RopeScaling

    assert check(model_config()) == "llama" and check(model_config(n_experts=4, top_k=2)) == "llama"
    assert check(model_config(family="gemma3_text", qk_norm="head", norm_position="sandwich", mlp_activation="gelu_tanh",
                              scale_embeddings=True, tie_embeddings=True)) == "gemma3"
    assert check(model_config(family="mistral", sliding_window=64)) == "llama"  # a window as long as the context
    refused = {
        "llama.cpp's llama architecture attends to the whole context": model_config(family="mistral", sliding_window=8),
        "head_dim 24 × 4 heads ≠ d_model 64": model_config(family="qwen2", qkv_bias=True, head_dim=24),
        "always uses the embedding": model_config(family="gemma", mlp_activation="gelu_tanh", scale_embeddings=True),
        "clip_qkv": model_config(clip_qkv=8.0),
        "scales queries by 1/√16": model_config(
            family="gemma2", mlp_activation="gelu_tanh", scale_embeddings=True, norm_position="sandwich", head_dim=16,
            attn_scale_dim=20, tie_embeddings=True),
        "llama architecture only": model_config(family="qwen3", qk_norm="head", rope_scaling=RopeScaling(
            type="llama3", factor=8, original_max_seq_len=16)),
        "beta_fast 16.0": model_config(rope_scaling=RopeScaling(type="yarn", factor=4, original_max_seq_len=16,
                                                                beta_fast=16)),
    }
    for needle, cfg in refused.items():
        with pytest.raises(UserError, match=needle.replace("(", r"\(")):
            check(cfg)


def test_chat_formats_are_recognised_by_what_they_render():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from lmforge.models.modelfile import chat_format, modelfile
    from lmforge.data.chat import CHAT_TEMPLATE

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    llama3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    other = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"

    def render(template):
        t = ImmutableSandboxedEnvironment().from_string(template)
        return lambda m: t.render(messages=m, add_generation_prompt=True, eos_token="</s>", bos_token="<s>")

    assert chat_format(render(CHAT_TEMPLATE), "</s>", None).name == "lmforge"
    assert chat_format(render(chatml), "</s>", None).name == "chatml"
    assert chat_format(render(llama3), "</s>", "<s>").name == "llama3"  # its BOS is llama.cpp's to add
    assert chat_format(render(other), "</s>", None) is None
    text = modelfile("model-f16.gguf", chat_format(render(chatml), "</s>", None), "</s>", True)
    assert text.startswith("FROM ./model-f16.gguf\n") and 'TEMPLATE """{{- range .Messages }}<|im_start|>' in text
    assert 'PARAMETER stop "</s>"' in text and 'PARAMETER stop "<|im_end|>"' in text
    plain = modelfile("m.gguf", chat_format(render(CHAT_TEMPLATE), "</s>", None), "</s>", True)
    assert "### Assistant:\n{{ .Content }}</s>" in plain and plain.count("PARAMETER stop") == 1
    assert "TEMPLATE \"\"\"" not in modelfile("m.gguf", None, "</s>", True)


@pytest.mark.integration  # imports the exporter (transformers, huggingface_hub): seconds on a cold process
def test_export_gguf_bad_input_is_one_line(tmp_path, tokenizers):
    from lmforge.models import build_model, save_pretrained

    ckpt = tmp_path / "ckpt"
    save_pretrained(build_model(model_config(vocab_size=448)), model_config(vocab_size=448), ckpt,
                    tokenizer_dir=tokenizers["gpt-2"].path)
    base = ["export", "--checkpoint", ckpt, "--format", "gguf", "--out", tmp_path / "out"]
    assert_one_line_error(cli(*base, "--dtype", "q4_k"), "--dtype 'q4_k'", "f32, f16, bf16, q8_0")
    assert_one_line_error(cli(*base, "--dtype", "float16"), "for --format gguf")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli("export", "--checkpoint", tmp_path / "empty", "--format", "gguf", "--out",
                              tmp_path / "out"), "holds no model")
    bare = tmp_path / "bare"
    save_pretrained(build_model(model_config()), model_config(), bare)
    assert_one_line_error(cli("export", "--checkpoint", bare, "--format", "gguf", "--out", tmp_path / "out"),
                          "holds no tokenizer", "--tokenizer")
    mistral = checkpoint(tmp_path, tokenizers["gpt-2"], "mistral")  # its window (8) is shorter than the context
    assert_one_line_error(cli("export", "--checkpoint", mistral, "--format", "gguf", "--out", tmp_path / "out"),
                          "sliding_window 8", "attends to the whole context")
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_export_gguf_to_a_file_replaces_it_atomically(tmp_path, tokenizers):
    """`--out FILE.gguf` is the GGUF file itself. An existing one is replaced only with --overwrite, by a
    file written beside it and renamed over it (issue 59: NotADirectoryError, a traceback, after the
    whole export was built); a file that is not a GGUF model is never replaced."""
    import gguf

    ckpt = checkpoint(tmp_path, tokenizers["gpt-2"])
    out = tmp_path / "m.gguf"
    cli("export", "--checkpoint", ckpt, "--format", "gguf", "--dtype", "f32", "--out", out, check=True)
    first = out.read_bytes()
    assert gguf.GGUFReader(str(out)).fields["general.architecture"] is not None
    assert_one_line_error(cli("export", "--checkpoint", ckpt, "--format", "gguf", "--out", out),
                          "already holds a GGUF model", "--overwrite")
    assert out.read_bytes() == first
    cli("export", "--checkpoint", ckpt, "--format", "gguf", "--dtype", "f16", "--out", out, "--overwrite", check=True)
    assert out.read_bytes() != first and len(out.read_bytes()) < len(first)  # the f16 export, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".m", "m."))) == ["m.gguf"]
    notes = tmp_path / "notes.gguf"
    notes.write_text("my notes\n")
    assert_one_line_error(cli("export", "--checkpoint", ckpt, "--format", "gguf", "--out", notes, "--overwrite"),
                          "not a GGUF model")
    assert notes.read_text() == "my notes\n"


# ------------------------------------------------------------------------------- llama.cpp itself

def checkpoint(tmp_path: Path, tok, family: str | None = None) -> Path:
    """A model folder with ``tok``: one of tests/family_models.py's random Hugging Face models, or
    (None, "moe") a random lmforge model — 448 rows, past the tokenizer's 400 (the padded rows)."""
    from lmforge.models import build_model, save_pretrained

    folder = tmp_path / f"ckpt-{family}"
    if family in (None, "moe"):
        cfg = model_config(vocab_size=448, **(dict(n_experts=4, top_k=2, expansion_ratio=1.5) if family else {}))
        torch.manual_seed(0)
        save_pretrained(build_model(cfg).eval(), cfg, folder, tokenizer_dir=tok.path)
    else:
        hf_model(family, vocab_size=448).save_pretrained(folder)
        for f in Path(tok.path).iterdir():  # the tokenizer's files beside the model's
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def export_gguf(ckpt: Path, out: Path, dtype: str) -> Path:
    from lmforge.train.export import export

    export(str(ckpt), str(out), fmt="gguf", dtype=dtype)
    return out / f"model-{dtype}.gguf"


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["gpt-2", "gpt-2-bos", "llama-bpe", "qwen2"])
def test_llama_cpp_tokenizes_like_lmforge(kind, tokenizers, llama_cpp, tmp_path):
    """Same ids on a corpus sample with special tokens (BOS added by both, or by neither), and the
    same text back."""
    tok = tokenizers[kind]
    llm = llama_cpp.Llama(model_path=str(export_gguf(checkpoint(tmp_path, tok), tmp_path / "g", "f16")),
                          vocab_only=True, verbose=False)
    for text in corpus_sample():
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert ids == tok.encode(text), text
        assert llm.detokenize(ids, special=True).decode() == tok.decode(ids)
    with_bos = kind in ("gpt-2-bos", "llama-bpe")
    assert tok.prefix_ids == ids[:1] if with_bos else not tok.prefix_ids


FAMILIES = ["llama", "qwen2", "qwen3", "olmo2", "gemma", "gemma3_text", "moe"]


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_computes_our_logits(family, tokenizers, llama_cpp, tmp_path):
    """Every dtype within its tolerance (the module's docstring) on 24 tokens: past the sliding windows (8) and
    the RoPE-scaling cases' original context (16). Families: tests/family_models.py's cases (llama3
    scaling and a tied head; q/k/v biases; per-head q/k norms with YaRN; post-norms; Gemma's GeGLU,
    offset norms and head size; Gemma 3's windows with their own RoPE), `moe` our MoE as Mixtral."""
    from llamacpp import load, logits
    from lmforge.train.locate import load_model

    ckpt = checkpoint(tmp_path, tokenizers["gpt-2"], family)
    ours, _, _ = load_model(str(ckpt))
    x = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ours(x)[0].numpy()
    for dtype in DTYPES:
        got = logits(load(llama_cpp, export_gguf(ckpt, tmp_path / dtype, dtype)), x[0].tolist())
        err = float(np.abs(got - ref).max() / ref.std())
        bound = F32 + (GELU if family.startswith("gemma") else 0.0)
        if dtype != "f32":
            with torch.no_grad():
                rounding = float(np.abs(rounded(ours, dtype)(x)[0].numpy() - ref).max() / ref.std())
            bound += ROUNDING * rounding
        print(f"{family} {dtype}: max |Δlogit| / std = {err:.2e} (bound {bound:.2e})")
        assert err <= bound, (family, dtype, err, bound)


def rounded(model, dtype: str):
    """A copy of ``model`` with its matrices rounded as a GGUF of ``dtype`` stores them (q8_0: in
    blocks of 32 along the input dimension: the last of a matrix, the middle of our 3-D experts)."""
    import copy

    import gguf

    out = copy.deepcopy(model)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for p in out.parameters():
        if p.ndim < 2:
            continue
        if dtype != "q8_0":
            p.data = p.data.to(torch.float16 if dtype == "f16" else torch.bfloat16).float()
            continue
        a = p.data.numpy() if p.ndim == 2 else p.data.transpose(1, 2).numpy()
        a = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a), q8), q8).reshape(a.shape)
        p.data = torch.from_numpy(a) if p.ndim == 2 else torch.from_numpy(a).transpose(1, 2).contiguous()
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}]


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["gpt-2", "qwen2"])
def test_llama_cpp_renders_the_chat_prompt(kind, tokenizers, llama_cpp, tmp_path):
    """The chat template inside the GGUF renders what lmforge (transformers) renders, through
    llama-cpp-python's chat formatter, and llama.cpp tokenizes that prompt as lmforge does; the
    Modelfile carries the format Ollama needs. gpt-2: a fine-tuned lmforge model's plain template;
    qwen2: ChatML, which llama.cpp's own (C++) renderer knows too."""
    import ctypes
    import shutil

    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from lmforge.data.chat import load_chat_template
    from lmforge.data.chat import CHAT_TEMPLATE
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.models.io import write_chat_template

    tok = tokenizers[kind]
    tok_dir = tmp_path / "tok"
    shutil.copytree(tok.path, tok_dir)
    template = CHAT_TEMPLATE if kind == "gpt-2" else CHATML
    write_chat_template(tok_dir, template)
    tok = load_tokenizer(tok_dir)
    gguf = export_gguf(checkpoint(tmp_path, tok), tmp_path / "g", "f16")
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    assert llm.metadata["tokenizer.chat_template"] == template
    text = lambda i: llm.detokenize([i], special=True).decode()  # noqa: E731
    prompt = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token=text(llm.token_eos()),
                                 bos_token=text(llm.token_bos()))(messages=CHAT).prompt
    assert prompt == load_chat_template(str(tok_dir)).render(CHAT, add_generation_prompt=True)
    assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == tok.encode(prompt)
    modelfile = (gguf.parent / "Modelfile").read_text()
    assert f"FROM ./{gguf.name}" in modelfile and f'PARAMETER stop "{tok.eos_token}"' in modelfile
    assert ("chat format: lmforge" if kind == "gpt-2" else "chat format: chatml") in modelfile
    if kind == "qwen2":
        msgs = (llama_cpp.llama_chat_message * len(CHAT))(
            *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in CHAT])
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_chat_apply_template(template.encode(), msgs, len(CHAT), True, buf, len(buf))
        assert buf.raw[:n].decode() == prompt
