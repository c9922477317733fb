"""What a run trains with, built once from its `ResolvedRun`: the `Trainer` takes the parts as built.

`build_trainer` → `build_parts` goes in the order every rank must share, reading the run's layout
(`plan.layout`: ranks, data parallelism, context and expert parallelism, the batch split, the
device's peak) — never `compute.*` or a batch size worked out again:

1. the save folder claimed — the same run resumes from its latest intact checkpoint, another
   run is refused (rank 0 decides, every rank takes its pick);
2. the model: the same seed on every rank; replicated, or (fsdp/hsdp) built whole by rank 0 on
   the CPU and scattered shard by shard into a meta-device twin on the others; starting weights
   (``custom_weights_path``) and LoRA adapters before it is wrapped;
3. the objective by the data's kind (reinforcement learning's KL penalty without LoRA: a frozen
   copy of the starting weights), and the optimizer over the wrapped model;
4. this rank's stream layout, the data as the objective prepares it (reference log-probs from
   the starting weights, before any step or checkpoint load) and its streams;
5. the checkpoint loaded (`train.resume`), and what watches the loop: ICL tasks (bad task files
   fail before any training), expert health, the background saver, the graceful stop, the hang
   watchdog and the goodput telemetry.

Nothing here steps, evaluates or saves: that is `train.trainer`'s.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial
from typing import Callable, Sequence

import torch

from lmforge.config.identity import run_identity
from lmforge.config.schema import RL_TASK
from lmforge.data.batch import StreamLayout
from lmforge.data.remote import is_remote
from lmforge.data.text.vocab_extension import read_extension
from lmforge.distributed.dist import DistInfo, all_ranks, barrier, broadcast_object
from lmforge.distributed.elastic import restarted_from_elastic
from lmforge.distributed.float8 import FP8Options
from lmforge.distributed.parallelize import materialize, parallelize
from lmforge.errors import UserError
from lmforge.eval.in_training import load_icl
from lmforge.goodput.conditions import scored_sections
from lmforge.goodput.interval import CheckpointSchedule
from lmforge.run_files import STATE_FILE, read_run_file
from lmforge.models import build_model
from lmforge.models.lora import apply_lora
from lmforge.models.resize import extend_embeddings
from lmforge.models.transformer import Transformer
from lmforge.resolve import ResolvedRun
from lmforge.secrets import redact_config
from lmforge.train import checkpoint as ckpt
from lmforge.train.callbacks import Callback, Callbacks
from lmforge.train.expert_health import ExpertHealth
from lmforge.train.locate import load_model
from lmforge.train.objective import objective_for
from lmforge.train.optim import build_optimizer
from lmforge.train.parts import TrainingParts
from lmforge.train.resume import TrainState, resume
from lmforge.train.stop import GracefulStop
from lmforge.train.telemetry import Telemetry
from lmforge.train.trainer import Trainer
from lmforge.train.watchdog import HangWatchdog, dump_and_exit

COMPLETE = "<complete>"  # what a completed run with damaged checkpoints resumes from: nothing


def autocast_for(precision: str, device: torch.device) -> Callable:
    """fp8: torchao's linear layers run their matmuls in FP8, everything else in bf16 (as bf16 does)."""
    if precision in ("bf16", "fp8"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def build_trainer(run: ResolvedRun, dist: DistInfo, *, save_folder: str | None = None,
                  callbacks: Sequence[Callback] = (), overwrite: bool = False, log=print) -> Trainer:
    """The trainer of ``run`` on this rank, its parts built (callbacks and output on rank 0 only).
    ``save_folder``: where it writes (a remote run's local staging folder; default the run's own)."""
    callbacks = Callbacks(callbacks if dist.is_main else ())
    log = log if dist.is_main else _silent
    save_folder = save_folder or run.config.save_folder
    parts = build_parts(run, dist, save_folder, callbacks, overwrite=overwrite, log=log)
    return Trainer(run, parts, dist, save_folder=save_folder, callbacks=callbacks, log=log)


def _silent(*_args, **_kwargs) -> None:
    pass


def build_parts(run: ResolvedRun, dist: DistInfo, save_folder: str, callbacks: Callbacks, *, overwrite: bool,
                log) -> TrainingParts | None:
    """The parts of ``run`` on this rank; None when the run completed before and only its final model
    is intact (nothing to build: the trainer reports it complete)."""
    cfg, plan, layout = run.config, run.plan, run.plan.layout
    if layout.ranks != dist.world_size:
        raise RuntimeError(f"the plan is for {layout.ranks} rank(s), this process group has {dist.world_size}")
    icl = load_icl(cfg)  # bad task files fail before any training
    resume_from, checked = claim_save_folder(cfg, dist, save_folder, callbacks, overwrite=overwrite, log=log)
    if resume_from == COMPLETE:
        return None
    model, train_forward = build_wrapped_model(run, dist, from_weights=not resume_from, log=log)
    objective = objective_for(run.data, cfg, model, reference=frozen_reference(run, dist))
    p = cfg.parameters
    # Muon's Newton–Schulz iterations run in the run's matmul dtype (bf16 on GPUs, fp32 on most CPUs).
    ns_dtype = torch.bfloat16 if plan.precision in ("bf16", "fp8") else torch.float32
    optimizer = build_optimizer(model, lr=plan.learning_rate, weight_decay=p.weight_decay, betas=tuple(p.betas),
                                eps=p.eps, device_type=dist.device.type, kind=plan.optimizer,
                                muon_momentum=p.muon_momentum, muon_weight_decay=p.muon_weight_decay,
                                ns_dtype=ns_dtype)
    reading = StreamLayout(  # a row's context-parallel ranks read the same rows
        seq_len=plan.context_length, layout=layout, rank=dist.rank, seed=p.seed, num_workers=cfg.compute.num_workers,
        pin_memory=dist.device.type == "cuda",
        document_eos=run.tokenizer.eos_id if p.document_masking and run.data.kind == "pretrain" else None)
    autocast = autocast_for(plan.precision, dist.device)
    data = objective.prepare(run.data, model, reading, save_folder, dist, autocast, resuming=bool(resume_from),
                             log=log)
    stream = data.train_stream(reading)
    state = TrainState()
    if resume_from:
        state = resume(resume_from, cfg, model=model, optimizer=optimizer, stream=stream, rank=dist.rank,
                       world_size=dist.world_size, schedule_signature=plan.schedule.signature(plan.learning_rate),
                       checked=checked, log=log)
    restarted_from_elastic(save_folder, resume_from, state.step, dist, log)
    return TrainingParts(
        state=state, model=model, train_forward=train_forward, objective=objective, optimizer=optimizer,
        layout=reading, data=data, stream=stream, eval_sets=data.eval_sets(reading, cfg.eval.max_batches),
        autocast=autocast, resume_from=resume_from, icl=icl,
        expert_health=ExpertHealth() if cfg.model.is_moe else None,
        saver=ckpt.PendingSave() if cfg.compute.async_checkpoint else None,
        stop=GracefulStop(dist, cfg.log_interval, log),
        watchdog=HangWatchdog(cfg.compute.hang_timeout, rank=dist.rank,
                              on_hang=partial(dump_and_exit, restarts=cfg.max_retries > 0)),
        telemetry=Telemetry(cfg.goodput, dist, folder=save_folder, log=log,
                            scored=scored_sections(layout, plan.optimizer), node_rank=cfg.compute.node_rank,
                            schedule=CheckpointSchedule(plan.goodput, plan.save_interval, plan.local_interval)),
        local_folder=cfg.local_checkpoints.folder if cfg.local_checkpoints else None)


def claim_save_folder(cfg, dist: DistInfo, save_folder: str, callbacks: Callbacks, *, overwrite: bool,
                      log) -> tuple[str | None, list[str]]:
    """Same run in the folder → the latest checkpoint to resume from and the files whose digests rank
    0 checked in choosing it (or COMPLETE); another run → refuse."""
    identity = run_identity(cfg)
    local = cfg.local_checkpoints.folder if cfg.local_checkpoints else None
    previous = read_run_file(save_folder) if dist.is_main else None
    if dist.is_main:
        callbacks.before_resume(save_folder)
        can_resume = ckpt.open_run_folder(save_folder, identity, overwrite=overwrite, autoresume=cfg.autoresume,
                                          all_local=not is_remote(cfg.save_folder))
        callbacks.resume_decided(save_folder, can_resume and cfg.autoresume, overwrite)
        ckpt.write_run_file(save_folder, identity, redact_config(cfg.model_dump(mode="json")))
        if local is not None:  # the local tier: the same rules (this run's, or refused; --overwrite clears it)
            claim_local_folder(local, identity, cfg, overwrite=overwrite)
    barrier()
    latest, checked = None, []
    if cfg.autoresume and dist.is_main:  # rank 0 checks the digests; every rank loads its pick
        try:
            latest = ckpt.newest_checkpoint(save_folder, local, log)
        except UserError:
            final = ckpt.completed_final(save_folder, previous, str(cfg.training_duration))
            if final is None:
                raise
            log(f"warning: no checkpoint of run {cfg.name} is intact, but it completed and its final model {final} "
                "is: nothing to train")
            latest = COMPLETE
        checked = ckpt.files_here(latest) if latest and latest != COMPLETE else []
    latest, checked = broadcast_object((latest, checked))
    if local is not None and latest and latest.startswith(os.path.join(local, "")) and \
            not all_ranks(os.path.isfile(os.path.join(latest, STATE_FILE)), dist.device):
        # a local tier another node cannot read (its own disk): the durable tier's newest instead
        log(f"warning: {latest} is not readable on every node; resuming from the save_folder's newest checkpoint")
        latest = ckpt.intact_checkpoint(save_folder, log) if dist.is_main else None
        checked = ckpt.files_here(latest) if latest else []
        latest, checked = broadcast_object((latest, checked))
    return latest, checked


def claim_local_folder(folder: str, identity: dict, cfg, *, overwrite: bool) -> None:
    """The local tier's folder, claimed as the save folder is (rank 0): this run's, resumed; another
    run's, refused (one line naming local_checkpoints.folder); --overwrite, cleared."""
    try:
        ckpt.open_run_folder(folder, identity, overwrite=overwrite, autoresume=cfg.autoresume)
    except UserError as e:
        raise UserError(str(e).replace(f"save_folder {folder}", f"local_checkpoints.folder {folder}")) from None
    ckpt.write_run_file(folder, identity, redact_config(cfg.model_dump(mode="json")))


def build_wrapped_model(run: ResolvedRun, dist: DistInfo, *, from_weights: bool,
                        log) -> tuple[Transformer, torch.nn.Module]:
    """The same seed on every rank gives the same initial weights; fsdp/hsdp: rank 0 alone builds the
    full model on the CPU, the others a meta-device twin, then rank 0's weights are scattered shard by
    shard."""
    cfg, layout = run.config, run.plan.layout
    sharded = layout.sharded
    torch.manual_seed(cfg.parameters.seed)  # every rank: the random numbers drawn after the build agree
    model = None
    if dist.is_main or not sharded:
        model = starting_model(run, "cpu" if sharded else dist.device, from_weights=from_weights, log=log)
        apply_lora(model, cfg.lora, log=log)  # frozen base + adapters; no-op without `lora:`
    options = dict(compute=cfg.compute, checkpointing=run.plan.activation_checkpointing,
                   compression=run.plan.activation_compression, offload=run.plan.activation_offload,
                   precision=run.plan.precision, fp8=FP8Options.of(cfg.parameters))
    if not sharded:
        return model, parallelize(model, layout, dist, **options)
    full = model.state_dict() if model is not None else None
    with torch.device("meta"):
        model = apply_lora(Transformer(cfg.model), cfg.lora)  # the same modules as rank 0's
    train_forward = parallelize(model, layout, dist, **options)
    materialize(model, dist.device, full)
    return model, train_forward


def frozen_reference(run: ResolvedRun, dist: DistInfo) -> Transformer | None:
    """Reinforcement learning's reference for its KL penalty (``rl.kl``) when it trains every weight: a
    frozen copy of the starting weights on this device (with LoRA the base with its adapters off is
    the reference: nothing to build). Whole on every rank: resolution refuses it under fsdp/hsdp."""
    cfg = run.config
    if cfg.task_type != RL_TASK or not cfg.rl.kl or cfg.lora is not None:
        return None
    return starting_model(run, dist.device, from_weights=True, log=_silent).eval().requires_grad_(False)


def starting_model(run: ResolvedRun, device, *, from_weights: bool, log) -> Transformer:
    """The run's starting weights, the same at every call: the seed, the model's init, then the custom
    weights where given (and ``from_weights``: a resumed run loads its checkpoint instead)."""
    cfg = run.config
    torch.manual_seed(cfg.parameters.seed)
    model = build_model(cfg.model, device=device)
    if cfg.custom_weights_path and from_weights:
        load_custom_weights(model, cfg, run.data.tokenizer_path, log)
    return model


def load_custom_weights(model: Transformer, cfg, tokenizer_path: str | None, log) -> None:
    path = cfg.custom_weights_path
    source, _, _ = load_model(path, device=model.output_weight.device)
    theirs, ours = source.state_dict(), model.state_dict()
    extension = read_extension(tokenizer_path)  # tokenizer.extend: new rows from their pieces
    if extension:
        theirs = extend_embeddings(theirs, extension, cfg.model.vocab_size)
    if theirs.keys() != ours.keys() or any(v.shape != ours[k].shape for k, v in theirs.items()):
        raise UserError(f"custom_weights_path: {path} holds a different model shape than `model` in the config "
                        "(leave `model` out to take the weights' own)")
    model.load_state_dict(theirs, strict=True)
    log(f"weights: starting from {path} (fresh optimizer and LR schedule)")
