"""Load a model from anything a user may call "a checkpoint" (what each kind is: `resolve.weights`)."""

from __future__ import annotations

import torch

from lmforge.models import lora
from lmforge.models.io import load_pretrained
from lmforge.models.transformer import build_model
from lmforge.resolve.weights import dcp_model_config, locate, lora_config_of
from lmforge.train.checkpoint import load_checkpoint


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.float32, *, merge_lora: bool = True):
    """(model, ModelConfig, Located) for any supported checkpoint.

    A checkpoint of a LoRA run comes back with its adapters merged into the weights (or, with
    merge_lora=False, still as adapters, e.g. to save them for PEFT)."""
    loc = locate(path)
    if loc.kind in ("lmforge", "hf"):
        model, cfg = load_pretrained(loc.path, device=device, dtype=dtype)
        return model, cfg, loc
    cfg = dcp_model_config(loc.path)
    model = build_model(cfg, device=device, init=False)
    lora.apply_lora(model, lora_config_of(loc.path))
    rng = torch.get_rng_state()
    load_checkpoint(loc.path, model, None, rank=0)
    torch.set_rng_state(rng)  # loading restores the run's RNG; a reader should not inherit it
    if merge_lora:
        lora.merge_lora(model)
    return model.to(dtype), cfg, loc
