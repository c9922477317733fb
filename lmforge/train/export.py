"""Export any checkpoint (see `locate`) to a Hugging Face folder, our own layout, a LoRA run's
PEFT adapter, or a GGUF file for llama.cpp / Ollama (`lmforge.models.gguf`, with a Modelfile).

HF: ``config.json`` (the model's family, see ``families.py``: LlamaForCausalLM, Qwen2ForCausalLM, …
for dense models, MixtralForCausalLM for MoE — our experts are Mixtral's top-k softmax experts,
so the layout is exact), ``model.safetensors`` or
shards ``model-0000i-of-0000n.safetensors`` + index when larger than ``max_shard_size``, the
tokenizer files (with the chat template of a fine-tuned model), ``generation_config.json``.
GGUF: ``model-<dtype>.gguf`` (weights, hyperparameters, tokenizer and chat template in one
file) and an Ollama ``Modelfile`` beside it (`lmforge.models.modelfile`).
Every folder is written next to ``out`` and renamed into place when complete.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from transformers import GenerationConfig

from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError
from lmforge.guard import check_output, check_output_file, checkpoint_reads, replace_folder
from lmforge.models.hf import to_hf_config, to_hf_state_dict
from lmforge.models.io import _copy_tokenizer, _state_dict, save_pretrained
from lmforge.checksums import write_export_digests
from lmforge.run_files import read_state
from lmforge.resolve.weights import check_tokenizer_fits, locate, lora_config_of
from lmforge.train.locate import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("hf", "lmforge", "peft", "gguf")
GGUF_DEFAULT_DTYPE = "f16"  # half the size of f32 for the same greedy text (tests/test_ladder.py)


def export(checkpoint: str, out: str, *, fmt: str = "hf", tokenizer: str | None = None, dtype: str | None = None,
           max_shard_size: str = "5GB", allow_clip_qkv: bool = False, overwrite: bool = False,
           merge: bool = False) -> Path:
    """``dtype``: float32 / bfloat16 / float16 (default float32); for gguf f32 / f16 / bf16 / q8_0 (default f16).
    ``merge``: a LoRA run's adapters merged into the GGUF's weights (required for such a run).
    ``out`` is a folder, or for gguf a ``FILE.gguf`` (the GGUF alone, no Modelfile); ``overwrite``
    replaces an earlier export there (`guard.check_output`), nothing else."""
    out_path = Path(out)
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    reads = [*checkpoint_reads(checkpoint), ("the tokenizer", tokenizer)]
    if gguf_file(fmt, out):
        check_output_file(out, "--out", overwrite, same_kind=lambda head: head.startswith(b"GGUF"), reads=reads,
                          strict=True, writes="a GGUF model")
    else:
        check_output(out, "--out", "export", overwrite=overwrite, reads=reads, command="export")
    if fmt == "gguf":
        return _export_gguf(checkpoint, out_path, tokenizer, dtype or GGUF_DEFAULT_DTYPE, merge)
    dtype = dtype or "float32"
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
    with _staged(out_path) as tmp:
        if fmt == "lmforge":
            save_pretrained(model, cfg, tmp, tokenizer_dir=tok_dir)
        else:
            _save_hf(model, cfg, tmp, tok, allow_clip_qkv=allow_clip_qkv, max_shard_size=max_shard_size)
            if tok_dir:
                _copy_tokenizer(tok_dir, tmp)
        if tok is not None and not tok_dir:
            tok.save(str(tmp))
        write_export_digests(str(tmp))
    return out_path


def gguf_file(fmt: str, out: str) -> bool:
    """``--format gguf --out FILE.gguf``: the GGUF file itself, not a folder for it and its Modelfile."""
    return fmt == "gguf" and str(out).lower().endswith(".gguf") and not os.path.isdir(out)


@contextmanager
def _staged(out: Path):
    """A fresh folder beside ``out`` to write into; it replaces ``out`` once the block ends without an
    error (`guard.replace_folder`), and is removed otherwise (``out`` is then left as it was)."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        replace_folder(str(tmp), str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _staged_file(out: Path):
    """A path beside the file ``out`` to write; renamed over ``out`` (atomic) once the block ends
    without an error, removed otherwise."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _export_gguf(checkpoint: str, out: Path, tokenizer: str | None, dtype: str, merge: bool) -> Path:
    """``model-<dtype>.gguf`` and its Ollama Modelfile. Everything that can be refused (the dtype, a
    LoRA run without --merge, a tokenizer or an architecture llama.cpp cannot represent) is, before
    the weights are read."""
    from lmforge.data.chat import load_chat_template
    from lmforge.models.gguf_vocab import gguf_vocab
    from lmforge.models.modelfile import chat_format, modelfile
    from lmforge.models.gguf import DTYPES as GGUF_DTYPES, check, write_gguf
    from lmforge.resolve.weights import model_config_of

    if dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(GGUF_DTYPES)} for --format gguf")
    loc = locate(checkpoint)
    lora = (loc.kind == "dcp" and lora_config_of(loc.path) is not None) or \
        (loc.kind == "lmforge" and os.path.isdir(os.path.join(loc.path, "adapter")))
    if lora and not merge:
        raise UserError(f"checkpoint {checkpoint}: a LoRA run; pass --merge to export its adapters merged into the "
                        "weights (or --format peft for the adapter alone)")
    cfg = model_config_of(loc.path)
    check(cfg)
    tok_dir = tokenizer or loc.tokenizer_dir
    if not tok_dir:
        raise UserError(f"checkpoint {checkpoint}: holds no tokenizer, and a GGUF carries one; pass --tokenizer DIR")
    tok = load_tokenizer(tok_dir)
    check_tokenizer_fits(tok, cfg, f"checkpoint {checkpoint}")
    template = load_chat_template(tok_dir)
    text = None if template is None else template.text
    vocab = gguf_vocab(tok, cfg.vocab_size, text.get("default") if isinstance(text, dict) else text)
    model, cfg, loc = load_model(loc.path)
    name = f"model-{dtype}.gguf"
    fmt = None if template is None else chat_format(
        lambda m: template.render(m, add_generation_prompt=True), tok.eos_token, template.hf.bos_token)
    if gguf_file("gguf", str(out)):
        with _staged_file(out) as tmp:
            write_gguf(model, cfg, vocab, tmp, dtype=dtype, name=_model_name(loc.path))
        return out
    with _staged(out) as tmp:
        write_gguf(model, cfg, vocab, tmp / name, dtype=dtype, name=_model_name(loc.path))
        (tmp / "Modelfile").write_text(modelfile(name, fmt, tok.eos_token, template is not None))
        write_export_digests(str(tmp))
    return out


def _model_name(path: str) -> str:
    """What the GGUF calls the model (general.name): its run's folder for a final/ or step_N."""
    p = Path(path).resolve()
    while p.parent != p and (p.name in ("final", "checkpoints") or p.name.startswith("step_")):
        p = p.parent
    return p.name


def _export_adapter(checkpoint: str, out: Path) -> Path:
    """A LoRA run's adapter as a PEFT folder: copied from its final/adapter, or read from a
    checkpoint (the adapters are kept apart from the frozen base there)."""
    from lmforge.models.lora import adapter_tensors, base_model_reference, write_peft_adapter

    loc = locate(checkpoint)
    with _staged(out) as tmp:
        if loc.kind == "lmforge" and os.path.isfile(os.path.join(loc.path, "adapter", "adapter_config.json")):
            shutil.copytree(os.path.join(loc.path, "adapter"), tmp, dirs_exist_ok=True)
        elif loc.kind == "dcp" and (lora := lora_config_of(loc.path)) is not None:
            model, _, _ = load_model(loc.path, merge_lora=False)
            base = (read_state(loc.path).get("config") or {}).get("custom_weights_path")
            write_peft_adapter(adapter_tensors(model), lora, tmp, base_model_reference(base))
        else:
            raise UserError(f"checkpoint {checkpoint}: holds no LoRA adapter (--format peft needs a run trained "
                            "with lora:)")
        write_export_digests(str(tmp))  # its marker too: what a later --overwrite may replace
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
