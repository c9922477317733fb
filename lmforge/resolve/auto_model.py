"""Resolve `model: auto` and `tokenizer: {train: {vocab_size: auto}}` before anything is prepared.

`plan.auto` holds the rule (pure, with the machine's probe for the candidates' measured throughput:
`train.throughput`, cached under ``$LMFORGE_HOME/cache/throughput``); this module feeds it what only
a run knows: its data's size and vocabulary. A resumed run takes the shape it started with from
its save folder, so re-measuring never changes a run's model.
"""

from __future__ import annotations

import os

from lmforge.config.defaults import auto_vocab
from lmforge.config.model import ModelConfig
from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.errors import UserError
from lmforge.run_files import read_run_file
from lmforge.plan.auto import SMALL_CONTEXT, choose_for_run
from lmforge.plan.machine import Machine
from lmforge.resolve.request import NO_DATA


def resolve_auto(cfg: RunConfig, machine: Machine, log=print) -> RunConfig:
    """The config with `model` and a trained tokenizer's vocabulary made concrete."""
    if cfg.model == "auto":
        if cfg.custom_weights_path:
            raise UserError("model: auto chooses a new model to train from scratch; with custom_weights_path "
                            "leave `model` out (the weights' own shape is used)")
        return _auto_model(cfg, machine, log)
    spec = cfg.tokenizer
    if isinstance(spec, TokenizerSpec) and spec.train is not None and spec.train.vocab_size == "auto":
        vocab = auto_vocab(cfg.model.d_model, raw_data_bytes(cfg))
        cfg = _with_vocab(cfg, vocab)
    return cfg


def _with_vocab(cfg: RunConfig, vocab: int) -> RunConfig:
    spec = cfg.tokenizer
    train = spec.train.model_copy(update={"vocab_size": vocab})
    return cfg.model_copy(update={"tokenizer": spec.model_copy(update={"train": train})})


def without_data(cfg: RunConfig) -> bool:
    """A run planned without data (`resolve.request.NO_DATA`)."""
    return any(d.path == NO_DATA for d in cfg.train_data)


def raw_data_bytes(cfg: RunConfig) -> float | None:
    """Bytes of raw training text where they can be known without reading it (None otherwise)."""
    from lmforge.data.text.builtin import stdlib_files
    from lmforge.data.prepare.prepared import is_prepared
    from lmforge.data.text.sources import list_files

    if without_data(cfg):
        return None
    total = 0.0
    for d in cfg.train_data:
        if is_prepared(d.path):
            return None
        for src in list_files([d.path]):
            if src.kind == "builtin":
                total += sum(os.path.getsize(f) for f in stdlib_files())
            elif src.size:
                total += src.size
            else:
                return None
    return total or None


def prepared_facts(cfg: RunConfig) -> tuple[int | None, int | None, int | None]:
    """(train tokens, tokenizer vocabulary, sample length) when every train_data entry is prepared."""
    from lmforge.data.prepare.prepared import is_prepared, prepared_summary

    if without_data(cfg):
        return None, None, None
    tokens, vocab, seq = 0, None, None
    for d in cfg.train_data:
        if not is_prepared(d.path):
            return None, None, None
        summary = prepared_summary(d.path)
        split = (summary.get("splits") or {}).get("train") or {}
        if not split.get("tokens"):
            return None, None, None
        tokens += int(split["tokens"])
        vocab = vocab or (summary.get("tokenizer") or {}).get("vocab_size")
        length = (summary.get("args") or {}).get("seq_len")
        seq = length if seq is None or (length and length < seq) else seq
    return tokens, vocab, seq


def _recorded_shape(cfg: RunConfig) -> dict | None:
    """The resolved config a previous start of this run wrote to its save folder (resume)."""
    if not (cfg.autoresume and cfg.save_folder):
        return None
    record = read_run_file(cfg.save_folder) or {}
    if (record.get("identity") or {}).get("name") != cfg.name:
        return None
    return record.get("config")


def _auto_model(cfg: RunConfig, machine: Machine, log) -> RunConfig:
    p = cfg.parameters
    recorded = _recorded_shape(cfg)
    if recorded and isinstance(recorded.get("model"), dict):
        model = ModelConfig(**recorded["model"])
        log(f"model: auto → {model.n_layers} layers × d_model {model.d_model}, as chosen when this run started")
        out = cfg.model_copy(update={"model": model})
        ctx = (recorded.get("parameters") or {}).get("context_length")
        if p.context_length is None and ctx:
            out = out.model_copy(update={"parameters": p.model_copy(update={"context_length": ctx})})
        if isinstance(cfg.tokenizer, TokenizerSpec) and cfg.tokenizer.train.vocab_size == "auto":
            out = _with_vocab(out, int((recorded.get("tokenizer") or {}).get("train", {}).get("vocab_size")
                                       or model.vocab_size))
        return out

    data_tokens, prepared_vocab, data_seq = prepared_facts(cfg)
    ctx = p.context_length or (min(SMALL_CONTEXT, data_seq) if data_seq else None)
    if data_tokens and ctx:  # the tokens an epoch trains (pieces of ctx, `data.pieces`), not the stored ones
        from lmforge.data.prepare.prepared import prepared_epoch_tokens

        data_tokens = prepared_epoch_tokens([d.path for d in cfg.train_data], ctx) or data_tokens
    vocab = None
    if isinstance(cfg.tokenizer, TokenizerSpec):
        if cfg.tokenizer.train is not None and cfg.tokenizer.train.vocab_size != "auto":
            vocab = int(cfg.tokenizer.train.vocab_size)
    elif isinstance(cfg.tokenizer, str) and os.path.exists(os.path.join(cfg.tokenizer, "tokenizer.json")):
        from lmforge.data.text.tokenizer import load_tokenizer

        vocab = load_tokenizer(cfg.tokenizer).vocab_size
    else:
        vocab = prepared_vocab
        if vocab is None:
            raise UserError("tokenizer: model: auto needs to know the vocabulary: give a tokenizer folder, "
                            "{train: {vocab_size: auto}}, or prepared train_data")
    data_bytes = raw_data_bytes(cfg) if data_tokens is None else None
    best, reason = choose_for_run(cfg, machine, ctx=ctx, vocab=vocab, data_bytes=data_bytes, data_tokens=data_tokens,
                                  unique_tokens=data_tokens, log=log)
    log(reason)
    out = cfg.model_copy(update={"model": best.model})
    if p.context_length is None:
        out = out.model_copy(update={"parameters": p.model_copy(update={"context_length": best.context_length})})
    if isinstance(cfg.tokenizer, TokenizerSpec):
        out = _with_vocab(out, best.model.vocab_size if vocab is None else vocab)
    return out
