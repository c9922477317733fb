"""Model shapes: the `model:` section of a run config, and the preset sizes.

A `model:` value may be a preset name (``llama-1b``), a mapping with a preset plus
overrides (``{preset: llama-125m, n_layers: 6}``), or a full custom shape. Shapes are
plain data; `lmforge.models` builds modules from them and `lmforge.plan` counts
their parameters and FLOPs.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from lmforge.config.checked import Checked
from lmforge.config.limits import MAX_ROPE_FACTOR, MAX_SEQ_LEN, MAX_VOCAB
from lmforge.errors import UserError

# Hugging Face architectures lmforge imports and exports; their specs: lmforge/models/families.py.
Family = Literal["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma", "gemma2", "gemma3_text", "mixtral"]
FAMILIES: tuple[str, ...] = get_args(Family)


# Hugging Face RoPE types a trained model cannot carry, and why (named in the refusal).
UNSUPPORTED_ROPE = {
    "dynamic": "dynamic NTK rescales by each input's length at inference, so no one trained model has it; "
               "for a static NTK-style base change raise model.rope_theta",
    "ntk": "raise model.rope_theta for NTK-aware scaling (a larger base), or use yarn (NTK-by-parts)",
    "longrope": "per-dimension factors searched for one model; lmforge has no such search",
    "default": "that is no scaling: leave rope_scaling out",
}


class RopeScaling(Checked):
    """Long-context RoPE frequency scaling, as published with Llama 3.1+ (llama3), Qwen (yarn)
    and older fine-tunes (linear). Values are Hugging Face's `rope_parameters` of the same name."""


    type: Literal["linear", "llama3", "yarn"] = Field(..., description="how the frequencies are rescaled")
    factor: float = Field(..., gt=0, le=MAX_ROPE_FACTOR, description="context extension factor")
    original_max_seq_len: int | None = Field(
        None, gt=0, le=MAX_SEQ_LEN, description="llama3/yarn: context length of the original pretraining")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original/low are scaled")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original/high are kept")
    beta_fast: float = Field(32.0, gt=0, description="yarn: high-frequency boundary (rotations)")
    beta_slow: float = Field(1.0, gt=0, description="yarn: low-frequency boundary (rotations)")
    attention_factor: float | None = Field(None, gt=0, description="yarn: cos/sin scale; default 0.1·ln(factor)+1")
    truncate: bool = Field(True, description="yarn: round the correction range to whole dimensions")

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v):
        if v in UNSUPPORTED_ROPE:
            raise ValueError(f"{v!r} is not supported ({UNSUPPORTED_ROPE[v]}); expected linear, llama3 or yarn")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        if self.type in ("llama3", "yarn") and self.original_max_seq_len is None:
            raise ValueError(f"rope_scaling type {self.type} needs original_max_seq_len")
        if self.factor < 1:
            raise ValueError(f"rope_scaling: factor {self.factor:g} would shorten the context; it extends it "
                             "(the new length over original_max_seq_len, e.g. 4 for 4,096 → 16,384)")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must be larger than low_freq_factor")
        return self


VOCAB_MULTIPLE = 64  # embedding and head matmuls run faster on multiples of 64


def padded_vocab(tokenizer_vocab: int) -> int:
    """The model vocabulary for a tokenizer's: rounded up to a multiple of 64."""
    return VOCAB_MULTIPLE * -(-tokenizer_vocab // VOCAB_MULTIPLE)


class ModelConfig(Checked):
    """A Llama-style decoder, optionally with mixture-of-experts feed-forward layers."""


    preset: str | None = Field(None, description="preset this shape started from (informational)")
    d_model: int = Field(..., gt=0, le=1 << 20, description="hidden size")
    n_layers: int = Field(..., gt=0, le=1 << 14, description="transformer blocks")
    n_heads: int = Field(..., gt=0, le=1 << 14, description="query heads")
    n_kv_heads: int | None = Field(None, gt=0, description="key/value heads (GQA); default n_heads")
    head_dim: int | None = Field(None, gt=0, description="per-head size; default d_model // n_heads")
    ffn_hidden: int | None = Field(
        None, gt=0, description="SwiGLU hidden size of dense blocks; default ~8/3·d_model rounded to 256"
    )
    vocab_size: int | None = Field(
        None, gt=0, le=MAX_VOCAB, description="vocabulary; default: the tokenizer's, rounded up to a multiple of 64"
    )
    max_seq_len: int = Field(2048, gt=0, le=MAX_SEQ_LEN, description="longest context the model is built for")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="share input embedding and output head")
    clip_qkv: float | None = Field(None, gt=0, description="clamp q/k/v projections to ±clip_qkv")
    init_std: float = Field(0.02, gt=0, description="std of the normal init of weight matrices")
    # Block features of published families (see lmforge/models/families.py); off = plain Llama.
    family: Family | None = Field(
        None, description="Hugging Face architecture for import/export; default: the family whose features match "
        "(llama for a plain dense model, mixtral for MoE)")
    qkv_bias: bool = Field(False, description="biases on the q/k/v projections (Qwen2)")
    qk_norm: Literal["none", "head", "full"] = Field(
        "none", description="RMSNorm on q and k before RoPE: per head (Qwen3) or over all heads (OLMo 2)")
    norm_position: Literal["pre", "post", "sandwich"] = Field(
        "pre", description="pre: normalize each sublayer's input; post: its output, before the residual add "
        "(OLMo 2); sandwich: both (Gemma 2 and 3)")
    mlp_activation: Literal["silu", "gelu_tanh"] = Field(
        "silu", description="the gate's activation in dense blocks: silu (SwiGLU) or the tanh-approximated GELU "
        "(GeGLU, Gemma)")
    scale_embeddings: bool = Field(False, description="multiply the input embeddings by √d_model (Gemma)")
    rope_scaling: RopeScaling | None = Field(None, description="long-context RoPE scaling (llama3, linear, yarn)")
    sliding_window: int | None = Field(
        None, gt=0, description="each token attends to at most this many tokens, itself included (Mistral)")
    sliding_window_pattern: int | None = Field(
        None, gt=1, description="with sliding_window: every N-th layer (the N-th, 2N-th, …) attends to the whole "
        "context and the others within the window (Gemma 2: 2, Gemma 3: 6); default: every layer within the window")
    rope_theta_local: float | None = Field(
        None, gt=0, description="with sliding_window_pattern: the RoPE base of the windowed layers, without "
        "rope_scaling (Gemma 3: 10000); default: as the others")
    attn_scale_dim: int | None = Field(
        None, gt=0, description="attention scores are scaled by 1/√attn_scale_dim; default head_dim "
        "(Gemma 2 27B: 144)")
    attn_softcap: float | None = Field(
        None, gt=0, description="attention scores become cap·tanh(score/cap) before the softmax (Gemma 2: 50); "
        "on CUDA through FlexAttention, elsewhere as plain matmuls")
    logit_softcap: float | None = Field(
        None, gt=0, description="output logits become cap·tanh(logit/cap) (Gemma 2: 30)")
    # Mixture of experts (n_experts == 0 means a dense model).
    n_experts: int = Field(0, ge=0, le=1 << 16, description="experts per MoE layer; 0 = dense")
    top_k: int = Field(0, ge=0, description="experts each token is routed to")
    expansion_ratio: float = Field(1.75, gt=0, description="expert SwiGLU hidden = ratio · d_model")
    moe_aux_loss_coef: float = Field(0.01, ge=0, description="load-balancing loss weight")
    moe_z_loss_coef: float = Field(0.001, ge=0, description="router z-loss weight")
    moe_jitter: float = Field(0.0, ge=0, description="multiplicative router input jitter (training)")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.family == "mixtral" and not self.n_experts:
            raise ValueError("family mixtral needs n_experts > 0 (a dense model is llama, mistral, qwen2, ...)")
        if self.family not in (None, "mixtral") and self.n_experts:
            raise ValueError(f"family {self.family} is dense; mixture-of-experts models export as mixtral")
        if self.sliding_window_pattern is not None and self.sliding_window is None:
            raise ValueError("sliding_window_pattern needs a sliding_window")
        if self.rope_theta_local is not None and self.sliding_window_pattern is None:
            raise ValueError("rope_theta_local needs a sliding_window_pattern (windowed and global layers)")
        if self.n_experts and self.mlp_activation != "silu":
            raise ValueError(f"mlp_activation {self.mlp_activation} is for dense blocks; "
                             "the experts are SwiGLU (silu)")
        scaling = self.rope_scaling
        if scaling is not None and (scaling.original_max_seq_len or 0) > self.max_seq_len:
            raise ValueError(f"rope_scaling.original_max_seq_len ({scaling.original_max_seq_len}) is above max_seq_len "
                             f"({self.max_seq_len}): RoPE scaling extends a context; set max_seq_len to the extended "
                             "length")
        if self.n_experts and not (0 < self.top_k <= self.n_experts):
            raise ValueError(f"top_k must be in 1..n_experts ({self.n_experts}), got {self.top_k}")
        return self

    def is_local(self, layer: int) -> bool:
        """Does this layer (0-based) attend within the sliding window (else: the whole context)?"""
        if self.sliding_window is None:
            return False
        return self.sliding_window_pattern is None or (layer + 1) % self.sliding_window_pattern != 0

    # Derived sizes: one place, used by the model, the estimator and the exporter.
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(8 * self.d_model / 3)
        return 256 * ((hidden + 255) // 256)

    @property
    def expert_dim(self) -> int:
        return int(self.expansion_ratio * self.d_model)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def label(self) -> str:
        """How logs and `runs list` name the shape: its preset while it is the preset's (its
        vocabulary and context length aside, which a tokenizer and a run set), "<preset>
        (modified)" once other fields differ — a dense twin written as `{preset: moe-tiny,
        n_experts: 0, …}` is not moe-tiny — and "custom" without a preset."""
        if not self.preset or self.preset not in PRESETS:
            return "custom"
        base = get_preset(self.preset)
        kept = {"preset", "vocab_size", "max_seq_len"}
        same = all(getattr(self, f) == getattr(base, f) for f in type(self).model_fields if f not in kept)
        return self.preset if same else f"{self.preset} (modified)"


def _dense(d, layers, heads, kv=None, ffn=None, vocab=None, theta=10000.0, ctx=2048, tie=False):
    return dict(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn,
                vocab_size=vocab, rope_theta=theta, max_seq_len=ctx, tie_embeddings=tie)


def _moe(d, heads, layers):
    # The DBRX-class suite: 16 experts, top-4, GQA with 8 KV heads, RoPE θ 5e5, clip_qkv 8,
    # vocabulary 100352, context 4096, expansion 1.75, untied embeddings.
    return dict(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=8, vocab_size=100352,
                rope_theta=5e5, clip_qkv=8.0, max_seq_len=4096, tie_embeddings=False,
                n_experts=16, top_k=4, expansion_ratio=1.75)


# Dense shapes follow published Llama/MPT-family sizes. vocab_size None = take the tokenizer's.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": _dense(256, 6, 4, kv=2, ffn=768, ctx=512, tie=True),
    "llama-125m": _dense(768, 12, 12, ffn=2048),
    "llama-350m": _dense(1024, 24, 16, ffn=2816),
    "llama-760m": _dense(1536, 24, 16, ffn=4096),
    "llama-1b": _dense(2048, 24, 16, kv=8, ffn=5632),
    "llama-3b": _dense(3072, 28, 24, kv=8, ffn=8192, theta=5e5),
    "llama-7b": _dense(4096, 32, 32, ffn=11008, vocab=32000, ctx=4096),
    "llama-13b": _dense(5120, 40, 40, ffn=13824, vocab=32000, ctx=4096),
    "llama-30b": _dense(6656, 60, 52, ffn=17920, vocab=32000, ctx=4096),
    "llama-70b": _dense(8192, 80, 64, kv=8, ffn=28672, vocab=32000, ctx=4096),
    "moe-tiny": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=512,
                     rope_theta=10000.0, n_experts=8, top_k=2, expansion_ratio=1.0,
                     tie_embeddings=True),
    "moe-9b": _moe(2048, 16, 24),
    "moe-18b": _moe(3072, 24, 22),
    "moe-35b": _moe(4096, 32, 24),
    "moe-73b": _moe(5120, 40, 32),
}


def as_trained(model: ModelConfig, context_length: int | None, from_scratch: bool) -> ModelConfig:
    """The model as its run trained it. Trained from scratch at a context shorter than its
    ``max_seq_len``, it has learned positions up to that context only: that is the length its weights
    claim — what `final/` and an export's ``max_position_embeddings`` say, so that lm-eval or vLLM do
    not score past it (RoPE tables are derived, not stored: the weights are the same). Weights
    continued from (fine-tuning, continued pretraining) keep the length they came with."""
    if from_scratch and context_length and context_length < model.max_seq_len and model.rope_scaling is None:
        return model.model_copy(update={"max_seq_len": int(context_length)})
    return model


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"model: unknown preset {name!r}{hint}; valid presets: {', '.join(PRESETS)}")
    return ModelConfig(preset=name, **PRESETS[name])


def resolve_model(value: Any) -> ModelConfig:
    """Turn a `model:` value (name, {preset, overrides...} or full shape) into a ModelConfig."""
    if isinstance(value, ModelConfig):
        return value
    if isinstance(value, str):
        return get_preset(value)
    if isinstance(value, dict):
        value = dict(value)
        name = value.pop("preset", None)
        base = PRESETS.get(name, {}) if name else {}
        if name:
            get_preset(name)  # raises the friendly error for unknown names
        return ModelConfig(preset=name, **{**base, **value})
    raise UserError(f"model: expected a preset name or a mapping, got {type(value).__name__}")
