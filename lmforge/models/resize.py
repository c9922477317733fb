"""Grow a model's vocabulary for an extended tokenizer (`lmforge.data.text.vocab_extension`).

A new token's embedding starts as the mean of the embeddings of the base pieces it replaces,
so the model reads a new token roughly as it read the pieces (an untied output head gets the
same treatment); rows past the tokenizer (rounding the table to a multiple of 64) start as the
mean of all old rows. Everything else is copied unchanged.
"""

from __future__ import annotations

import torch


def extend_embeddings(sd: dict[str, torch.Tensor], extension: dict, vocab_size: int) -> dict[str, torch.Tensor]:
    """`sd` (our parameter names) with `tok_embeddings.weight` / `output.weight` grown to `vocab_size` rows."""
    out = dict(sd)
    for name in ("tok_embeddings.weight", "output.weight"):
        if name not in sd:
            continue
        old = sd[name]
        if old.shape[0] > vocab_size:
            raise ValueError(f"{name}: {old.shape[0]} rows, more than the extended vocabulary {vocab_size}")
        grown = old.new_empty((vocab_size, old.shape[1]))
        grown[:old.shape[0]] = old
        used = extension["base_vocab_size"]
        fill = old[:min(used, old.shape[0])].float().mean(0).to(old.dtype)
        grown[old.shape[0]:] = fill
        for tid, pieces in extension["pieces"].items():
            grown[tid] = old[pieces].float().mean(0).to(old.dtype)
        out[name] = grown
    return out
