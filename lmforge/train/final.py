"""A completed run's ``final/`` folder: the trained model as `save_pretrained` writes it (or, with
LoRA, the merged model and the PEFT adapter), its tokenizer and chat template, digests last."""

from __future__ import annotations

import os

from lmforge.checksums import write_export_digests
from lmforge.config.model import as_trained
from lmforge.distributed.dist import DistInfo
from lmforge.distributed.parallelize import full_state_dict, is_sharded
from lmforge.models import build_model, save_pretrained
from lmforge.models.io import write_chat_template
from lmforge.models.lora import apply_lora, save_final as save_lora_final
from lmforge.models.transformer import Transformer


def write_final(model: Transformer, cfg, dist: DistInfo, save_folder: str, tokenizer_path: str | None,
                chat_template: str | None) -> str | None:
    """``<save_folder>/final`` written by rank 0 (its path; None on the other ranks). Sharded weights
    are gathered first, which every rank takes part in."""
    if is_sharded(model):
        full = full_state_dict(model)
        if not dist.is_main:
            return None
        model = apply_lora(build_model(cfg.model, device="cpu", init=False), cfg.lora)
        model.load_state_dict(full)
    elif not dist.is_main:
        return None
    final_dir = os.path.join(save_folder, "final")
    if cfg.lora:  # final/ = the merged model, final/adapter = the PEFT adapter
        save_lora_final(model, cfg, final_dir, tokenizer_path)
    else:  # its config says the context it was trained at (`config.model.as_trained`)
        trained = as_trained(cfg.model, cfg.parameters.context_length, from_scratch=not cfg.custom_weights_path)
        save_pretrained(model, trained, final_dir, tokenizer_dir=tokenizer_path)
    if chat_template:
        write_chat_template(final_dir, chat_template)
    write_export_digests(final_dir)  # last: what load_pretrained checks the weights against
    return final_dir
