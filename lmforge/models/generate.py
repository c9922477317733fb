"""Autoregressive sampling with a preallocated KV cache (one sequence at a time)."""

from __future__ import annotations

from typing import Callable

import torch

from lmforge.models.transformer import Transformer


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
            gen: torch.Generator | None) -> int:
    """logits: [V] fp32. Greedy when temperature == 0."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass *before* it already reaches top_p (the top one always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(drop.scatter(0, idx, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             seed: int | None = None, on_token: Callable[[int], None] | None = None) -> list[int]:
    """Return the new tokens only (the eos token, if hit, is included and ends generation)."""
    if not prompt_ids:
        raise ValueError("generate: prompt_ids must not be empty")
    max_len = model.cfg.max_seq_len
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    device = model.tok_embeddings.weight.device
    was_training = model.training
    model.eval()
    tokens = list(prompt_ids[-max_len:])  # crop from the left: the most recent context matters
    new: list[int] = []
    try:
        with torch.no_grad():
            cache = model.new_kv_cache(1, min(max_len, len(tokens) + max_new_tokens))
            pos, feed = 0, tokens
            for _ in range(max_new_tokens):
                if pos + len(feed) > cache.max_len:
                    # Cache full: restart from the most recent half-context (positions are
                    # relative under RoPE, so restarting at 0 is sound).
                    feed, pos = tokens[-(max_len // 2):], 0
                ids = torch.tensor([feed], dtype=torch.long, device=device)
                logits = model.decode(ids, cache, start_pos=pos)[0, -1].float()
                pos += len(feed)
                tok = _sample(logits, temperature, top_k, top_p, gen)
                tokens.append(tok)
                new.append(tok)
                if on_token is not None:
                    on_token(tok)
                if eos_id is not None and tok == eos_id:
                    break
                feed = [tok]
    finally:
        model.train(was_training)
    return new
