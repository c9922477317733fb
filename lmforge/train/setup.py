"""From a run config to what the trainer needs: resolved config, plan, data and tokenizer.

`setup_run` picks by the config's declared `task_type`: pretraining and continued pretraining
go through the data pipeline (`data.resolve`: raw text → tokenizer → packed MDS shards, cached),
fine-tuning through `train.finetune` (prompt/response or chat rows). Either way every default
is filled here, once, and the resolved config is what checkpoints record.
"""

from __future__ import annotations

from lmforge.config.identity import with_default_names
from lmforge.config.model import padded_vocab
from lmforge.config.schema import FINETUNE_TASKS, RunConfig, TokenizerSpec
from lmforge.data.resolve import resolve_data
from lmforge.data.stream import StreamPhase, open_dataset
from lmforge.data.tokenizer import load_tokenizer
from lmforge.data.vocab_extension import grown_vocab
from lmforge.distributed.dist import DistInfo, broadcast_object
from lmforge.errors import PeerUserError, UserError
from lmforge.train.auto_model import resolve_auto
from lmforge.train.finetune import finetune_setup
from lmforge.train.locate import locate
from lmforge.train.plan import TrainPlan, make_plan, resolved_config
from lmforge.train.trainer import RunSetup


def setup_run(cfg: RunConfig, dist: DistInfo, log=print) -> RunSetup:
    cfg = with_default_names(cfg)
    if cfg.task_type in FINETUNE_TASKS:  # SFT and preference rows
        if cfg.model == "auto":
            raise UserError("model: auto sizes a model to pretrain; fine-tuning takes the shape of "
                            "custom_weights_path (leave `model` out)")
        return finetune_setup(cfg, dist, log)
    return pretrain_setup(cfg, dist, log)


def with_vocab(cfg: RunConfig, tokenizer_vocab: int) -> RunConfig:
    """The model's vocabulary: the config's, else the tokenizer's rounded up (`padded_vocab`)."""
    v = cfg.model.vocab_size
    if v is None:
        v = padded_vocab(tokenizer_vocab)
    elif v < tokenizer_vocab:
        raise UserError(f"model.vocab_size ({v}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": v})})


def _on_main(fn, dist: DistInfo):
    """``fn()`` on rank 0 (it may measure this machine), its result or its UserError on every rank."""
    result = error = None
    if dist.is_main:
        try:
            result = fn()
        except UserError as e:
            error = e
    result, message = broadcast_object((result, None if error is None else str(error)))
    if error is not None:
        raise error
    if message:
        raise PeerUserError(message)
    return result


def check_data_vocab(cfg: RunConfig, datasets, tokenizer, log=print) -> None:
    """A prepared dataset's token ids must fit the model's vocabulary (else: an index error mid-step);
    one prepared with another tokenizer than the run's is named in a warning."""
    for d in datasets:
        tok = (d.summary or {}).get("tokenizer") or {}
        vocab = tok.get("vocab_size")
        if tok.get("fingerprint") and tokenizer.fingerprint and tok["fingerprint"] != tokenizer.fingerprint:
            log(f"warning: train_data {d.path} was prepared with another tokenizer ({tok.get('path')}) than "
                f"this run's ({tokenizer.path}); its token ids may mean other text")
        if vocab and vocab > cfg.model.vocab_size:
            raise UserError(f"train_data {d.path}: prepared with a tokenizer of {vocab} tokens, more than the model's "
                            f"vocabulary ({cfg.model.vocab_size}); use that tokenizer (tokenizer: {tok.get('path')}) "
                            "or prepare the data again with this one")


def with_extension_base(cfg: RunConfig) -> RunConfig:
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



def pretrain_setup(cfg: RunConfig, dist: DistInfo, log=print) -> RunSetup:
    """Resolve `model: auto` (rank 0 chooses, the others take its choice), the data (rank 0 prepares
    it first; the others then hit the cache) and every default."""
    cfg = with_extension_base(cfg)
    cfg = _on_main(lambda: resolve_auto(cfg, dist.device, log=log), dist)
    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    # Rank 0 prepares the data first and the others then hit its cache. Its UserError (bad data)
    # reaches every rank: none is left waiting for a peer that has gone (a traceback, not one line).
    data = None

    def prepare_first() -> None:
        nonlocal data
        data = resolve_data(cfg, seq_len, log=log)

    _on_main(prepare_first, dist)
    if data is None:
        data = resolve_data(cfg, seq_len, log=lambda *_: None)
    tokenizer = load_tokenizer(data.tokenizer_path)
    cfg = with_vocab(grown_vocab(cfg, tokenizer.vocab_size), tokenizer.vocab_size)  # grown: tokenizer.extend
    check_data_vocab(cfg, data.train, tokenizer, log)
    lengths = [d.seq_len for d in data.train]
    data_seq_len = min(lengths) if all(lengths) else min(open_dataset(d.path).sample_length(0) for d in data.train)
    if cfg.parameters.context_length and cfg.parameters.context_length > cfg.model.max_seq_len:
        log(f"warning: parameters.context_length {cfg.parameters.context_length} is longer than model.max_seq_len "
            f"{cfg.model.max_seq_len}; the model is built for {cfg.parameters.context_length} tokens")
        cfg.model.max_seq_len = cfg.parameters.context_length  # RoPE tables are derived, not stored
    samples = None
    if cfg.training_duration.unit == "ep":
        samples = sum(len(open_dataset(d.path)) for d in data.train)
    plan = make_plan(cfg, world_size=dist.world_size, device=dist.device, samples_per_epoch=samples,
                     data_seq_len=data_seq_len)
    if cfg.curriculum:
        data.phases = stream_phases(cfg, plan)
    return RunSetup(resolved_config(cfg, plan), plan, data, tokenizer)


def stream_phases(cfg: RunConfig, plan: TrainPlan) -> list[StreamPhase]:
    """The curriculum on the stream's global sample axis: each phase ends on the optimizer step
    the plan chose (whole global batches, so a step never mixes two phases); the last runs on."""
    ends = [step * plan.global_batch for step in plan.phase_steps] + [None]
    return [StreamPhase(end, phase.mix) for end, phase in zip(ends, cfg.curriculum)]
