"""Save and load model weights: our own folder layout, or a Hugging Face Llama/Mixtral folder.

Ours: `model.safetensors` (our parameter names) + `lmforge-model.json` (the ModelConfig).
HF: `config.json` + `model.safetensors` or sharded `model-*.safetensors` with an index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from lmforge.checksums import verify_export
from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.run_files import MODEL_CONFIG_FILE
from lmforge.models.moe import fuse_legacy_experts
from lmforge.models.transformer import Transformer, build_model

WEIGHTS_FILE = "model.safetensors"
# What a tokenizer folder may hold; copied so the saved folder is self-contained.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "lmforge-tokenizer.json",
                   "chat_template.jinja")


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared or non-contiguous storage; copy to CPU, contiguous.
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def _copy_tokenizer(tokenizer_dir: str | Path | None, out: Path) -> None:
    if tokenizer_dir is None:
        return
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise UserError(f"tokenizer_dir: {src} is not a folder")
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not copied:
        raise UserError(f"tokenizer_dir: {src} holds none of {', '.join(TOKENIZER_FILES)}")
    for f in copied:
        shutil.copy2(src / f, out / f)


def save_pretrained(model: Transformer | None, cfg: ModelConfig, out_dir: str | Path,
                    tokenizer_dir: str | Path | None = None, *, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write our layout (weights + config, and the tokenizer files if given) to `out_dir`.
    `weights`: CPU tensors under our names to write instead of the model's (e.g. LoRA merged)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(_state_dict(model) if weights is None else weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / MODEL_CONFIG_FILE).write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    _copy_tokenizer(tokenizer_dir, out)
    return out


def write_chat_template(folder: str | Path, template: str) -> None:
    """Store a chat template with a saved tokenizer (what transformers' apply_chat_template reads)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2) + "\n")


def save_hf(model: Transformer | None, cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
            *, bos_id: int | None = None, eos_id: int | None = None, allow_clip_qkv: bool = False,
            weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) that transformers/vLLM load.

    bos_id/eos_id (from the tokenizer) go into config.json so HF generation stops at eos.
    `weights`: CPU tensors under our names to write instead of the model's (e.g. a LoRA run's base)."""
    from safetensors.torch import save_file

    from lmforge.models.hf import to_hf_config, to_hf_state_dict

    hf_config = to_hf_config(cfg, allow_clip_qkv=allow_clip_qkv)
    hf_config.bos_token_id, hf_config.eos_token_id = bos_id, eos_id
    sd = _state_dict(model) if weights is None else weights
    hf_config.dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state_dict(sd, cfg), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    _copy_tokenizer(tokenizer_dir, out)
    return out


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"{f}: not a readable safetensors file ({why[:200]}); it may be truncated or "
                            "damaged — copy or export it again") from None
    return sd


def _hf_weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise UserError(f"{index}: shard {missing[0]} is missing")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def load_pretrained(path: str | Path, device="cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[Transformer, ModelConfig]:
    """Load our layout or a Hugging Face Llama/Mixtral folder into a Transformer."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder with model weights")
    verify_export(str(folder))  # digests recorded at export (lmforge folders): a damaged file is named
    if (folder / MODEL_CONFIG_FILE).is_file():
        try:
            cfg = ModelConfig(**json.loads((folder / MODEL_CONFIG_FILE).read_text()))
        except (ValueError, TypeError) as e:
            raise UserError(f"{folder / MODEL_CONFIG_FILE}: invalid model config ({e})".splitlines()[0]) from None
        if not (folder / WEIGHTS_FILE).is_file():
            raise UserError(f"{folder}: {WEIGHTS_FILE} is missing")
        sd = fuse_legacy_experts(_read_safetensors([folder / WEIGHTS_FILE]))
    elif (folder / "config.json").is_file():
        from transformers import AutoConfig

        from lmforge.models.hf import from_hf_config, from_hf_state_dict

        try:
            hf_config = AutoConfig.from_pretrained(str(folder))
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"{folder / 'config.json'}: cannot read ({str(e).splitlines()[0]})") from None
        cfg = from_hf_config(hf_config)
        sd = from_hf_state_dict(_read_safetensors(_hf_weight_files(folder)), cfg)
    else:
        raise UserError(f"{folder}: neither {MODEL_CONFIG_FILE} (lmforge) nor config.json (Hugging Face) found")
    model = build_model(cfg, device=device, dtype=dtype, init=False)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise UserError(f"{folder}: weights do not match the config "
                        f"({what}; {len(missing)} missing, {len(extra)} unexpected)")
    for k, v in sd.items():
        if v.shape != expected[k].shape:
            raise UserError(f"{folder}: tensor {k} has shape {tuple(v.shape)}, "
                            f"the config implies {tuple(expected[k].shape)}")
    model.load_state_dict(sd, strict=True)
    return model, cfg
