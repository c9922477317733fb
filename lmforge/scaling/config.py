"""The ladder file: what `lmforge scaling run -f ladder.yaml` reads.

    name: shakes-ladder
    train_data: data/train.txt          # as `lmforge train` accepts (raw or prepared)
    tokenizer: tok                      # a folder, or {train: {vocab_size: 512}}: one for every run
    eval: {data_path: data/val.txt}     # the held-out data whose loss is fitted and predicted
    save_folder: ladders/shakes
    target: {model: {d_model: 160, n_layers: 5, n_heads: 5}, tokens: 1M}   # or {tokens: 20M}, {flops: 1e18}
    budget: 6min                        # the whole ladder on this machine, or training FLOPs ('3e14flop')
    ladder: {sizes: 4, levels: 3}       # optional: the knobs of LadderOptions below

Every other key is a run-config key (``parameters``, ``compute``, ``experiment_tracker``, …) given
to every run of the ladder and to the target alike: the law is fitted for one recipe. The ladder
chooses each run's ``model``, ``training_duration``, ``name`` and ``save_folder`` itself.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from lmforge.config.counts import parse_count
from lmforge.config.durations import Duration, parse_duration
from lmforge.config.load import build_config, format_error, parse_set, read_yaml, set_path
from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.errors import UserError
from lmforge.guard import check_target

LADDER_KEYS = ("name", "save_folder", "target", "budget", "ladder")
# Run-config keys a ladder sets per run, or that have no place in a ladder of fresh models.
CHOSEN_BY_LADDER = {
    "model": "the ladder chooses each run's model; the target's goes in `target: {model: …}`",
    "training_duration": "the ladder chooses each run's tokens; the target's go in `target: {tokens: …}`",
    "custom_weights_path": "a ladder trains every model from scratch (its law is for pretraining)",
    "lora": "a ladder trains every model from scratch (its law is for pretraining)",
}


class Target(BaseModel):
    """The run whose loss is predicted: a model and tokens, tokens alone (the model is the
    compute-optimal one for them), or a FLOPs budget (compute-optimal model and tokens)."""

    model_config = ConfigDict(extra="forbid")

    model: str | dict | None = Field(None, description="a preset name or a model mapping, as `model:` in a run config")
    tokens: float | None = Field(None, description="training tokens, e.g. 20M or 2B")
    flops: float | None = Field(None, description="training compute, 6·N·D, e.g. 1e18")

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, v):
        return None if v is None else parse_count(v, "target.tokens")

    @field_validator("flops", mode="before")
    @classmethod
    def _flops(cls, v):
        return None if v is None else parse_count(v, "target.flops")

    @model_validator(mode="after")
    def _one_budget(self):
        if self.tokens is None and self.flops is None:
            raise ValueError("target: give `tokens` (with or without a `model`) or `flops`")
        if self.tokens is not None and self.flops is not None:
            raise ValueError("target: give `tokens` or `flops`, not both (the one follows from the other)")
        return self


class LadderOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sizes: int = Field(4, ge=2, le=8, description="model sizes in the ladder")
    levels: int = Field(3, ge=1, le=6, description="compute levels (IsoFLOP lines): each size trains once per level")
    level_ratio: float = Field(2.0, gt=1, le=10, description="compute of each level over the one below")
    target_gap: float = Field(4.0, ge=1, description="the target has at least this many times the parameters of "
                              "the ladder's largest model")
    max_epochs: float = Field(4.0, gt=0, description="no run (ladder or target) repeats its data more often "
                              "(Muennighoff et al. 2023: up to ~4 epochs repeated tokens are worth nearly new ones)")
    min_steps: int = Field(200, ge=10, description="a ladder run takes at least this many optimizer steps, and "
                           "at least four warmups (shorter runs of the larger sizes fell off the law: BENCHMARKS.md)")
    parallel: int = Field(1, ge=1, description="ladder runs at once (each a separate `lmforge train`)")
    threads: int | Literal["auto"] = Field(
        "auto", description="CPU threads per run; auto: the cores divided by `parallel`, or 1 when the machine "
        "is busier than it has cores (threads waiting for a busy core spin: 5–10× slower)")
    confidence: float = Field(0.9, gt=0.5, lt=1, description="coverage of the printed prediction interval")
    models: list[str | dict] | None = Field(
        None, description="the ladder's model shapes, smallest first (default: the built-in family below the target)")


class LadderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    save_folder: str
    target: Target
    budget: Duration
    ladder: LadderOptions = Field(default_factory=LadderOptions)
    base: dict = Field(default_factory=dict, description="the run-config keys every run shares")
    # The folder the file's relative paths are relative to (where the ladder was started, as for
    # `lmforge train`): the runs' configs and target.yaml get them absolute, so that they run from
    # any folder (target.yaml from its own).
    _root: str = PrivateAttr(default_factory=os.getcwd)

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v):
        d = parse_duration(v, "budget")
        if d.unit not in ("s", "flop"):
            raise ValueError(f"budget: expected a wall-clock time on this machine ('6min', '2h') or training FLOPs "
                             f"('3e14flop'), got {v!r}")
        return d

    @property
    def optimizer(self) -> str:
        """The one optimizer of every run and the target: the file's, or AdamW for ``auto`` (whose
        rule changes optimizer at 5M parameters, which would split the ladder's law in two)."""
        value = self.base_config.parameters.optimizer
        return "adamw" if value == "auto" else value

    @functools.cached_property
    def run_base(self) -> dict:
        """The shared keys as every run's config gets them: local paths made absolute."""
        return absolute_paths(self.base, self._root)

    @functools.cached_property
    def base_config(self) -> RunConfig:
        """The shared keys as a validated run config (with a placeholder model and duration)."""
        return build_config(self.run_base | {"model": {"d_model": 64, "n_layers": 2, "n_heads": 2},
                                             "training_duration": "1tok", "name": self.name})


# Run-config keys that hold local paths (relative ones are relative to where a command started).
_PATH_KEYS = (("tokenizer",), ("eval", "data_path"), ("eval", "icl_tasks"), ("eval", "gauntlet"),
              ("eval", "data_root"), ("secrets", "file"))


def _absolute(value, root: str):
    """A local path made absolute; anything else (a URI, builtin:, a hub name, a mapping) as it is."""
    if not isinstance(value, str) or not value or "://" in value or value.startswith(("builtin:", "hf:")):
        return value
    path = os.path.join(root, os.path.expanduser(value))
    globbed = any(c in value for c in "*?[")
    return os.path.normpath(path) if os.path.isabs(value) or globbed or os.path.exists(path) else value


def _absolute_data(value, root: str):
    """``train_data`` in any of its forms (a path, a list, a mix, curriculum phases) with absolute paths."""
    if isinstance(value, list):
        return [_absolute_data(v, root) for v in value]
    if isinstance(value, dict):
        return {k: (_absolute(v, root) if k == "path" else v if k in ("until", "proportion", "curate")
                    else _absolute_data(v, root)) for k, v in value.items()}
    return _absolute(value, root)


def absolute_paths(raw: dict, root: str) -> dict:
    """A copy of the run-config mapping ``raw`` with its local paths (train data, tokenizer, held-out
    data, task files, secrets file) absolute, relative ones taken from ``root``."""
    import copy

    out = copy.deepcopy(raw)
    if "train_data" in out:
        out["train_data"] = _absolute_data(out["train_data"], root)
    for keys in _PATH_KEYS:
        node = out
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node.get(k), dict) else {}
        if keys[-1] in node:
            node[keys[-1]] = _absolute(node[keys[-1]], root)
    return out


def load_ladder(path: str, overrides: list[str] = (), budget: str | None = None) -> LadderConfig:
    """Read and check a ladder file, with ``--set KEY.PATH=VALUE`` ``overrides`` and a ``--budget``
    applied first (as `lmforge train` applies its own); every problem is one UserError naming the key."""
    raw = read_yaml(path)
    for item in overrides:
        set_path(raw, *parse_set(item))
    if budget is not None:
        raw["budget"] = budget
    for key, why in CHOSEN_BY_LADDER.items():
        if key in raw:
            raise UserError(f"{path}: `{key}` has no place in a ladder file: {why}")
    spec = {k: raw.pop(k) for k in LADDER_KEYS if k in raw}
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec.setdefault("save_folder", os.path.join("ladders", str(spec["name"])))
    for key in ("target", "budget"):
        if key not in spec:
            raise UserError(f"{path}: missing `{key}` (e.g. target: {{tokens: 20M}} and budget: 6min)")
    try:
        cfg = LadderConfig.model_validate(spec | {"base": raw})
    except ValidationError as e:
        raise UserError(format_error(e, LadderConfig, path)) from None
    try:
        base = cfg.base_config
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    _check_tokenizer(base, path)
    # Its runs, plan and report are written there, and a re-run replaces what it planned.
    check_target(cfg.save_folder, f"{path}: save_folder", [("the training data", d.path) for d in base.train_data])
    return cfg


def _check_tokenizer(base: RunConfig, path: str) -> None:
    tok = base.tokenizer
    if isinstance(tok, TokenizerSpec):
        if tok.extend is not None:
            raise UserError(f"{path}: tokenizer.extend: a ladder trains fresh models; give a tokenizer folder or "
                            "{train: {vocab_size: N}}")
        if tok.train is not None and tok.train.vocab_size == "auto":
            raise UserError(f"{path}: tokenizer.train.vocab_size: auto would give each model size its own "
                            "vocabulary, and losses per token of different tokenizers cannot be fitted together; "
                            "give a number (e.g. 512) or a tokenizer folder")
