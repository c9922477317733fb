"""Resolve `model: auto` and `tokenizer: {train: {vocab_size: auto}}` before anything is prepared.

`estimate.auto` holds the rule (pure); this module feeds it what only a run knows: the budget,
the data's size, and this machine's measured throughput of the candidate shapes
(the `Machine`'s probe: `train.throughput`, cached under ``$LMFORGE_HOME/cache/throughput``). A resumed run takes the
shape it started with from its save folder, so re-measuring never changes a run's model.
"""

from __future__ import annotations

import os

from lmforge.config.defaults import auto_vocab, default_batch_tokens, estimated_bytes_per_token, micro_batch_for
from lmforge.config.durations import parse_duration
from lmforge.config.model import ModelConfig
from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.errors import UserError
from lmforge.plan.auto import SMALL_CONTEXT, Budget, Candidate, candidates, choose
from lmforge.plan.flops import flops_per_token, mfu_flops_per_token, param_counts
from lmforge.plan.hardware import mfu_basis, peak_flops
from lmforge.layout import read_run_file
from lmforge.plan.machine import Machine
from lmforge.plan.run import plan_optimizer


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


def raw_data_bytes(cfg: RunConfig) -> float | None:
    """Bytes of raw training text where they can be known without reading it (None otherwise)."""
    from lmforge.data.builtin import stdlib_files
    from lmforge.data.resolve import is_prepared
    from lmforge.data.sources import list_files

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


def _prepared(cfg: RunConfig) -> tuple[int | None, int | None, int | None]:
    """(train tokens, tokenizer vocabulary, sample length) when every train_data entry is prepared."""
    from lmforge.data.resolve import _read_summary, is_prepared

    tokens, vocab, seq = 0, None, None
    for d in cfg.train_data:
        if not is_prepared(d.path):
            return None, None, None
        summary = _read_summary(d.path)
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

    data_tokens, prepared_vocab, data_seq = _prepared(cfg)
    ctx = p.context_length or (min(SMALL_CONTEXT, data_seq) if data_seq else None)
    if data_tokens and ctx:  # the tokens an epoch trains (pieces of ctx, `data.pieces`), not the stored ones
        from lmforge.data.resolve import prepared_epoch_tokens

        data_tokens = prepared_epoch_tokens([d.path for d in cfg.train_data], ctx) or data_tokens
    budget = Budget.from_duration(cfg.training_duration, data_tokens=data_tokens)
    vocab = None
    if isinstance(cfg.tokenizer, TokenizerSpec):
        if cfg.tokenizer.train is not None and cfg.tokenizer.train.vocab_size != "auto":
            vocab = int(cfg.tokenizer.train.vocab_size)
    elif isinstance(cfg.tokenizer, str) and os.path.exists(os.path.join(cfg.tokenizer, "tokenizer.json")):
        from lmforge.data.tokenizer import load_tokenizer

        vocab = load_tokenizer(cfg.tokenizer).vocab_size
    else:
        vocab = prepared_vocab
        if vocab is None:
            raise UserError("tokenizer: model: auto needs to know the vocabulary: give a tokenizer folder, "
                            "{train: {vocab_size: auto}}, or prepared train_data")
    data_bytes = raw_data_bytes(cfg) if data_tokens is None else None
    precision = "bf16" if (p.precision == "bf16" or (p.precision == "auto" and machine.bf16)) else "fp32"

    def batch_tokens(m: ModelConfig, ctx: int) -> int:
        if p.global_batch_size is None:
            return default_batch_tokens(param_counts(m)["non_embedding"], _budget_tokens(budget, m, ctx, machine,
                                                                                         precision))
        if isinstance(p.global_batch_size, str):
            return int(parse_duration(p.global_batch_size).value) if "tok" in p.global_batch_size else \
                int(parse_duration(p.global_batch_size).value) * ctx
        return int(p.global_batch_size) * ctx

    cands = candidates(vocab, data_bytes, ctx, batch_tokens)
    unique = data_tokens
    if unique is None and data_bytes:
        unique = data_bytes / estimated_bytes_per_token(vocab or cands[0].model.vocab_size)
    measure = _throughput_fn(machine, precision, log,  # each candidate timed with the optimizer it would get
                             lambda m: plan_optimizer(cfg, m))
    note = "measured here" if machine.probe.measures else f"40% of the peak of {machine.spec.name}"
    if _devices(machine) > 1:
        note += f", × {_devices(machine)} GPUs"
    best, reason = choose(budget, cands, unique_tokens=unique, tokens_per_s=measure,
                          flops_per_s_guess=_flops_guess(machine, precision), rate_note=note)
    log(reason)
    out = cfg.model_copy(update={"model": best.model})
    if p.context_length is None:
        out = out.model_copy(update={"parameters": p.model_copy(update={"context_length": best.context_length})})
    if isinstance(cfg.tokenizer, TokenizerSpec):
        out = _with_vocab(out, best.model.vocab_size if vocab is None else vocab)
    return out


def _budget_tokens(budget: Budget, m: ModelConfig, ctx: int, machine: Machine, precision: str) -> float | None:
    """Roughly how many tokens the budget buys for this shape (sizes its default batch); None for steps."""
    if budget.kind == "tok":
        return budget.value
    if budget.kind == "flop":
        return budget.value / mfu_flops_per_token(m, ctx)
    if budget.kind == "s":
        return budget.value * _flops_guess(machine, precision) / flops_per_token(m, ctx)["total"]
    return None


def _flops_guess(machine: Machine, precision: str) -> float:
    """Sustained FLOP/s to pre-rank candidates of a wall-clock budget before timing a few."""
    return 0.4 * peak_flops(machine.spec, mfu_basis(precision)) * _devices(machine)


def _devices(machine: Machine) -> int:
    """Devices a wall-clock budget buys tokens on at once: every GPU (a rate is one device's);
    CPU ranks share one machine's cores, whose measured rate already counts them all."""
    return machine.world_size if machine.device == "cuda" else 1


def _throughput_fn(machine: Machine, precision: str, log, optimizer_of):
    def tokens_per_s(c: Candidate) -> float:
        micro = micro_batch_for(max(1, c.batch_tokens // c.context_length), 8 if machine.device == "cpu" else 64)
        m = c.model
        optimizer = optimizer_of(m)
        hit = machine.probe.tokens_per_s(m, c.context_length, micro, precision=precision, optimizer=optimizer,
                                         measure=False)
        if hit:
            return hit * _devices(machine)
        # Too big to time casually, or a machine that is only described: 40% of the peak.
        if param_counts(m)["total"] > 2e9 or not machine.probe.measures:
            return _flops_guess(machine, precision) / flops_per_token(m, c.context_length)["total"]
        log(f"model: auto: timing {m.n_layers}×{m.d_model} (vocab {m.vocab_size}) on {machine.device} "
            "(cached for next time)")
        return machine.probe.tokens_per_s(m, c.context_length, micro, precision=precision, optimizer=optimizer,
                                          measure=True) * _devices(machine)
    return tokens_per_s
