"""The steps of `resolve` past the config stage: they read data and tokenizers.

See `lmforge.resolve` for the order of the steps and what each stage holds. Up to the plan nothing
here imports torch (the command a user starts plans its run in preflight, and then only waits
for it): the data's streams, rows and pairs are imported where stage "run" builds them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from lmforge.config.model import padded_vocab
from lmforge.config.schema import FINETUNE_TASKS, PREFERENCE_TASK, RL_TASK, RunConfig, TokenizerSpec
from lmforge.data.chat import ASSISTANT_HEADER, CHAT_TEMPLATE, chat_prompt, load_chat_template
from lmforge.data.text.tokenizer import Tokenizer, load_tokenizer
from lmforge.errors import UserError
from lmforge.plan.batch import training_context
from lmforge.plan.checks import check_rl
from lmforge.plan.machine import Machine
from lmforge.plan.run import TrainPlan, make_plan, resolved_config
from lmforge.resolve.auto_model import resolve_auto, without_data
from lmforge.resolve.resolved import ResolvedRun, Stage
from lmforge.resolve.weights import check_tokenizer_fits, locate

if TYPE_CHECKING:
    from lmforge.data.rows.preference import PreferenceData
    from lmforge.data.stream.run_data import ResolvedData
    from lmforge.data.rows.rl import RLData
    from lmforge.data.rows.sft import SFTData
    from lmforge.data.stream.tokens import StreamPhase

# Generation settings of a fine-tuning run's evaluations (where `eval` leaves them unset).
SFT_SAMPLING = {"max_new_tokens": 100, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


def resolve_run(cfg: RunConfig, machine: Machine, until: Stage, log) -> ResolvedRun:
    """Steps 2–6 of `resolve` for a named config."""
    if cfg.task_type in FINETUNE_TASKS:
        return _finetune(cfg, machine, until, log)
    return _pretrain(cfg, machine, until, log)


# --------------------------------------------------------------------------- pretraining

def _pretrain(cfg: RunConfig, machine: Machine, until: Stage, log) -> ResolvedRun:
    """Pretraining and continued pretraining: raw text or prepared MDS datasets."""
    cfg = _with_extension_base(cfg)
    cfg = machine.probe.on_main(lambda: resolve_auto(cfg, machine, log=log))
    _check_family(cfg)
    if until == "plan":
        cfg = _with_vocab(cfg, _known_tokenizer_vocab(cfg))
        data_seq_len, samples = _planned_data(cfg)
        plan = make_plan(cfg, machine, samples_per_epoch=samples, data_seq_len=data_seq_len)
        return ResolvedRun(resolved_config(cfg, plan), plan)
    from lmforge.data.stream.run_data import resolve_data  # torch (the streams)
    from lmforge.data.stream.tokens import open_dataset

    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    # Rank 0 prepares the data first and the others then hit its cache; its UserError (bad data)
    # reaches every rank: none is left waiting for a peer that has gone.
    prepared: list[ResolvedData] = []
    machine.probe.on_main(lambda: prepared.append(resolve_data(cfg, seq_len, log=log)))
    data = prepared[0] if prepared else resolve_data(cfg, seq_len, log=lambda *_: None)
    tokenizer = load_tokenizer(data.tokenizer_path)
    cfg = _with_vocab(cfg, tokenizer.vocab_size)
    _check_data_vocab(cfg, data, tokenizer, log)
    lengths = [d.seq_len for d in data.train]
    data_seq_len = min(lengths) if all(lengths) else min(open_dataset(d.path).sample_length(0) for d in data.train)
    cfg = _with_context(cfg, log)
    ctx = training_context(cfg.parameters.context_length, cfg.model.max_seq_len, data_seq_len)
    samples = data.epoch_pieces(ctx) if cfg.training_duration.unit == "ep" else None  # every piece once
    # Rank 0 plans (on a GPU it may time micro-batch candidates); every rank takes its plan.
    plan = machine.probe.on_main(lambda: make_plan(cfg, machine, samples_per_epoch=samples, data_seq_len=data_seq_len))
    for line in said_lines(plan) + data.split_lines(plan.context_length):  # + samples longer than the context
        log(line)
    if cfg.curriculum:
        data = replace(data, phases=_stream_phases(cfg, plan))
    return ResolvedRun(resolved_config(cfg, plan), plan, data, tokenizer)


def said_lines(plan: TrainPlan) -> list[str]:
    """What a run says about its plan at its start: how the micro-batch was chosen (GPUs), RoPE scaling,
    a batch other than asked for, its evaluation."""
    return ([plan.micro_batch_reason] if plan.micro_batch_reason else []) + list(plan.notes) + \
        ([plan.evaluation.line] if plan.evaluation else [])


def _planned_data(cfg: RunConfig) -> tuple[int | None, int | None]:
    """(sample length, training samples per epoch) the run will have, as far as they are known
    before anything is prepared: prepared datasets say both; raw text will be prepared at the
    run's context (or the model's length), and its epoch is not known yet. Only local data is
    looked at (a dry run needs no credentials for an object store)."""
    from lmforge.data.remote import is_remote

    if without_data(cfg) or any(is_remote(d.path) for d in cfg.train_data):
        return None, None
    from lmforge.data.prepare.prepare import summary_seq_len
    from lmforge.data.prepare.prepared import is_prepared, prepared_epoch_tokens, prepared_summary

    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    lengths = [summary_seq_len(prepared_summary(d.path)) if is_prepared(d.path) else seq_len for d in cfg.train_data]
    data_seq_len = min((n for n in lengths if n), default=None)
    if cfg.training_duration.unit != "ep" or data_seq_len is None:
        return data_seq_len, None
    ctx = training_context(cfg.parameters.context_length, cfg.model.max_seq_len, data_seq_len)
    tokens = prepared_epoch_tokens([d.path for d in cfg.train_data], ctx)
    return data_seq_len, tokens // ctx if tokens else None


def _check_family(cfg: RunConfig) -> None:
    """A pinned model.family must fit the model's features: else the refusal would come only at
    export, after the training."""
    if cfg.model.family is not None:
        from lmforge.models.families import family_of

        family_of(cfg.model)


def _with_extension_base(cfg: RunConfig) -> RunConfig:
    """`tokenizer: {extend: …}` without a `base`: the tokenizer stored with custom_weights_path."""
    spec = cfg.tokenizer
    if not (isinstance(spec, TokenizerSpec) and spec.extend is not None and spec.extend.base is None):
        return cfg
    base = locate(cfg.custom_weights_path).tokenizer_dir
    if base is None:
        raise UserError(f"tokenizer.extend: {cfg.custom_weights_path} holds no tokenizer.json; "
                        "set tokenizer.extend.base to the tokenizer folder to extend")
    extend = spec.extend.model_copy(update={"base": base})
    return cfg.model_copy(update={"tokenizer": spec.model_copy(update={"extend": extend})})


def _known_tokenizer_vocab(cfg: RunConfig) -> int | None:
    """The tokenizer's vocabulary where it is known without preparing anything (a dry run): the one
    to train or extend to, a tokenizer folder's, or — with no `tokenizer` — the one the prepared
    training data was made with (what the run then loads, `data.stream.run_data.resolve_tokenizer`)."""
    from lmforge.data.remote import is_remote

    spec = cfg.tokenizer
    if isinstance(spec, TokenizerSpec):
        if spec.extend is not None:
            return spec.extend.vocab_size
        return spec.train.vocab_size if spec.train and isinstance(spec.train.vocab_size, int) else None
    if isinstance(spec, str):
        return load_tokenizer(spec).vocab_size if os.path.exists(spec) else None
    if without_data(cfg):
        return None
    from lmforge.data.prepare.prepared import is_prepared, prepared_summary

    for d in cfg.train_data:
        if is_remote(d.path) or not is_prepared(d.path):
            continue
        tok = prepared_summary(d.path).get("tokenizer") or {}
        if tok.get("path") and os.path.exists(tok["path"]):
            return load_tokenizer(tok["path"]).vocab_size
        return tok.get("vocab_size")
    return None


def _with_vocab(cfg: RunConfig, tokenizer_vocab: int | None) -> RunConfig:
    """The model's vocabulary: the config's (at least the tokenizer's; grown with `tokenizer.extend`),
    else the tokenizer's rounded up (`padded_vocab`)."""
    if tokenizer_vocab is None:
        return cfg
    v = cfg.model.vocab_size
    extended = isinstance(cfg.tokenizer, TokenizerSpec) and cfg.tokenizer.extend is not None
    if v is None:
        v = padded_vocab(tokenizer_vocab)
    elif extended:
        v = max(v, padded_vocab(tokenizer_vocab))
    elif v < tokenizer_vocab:
        raise UserError(f"model.vocab_size ({v}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": v})})


def _with_context(cfg: RunConfig, log) -> RunConfig:
    """A context longer than the model's max_seq_len builds the model for it (RoPE tables are derived,
    not stored)."""
    ctx = cfg.parameters.context_length
    if not ctx or ctx <= cfg.model.max_seq_len:
        return cfg
    if cfg.task_type not in FINETUNE_TASKS:
        log(f"warning: parameters.context_length {ctx} is longer than model.max_seq_len {cfg.model.max_seq_len}; "
            f"the model is built for {ctx} tokens")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_seq_len": ctx})})


def _check_data_vocab(cfg: RunConfig, data: ResolvedData, tokenizer: Tokenizer, log) -> None:
    """A prepared dataset's token ids must fit the model's vocabulary (else: an index error mid-step);
    one prepared with another tokenizer than the run's is named in a warning."""
    for d in data.train:
        tok = (d.summary or {}).get("tokenizer") or {}
        vocab = tok.get("vocab_size")
        if tok.get("fingerprint") and tokenizer.fingerprint and tok["fingerprint"] != tokenizer.fingerprint:
            log(f"warning: train_data {d.path} was prepared with another tokenizer ({tok.get('path')}) than "
                f"this run's ({tokenizer.path}); its token ids may mean other text")
        if vocab and vocab > cfg.model.vocab_size:
            raise UserError(f"train_data {d.path}: prepared with a tokenizer of {vocab} tokens, more than the model's "
                            f"vocabulary ({cfg.model.vocab_size}); use that tokenizer (tokenizer: {tok.get('path')}) "
                            "or prepare the data again with this one")


def _stream_phases(cfg: RunConfig, plan: TrainPlan) -> list[StreamPhase]:
    """The curriculum on the stream's global sample axis: each phase ends on the optimizer step
    the plan chose (whole global batches, so a step never mixes two phases); the last runs on."""
    from lmforge.data.stream.tokens import StreamPhase

    ends = [step * plan.global_batch for step in plan.phase_steps] + [None]
    return [StreamPhase(end, phase.mix) for end, phase in zip(ends, cfg.curriculum)]


# --------------------------------------------------------------------------- fine-tuning

def _finetune(cfg: RunConfig, machine: Machine, until: Stage, log) -> ResolvedRun:
    """Fine-tuning on prompt/response, chat or preference rows: tokenizer, defaults, packed rows, plan.

    Defaults that differ from pretraining: the learning rate (`config.defaults.task_learning_rate`),
    the chat template (the tokenizer's own, else lmforge's plain one: the one exported with the
    final tokenizer), the sampling of evaluations (SFT_SAMPLING), for preference pairs the loss's
    β and reference (`PreferenceOptions.resolved`), for reinforcement learning its clip range and
    reward weights (`RLOptions.resolved`)."""
    if cfg.model == "auto":
        raise UserError("model: auto sizes a model to pretrain; fine-tuning takes the shape of "
                        "custom_weights_path (leave `model` out)")
    if not isinstance(cfg.tokenizer, str):
        what = "a tokenizer to train or extend" if isinstance(cfg.tokenizer, TokenizerSpec) else "none"
        raise UserError(f"tokenizer: fine-tuning needs the base model's tokenizer folder (got {what}); "
                        "set tokenizer: PATH, or custom_weights_path to a model folder that holds one")
    if cfg.task_type == PREFERENCE_TASK and cfg.compute.context_parallel > 1:
        raise UserError("compute.context_parallel: preference pairs are scored whole on one rank; expected "
                        "context_parallel 1 for task_type preference")
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_tokenizer_fits(tokenizer, cfg.model, "tokenizer")
    _check_family(cfg)
    cfg = _with_vocab(cfg, tokenizer.vocab_size)
    template = load_chat_template(tokenizer.path)  # the tokenizer's own, else None → ours
    cfg = _with_context(cfg.model_copy(update={"eval": _sft_eval(cfg, template, tokenizer),
                                               "preference": _preference(cfg),
                                               "rl": cfg.rl.resolved() if cfg.task_type == RL_TASK else cfg.rl}), log)
    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    if until == "plan":
        plan = make_plan(cfg, machine, samples_per_epoch=None, data_seq_len=seq_len)
        return ResolvedRun(resolved_config(cfg, plan), plan, tokenizer=tokenizer)
    log(f"chat template: {'the tokenizer’s own' if template else 'lmforge’s plain one (the tokenizer has none)'}")
    check_rl(cfg, seq_len, machine.device)  # (before the prompts are cut to fit beside max_new_tokens)
    # Rank 0 reads (and checks) the rows first: a bad row is its one line, and the other ranks stop
    # with it instead of each saying the same line again; they then read the same rows quietly.
    read: list[SFTData | PreferenceData | RLData] = []
    machine.probe.on_main(lambda: read.append(_rows(cfg, tokenizer, template, seq_len, log)))
    data = read[0] if read else _rows(cfg, tokenizer, template, seq_len, lambda *_: None)
    samples = len(data.prompts) if cfg.task_type == RL_TASK else len(data.rows)
    plan = machine.probe.on_main(lambda: make_plan(cfg, machine, samples_per_epoch=samples, data_seq_len=seq_len))
    for line in said_lines(plan):
        log(line)
    return ResolvedRun(resolved_config(cfg, plan), plan, data, tokenizer)


def _preference(cfg: RunConfig):
    """The preference settings with every default written in (β by loss, the reference)."""
    if cfg.task_type != PREFERENCE_TASK:
        return cfg.preference
    return cfg.preference.resolved(lora=cfg.lora is not None)


def _rows(cfg: RunConfig, tokenizer: Tokenizer, template, seq_len: int, log) -> SFTData | PreferenceData | RLData:
    """The run's rows, packed at the context: prompt/response or chat examples, or preference pairs;
    or reinforcement learning's prompts."""
    from lmforge.data.rows.preference import load_preference_data  # torch (rows as tensors)
    from lmforge.data.rows.sft import SFTData, load_rows

    chat_template = template.text if template else CHAT_TEMPLATE
    paths = [d.path for d in cfg.train_data]
    if cfg.task_type == RL_TASK:
        return _prompts(cfg, paths, tokenizer, template, chat_template, seq_len, log)
    if cfg.task_type == PREFERENCE_TASK:
        return load_preference_data(paths, cfg.eval.data_path, tokenizer, seq_len, packing=cfg.sft.packing,
                                    seed=cfg.parameters.seed, template=template, chat_template=chat_template, log=log)

    def rows_of(paths: list[str]):
        return load_rows(paths, tokenizer, seq_len, task=cfg.task_type, packing=cfg.sft.packing,
                         seed=cfg.parameters.seed, template=template)

    rows = rows_of(paths)
    eval_rows = rows_of([cfg.eval.data_path]) if cfg.eval.data_path else None
    from lmforge.data.rows.sft import packing_note

    log(f"data: {rows.examples} examples in {len(rows)} rows of {seq_len} tokens"
        f"{packing_note(rows.examples, len(rows), cfg.sft.packing, 'example')}"
        + (f"; {rows.truncated} cut at the context length" if rows.truncated else "")
        + (f"; {rows.dropped} dropped (no response token fits)" if rows.dropped else ""))
    return SFTData(tokenizer.path, rows, eval_rows, chat_template=chat_template)


def _prompts(cfg: RunConfig, paths: list[str], tokenizer: Tokenizer, template, chat_template: str, seq_len: int,
             log) -> RLData:
    """Reinforcement learning's prompts (a prompt leaves room for rl.max_new_tokens), and its rewards
    loaded and checked against every row: a reward file that does not import, or a column a reward
    needs and a row lacks, is one line before anything is trained."""
    from lmforge.data.rows.rl import load_rl_data  # torch (the stream's order)
    from lmforge.rewards.functions import check_columns, load_rewards

    rl = cfg.rl
    rewards = load_rewards(rl.reward, rl.reward_weights, rl.format_regex)
    data = load_rl_data(paths, cfg.eval.data_path, tokenizer, seq_len - rl.max_new_tokens, template=template,
                        chat_template=chat_template, log=log)
    for prompts in (data.prompts, data.eval_prompts):
        if prompts is not None:
            check_columns(rewards, prompts.rows, prompts.wheres)
    return replace(data, rewards=tuple(rewards))


def _sft_eval(cfg: RunConfig, template, tokenizer):
    """Evaluation settings of a fine-tuning run: SFT sampling where unset; chat prompts in the template."""
    updates = {k: v for k, v in SFT_SAMPLING.items() if k not in cfg.eval.model_fields_set}
    if cfg.task_type == "chat_completion":
        updates["prompts"] = [template.generation_prompt(p, tokenizer) if template else
                              p if ASSISTANT_HEADER in p else chat_prompt(p) for p in cfg.eval.prompts]
    return cfg.eval.model_copy(update=updates)
