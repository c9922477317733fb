"""A run's name, its default save folder and its identity — one rule each, used everywhere.

The identity says what makes two starts "the same run": the same name, model shape and
training data. A longer duration, new eval settings or a different number of ranks keep the
identity, so they resume. It is what guards a save folder against being mixed with another
run's checkpoints (`train.checkpoint`) and what the run registry compares (`runs`).
"""

from __future__ import annotations

import os
import time

from lmforge.config.schema import RunConfig


def default_name(cfg: RunConfig) -> str:
    """The config's `name`, else the model preset and the start time."""
    label = "auto" if cfg.model == "auto" else cfg.model.preset or "custom"
    return cfg.name or f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def with_default_names(cfg: RunConfig) -> RunConfig:
    """`name` and `save_folder` filled in (runs/<name> by default: re-running the command resumes)."""
    name = default_name(cfg)
    return cfg.model_copy(update={"name": name, "save_folder": cfg.save_folder or os.path.join("runs", name)})


def run_identity(cfg: RunConfig) -> dict:
    """Name, model shape and training data. The vocabulary is left out: it is only known once
    the tokenizer is resolved, and a tokenizer change shows up in the data already."""
    model = "auto" if cfg.model == "auto" else cfg.model.model_dump(mode="json", exclude={"vocab_size"})
    return {"name": cfg.name, "model": model,
            "train_data": [d.model_dump(mode="json") for d in cfg.train_data]}
