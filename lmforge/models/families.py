"""The Hugging Face model families lmforge imports and exports, one explicit spec each.

A family is data: the `transformers` config class and architecture it reads and writes, the
block features it always has (plain `ModelConfig` options the transformer implements), the
Hugging Face names of its two per-layer norms, and which optional features its config may
turn on. `lmforge/models/hf.py` turns a spec into config and weight-name mappings; nothing
else in lmforge branches on a family.

| family  | features                                   | optional                     |
|---------|--------------------------------------------|------------------------------|
| llama   | (plain: pre-norm RMSNorm, RoPE, SwiGLU)     | rope_scaling (llama3, …)     |
| mistral | as llama                                    | sliding_window, rope_scaling |
| qwen2   | q/k/v biases                                | sliding_window (all layers), rope_scaling |
| qwen3   | q/k RMSNorm per head                        | sliding_window (all layers), rope_scaling |
| olmo2   | q/k RMSNorm over all heads, norms after each sublayer | rope_scaling       |
| gemma   | GeGLU (tanh GELU), embeddings × √d_model, norm weights stored as offsets from 1 | rope_scaling |
| gemma2  | as gemma; norms before and after each sublayer | window pattern, soft-caps, query scale |
| gemma3_text | as gemma2, q/k RMSNorm per head, no soft-caps | window pattern with own RoPE, query scale |
| mixtral | mixture of experts (top-k softmax SwiGLU)  | sliding_window, rope_scaling |

The multimodal Gemma 3 (`gemma3`) imports as its text model, a gemma3_text (`hf._TEXT_TOWERS`).
Anything else a config.json asks for (another architecture, biases elsewhere, another
activation, per-layer window patterns, partial rotary, dynamic/longrope scaling) is refused
with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family and the HF config's model_type
    config_class: str  # in `transformers`
    architecture: str  # written to config.json "architectures"
    features: dict = field(default_factory=dict)  # ModelConfig options this family always has
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")  # HF names of attn_norm, mlp_norm
    out_norms: tuple[str, str] = ()  # sandwich norms: HF names of attn_out_norm, mlp_out_norm
    sliding_window: bool = False  # may its config set a (whole-model) sliding attention window
    # ... or one on most layers, every N-th layer global (sliding_window_pattern), the windowed layers
    # with their own RoPE base (rope_theta_local) where local_rope
    window_pattern: bool = False
    local_rope: bool = False
    query_scale: bool = False  # may its queries be scaled by 1/√x, x not head_dim (attn_scale_dim)
    softcaps: bool = False  # may its attention scores and logits be soft-capped
    moe: bool = False
    # Norm weights stored as offsets from 1 (Gemma's norms multiply by 1 + weight): ours hold
    # the factor itself, so import adds 1 and export subtracts it (the same math in fp32).
    norm_offset: bool = False


# The block features a family fixes; everything not listed is the plain-Llama value.
PLAIN = {"qkv_bias": False, "qk_norm": "none", "norm_position": "pre", "mlp_activation": "silu",
         "scale_embeddings": False}

LLAMA = Family("llama", "LlamaConfig", "LlamaForCausalLM")
MISTRAL = Family("mistral", "MistralConfig", "MistralForCausalLM", sliding_window=True)
QWEN2 = Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {"qkv_bias": True}, sliding_window=True)
QWEN3 = Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"qk_norm": "head"}, sliding_window=True)
OLMO2 = Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {"qk_norm": "full", "norm_position": "post"},
               norms=("post_attention_layernorm", "post_feedforward_layernorm"))
GEMMA = Family("gemma", "GemmaConfig", "GemmaForCausalLM", {"mlp_activation": "gelu_tanh", "scale_embeddings": True},
               norm_offset=True)
SANDWICH = dict(norms=("input_layernorm", "pre_feedforward_layernorm"),
                out_norms=("post_attention_layernorm", "post_feedforward_layernorm"))
GEMMA2 = Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", GEMMA.features | {"norm_position": "sandwich"},
                **SANDWICH, sliding_window=True, window_pattern=True, query_scale=True, softcaps=True,
                norm_offset=True)
GEMMA3 = Family("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
                GEMMA.features | {"qk_norm": "head", "norm_position": "sandwich"}, **SANDWICH,
                sliding_window=True, window_pattern=True, local_rope=True, query_scale=True, norm_offset=True)
MIXTRAL = Family("mixtral", "MixtralConfig", "MixtralForCausalLM", sliding_window=True, moe=True)

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2, GEMMA, GEMMA2, GEMMA3,
                                                    MIXTRAL)}


# Options only some families may set (None elsewhere), named in the refusals.
OPTIONAL = ("sliding_window", "sliding_window_pattern", "rope_theta_local", "attn_scale_dim", "attn_softcap",
            "logit_softcap")


def features_of(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in PLAIN}


def _fits(spec: Family, cfg: ModelConfig) -> bool:
    return (features_of(cfg) == PLAIN | spec.features and spec.moe == cfg.is_moe
            and (spec.sliding_window or cfg.sliding_window is None)
            and (spec.window_pattern or cfg.sliding_window_pattern is None)
            and (spec.local_rope or cfg.rope_theta_local is None)
            and (spec.query_scale or cfg.attn_scale_dim is None)
            and (spec.softcaps or cfg.attn_softcap is None and cfg.logit_softcap is None))


def family_of(cfg: ModelConfig) -> Family:
    """The family a model exports as: `cfg.family`, else the first whose features match
    (a model trained from scratch with qk_norm: head exports as Qwen3, and so on)."""
    if cfg.family is not None:
        spec = FAMILIES[cfg.family]
        if not _fits(spec, cfg):
            have = {k: v for k, v in features_of(cfg).items() if v != PLAIN[k]}
            for key in OPTIONAL:
                if getattr(cfg, key) is not None:
                    have[key] = getattr(cfg, key)
            want = spec.features or "none of qkv_bias, qk_norm, post norms, a GELU gate, scaled embeddings"
            raise UserError(f"model.family {spec.name}: the model's features {have or 'plain'} do not match "
                            f"{spec.name}'s ({want}{', sliding_window' if spec.sliding_window else ''})")
        return spec
    for spec in FAMILIES.values():
        if _fits(spec, cfg):
            return spec
    options = "".join(f", {k}={getattr(cfg, k)}" for k in OPTIONAL if getattr(cfg, k) is not None)
    raise UserError(f"model: no Hugging Face family has this combination of features "
                    f"({features_of(cfg)}{options}); see lmforge/models/families.py")


def family_for_hf(hf_config) -> Family:
    kind = getattr(hf_config, "model_type", None)
    if kind not in FAMILIES:
        raise UserError(f"config.json: model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[kind]
