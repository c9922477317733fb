"""Models: the dense/MoE transformer, generation, Hugging Face interop, save/load, and the export
formats (GGUF with its vocabulary, the Ollama Modelfile). Generation is ``lmforge.models.generate``.

The names below load on first use, so that the torch-free leaves here (``gguf_vocab``,
``modelfile``) can be imported without torch.
"""

_EXPORTS = {"load_pretrained": "io", "save_hf": "io", "save_pretrained": "io",
            "KVCache": "transformer", "Transformer": "transformer", "build_model": "transformer",
            "num_active_params": "transformer", "num_params": "transformer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"lmforge.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
