"""Export any checkpoint (see `locate`) to a Hugging Face folder or to our own layout.

HF: ``config.json`` (the model's family, see ``families.py``: LlamaForCausalLM, Qwen2ForCausalLM, …
for dense models, MixtralForCausalLM for MoE — our experts are Mixtral's top-k softmax experts,
so the layout is exact), ``model.safetensors`` or
shards ``model-0000i-of-0000n.safetensors`` + index when larger than ``max_shard_size``, the
tokenizer files (with the chat template of a fine-tuned model), ``generation_config.json``.
The folder is written next to ``out`` and renamed into place when complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from transformers import GenerationConfig

from lmforge.data.tokenizer import load_tokenizer
from lmforge.errors import UserError
from lmforge.guard import check_target, checkpoint_reads
from lmforge.models.hf import to_hf_config, to_hf_state_dict
from lmforge.models.io import _copy_tokenizer, _state_dict, save_pretrained
from lmforge.checksums import write_export_digests
from lmforge.layout import read_state
from lmforge.resolve.weights import check_tokenizer_fits, locate, lora_config_of
from lmforge.train.locate import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(checkpoint: str, out: str, *, fmt: str = "hf", tokenizer: str | None = None, dtype: str = "float32",
           max_shard_size: str = "5GB", allow_clip_qkv: bool = False, overwrite: bool = False) -> Path:
    out_path = Path(out)
    check_target(out, "--out", [*checkpoint_reads(checkpoint), ("the tokenizer", tokenizer)])
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())) and not overwrite:
        raise UserError(f"--out {out}: already exists and is not empty; choose another folder or pass --overwrite")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if fmt == "peft":
        return _export_adapter(checkpoint, out_path)
    model, cfg, loc = load_model(checkpoint, dtype=DTYPES[dtype])
    tok_dir = tokenizer or loc.tokenizer_dir
    tok = None
    if tok_dir:
        tok = load_tokenizer(tok_dir)
        check_tokenizer_fits(tok, cfg, f"checkpoint {checkpoint}")
        if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            tok_dir = None  # a hub name or a bare tokenizer.json file: save a folder below
    tmp = out_path.with_name(out_path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if fmt == "lmforge":
            save_pretrained(model, cfg, tmp, tokenizer_dir=tok_dir)
        elif fmt == "hf":
            _save_hf(model, cfg, tmp, tok, allow_clip_qkv=allow_clip_qkv, max_shard_size=max_shard_size)
            if tok_dir:
                _copy_tokenizer(tok_dir, tmp)
        else:
            raise UserError(f"--format {fmt!r}: expected hf, lmforge or peft")
        if tok is not None and not tok_dir:
            tok.save(str(tmp))
        write_export_digests(str(tmp))
        if out_path.exists():
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_path


def _export_adapter(checkpoint: str, out: Path) -> Path:
    """A LoRA run's adapter as a PEFT folder: copied from its final/adapter, or read from a
    checkpoint (the adapters are kept apart from the frozen base there)."""
    from lmforge.models.lora import adapter_tensors, base_model_reference, write_peft_adapter

    loc = locate(checkpoint)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if loc.kind == "lmforge" and os.path.isfile(os.path.join(loc.path, "adapter", "adapter_config.json")):
            shutil.copytree(os.path.join(loc.path, "adapter"), tmp)
        elif loc.kind == "dcp" and (lora := lora_config_of(loc.path)) is not None:
            model, _, _ = load_model(loc.path, merge_lora=False)
            base = (read_state(loc.path).get("config") or {}).get("custom_weights_path")
            write_peft_adapter(adapter_tensors(model), lora, tmp, base_model_reference(base))
        else:
            raise UserError(f"checkpoint {checkpoint}: holds no LoRA adapter (--format peft needs a run trained "
                            "with lora:)")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_hf(model, cfg, out: Path, tok, *, allow_clip_qkv: bool, max_shard_size: str) -> None:
    hf_config = to_hf_config(cfg, allow_clip_qkv=allow_clip_qkv)
    bos = tok.bos_id if tok is not None else None
    eos = tok.eos_id if tok is not None else None
    hf_config.bos_token_id, hf_config.eos_token_id = bos, eos
    hf_config.pad_token_id = tok.pad_id if tok is not None else None
    hf_config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    try:
        save_torch_state_dict(to_hf_state_dict(_state_dict(model), cfg), str(out), max_shard_size=max_shard_size,
                              metadata={"format": "pt"})
    except ValueError as e:
        raise UserError(f"--max-shard-size {max_shard_size!r}: {e}") from None
    if eos is not None:
        # Greedy by default: evaluators (LLM Foundry, lm-eval) and vLLM call `generate` without
        # sampling arguments and would otherwise score random samples. Sampling is opt-in there.
        GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=tok.pad_id,
                         do_sample=False).save_pretrained(str(out))
