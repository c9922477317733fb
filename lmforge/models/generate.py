"""Autoregressive sampling with a preallocated KV cache: one sequence at a time (`generate`: prompts,
evaluations), or a batch of prompts at once (`sample`: reinforcement learning's rollouts)."""

from __future__ import annotations

from dataclasses import dataclass
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


# --------------------------------------------------------------------------- batched sampling

@dataclass
class Samples:
    """Completions of a batch of prompts, each as long as it ran (its end-of-text or stop token included)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]  # each token's log-probability under the model itself (not tempered or cut)
    entropy: list[list[float]]  # the entropy of the model's distribution at each token (nats)
    finish: list[str]  # why each ended: "eos", "stop" (a stop string) or "length" (max_new_tokens: truncated)
    steps: int = 0  # forward passes run (the longest completion, or max_new_tokens with ``to_the_end``)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """[N, V] logits tempered and cut to the top k and the nucleus of mass top_p (the most likely token
    always stays), as `_sample` does for one row."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p  # the mass before a token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


@torch.no_grad()
def sample(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
           top_p: float | None = None, top_k: int | None = None, eos_id: int | None = None,
           stop: Callable[[list[int]], bool] | None = None, generator: torch.Generator | None = None,
           pad_id: int = 0, cache: bool = True, to_the_end: bool = False) -> Samples:
    """Sample one completion of each prompt, all rows in one batch: the prompts left-padded to one length
    (the padding masked out of attention), then one token per row and forward pass — with ``cache``
    from the KV cache (`Transformer.decode`), else recomputing every position each time (what the cache
    saves: `bench/rl.py`). Greedy when ``temperature`` is 0. A row ends at ``eos_id``, when ``stop(its
    tokens)`` says so, or after ``max_new_tokens``; ``to_the_end``: every row runs all max_new_tokens
    passes (under FSDP every rank must run as many forwards as its peers). Random numbers come from
    ``generator`` only (on the model's device)."""
    n, width = len(prompts), max(len(p) for p in prompts)
    device = model.tok_embeddings.weight.device
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    real = torch.ones((n, width + max_new_tokens), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        real[i, :width - len(p)] = False
    out, steps = [[] for _ in range(n)], 0
    logps, ents = [[] for _ in range(n)], [[] for _ in range(n)]
    finish, done = ["length"] * n, [False] * n
    was_training = model.training
    model.eval()
    try:
        kv = model.new_kv_cache(n, width + max_new_tokens) if cache else None
        feed, seq = ids, ids
        for _ in range(max_new_tokens):
            if cache:
                pos = seq.shape[1] - feed.shape[1]
                logits = model.decode(feed, kv, start_pos=pos, key_mask=real[:, :seq.shape[1]])[:, -1].float()
            else:  # every position again, through a fresh cache of this length
                logits = model.decode(seq, model.new_kv_cache(n, seq.shape[1]), key_mask=real[:, :seq.shape[1]])
                logits = logits[:, -1].float()
            logp = torch.log_softmax(logits, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            steps += 1
            rows = torch.stack([tok.float(), logp.gather(1, tok[:, None]).squeeze(1), entropy]).tolist()  # one wait
            for i in range(n):
                if done[i]:  # (a finished row goes on being fed its samples: nothing reads them)
                    continue
                out[i].append(int(rows[0][i]))
                logps[i].append(rows[1][i])
                ents[i].append(rows[2][i])
                if eos_id is not None and out[i][-1] == eos_id:
                    finish[i] = "eos"
                elif stop is not None and stop(out[i]):
                    finish[i] = "stop"
                done[i] = finish[i] != "length" or len(out[i]) == max_new_tokens
            if not to_the_end and all(done):
                break
            feed = tok[:, None]
            seq = torch.cat([seq, feed], 1)
    finally:
        model.train(was_training)
    return Samples(out, logps, ents, finish, steps)
