"""Hugging Face interop: config and state-dict name mapping (Llama; Mixtral for MoE).

Our layout was chosen so the mapping is a pure rename: RoPE uses HF's rotate-half pairing, so
q/k rows need no permutation, and SwiGLU w1/w3/w2 are HF's gate/up/down projections. MoE expert
weights are 3-D parameters here — ``w13 [E, d, 2h]`` (gate and up fused, gate first) and
``w2 [E, h, d]`` —; they are split into the per-expert `block_sparse_moe.experts.{j}.w1/w2/w3`
matrices of the published Mixtral checkpoint format, which transformers, vLLM and llama.cpp all
read.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError

SUPPORTED = ("llama", "mixtral")


def to_hf_config(cfg: ModelConfig, *, allow_clip_qkv: bool = False):
    """A `transformers.LlamaConfig` (dense) or `MixtralConfig` (MoE) for this shape."""
    from transformers import LlamaConfig, MixtralConfig

    if cfg.vocab_size is None:
        raise UserError("model.vocab_size: must be set to export to Hugging Face format")
    if cfg.clip_qkv is not None and not allow_clip_qkv:
        raise UserError(
            f"model.clip_qkv: {cfg.clip_qkv} has no Hugging Face Llama/Mixtral equivalent; the exported "
            "model matches only while |q|,|k|,|v| stay under the clip (pass allow_clip_qkv=True to accept)")
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.dim_head,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, hidden_act="silu",
        attention_bias=False, bos_token_id=None, eos_token_id=None,  # the exporter sets them from the tokenizer
    )
    if cfg.is_moe:
        hf = MixtralConfig(intermediate_size=cfg.expert_dim, num_local_experts=cfg.n_experts,
                           num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef,
                           sliding_window=None, **common)
        hf.architectures = ["MixtralForCausalLM"]
    else:
        hf = LlamaConfig(intermediate_size=cfg.ffn_dim, mlp_bias=False, **common)
        hf.architectures = ["LlamaForCausalLM"]
    return hf


def _rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"config.json: rope_type {kind!r} is not supported (only plain RoPE, 'default')")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def from_hf_config(hf_config) -> ModelConfig:
    """Our ModelConfig for a Hugging Face Llama or Mixtral config."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        raise UserError(f"config.json: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    for attr in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, attr, False):
            raise UserError(f"config.json: {attr}=true is not supported (lmforge models have no biases)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError(f"config.json: hidden_act {hf_config.hidden_act!r} is not supported (expected 'silu')")
    d, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    fields: dict[str, Any] = dict(
        d_model=d, n_layers=hf_config.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=None if head_dim * heads == d else head_dim,
        vocab_size=hf_config.vocab_size, max_seq_len=hf_config.max_position_embeddings,
        rope_theta=_rope_theta(hf_config), norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=getattr(hf_config, "initializer_range", 0.02),
    )
    if kind == "mixtral":
        ffn = hf_config.intermediate_size
        fields.update(n_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                      expansion_ratio=ffn / d)
        cfg = ModelConfig(**fields)
        if cfg.expert_dim != ffn:  # ratio did not round-trip through int(ratio * d)
            raise UserError(f"config.json: intermediate_size {ffn} is not representable as expansion_ratio·{d}")
        return cfg
    return ModelConfig(ffn_hidden=hf_config.intermediate_size, **fields)


# (our name, HF name) for one block, dense parts; `{i}` is the layer.
_BLOCK = [
    ("blocks.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blocks.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
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


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    per_block = _BLOCK + ([_MOE_ROUTER] if cfg.is_moe else _MLP)
    for i in range(cfg.n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in per_block]
    return pairs


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename our tensors to HF names (Mixtral per-expert matrices for MoE)."""
    out = {theirs: sd[ours] for ours, theirs in _pairs(cfg)}
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
    """Our state dict from HF tensors (checkpoint names, or transformers' in-memory fused experts)."""
    def take(name: str) -> torch.Tensor:
        if name not in hf_sd and "block_sparse_moe" in name:  # transformers >= 5 module names
            name = name.replace("block_sparse_moe", "mlp")
        if name not in hf_sd:
            raise UserError(f"weights: tensor {name!r} missing from the Hugging Face checkpoint")
        return hf_sd[name]

    out = {ours: take(theirs) for ours, theirs in _pairs(cfg)}
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
