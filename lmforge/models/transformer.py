"""A Llama-style decoder-only transformer, optionally with mixture-of-experts blocks.

Design choices, and why:

- **RMSNorm, pre-norm.** Cheaper than LayerNorm (no mean, no bias) and the standard in
  Llama-family models; pre-norm keeps the residual stream an identity path, so deep models
  train without warm-up tricks.
- **RoPE, rotate-half convention.** Relative positions come out of the q·k product with no
  learned parameters. We pair dimension i with i + d/2 (Hugging Face Llama's layout) rather
  than interleaved pairs, so HF weights map 1:1 with no q/k row permutation.
- **SwiGLU MLP.** A gated feed-forward (silu(x W1) * x W3) W2 beats a plain GELU MLP at the
  same FLOPs; hidden size comes from `ModelConfig.ffn_dim`.
- **Grouped-query attention** through `F.scaled_dot_product_attention` with `enable_gqa`,
  which dispatches to flash attention on GPU and never materializes repeated K/V.
- **FlexAttention for masks that are not plain causal** (packed documents, sliding windows)
  on CUDA: a dense [B, 1, T, T] boolean mask would force SDPA onto its O(T²)-memory math
  kernel, so `attention_mask` builds a `BlockMask` instead and a compiled `flex_attention`
  skips the blocks nothing attends to. The CPU keeps the boolean mask (torch has no
  FlexAttention backward on the CPU), and so does decoding with a KV cache.
- **Context parallelism** (`compute.context_parallel`): ``training_loss`` may get one rank's
  part of each row with the tokens' global ``positions``; RoPE reads its tables there and
  attention reaches the other ranks' keys through `sharded_attention` (a `ShardedMask`).
- **clip_qkv.** Clamping q/k/v projections (DBRX) bounds attention logits and prevents the
  loss spikes seen in large runs; off unless the config sets it.
- **No biases** by default: they add parameters and state but nothing measurable in quality.
- **Options published families need** (`lmforge/models/families.py` maps each one): q/k/v
  biases (Qwen2), RMSNorm on q and k per head (Qwen3) or over all heads (OLMo 2), norms on the
  sublayer outputs instead of inputs (OLMo 2) or on both (Gemma 2, 3), a GELU-gated MLP and input
  embeddings scaled by √d_model (Gemma), long-context RoPE scaling (`rope.py`), a sliding
  attention window (Mistral) and one global layer in every N windowed ones, each kind with its
  own RoPE base (Gemma 3), soft-capped attention scores and logits and another query scale
  (Gemma 2). Each is a plain constructor option; `forward` has no per-family branches.
- **Tied embeddings** are implemented by reusing the embedding matrix in the head inside
  `forward` (no second Parameter). That keeps exactly one tensor after meta-device
  construction, `to_empty`, FSDP sharding and checkpoint load — attribute-level tying breaks
  in all of those.
- **Init.** normal(0, init_std) for every matrix and embedding; the two projections that write
  into the residual stream (attention out, MLP down) are scaled by 1/sqrt(2·n_layers) so the
  residual variance does not grow with depth (GPT-2); norm weights start at 1.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.models.loss import LossOutput, next_token_loss, token_logprobs
from lmforge.models.rope import rope_tables
from lmforge.models.sharded_attention import SequenceGroup, ShardedMask, ShardKeys


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16, then cast back (as HF Llama does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, Dh]; cos/sin: [T, Dh]."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Preallocated per-layer key/value buffers for incremental decoding."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device, dtype):
        shape = (batch_size, cfg.kv_heads, max_len, cfg.dim_head)
        self.max_len = max_len
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.dh = cfg.n_heads, cfg.kv_heads, cfg.dim_head
        self.clip = cfg.clip_qkv
        self.scale = None if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5  # None: 1/√head_dim
        self.softcap = cfg.attn_softcap
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.dh, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.dh, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.dh, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.dh, cfg.d_model, bias=False)
        # q/k norms: over each head's dims ("head", shared by the heads) or the whole projection ("full").
        self.qk_norm = cfg.qk_norm
        self.q_norm = self.k_norm = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.dh if per_head else self.n_heads * self.dh, cfg.norm_eps)
            self.k_norm = RMSNorm(self.dh if per_head else self.n_kv * self.dh, cfg.norm_eps)

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, torch.Tensor] | None = None, start_pos: int = 0,
                attn_mask: torch.Tensor | BlockMask | None = None):
        """attn_mask: None for plain causal attention, else a boolean mask or a FlexAttention
        block mask (see `attention_mask`), or a `ShardedMask` (context parallelism)."""
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.dh)
        k = k.view(B, T, self.n_kv, self.dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.dh).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            ck, cv = cache
            end = start_pos + T
            ck[:B, :, start_pos:end] = k
            cv[:B, :, start_pos:end] = v
            k, v = ck[:B, :, :end], cv[:B, :, :end]
        if isinstance(attn_mask, ShardedMask):  # context parallelism: the local queries over the whole row
            k, v, attn_mask = attn_mask.keys_and_values(k, v, self.n_heads)
        if isinstance(attn_mask, BlockMask):
            score_mod = None if self.softcap is None else _softcap_mod(self.softcap)
            y = _flex(q)(q, k, v, score_mod=score_mod, block_mask=attn_mask, scale=self.scale,
                         enable_gqa=self.n_kv != self.n_heads)
        elif self.softcap is not None:
            y = softcapped_attention(q, k, v, attn_mask, self.softcap, self.scale or self.dh ** -0.5)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                               scale=self.scale, enable_gqa=k.shape[1] != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dh))


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         cap: float, scale: float) -> torch.Tensor:
    """Attention whose scores become cap·tanh(score/cap) before the softmax (Gemma 2), written out
    as matmuls (SDPA takes no score modifier): the CPU, and cached decoding. Training on CUDA
    runs FlexAttention with the same cap as its `score_mod` (`_softcap_mod`), fused.
    q [B, H, T, Dh], k and v [B, KV, S, Dh]; ``mask`` a boolean [T, S] or [B, 1, T, S]
    (`attention_mask`), None for plain causal attention."""
    if mask is None:
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each K/V head serves `groups` query heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh((q @ k.transpose(-2, -1)) * (scale / cap)) * cap
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    return probs.to(q.dtype) @ v


@functools.cache  # one function per cap: compiled FlexAttention is reused, not traced again per call
def _softcap_mod(cap: float):
    def softcap(score, batch, head, q_idx, k_idx):
        return torch.tanh(score / cap) * cap
    return softcap


class MLP(nn.Module):
    """Gated feed-forward w2(act(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down. act: silu (SwiGLU),
    or GELU with the tanh approximation (GeGLU, as Gemma)."""

    def __init__(self, d_model: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.gelu = activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(gate * self.w3(x))


class Block(nn.Module):
    """Pre-norm block; or post-norm (the norms applied to each sublayer's output before the
    residual add, as in OLMo 2); or sandwich (both, as in Gemma 2 and 3: attn_norm and mlp_norm on
    the inputs, attn_out_norm and mlp_out_norm on the outputs). Returns (x, aux) so MoE
    statistics survive FSDP/checkpoint/compile wrapping without side channels; aux is {} for
    dense blocks."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.post_norm = cfg.norm_position == "post"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe:
            from lmforge.models.moe import MoE  # moe imports nothing from here at import time
            self.mlp: nn.Module = MoE(cfg)
        else:
            self.mlp = MLP(cfg.d_model, cfg.ffn_dim, cfg.mlp_activation)
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.norm_position == "sandwich":
            self.attn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, cos, sin, cache=None, start_pos: int = 0, attn_mask=None):
        x = x + self.attention(x, cos, sin, cache, start_pos, attn_mask)
        h, aux = self.feed_forward(x)
        return x + h, aux

    # The two sublayers, each with its norms: what it adds to the residual stream. Activation
    # checkpointing of one of them (`distributed.parallelize`) replaces the method on the instance.
    def attention(self, x, cos, sin, cache=None, start_pos: int = 0, attn_mask=None):
        if self.post_norm:  # normalize what each sublayer writes into the residual stream
            return self.attn_norm(self.attn(x, cos, sin, cache, start_pos, attn_mask))
        h = self.attn(self.attn_norm(x), cos, sin, cache, start_pos, attn_mask)
        return h if self.attn_out_norm is None else self.attn_out_norm(h)

    def feed_forward(self, x) -> tuple[torch.Tensor, dict]:
        if self.post_norm:
            h, aux = _with_aux(self.mlp(x))
            return self.mlp_norm(h), aux
        h, aux = _with_aux(self.mlp(self.mlp_norm(x)))
        return (h if self.mlp_out_norm is None else self.mlp_out_norm(h)), aux


def _with_aux(out) -> tuple[torch.Tensor, dict]:
    """An MLP's output and its statistics: MoE layers return (h, aux), dense ones just h."""
    return out if isinstance(out, tuple) else (out, {})


class Transformer(nn.Module):
    # How `head_loss` computes the loss (`models.loss.next_token_loss`'s kernel); set from
    # compute.loss_kernel by `distributed.parallelize`.
    loss_kernel: str = "auto"
    # The ranks each row is split over (compute.context_parallel), set by `distributed.parallelize`;
    # None: every rank holds whole rows.
    sequence_group: SequenceGroup | None = None
    # What the blocks save for backward, counted over a micro-batch on request (`memory/activations_saved`),
    # set by `distributed.parallelize` (a `distributed.activations.Meter`); None outside a training run.
    activation_meter = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise UserError("model.vocab_size: not set; give it in the config or take it from a tokenizer")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Non-persistent: derived from the config, so not part of checkpoints.
        cos, sin = rope_tables(cfg.dim_head, cfg.max_seq_len, cfg.rope_theta,
                               device=self.tok_embeddings.weight.device, scaling=cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.rope_theta_local is not None:  # the windowed layers' own base (Gemma 3), unscaled
            cos, sin = rope_tables(cfg.dim_head, cfg.max_seq_len, cfg.rope_theta_local, device=cos.device)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)
        if cos.device.type != "meta":  # direct construction gets the documented init too
            self.init_weights()

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def init_rope(self) -> None:
        cfg, device = self.cfg, self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(cfg.dim_head, cfg.max_seq_len, cfg.rope_theta, device=device,
                                                   scaling=cfg.rope_scaling)
        if cfg.rope_theta_local is not None:
            self.rope_cos_local, self.rope_sin_local = rope_tables(cfg.dim_head, cfg.max_seq_len,
                                                                   cfg.rope_theta_local, device=device)

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        self.init_rope()
        nn.init.normal_(self.tok_embeddings.weight, 0.0, std)
        if self.output is not None:
            nn.init.normal_(self.output.weight, 0.0, std)
        self.norm.weight.fill_(1.0)
        for block in self.blocks:
            for norm in (block.attn_norm, block.mlp_norm, block.attn_out_norm, block.mlp_out_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            for lin in (block.attn.wq, block.attn.wk, block.attn.wv):
                nn.init.normal_(lin.weight, 0.0, std)
                if lin.bias is not None:
                    lin.bias.zero_()
            for norm in (block.attn.q_norm, block.attn.k_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            nn.init.normal_(block.attn.wo.weight, 0.0, out_std)
            if isinstance(block.mlp, MLP):
                nn.init.normal_(block.mlp.w1.weight, 0.0, std)
                nn.init.normal_(block.mlp.w3.weight, 0.0, std)
                nn.init.normal_(block.mlp.w2.weight, 0.0, out_std)
            else:
                block.mlp.init_weights(std, out_std)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        w = self.tok_embeddings.weight
        return KVCache(self.cfg, batch_size, max_len or self.cfg.max_seq_len, w.device, w.dtype)

    # Three entry points with fixed return types: `forward` (logits, for evaluation and
    # inference), `training_loss` (the training forward: loss and MoE statistics, never the
    # full logits) and `decode` (incremental decoding with a KV cache).

    def forward(self, input_ids: torch.Tensor, *, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]. doc_ids [B, T] (packed rows): a token attends only to earlier tokens
        with the same id; without them attention is plain causal (SDPA's is_causal fast path)."""
        h, _ = self._hidden(input_ids, doc_ids)
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.norm(h), self.output_weight)
        cap = self.cfg.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def training_loss(self, input_ids: torch.Tensor, targets: torch.Tensor, *,
                      doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                      per_token: bool = False) -> LossOutput:
        """The training forward: summed next-token loss against shifted ``targets`` (see
        `data.batch.Batch`), plus the MoE auxiliary loss and routing statistics. ``positions``
        [T] (context parallelism): the tokens are this rank's part of longer rows, at these
        global positions; the loss is then this part's. ``per_token``: also each target's
        log-probability (`LossOutput.token_logp`, for preference losses)."""
        h, stats = self._hidden(input_ids, doc_ids, positions)
        token_logp = None
        if per_token:
            token_logp = self.head_logprobs(h, targets)
            ce = -token_logp.sum()
        else:
            ce = self.head_loss(h, targets)
        if not stats:
            return LossOutput(ce, token_logp=token_logp)
        aux = _reduce_aux(stats, self.cfg)
        return LossOutput(ce, aux.pop("aux_loss"), aux, token_logp=token_logp)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and summed cross-entropy of the last hidden states: one unit
        that `distributed.parallelize` compiles (the logits never exist whole, see `models.loss`)."""
        return next_token_loss(self.norm(h), self.output_weight, targets, kernel=self.loss_kernel,
                               softcap=self.cfg.logit_softcap)

    def head_logprobs(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and each target's log-probability [B, T] (preference losses): the
        per-token twin of `head_loss`, compiled as one unit like it (`models.loss.token_logprobs`)."""
        return token_logprobs(self.norm(h), self.output_weight, targets, softcap=self.cfg.logit_softcap)

    def decode(self, input_ids: torch.Tensor, kv_cache: KVCache, start_pos: int = 0,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] of ``input_ids`` placed at ``start_pos``, reading and filling ``kv_cache``.
        ``key_mask`` [B, start_pos + T] (rows of different lengths, left-padded to one): False at the
        padding, which no other position attends to."""
        B, T = input_ids.shape
        if start_pos + T > min(kv_cache.max_len, self.cfg.max_seq_len):
            raise ValueError(f"sequence end {start_pos + T} exceeds max_seq_len/cache length {kv_cache.max_len}")
        h = self.embed(input_ids)
        layers = self._attention_inputs(T, start_pos, None, input_ids.device)
        if key_mask is not None:
            masks = {id(m): padding_mask(m, key_mask, T, start_pos) for _, _, m in layers}
            layers = [(cos, sin, masks[id(m)]) for cos, sin, m in layers]
        for i, (block, (cos, sin, mask)) in enumerate(zip(self.blocks, layers)):
            h, _ = block(h, cos, sin, (kv_cache.k[i], kv_cache.v[i]), start_pos, mask)
        return self._logits(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings: scaled by √d_model in Gemma's models, whose tied embedding matrix
        is also the output head (so the scale cannot live in the weights)."""
        h = self.tok_embeddings(input_ids)
        return h * math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else h

    def _hidden(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, positions: torch.Tensor | None = None):
        """Final hidden states (before the last norm) and the MoE statistics of each block."""
        B, T = input_ids.shape
        whole = T if positions is None else T * self.sequence_group.size
        if whole > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {whole} exceeds max_seq_len {self.cfg.max_seq_len}")
        h = self.embed(input_ids)
        layers = self._attention_inputs(T, 0, doc_ids, input_ids.device, flex=input_ids.is_cuda, positions=positions)
        stats: list[dict[str, torch.Tensor]] = []
        for block, (cos, sin, mask) in zip(self.blocks, layers):
            h, aux = block(h, cos, sin, attn_mask=mask)
            if aux:
                stats.append(aux)
        return h, stats

    def _attention_inputs(self, T: int, start_pos: int, doc_ids: torch.Tensor | None, device, flex: bool = False,
                          positions: torch.Tensor | None = None):
        """(cos, sin, mask) of each layer for positions start_pos … start_pos + T − 1 (or the
        given global ``positions`` of a context-parallel shard), each kind built once: layers
        within the sliding window get its mask (and, with rope_theta_local, their own RoPE
        tables); the others attend to the whole context."""
        cfg = self.cfg
        span = slice(start_pos, start_pos + T) if positions is None else positions
        shard = None if positions is None else ShardKeys.gather(self.sequence_group, positions, doc_ids)
        kinds = [cfg.is_local(i) for i in range(cfg.n_layers)]
        inputs = {}
        for local in set(kinds):
            own_rope = local and cfg.rope_theta_local is not None
            cos, sin = (self.rope_cos_local, self.rope_sin_local) if own_rope else (self.rope_cos, self.rope_sin)
            window = cfg.sliding_window if local else None
            if shard is not None:
                mask = shard.mask(window)
            elif flex and start_pos == 0 and cfg.attn_softcap is not None:
                # a BlockMask even for plain causal attention: the cap is FlexAttention's score_mod
                mask = flex_mask(T, doc_ids, window, device)
            else:
                mask = attention_mask(T, start_pos, doc_ids, window, device, flex)
            inputs[local] = (cos[span], sin[span], mask)
        return [inputs[local] for local in kinds]


def attention_mask(T: int, start_pos: int, doc_ids: torch.Tensor | None, window: int | None,
                   device, flex: bool = False) -> torch.Tensor | BlockMask | None:
    """The mask shared by the layers of one kind (within ``window``, or not), or None when plain
    causal attention is exact (SDPA's is_causal fast path). Query i (absolute position
    start_pos + i) may see key j when j <= start_pos + i, j is within `window` positions (itself
    included), and, for packed rows (doc_ids [B, T]), j belongs to the same example.

    Without cached keys (start_pos 0) and with ``flex``, the mask is a FlexAttention `BlockMask`
    (`flex_mask`); otherwise a boolean tensor, [T, start_pos + T] or [B, 1, T, T]."""
    end = start_pos + T
    if doc_ids is None and start_pos == 0 and (window is None or end <= window):
        return None
    if flex and start_pos == 0:
        return flex_mask(T, doc_ids, window, device)
    # After cached keys (start_pos > 0) SDPA's top-left-aligned is_causal would be wrong, so
    # the mask is explicit there too.
    q = torch.arange(start_pos, end, device=device)[:, None]
    k = torch.arange(end, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    if doc_ids is not None:
        mask = (mask & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]  # [B, 1, T, T]
    return mask


def padding_mask(mask: torch.Tensor | None, key_mask: torch.Tensor, T: int, start_pos: int) -> torch.Tensor:
    """`attention_mask`'s boolean ``mask`` (None: plain causal) of queries start_pos … start_pos + T − 1,
    [B, 1, T, S] with keys where ``key_mask`` [B, S] is False left out — but each query's own position
    kept, so a padding query still attends to something and its row stays finite (its output is
    never read)."""
    end = start_pos + T
    q = torch.arange(start_pos, end, device=key_mask.device)[:, None]
    k = torch.arange(end, device=key_mask.device)[None, :]
    base = (k <= q) if mask is None else mask
    return (base & (key_mask[:, None, :end] | (k == q)))[:, None]


def flex_mask(T: int, doc_ids: torch.Tensor | None, window: int | None, device) -> BlockMask:
    """`attention_mask`'s rule as a FlexAttention block mask over T queries and keys (one per row
    of ``doc_ids``, shared by the heads). Blocks of 128×128 positions that no query may see
    (other documents, beyond the window, the future) are skipped, never computed."""

    def rule(b, h, q, k):
        keep = k <= q
        if window is not None:
            keep = keep & (q - k < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q] == doc_ids[b, k])
        return keep

    rows = None if doc_ids is None else doc_ids.shape[0]
    return create_block_mask(rule, rows, None, T, T, device=device)


_compiled_flex = None


def _flex(q: torch.Tensor):
    """flex_attention, compiled on CUDA (inside a compiled block it is traced into the block's
    graph; without compile its eager form would materialize the scores: a reference
    implementation, which is what the CPU gets)."""
    global _compiled_flex
    if not q.is_cuda or torch.compiler.is_compiling():  # a compiled block traces flex_attention itself
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _reduce_aux(stats: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Average MoE losses over layers (so the coefficients do not scale with depth); keep the
    routing statistics per layer (for expert-health metrics): counts [L, E], entropy [L]."""
    if not stats:
        return {}
    lb = torch.stack([s["lb_loss"] for s in stats]).mean()
    z = torch.stack([s["z_loss"] for s in stats]).mean()
    return {
        "aux_loss": cfg.moe_aux_loss_coef * lb + cfg.moe_z_loss_coef * z,
        "moe_lb_loss": lb.detach(),
        "moe_z_loss": z.detach(),
        "moe_tokens_per_expert": torch.stack([s["tokens_per_expert"] for s in stats]).detach(),
        "moe_router_entropy": torch.stack([s["router_entropy"] for s in stats]).detach(),
    }


def build_model(cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32,
                init: bool = True) -> Transformer:
    """Construct on the meta device (no memory, no init cost), then materialize on `device`.

    Seed torch before calling: the same seed gives identical weights. With init=False the
    weights are left uninitialized (to be loaded), but the RoPE tables are still computed.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    if init:
        model.init_weights()
    else:
        model.init_rope()
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def num_active_params(model: Transformer) -> int:
    """Parameters one token uses: all but the input embedding, with only top_k/E of each MoE
    layer's experts. This is the N of 6·N·D for FLOPs and MFU (an embedding lookup is no matmul;
    a tied head still counts once, as the head)."""
    cfg = model.cfg
    total = num_params(model)
    if not cfg.tie_embeddings:
        total -= model.tok_embeddings.weight.numel()
    for block in model.blocks:
        if cfg.is_moe:
            expert = sum(p.numel() for p in block.mlp.experts.parameters())
            total -= expert - expert * cfg.top_k // cfg.n_experts
    return total
