"""lmforge: pretrain, continue pretraining and fine-tune your own language model.

The SDK: ``lmforge.pretrain(...) -> Run``, ``lmforge.finetune(...) -> Run``, ``lmforge.get_run(name)``, ``lmforge.get_runs()``.
They are loaded on first use so that ``import lmforge`` stays light (no torch).
"""

__version__ = "0.1.0"

_SDK = {"pretrain", "finetune", "get_run", "get_runs", "Run"}


def __getattr__(name):
    if name in _SDK:
        from lmforge.runs import run

        return getattr(run, name)
    raise AttributeError(f"module 'lmforge' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SDK))
