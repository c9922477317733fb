"""Models: the dense/MoE transformer, generation, Hugging Face interop and save/load."""

from lmforge.models.generate import generate
from lmforge.models.io import load_pretrained, save_hf, save_pretrained
from lmforge.models.transformer import KVCache, Transformer, build_model, num_active_params, num_params

__all__ = ["KVCache", "Transformer", "build_model", "generate", "load_pretrained", "num_active_params",
           "num_params", "save_hf", "save_pretrained"]
