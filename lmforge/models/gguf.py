"""A model as a GGUF file for llama.cpp (and Ollama, which runs llama.cpp), written with the
`gguf` library of the llama.cpp project.

Each family (`families.py`) maps to the llama.cpp architecture that computes the same function:

| family           | llama.cpp arch | what differs in the file                                    |
|------------------|----------------|-------------------------------------------------------------|
| llama, mistral   | llama          | q/k rows permuted: llama.cpp's "normal" RoPE rotates adjacent pairs, ours (HF's) the two halves |
| mixtral (our MoE)| llama          | the same, plus the experts as 3-D tensors (`ffn_*_exps`)    |
| qwen2, qwen3     | qwen2, qwen3   | none (NeoX RoPE is our rotate-half)                         |
| olmo2            | olmo2          | the norms after each sublayer, q/k norms over all heads     |
| gemma, gemma2, gemma3_text | gemma, gemma2, gemma3 | norm weights as the factor itself (ours already are: llama.cpp's converter adds the 1 that HF leaves out), per-layer sliding-window pattern, soft-caps |

What llama.cpp cannot compute is refused in one line before anything is written (`check`): a
sliding window where the llama.cpp architecture has none, a head size other than
d_model / n_heads where it assumes one, an untied Gemma head, clipped q/k/v, a query scale
other than the one llama.cpp derives, llama3 RoPE scaling outside the llama architecture (the
per-dimension factors, `rope_freqs`, are read by that one alone).

Weights: ``f32``; ``f16`` and ``bf16`` (matrices; norms, biases and the RoPE factors stay f32,
as llama.cpp's own converter keeps them); ``q8_0`` (matrices whose rows are a multiple of 32
values, else f16).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from lmforge.config.model import ModelConfig
from lmforge.models.gguf_vocab import GGUFVocab
from lmforge.errors import UserError
from lmforge.models.families import family_of
from lmforge.models.rope import inv_frequencies

DTYPES = ("f32", "f16", "bf16", "q8_0")
ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "olmo2": "olmo2", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
WINDOWED = ("gemma2", "gemma3")  # the archs with per-layer sliding windows
WHOLE_HEADS = ("qwen2", "olmo2")  # the archs that assume head_dim = d_model / n_heads
NO_OUTPUT = ("gemma", "gemma2")  # the archs whose head is always the embedding


def check(cfg: ModelConfig) -> str:
    """The llama.cpp architecture for this model, or one line saying what llama.cpp cannot compute."""
    family = family_of(cfg).name
    arch = ARCH[family]
    where = f"model ({family})"
    if cfg.vocab_size is None:
        raise UserError("model.vocab_size: must be set to export to GGUF")
    if cfg.clip_qkv is not None:
        raise UserError(f"{where}: clip_qkv {cfg.clip_qkv} has no llama.cpp equivalent")
    if cfg.sliding_window is not None and arch not in WINDOWED and cfg.sliding_window < cfg.max_seq_len:
        raise UserError(f"{where}: sliding_window {cfg.sliding_window} is shorter than the context "
                        f"({cfg.max_seq_len}), and llama.cpp's {arch} architecture attends to the whole context")
    if arch in WHOLE_HEADS and cfg.dim_head * cfg.n_heads != cfg.d_model:
        raise UserError(f"{where}: head_dim {cfg.dim_head} × {cfg.n_heads} heads ≠ d_model {cfg.d_model}; "
                        f"llama.cpp's {arch} architecture assumes d_model / n_heads")
    if arch in NO_OUTPUT and not cfg.tie_embeddings:
        raise UserError(f"{where}: an output head apart from the embedding (tie_embeddings: false); llama.cpp's "
                        f"{arch} architecture always uses the embedding")
    if arch in WINDOWED:
        # llama.cpp scales queries by 1/√head_dim, or 1/√(d_model/n_heads) for the 27B shapes
        # (46 or 62 layers): it knows no query_pre_attn_scalar of its own.
        big = cfg.n_layers == (46 if arch == "gemma2" else 62)
        theirs = cfg.d_model // cfg.n_heads if big else cfg.dim_head
        if (cfg.attn_scale_dim or cfg.dim_head) != theirs:
            raise UserError(f"{where}: attn_scale_dim {cfg.attn_scale_dim or cfg.dim_head}; llama.cpp's {arch} "
                            f"scales queries by 1/√{theirs} for this shape")
        if arch == "gemma3" and cfg.rope_scaling is not None and cfg.rope_theta_local is None:
            raise UserError(f"{where}: rope_scaling on the windowed layers too (no rope_theta_local); llama.cpp's "
                            "gemma3 leaves them unscaled")
    _check_rope(cfg, arch, where)
    return arch


def _check_rope(cfg: ModelConfig, arch: str, where: str) -> None:
    s = cfg.rope_scaling
    if s is None:
        return
    if s.type == "llama3" and arch != "llama":
        raise UserError(f"{where}: llama3 RoPE scaling; llama.cpp reads its per-dimension factors for the llama "
                        "architecture only")
    if s.type == "yarn" and (not s.truncate or (s.beta_fast, s.beta_slow) != (32.0, 1.0)):
        raise UserError(f"{where}: yarn RoPE scaling with truncate {s.truncate}, beta_fast {s.beta_fast}, beta_slow "
                        f"{s.beta_slow}; llama.cpp's {arch} takes true, 32 and 1")


def write_gguf(model: torch.nn.Module, cfg: ModelConfig, vocab: GGUFVocab, path: Path, *, dtype: str,
               name: str) -> None:
    """Write ``model`` (weights in any dtype: read as fp32) with ``vocab`` to ``path``."""
    import gguf

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)} for --format gguf")
    arch = check(cfg)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _hyperparameters(writer, cfg, arch)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    _vocabulary(writer, vocab)
    sd = {k: v.detach().to("cpu", torch.float32).numpy() for k, v in model.state_dict().items()}
    for tensor_name, array in _tensors(sd, cfg, arch):
        data, raw = _encode(array, dtype, keep_f32=array.ndim == 1)
        writer.add_tensor(tensor_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hyperparameters(w, cfg: ModelConfig, arch: str) -> None:
    import gguf

    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.expert_dim if cfg.is_moe else cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.dim_head)
    w.add_value_length(cfg.dim_head)
    w.add_rope_dimension_count(cfg.dim_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.is_moe:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.top_k)
    s = cfg.rope_scaling
    if s is not None and s.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
    elif s is not None and s.type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_seq_len)
        # llama.cpp multiplies cos/sin by 0.1·ln(factor)+1 itself; only a different factor is written
        _, ours = inv_frequencies(cfg.dim_head, cfg.rope_theta, s)
        w.add_rope_scaling_attn_factors(ours / (0.1 * math.log(s.factor) + 1.0))
    # llama3: `rope_freqs` (a tensor, see _tensors); the nominal scaling stays "none"
    if arch in WINDOWED:
        w.add_sliding_window(cfg.sliding_window or cfg.max_seq_len)
        w.add_sliding_window_pattern([cfg.is_local(i) for i in range(cfg.n_layers)])
        w.add_rope_freq_base_swa(cfg.rope_theta_local or cfg.rope_theta)
    if cfg.attn_softcap is not None:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.logit_softcap is not None:
        w.add_final_logit_softcapping(cfg.logit_softcap)


def _vocabulary(w, vocab: GGUFVocab) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


# Our names → llama.cpp's, per block; the norms depend on where the family puts them.
_BLOCK = {"attn.wq.weight": "attn_q.weight", "attn.wk.weight": "attn_k.weight", "attn.wv.weight": "attn_v.weight",
          "attn.wo.weight": "attn_output.weight", "attn.wq.bias": "attn_q.bias", "attn.wk.bias": "attn_k.bias",
          "attn.wv.bias": "attn_v.bias", "attn.q_norm.weight": "attn_q_norm.weight",
          "attn.k_norm.weight": "attn_k_norm.weight", "mlp.w1.weight": "ffn_gate.weight",
          "mlp.w3.weight": "ffn_up.weight", "mlp.w2.weight": "ffn_down.weight", "mlp.router.weight": "ffn_gate_inp.weight"}
_NORMS = {"pre": {"attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight"},
          # OLMo 2 normalizes each sublayer's output (its "attn_norm" is applied after attention)
          "post": {"attn_norm.weight": "post_attention_norm.weight", "mlp_norm.weight": "post_ffw_norm.weight"},
          "sandwich": {"attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
                       "attn_out_norm.weight": "post_attention_norm.weight",
                       "mlp_out_norm.weight": "post_ffw_norm.weight"}}


def _tensors(sd: dict[str, np.ndarray], cfg: ModelConfig, arch: str):
    """(llama.cpp name, fp32 array in llama.cpp's layout), every tensor the architecture reads."""
    yield "token_embd.weight", sd["tok_embeddings.weight"]
    yield "output_norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "output.weight", sd["output.weight"]
    elif arch == "olmo2":  # it has no tied form: the head is a copy
        yield "output.weight", sd["tok_embeddings.weight"]
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "llama3":
        plain, _ = inv_frequencies(cfg.dim_head, cfg.rope_theta)
        scaled, _ = inv_frequencies(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling)
        yield "rope_freqs.weight", (plain / scaled).numpy()  # llama.cpp divides each frequency by these
    names = _BLOCK | _NORMS[cfg.norm_position]
    for i in range(cfg.n_layers):
        prefix = f"blocks.{i}."
        for ours, array in sd.items():
            if not ours.startswith(prefix):
                continue
            rest = ours[len(prefix):]
            if rest in names:
                yield f"blk.{i}.{names[rest]}", _layout(rest, array, cfg, arch)
            elif rest == "mlp.experts.w13":  # [E, d, 2h], gate first → [E, h, d] each
                gate, up = np.split(array, 2, axis=-1)
                yield f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate.transpose(0, 2, 1))
                yield f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up.transpose(0, 2, 1))
            elif rest == "mlp.experts.w2":  # [E, h, d] → [E, d, h]
                yield f"blk.{i}.ffn_down_exps.weight", np.ascontiguousarray(array.transpose(0, 2, 1))
            else:
                raise UserError(f"model: tensor {ours} has no place in llama.cpp's {arch} architecture")


def _layout(rest: str, array: np.ndarray, cfg: ModelConfig, arch: str) -> np.ndarray:
    """llama.cpp's llama architecture rotates adjacent pairs (x[2i], x[2i+1]); ours, HF's halves
    (x[i], x[i + d/2]). Reordering each head's q/k rows — row i of a half to 2i, row i of the
    second half to 2i + 1 — makes the one the other."""
    if arch != "llama" or rest not in ("attn.wq.weight", "attn.wk.weight"):
        return array
    heads = cfg.n_heads if rest == "attn.wq.weight" else cfg.kv_heads
    rows = array.reshape(heads, 2, cfg.dim_head // 2, -1)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3).reshape(array.shape))


def _encode(array: np.ndarray, dtype: str, *, keep_f32: bool):
    """(data, raw gguf type or None for numpy's own) of one tensor in the export's dtype."""
    import gguf

    if dtype == "f32" or keep_f32:
        return np.ascontiguousarray(array, dtype=np.float32), None
    if dtype == "f16" or (dtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]):
        return array.astype(np.float16), None
    kind = gguf.GGMLQuantizationType.BF16 if dtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, kind), kind
