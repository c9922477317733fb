"""Hugging Face interop: config and state-dict name mapping for the families in `families.py`
(Llama 3.x, Mistral, Qwen2/2.5, Qwen3, OLMo 2, Gemma 1–3 dense, the text model of multimodal
Gemma 3; Mixtral for MoE).

Our layout was chosen so the mapping is a pure rename: RoPE uses HF's rotate-half pairing, so
q/k rows need no permutation, and SwiGLU w1/w3/w2 are HF's gate/up/down projections (the one
exception: Gemma stores norm weights as offsets from 1, see `Family.norm_offset`). MoE expert
weights are 3-D parameters here — ``w13 [E, d, 2h]`` (gate and up fused, gate first) and
``w2 [E, h, d]`` —; they are split into the per-expert `block_sparse_moe.experts.{j}.w1/w2/w3`
matrices of the published Mixtral checkpoint format, which transformers, vLLM and llama.cpp all
read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.config.model import ModelConfig, RopeScaling
from lmforge.errors import UserError
from lmforge.models.families import Family, family_for_hf, family_of

def to_hf_config(cfg: ModelConfig, *, allow_clip_qkv: bool = False):
    """The `transformers` config of this model's family (see `families.family_of`)."""
    import transformers

    if cfg.vocab_size is None:
        raise UserError("model.vocab_size: must be set to export to Hugging Face format")
    if cfg.clip_qkv is not None and not allow_clip_qkv:
        raise UserError(
            f"model.clip_qkv: {cfg.clip_qkv} has no Hugging Face equivalent; the exported "
            "model matches only while |q|,|k|,|v| stay under the clip (pass allow_clip_qkv=True to accept)")
    spec = family_of(cfg)
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.dim_head,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        hidden_act=_HF_ACT[cfg.mlp_activation],
        bos_token_id=None, eos_token_id=None,  # the exporter sets them from the tokenizer
    )
    if cfg.rope_scaling is not None:
        kwargs["rope_scaling"] = _hf_rope(cfg)
    if spec.moe:
        kwargs.update(intermediate_size=cfg.expert_dim, num_local_experts=cfg.n_experts,
                      num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef)
    else:
        kwargs["intermediate_size"] = cfg.ffn_dim
    if spec.name in ("llama", "qwen3", "olmo2", "gemma"):
        kwargs["attention_bias"] = False
    if spec.name == "llama":
        kwargs["mlp_bias"] = False
    if spec.name in ("qwen2", "qwen3"):  # a window on every layer, or none
        kwargs.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                      max_window_layers=0)
    elif spec.window_pattern:
        kwargs = _gemma_fields(cfg, spec, kwargs)
    elif spec.sliding_window:
        kwargs["sliding_window"] = cfg.sliding_window
    hf = getattr(transformers, spec.config_class)(**kwargs)
    hf.architectures = [spec.architecture]
    return hf


_HF_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}  # mlp_activation -> config.json's hidden_act


def _gemma_fields(cfg: ModelConfig, spec: Family, kwargs: dict) -> dict:
    """``kwargs`` as Gemma 2 and 3's configs take them: each layer's type (windowed or global),
    the query scale, the soft-caps (Gemma 2), Gemma 3's RoPE per layer type (windowed layers:
    rope_theta_local, unscaled) in place of rope_theta / rope_scaling, and the activation under
    its name there, `hidden_activation`."""
    fields = {k: v for k, v in kwargs.items() if k != "hidden_act"}
    fields.update(hidden_activation=kwargs["hidden_act"], query_pre_attn_scalar=cfg.attn_scale_dim or cfg.dim_head,
                  sliding_window=cfg.sliding_window or cfg.max_seq_len,
                  layer_types=["sliding_attention" if cfg.is_local(i) else "full_attention"
                               for i in range(cfg.n_layers)])
    if spec.softcaps:
        fields.update(attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.logit_softcap)
    if spec.local_rope:
        full = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")} | fields.pop("rope_scaling", {})
        local = full if cfg.rope_theta_local is None else {"rope_type": "default", "rope_theta": cfg.rope_theta_local}
        fields["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return fields


def _hf_rope(cfg: ModelConfig) -> dict:
    s = cfg.rope_scaling
    out = {"rope_type": s.type, "factor": s.factor}
    if s.type == "llama3":
        out.update(original_max_position_embeddings=s.original_max_seq_len, low_freq_factor=s.low_freq_factor,
                   high_freq_factor=s.high_freq_factor)
    elif s.type == "yarn":
        # attention_factor written out: transformers versions differ in how they derive it.
        out.update(original_max_position_embeddings=s.original_max_seq_len, beta_fast=s.beta_fast,
                   beta_slow=s.beta_slow, truncate=s.truncate,
                   attention_factor=s.attention_factor or (0.1 * math.log(s.factor) + 1 if s.factor > 1 else 1.0))
    return out


def _rope(hf_config, rope: dict | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` (4.x); or from
    ``rope``, one layer type's entry of per-type `rope_parameters` (Gemma 3)."""
    if rope is None:
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # per-layer-type form
        raise UserError("config.json: per-layer RoPE parameters are not supported")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = float(theta if theta is not None else 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        raise UserError("config.json: partial_rotary_factor < 1 is not supported (lmforge rotates whole heads)")
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3", "yarn"):
        raise UserError(f"config.json: rope_type {kind!r} is not supported (supported: default, linear, llama3, yarn)")
    original = rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    factor = rope.get("factor") or hf_config.max_position_embeddings / original
    fields: dict[str, Any] = {"type": kind, "factor": float(factor)}
    if kind == "llama3":
        fields.update(original_max_seq_len=original, low_freq_factor=rope["low_freq_factor"],
                      high_freq_factor=rope["high_freq_factor"])
    elif kind == "yarn":
        attention = rope.get("attention_factor")
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if attention is None and mscale and mscale_all and factor > 1:
            attention = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all * math.log(factor) + 1)
        if attention is None:  # explicit, so an export writes back the same number
            attention = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
        fields.update(original_max_seq_len=original, beta_fast=rope.get("beta_fast") or 32.0,
                      beta_slow=rope.get("beta_slow") or 1.0, attention_factor=attention,
                      truncate=rope.get("truncate", True))
    return theta, RopeScaling(**fields)


def _window_pattern(hf_config, spec: Family, head_dim: int) -> dict[str, Any]:
    """Gemma 2 and 3's attention -> sliding_window and sliding_window_pattern (every N-th layer
    global), the RoPE (Gemma 3: rope_theta / rope_scaling of the global layers, rope_theta_local
    of the windowed ones), attn_scale_dim, and the soft-caps."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf_config, key, None) is not None and not spec.softcaps:
            raise UserError(f"config.json: {key} is not supported for {spec.name}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UserError("config.json: use_bidirectional_attention=true is not supported (lmforge is causal)")
    scale_dim = getattr(hf_config, "query_pre_attn_scalar", None) or head_dim
    fields: dict[str, Any] = dict(attn_scale_dim=None if scale_dim == head_dim else int(scale_dim),
                                  attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
                                  logit_softcap=getattr(hf_config, "final_logit_softcapping", None))
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # transformers < 4.53: every N-th layer global (Gemma 2: every other one)
        n = getattr(hf_config, "sliding_window_pattern", None) or 2
        types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                 for i in range(hf_config.num_hidden_layers)]
    types = list(types)
    local = [t == "sliding_attention" for t in types]
    per_type = getattr(hf_config, "rope_parameters", None) if spec.local_rope else None
    if spec.local_rope and "full_attention" not in (per_type or {}):  # transformers 4: the windowed layers'
        per_type = {"full_attention": None,  # base apart, the global ones' in the usual fields
                    "sliding_attention": {"rope_theta": getattr(hf_config, "rope_local_base_freq", None) or 1e4}}
    rope = None if per_type is None else per_type["full_attention" if not all(local) else "sliding_attention"]
    fields["rope_theta"], fields["rope_scaling"] = _rope(hf_config, rope)
    fields["sliding_window"] = hf_config.sliding_window if any(local) else None
    if not any(local) or all(local):
        return fields
    n = local.index(False) + 1  # the first global layer
    if local != [(i + 1) % n != 0 for i in range(len(types))]:
        raise UserError(f"config.json: layer_types {types} are not one global layer in every N "
                        "(lmforge supports a regular pattern)")
    fields["sliding_window_pattern"] = n
    if per_type is not None:
        local_theta, local_scaling = _rope(hf_config, per_type["sliding_attention"])
        if local_scaling is not None:
            raise UserError("config.json: rope scaling on the sliding-window layers is not supported")
        fields["rope_theta_local"] = local_theta
    return fields


def _sliding_window(hf_config, spec: Family) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if spec.name in ("qwen2", "qwen3") and types is None:  # transformers < 4.53
        window = window if getattr(hf_config, "use_sliding_window", False) else None
        if window is not None and getattr(hf_config, "max_window_layers", 0) > 0:
            types = ["mixed"]
    if types is not None:
        kinds = set(types)
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise UserError("config.json: sliding-window attention on some layers only (layer_types / "
                            "max_window_layers) is not supported; lmforge applies a window to all layers or none")
    if window is not None and not spec.sliding_window:
        raise UserError(f"config.json: sliding_window is not supported for {spec.name}")
    return window


# Multimodal checkpoints whose text model is a supported family: model_type -> the config's text
# part. Import reads the text model alone (the vision tower and projector are left out), so an
# export is the text-only architecture (Gemma 3 4B and larger -> Gemma3ForCausalLM).
_TEXT_TOWERS = {"gemma3": "text_config"}
# Where such a checkpoint keeps the text model's tensors (plain name prefix -> its prefix there):
# as published and as transformers 5 saves them, and as transformers 4.52–4.57 saved them (and 5
# holds them in memory). (Gemma 3 ties its output head to the embedding: no lm_head to find.)
_TOWER_PREFIXES = (("model.", "language_model.model."), ("model.", "model.language_model."))


def from_hf_config(hf_config) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config of a supported family (see `families.py`), or
    for the text model of a multimodal one (`_TEXT_TOWERS`)."""
    if getattr(hf_config, "model_type", None) in _TEXT_TOWERS:
        hf_config = getattr(hf_config, _TEXT_TOWERS[hf_config.model_type])
    spec = family_for_hf(hf_config)
    if getattr(hf_config, "attention_bias", False) and spec.name != "qwen2":
        raise UserError(f"config.json: attention_bias=true is not supported for {spec.name} "
                        "(lmforge has q/k/v biases only, as in qwen2)")
    if getattr(hf_config, "mlp_bias", False):
        raise UserError("config.json: mlp_bias=true is not supported (lmforge MLPs have no biases)")
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    want = _HF_ACT[spec.features.get("mlp_activation", "silu")]
    if act != want:
        raise UserError(f"config.json: hidden_act {act!r} is not supported for {spec.name} (expected {want!r})")
    d, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    if spec.window_pattern:
        attention = _window_pattern(hf_config, spec, head_dim)
    else:
        theta, scaling = _rope(hf_config)
        attention = dict(rope_theta=theta, rope_scaling=scaling, sliding_window=_sliding_window(hf_config, spec))
    fields: dict[str, Any] = dict(
        d_model=d, n_layers=hf_config.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=None if head_dim * heads == d else head_dim,
        vocab_size=hf_config.vocab_size, max_seq_len=hf_config.max_position_embeddings,
        norm_eps=hf_config.rms_norm_eps, tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02), family=spec.name, **attention, **spec.features,
    )
    if spec.moe:
        ffn = hf_config.intermediate_size
        fields.update(n_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                      expansion_ratio=ffn / d)
        cfg = _model_config(fields)
        if cfg.expert_dim != ffn:  # ratio did not round-trip through int(ratio * d)
            raise UserError(f"config.json: intermediate_size {ffn} is not representable as expansion_ratio·{d}")
        return cfg
    return _model_config(fields | {"ffn_hidden": hf_config.intermediate_size})


def _model_config(fields: dict) -> ModelConfig:
    """A config.json's values that our config refuses (say a window pattern without a window):
    one line naming the rule, not pydantic's report."""
    from pydantic import ValidationError

    from lmforge.config.load import format_error

    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        raise UserError(format_error(e, ModelConfig, "config.json")) from None


# (our name, HF name) for one block, dense parts; `{i}` is the layer. The norms' HF names
# come from the family (OLMo 2's sit after the sublayers and are named for it).
_BLOCK = [
    ("blocks.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
]
_MLP = [
    ("blocks.{i}.mlp.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.mlp.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.mlp.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
]
_MOE_ROUTER = ("blocks.{i}.mlp.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight")
_MOE_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"


_QKV_BIAS = [(f"blocks.{{i}}.attn.w{a}.bias", f"model.layers.{{i}}.self_attn.{a}_proj.bias") for a in "qkv"]
_QK_NORM = [(f"blocks.{{i}}.attn.{a}_norm.weight", f"model.layers.{{i}}.self_attn.{a}_norm.weight") for a in "qk"]


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    spec = family_of(cfg)
    norms = zip(("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"), spec.norms + spec.out_norms)
    per_block = [(f"blocks.{{i}}.{ours}.weight", f"model.layers.{{i}}.{theirs}.weight") for ours, theirs in norms]
    per_block += _BLOCK
    per_block += (_QKV_BIAS if cfg.qkv_bias else []) + (_QK_NORM if cfg.qk_norm != "none" else [])
    per_block += [_MOE_ROUTER] if cfg.is_moe else _MLP
    for i in range(cfg.n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in per_block]
    return pairs


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")  # the final norm, the blocks' norms, q/k norms


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename our tensors to HF names (Mixtral per-expert matrices for MoE)."""
    offset = family_of(cfg).norm_offset
    out = {theirs: sd[ours] - 1 if offset and _is_norm(ours) else sd[ours] for ours, theirs in _pairs(cfg)}
    for i in range(cfg.n_layers if cfg.is_moe else 0):
        w13, w2 = sd[f"blocks.{i}.mlp.experts.w13"], sd[f"blocks.{i}.mlp.experts.w2"]  # [E,d,2h], [E,h,d]
        w1, w3 = w13.chunk(2, dim=-1)
        for j in range(cfg.n_experts):
            # nn.Linear layout is [out, in]: ours are [in, out] per expert, so transpose.
            out[_MOE_EXPERT.format(i=i, j=j, w="w1")] = w1[j].t().contiguous()
            out[_MOE_EXPERT.format(i=i, j=j, w="w3")] = w3[j].t().contiguous()
            out[_MOE_EXPERT.format(i=i, j=j, w="w2")] = w2[j].t().contiguous()
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from HF tensors (checkpoint names, or transformers' in-memory fused experts;
    a multimodal checkpoint's text model under its prefixes, the rest ignored)."""
    def take(name: str) -> torch.Tensor:
        if name not in hf_sd and "block_sparse_moe" in name:  # transformers >= 5 module names
            name = name.replace("block_sparse_moe", "mlp")
        for plain, tower in _TOWER_PREFIXES if name not in hf_sd else ():  # a multimodal model's text part
            if name.startswith(plain) and tower + name[len(plain):] in hf_sd:
                name = tower + name[len(plain):]
                break
        if name not in hf_sd:
            raise UserError(f"weights: tensor {name!r} missing from the Hugging Face checkpoint")
        return hf_sd[name]

    offset = family_of(cfg).norm_offset  # 1 + a bf16 offset: in fp32, as Gemma's norms compute it
    out = {ours: take(theirs).float() + 1 if offset and _is_norm(ours) else take(theirs)
           for ours, theirs in _pairs(cfg)}
    for i in range(cfg.n_layers if cfg.is_moe else 0):
        fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if fused in hf_sd:  # transformers >= 5 module layout: [E, 2h, d] (gate rows first) and [E, d, h]
            out[f"blocks.{i}.mlp.experts.w13"] = hf_sd[fused].transpose(1, 2).contiguous()
            down = take(f"model.layers.{i}.mlp.experts.down_proj")
            out[f"blocks.{i}.mlp.experts.w2"] = down.transpose(1, 2).contiguous()
            continue
        w1, w3, w2 = ([take(_MOE_EXPERT.format(i=i, j=j, w=n)).t() for j in range(cfg.n_experts)]
                      for n in ("w1", "w3", "w2"))
        out[f"blocks.{i}.mlp.experts.w13"] = torch.cat([torch.stack(w1), torch.stack(w3)], dim=-1).contiguous()
        out[f"blocks.{i}.mlp.experts.w2"] = torch.stack(w2).contiguous()
    return out
