"""Every supported Hugging Face family: import, logits parity with transformers (fp32, CPU,
max abs diff ≤ 1e-4), export back to the same architecture, and the refusals."""

from __future__ import annotations

import pytest
import torch

from family_models import CASES, SHAPE, hf_config, hf_model
from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.flops import param_counts
from lmforge.models import build_model, load_pretrained, num_params, save_hf
from lmforge.models.generate import generate
from lmforge.models.hf import from_hf_config, from_hf_state_dict, to_hf_config

import transformers  # a required dependency: a broken install fails here, it is not skipped

TOL = 1e-4
# 40 tokens: longer than the sliding windows (8) and the RoPE-scaling cases' original context (16).
IDS = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
# The option that makes each case differ from a plain Llama: dropping it must change the logits.
FEATURE = {"llama": "rope_scaling", "mistral": "sliding_window", "qwen2": "qkv_bias", "qwen3": "qk_norm",
           "olmo2": "norm_position", "gemma": "scale_embeddings", "gemma2": "logit_softcap",
           "gemma3_text": "norm_position",
           "mixtral": "sliding_window"}


def ours_from(hf, cfg: ModelConfig):
    model = build_model(cfg, init=False).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return model


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.integration
@pytest.mark.parametrize("family", list(CASES))
def test_import_export_parity(family, tmp_path):
    hf = hf_model(family)
    cfg = from_hf_config(hf.config)
    assert cfg.family == family
    model = ours_from(hf, cfg)
    assert param_counts(cfg)["total"] == num_params(model)  # the estimator counts the new parameters
    with torch.no_grad():
        expected = hf(IDS).logits
        assert max_diff(model(IDS), expected) <= TOL
        # the family's feature is load-bearing here: without it the logits are different
        plain = {"rope_scaling": None, "sliding_window": None, "qkv_bias": False, "qk_norm": "none",
                 "norm_position": "pre", "scale_embeddings": False, "logit_softcap": None}[FEATURE[family]]
        reduced = cfg.model_copy(update={FEATURE[family]: plain, "family": None})
        other = build_model(reduced, init=False).eval()
        other.load_state_dict({k: v for k, v in model.state_dict().items() if k in other.state_dict()})
        assert max_diff(other(IDS), expected) > 1e-3

    # export: the same architecture, loaded by transformers, same logits
    save_hf(model, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert max_diff(back(IDS).logits, expected) <= TOL
    # and our loader reads the exported folder into the same config
    again, cfg2 = load_pretrained(tmp_path / "out")
    assert cfg2.model_dump(exclude={"preset"}) == cfg.model_dump(exclude={"preset"})


@pytest.mark.integration
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_generation_matches_transformers(family):
    """Cached decoding past the window: our KV cache + band mask vs transformers' generate (Gemma 2:
    soft-capped attention on alternating windowed and global layers; Gemma 3: windowed layers and
    a global one, each with its own RoPE)."""
    hf = hf_model(family)
    model = ours_from(hf, from_hf_config(hf.config))
    prompt = IDS[:1, :12]
    hf.generation_config.eos_token_id = None  # (Gemma's config names token 1: generate all 10 here)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(prompt))[0, 12:].tolist()
    assert generate(model, prompt[0].tolist(), 10, temperature=0) == want


def _multimodal_gemma3():
    """A tiny Gemma3ForConditionalGeneration: the gemma3_text case's text model, a one-layer
    vision tower; every norm randomized."""
    _, text = CASES["gemma3_text"]
    config = transformers.Gemma3Config(
        text_config=SHAPE | text | {"vocab_size": 101},
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.integration
def test_multimodal_gemma3_imports_its_text_model(tmp_path):
    """Gemma 3 4B and larger are multimodal (`gemma3`): import reads the text model (its weights
    under `language_model.model.` in the saved folder, `model.language_model.` in memory), with
    the logits transformers gives for text, and exports it as the text-only Gemma3ForCausalLM."""
    hf = _multimodal_gemma3()
    hf.save_pretrained(tmp_path / "mm")
    model, cfg = load_pretrained(tmp_path / "mm")
    assert cfg.family == "gemma3_text" and cfg.sliding_window_pattern == 3
    with torch.no_grad():
        expected = hf(input_ids=IDS).logits
        assert max_diff(model.eval()(IDS), expected) <= TOL
        in_memory = ours_from(hf, cfg)  # the in-memory names
        assert max_diff(in_memory(IDS), expected) <= TOL
    save_hf(model, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert max_diff(back(IDS).logits, expected) <= TOL


def test_families_from_our_own_features():
    """A model trained from scratch with a family's features exports as that family."""
    from lmforge.models.families import family_of

    base = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=101)
    assert family_of(ModelConfig(**base)).name == "llama"
    assert family_of(ModelConfig(**base, qk_norm="head")).name == "qwen3"
    assert family_of(ModelConfig(**base, qkv_bias=True)).name == "qwen2"
    assert family_of(ModelConfig(**base, qk_norm="full", norm_position="post")).name == "olmo2"
    assert family_of(ModelConfig(**base, sliding_window=128)).name == "mistral"
    gemma = dict(mlp_activation="gelu_tanh", scale_embeddings=True)
    assert family_of(ModelConfig(**base, **gemma)).name == "gemma"
    assert family_of(ModelConfig(**base, **gemma, qk_norm="head", norm_position="sandwich", sliding_window=64,
                                 sliding_window_pattern=2, rope_theta_local=1e4)).name == "gemma3_text"
    with pytest.raises(UserError, match="sliding_window_pattern"):  # only Gemma 3 has global layers among windowed ones
        family_of(ModelConfig(**base, sliding_window=64, sliding_window_pattern=2))
    with pytest.raises(UserError, match="no Hugging Face family"):  # Gemma has both, or neither is plain
        family_of(ModelConfig(**base, mlp_activation="gelu_tanh"))
    with pytest.raises(ValueError, match="the experts are SwiGLU"):
        ModelConfig(**base, n_experts=4, top_k=2, mlp_activation="gelu_tanh")
    with pytest.raises(UserError, match="no Hugging Face family"):
        family_of(ModelConfig(**base, qkv_bias=True, qk_norm="head"))
    with pytest.raises(UserError, match="model.family llama"):
        to_hf_config(ModelConfig(**base, family="llama", qkv_bias=True))


@pytest.mark.parametrize("family,change,needle", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("gemma", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for gemma .expected 'gelu_pytorch_tanh'"),
    ("gemma3_text", {"sliding_window": None}, "config.json: sliding_window_pattern needs a sliding_window"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported for gemma3_text"),
    ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "regular pattern"),
    ("llama", {"attention_bias": True}, "attention_bias=true is not supported for llama"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}, "some layers only"),
])
def test_unsupported_options_are_one_line(family, change, needle):
    config = hf_config(family)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(UserError, match=needle) as e:
        from_hf_config(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_configs_of_transformers_4_read_the_same(family):
    """Before transformers 4.53 (lmforge allows 4.45) Gemma configs had no `layer_types`, and Gemma 3
    kept its windowed layers' RoPE base in `rope_local_base_freq`: the same model either way."""
    from types import SimpleNamespace

    new = hf_config(family)
    old = {k: v for k, v in new.to_dict().items() if k not in ("layer_types", "rope_parameters")}
    rope = new.rope_parameters
    if family == "gemma3_text":  # every 3rd layer global; linear ×2 on those, 1e4 on the others
        old |= dict(sliding_window_pattern=3, rope_theta=rope["full_attention"]["rope_theta"],
                    rope_scaling={"rope_type": "linear", "factor": 2.0},
                    rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    else:
        old |= dict(rope_theta=rope["rope_theta"], rope_scaling=None)
    assert from_hf_config(SimpleNamespace(**old)) == from_hf_config(new)


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(UserError, match="model_type 'phi3' is not supported; supported: llama, mistral, qwen2, "
                                        "qwen3, olmo2, gemma, gemma2, gemma3_text, mixtral"):
        from_hf_config(transformers.Phi3Config())


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(CASES))
def test_continued_pretraining_from_each_family(family, tmp_path, tiny_data):
    """hf:/path import → a few steps of continued pretraining (in-process) → export back to the
    same architecture, which transformers loads with the same logits as our final model."""
    import shutil

    from conftest import tiny_run_config
    from lmforge.train.export import export
    from lmforge.train.locate import load_model
    from train_helpers import train_in_process

    hf = hf_model(family, vocab_size=512)
    hf.save_pretrained(tmp_path / "hf")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_data.tokenizer / f, tmp_path / "hf" / f)
    raw = tiny_run_config(tiny_data, tmp_path / "cpt", training_duration="2ba", save_interval="2ba",
                          custom_weights_path=f"hf:{tmp_path / 'hf'}", task_type="continued_pretrain",
                          **{"eval.prompts": [], "eval.interval": "2ba"})
    del raw["model"], raw["tokenizer"]  # both from the weights folder
    result = train_in_process(raw)
    trained, cfg, _ = load_model(result.final_dir)
    assert cfg.family == family
    assert not torch.equal(trained.tok_embeddings.weight, from_hf_state_dict(hf.state_dict(), cfg)[
        "tok_embeddings.weight"])  # it trained
    export(result.final_dir, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    x = IDS * 5 % 512
    with torch.no_grad():
        assert max_diff(back(x).logits, trained.eval()(x)) <= TOL


# Published Gemma shapes (their config.json values; no weights) and their sizes in billions.
PUBLISHED_GEMMA = [
    ("GemmaConfig", dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=256), 2.51),  # Gemma 2B
    ("Gemma2Config", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                          sliding_window=4096), 9.24),  # Gemma 2 9B
    ("Gemma2Config", dict(vocab_size=256000, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                          num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144,
                          sliding_window=4096), 27.23),  # Gemma 2 27B: queries scaled by 1/√144
    ("Gemma3TextConfig", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=512, rope_parameters={
                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     1.00),  # Gemma 3 1B
    ("Gemma3Config", dict(text_config=dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
     3.88),  # Gemma 3 4B (multimodal): its text model, 0.67B embedding + 3.21B in the blocks
]


@pytest.mark.parametrize("config_class,fields,billions", PUBLISHED_GEMMA)
def test_published_gemma_shapes_read_at_their_size(config_class, fields, billions):
    """The published Gemma configs read into the shapes of their published sizes (the estimator's
    count, which the parity test ties to the built model), with their windows and soft-caps."""
    cfg = from_hf_config(getattr(transformers, config_class)(**fields))
    assert param_counts(cfg)["total"] / 1e9 == pytest.approx(billions, abs=0.01)
    if config_class == "Gemma2Config":
        assert (cfg.sliding_window_pattern, cfg.attn_softcap, cfg.logit_softcap) == (2, 50.0, 30.0)
        assert cfg.attn_scale_dim == (144 if cfg.d_model == 4608 else None)
    if config_class.startswith("Gemma3"):
        assert (cfg.sliding_window_pattern, cfg.rope_theta, cfg.rope_theta_local) == (6, 1e6, 1e4)
        assert cfg.rope_scaling is None if cfg.d_model == 1152 else cfg.rope_scaling.factor == 8.0
