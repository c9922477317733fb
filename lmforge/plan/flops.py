"""Parameter counts and training FLOPs of a model shape: the one implementation.

`lmforge estimate`, `lmforge train --dry-run` and the trainer's MFU metric all use
these functions, so a planned MFU and a logged MFU mean the same thing.

MFU basis (the standard one, used everywhere MFU appears): `mfu_flops_per_token` =
6 · N_active (forward 2·N + backward 4·N per token, Kaplan/Chinchilla; active parameters for
MoE) + 12·L·H·Dh·T for the attention scores (nanoGPT/PaLM). `flops_per_token` gives the
two terms apart; "FLOPs = 6·N·D" planning figures are its "dense" term alone.

LoRA (a frozen base with low-rank adapters): the base still runs forward (2·N) and passes
gradients back through every layer (2·N), but forms no weight gradients of its own, so its dense
term is 4·N_active + 6·N_adapters — 6·N would overstate the work, and the MFU, by about 1.5×.
"""

from __future__ import annotations

from lmforge.config.model import ModelConfig

# Dense presets leave the vocabulary to the tokenizer; estimates assume this then.
DEFAULT_VOCAB = 32000


def vocab_of(cfg: ModelConfig) -> int:
    """The model's vocabulary, or DEFAULT_VOCAB when it is left to the tokenizer."""
    return cfg.vocab_size or DEFAULT_VOCAB


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _weights(shapes: dict[str, tuple[int, int]], names: tuple[str, ...]) -> int:
    return sum(shapes[n][0] * shapes[n][1] for n in names)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each weight matrix of a block, by its Hugging Face / PEFT name: the attention
    projections, and the SwiGLU ones of a dense model (an MoE's experts are counted apart)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    if not cfg.is_moe:
        shapes |= {"gate_proj": (d, cfg.ffn_dim), "up_proj": (d, cfg.ffn_dim), "down_proj": (cfg.ffn_dim, d)}
    return shapes


def block_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one transformer block: attention, norms, feed-forward (all / active)."""
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    shapes = projection_shapes(cfg)
    attention = _weights(shapes, ATTENTION_PROJECTIONS)
    if cfg.qkv_bias:
        attention += (h + 2 * kv) * dh
    if cfg.qk_norm != "none":
        attention += 2 * dh if cfg.qk_norm == "head" else (h + kv) * dh
    norms = (4 if cfg.norm_position == "sandwich" else 2) * d
    if cfg.is_moe:
        expert = 3 * d * cfg.expert_dim  # SwiGLU: gate, up, down
        router = d * cfg.n_experts
        ffn = router + cfg.n_experts * expert
        ffn_active = router + cfg.top_k * expert
    else:
        ffn = ffn_active = _weights(shapes, MLP_PROJECTIONS)
    return {"attention": attention, "norms": norms, "ffn": ffn, "ffn_active": ffn_active,
            "total": attention + norms + ffn, "active": attention + norms + ffn_active}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts: total, active (per token), embedding, non_embedding.

    Layout: embedding V·d; per block q/k/v/o, two RMSNorm weights (four: sandwich), SwiGLU MLP (dense)
    or router + experts (MoE); final norm d; output head V·d unless tied. "active"
    counts top_k of the experts and excludes the input embedding (a lookup, no
    FLOPs) but includes the output head matmul, tied or not. "embedding" is the
    input embedding plus an untied output head.
    """
    v, d = vocab_of(cfg), cfg.d_model
    block = block_counts(cfg)
    head = v * d
    embedding = v * d + (0 if cfg.tie_embeddings else head)
    non_embedding = cfg.n_layers * block["total"] + d
    return {
        "total": embedding + non_embedding,
        "active": cfg.n_layers * block["active"] + d + head,
        "embedding": embedding,
        "non_embedding": non_embedding,
    }


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the attention scores and weighted sum: 12·L·H·Dh·T.

    Forward QKᵀ and AV are 2·2·H·Dh·T per token per layer (T keys, no causal
    discount, as nanoGPT and PaLM count it); backward doubles it twice: ×3 in total.
    """
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.dim_head * seq_len


def lora_adapter_params(cfg: ModelConfig, rank: int, targets: list[str]) -> int:
    """Parameters of rank-``rank`` adapters (A: in × r, B: r × out) on ``targets`` of every block."""
    shapes = projection_shapes(cfg)
    return cfg.n_layers * sum(rank * sum(shapes[t]) for t in targets)


def flops_per_token(cfg: ModelConfig, seq_len: int, lora=None) -> dict[str, float]:
    """Training (forward + backward) FLOPs per token: dense 6·N_active (4·N_active + 6·N_adapters
    with ``lora``, a `LoRAConfig`), attention, total."""
    active = param_counts(cfg)["active"]
    dense = 6.0 * active if lora is None else 4.0 * active + 6.0 * lora_adapter_params(cfg, lora.rank, lora.targets)
    attention = attention_flops_per_token(cfg, seq_len)
    return {"dense": dense, "attention": attention, "total": dense + attention}


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int, lora=None) -> float:
    """The FLOPs per token MFU is measured against (estimate, trainer and benchmarks alike):
    6·N_active + 12·L·H·Dh·T (LoRA: 4·N_active + 6·N_adapters + 12·L·H·Dh·T)."""
    return flops_per_token(cfg, seq_len, lora)["total"]
