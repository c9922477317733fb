"""What a user's "checkpoint" path holds, read from its metadata alone (no torch, no weights).

`lmforge export`, `lmforge generate`, `custom_weights_path` and pipelines all accept:

- a run's save folder (``runs/NAME``): its ``final/`` export if the run finished, else its
  latest DCP checkpoint;
- a ``final/`` folder, or any folder in our layout (``lmforge-model.json`` + safetensors);
- a DCP step folder (``checkpoints/step_N``): the model is built from the resolved config
  stored in its ``lmforge-state.json``;
- a Hugging Face folder of a supported family (``config.json`` + safetensors, see
  ``models/families.py``), optionally written ``hf:/path`` to say so explicitly.

Resolution reads a run's shape and tokenizer from here (`fill_from_weights`); `train.locate`
loads the weights themselves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lmforge.config.model import ModelConfig, as_trained
from lmforge.config.schema import LoRAConfig
from lmforge.errors import UserError
from lmforge.run_files import MODEL_CONFIG_FILE, STATE_FILE, latest_checkpoint, read_state

HF_PREFIX = "hf:"


@dataclass
class Located:
    kind: str  # "lmforge" | "hf" | "dcp"
    path: str  # the folder the weights are read from
    tokenizer_dir: str | None  # a folder with tokenizer.json, if one goes with the weights


def _has_tokenizer(folder: str | None) -> bool:
    return bool(folder) and os.path.isfile(os.path.join(folder, "tokenizer.json"))


def locate(path: str) -> Located:
    """Which kind of checkpoint `path` is, without loading any weights."""
    raw = str(path)
    folder = os.path.expanduser(raw.removeprefix(HF_PREFIX))
    if not os.path.isdir(folder):
        raise UserError(f"checkpoint {raw}: no such folder (expected a run's save folder, its final/, a "
                        "checkpoints/step_N folder or a Hugging Face model folder)")
    if raw.startswith(HF_PREFIX) and not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(f"checkpoint {raw}: no config.json (a Hugging Face model folder was expected)")
    if os.path.isfile(os.path.join(folder, MODEL_CONFIG_FILE)):
        return Located("lmforge", folder, folder if _has_tokenizer(folder) else None)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return Located("hf", folder, folder if _has_tokenizer(folder) else None)
    if os.path.isfile(os.path.join(folder, STATE_FILE)):
        return Located("dcp", folder, _state_tokenizer(folder))
    final = os.path.join(folder, "final")
    if os.path.isfile(os.path.join(final, MODEL_CONFIG_FILE)):
        return Located("lmforge", final, final if _has_tokenizer(final) else None)
    latest = latest_checkpoint(folder)
    if latest:
        return Located("dcp", latest, _state_tokenizer(latest))
    raise UserError(f"checkpoint {raw}: holds no model (no {MODEL_CONFIG_FILE}, config.json, {STATE_FILE}, final/ "
                    "or checkpoints/step_N)")


def _state_tokenizer(folder: str) -> str | None:
    tok = (read_state(folder).get("config") or {}).get("tokenizer")
    return tok if isinstance(tok, str) and _has_tokenizer(tok) else None


def model_config_of(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint, read from its metadata only."""
    loc = locate(path)
    if loc.kind == "lmforge":
        return ModelConfig(**json.loads(Path(loc.path, MODEL_CONFIG_FILE).read_text()))
    if loc.kind == "hf":
        from transformers import AutoConfig

        from lmforge.models.hf import from_hf_config

        try:
            return from_hf_config(AutoConfig.from_pretrained(loc.path))
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"{loc.path}/config.json: cannot read ({str(e).splitlines()[0]})") from None
    return dcp_model_config(loc.path)


def dcp_model_config(folder: str) -> ModelConfig:
    """A checkpoint's model, as its run trained it (`config.model.as_trained`: the context it was
    trained at, where that is shorter than the model's length and the run started from scratch)."""
    config = read_state(folder).get("config") or {}
    model = config.get("model")
    if not isinstance(model, dict):
        raise UserError(f"checkpoint {folder}: its lmforge-state.json has no model config")
    ctx = (config.get("parameters") or {}).get("context_length")
    return as_trained(ModelConfig(**model), ctx if isinstance(ctx, int) else None,
                      from_scratch=not config.get("custom_weights_path"))


def lora_config_of(path: str) -> LoRAConfig | None:
    """The `lora:` settings a checkpoint was trained with (None if it was not a LoRA run)."""
    loc = locate(path)
    if loc.kind != "dcp":
        return None
    adapters = (read_state(loc.path).get("config") or {}).get("lora")
    return LoRAConfig(**adapters) if adapters else None


def check_tokenizer_fits(tokenizer, cfg: ModelConfig, what: str) -> None:
    """A tokenizer whose ids run past the embedding table belongs to other weights."""
    if cfg.vocab_size is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"{what}: the tokenizer ({tokenizer.path}) has {tokenizer.vocab_size} tokens but the "
                        f"weights' vocabulary has {cfg.vocab_size}; use the tokenizer the model was trained with")


def is_model_change(model) -> bool:
    """Whether a `model:` value is changes to custom_weights_path's shape rather than a shape."""
    return isinstance(model, dict) and "preset" not in model and "d_model" not in model


def fill_from_weights(raw: dict) -> dict:
    """A raw config dict with `model` / `tokenizer` taken from its `custom_weights_path` when left
    out. A `model` mapping that names no shape (no preset, no d_model) holds changes to the
    weights' own: ``{max_seq_len: 8192, rope_scaling: {...}}`` extends their context."""
    path = raw.get("custom_weights_path")
    model = raw.get("model")
    if not path or (model and not is_model_change(model) and raw.get("tokenizer")):
        return raw
    raw = dict(raw)
    if not model or is_model_change(model):
        raw["model"] = model_config_of(path).model_dump(mode="json") | (model or {})
    if not raw.get("tokenizer"):
        tok = locate(path).tokenizer_dir
        if tok:
            raw["tokenizer"] = tok
    return raw
