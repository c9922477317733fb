"""The training loop: config → data → model → steps → checkpoints and trackers.

One code path for a single CPU process, torchrun with N gloo ranks, and GPUs. Read
`train()` top to bottom: setup, resume, then the loop (accumulate micro-batches, clip,
step, log, evaluate, checkpoint), then the final export.
"""

from __future__ import annotations

import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmforge.config.schema import RunConfig
from lmforge.data.pipeline import ResolvedData, resolve_data
from lmforge.data.stream import DatasetSpec, TokenStream
from lmforge.data.tokenizer import load_tokenizer
from lmforge.distributed.dist import (DistInfo, all_reduce_sum, any_rank, barrier, broadcast_object, destroy,
                                      init_distributed)
from lmforge.distributed.elastic import restarted_from_elastic
from lmforge.distributed.parallelize import (SHARDED, full_state_dict, is_sharded, local_value, materialize,
                                              no_grad_sync, parallelize)
from lmforge.errors import UserError
from lmforge.estimate.cost import live_cost
from lmforge.estimate.hardware import detect_device_spec, mfu, peak_flops
from lmforge.eval.heldout import bits_per_byte, heldout_loss
from lmforge.models import build_model, generate, save_pretrained
from lmforge.models.transformer import Transformer
from lmforge.secrets import redact_config
from lmforge.train import checkpoint as ckpt
from lmforge.train import remote_store
from lmforge.train.finetune import target_count, unpack_batch
from lmforge.train.optim import build_optimizer, lr_factor
from lmforge.train.plan import TrainPlan, make_plan, resolved_config


class TrainingDiverged(UserError):
    exit_code = 3


@dataclass
class TrainResult:
    status: str  # completed | stopped
    step: int
    tokens: int
    save_folder: str
    final_dir: str | None
    eval: dict = field(default_factory=dict)
    generations: list[str] = field(default_factory=list)
    mlflow_ui: str | None = None


def default_names(cfg: RunConfig) -> RunConfig:
    """Fill name and save_folder (a stable folder, so re-running the command resumes)."""
    name = cfg.name or f"{cfg.model.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.model_copy(update={"name": name, "save_folder": cfg.save_folder or os.path.join("runs", name)})


def vocab_for(cfg: RunConfig, tokenizer_vocab: int) -> RunConfig:
    """The model's vocabulary: the tokenizer's, rounded up to a multiple of 64 (faster matmuls)."""
    v = cfg.model.vocab_size
    if v is None:
        v = 64 * math.ceil(tokenizer_vocab / 64)
    elif v < tokenizer_vocab:
        raise UserError(f"model.vocab_size ({v}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": v})})


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def _stream(data: ResolvedData, plan: TrainPlan, dist: DistInfo, cfg: RunConfig, *, split="train",
            datasets=None, micro_batch=None, global_batch=None) -> TokenStream:
    specs = [DatasetSpec(d.name, d.path, d.proportion) for d in (datasets or data.train)]
    mb = micro_batch or plan.micro_batch
    return TokenStream(specs, seq_len=plan.context_length, micro_batch_size=mb,
                       global_batch_size=global_batch or plan.global_batch, rank=dist.rank,
                       world_size=dist.world_size, seed=cfg.parameters.seed,
                       num_workers=cfg.compute.num_workers if split == "train" else 0, split=split)


def setup(cfg: RunConfig, dist: DistInfo, log=print):
    """Resolve data and every default. Rank 0 prepares data first; the others then hit the cache."""
    from lmforge.train.finetune import is_sft, sft_setup

    if is_sft(cfg):  # JSONL prompt/response or chat rows instead of the pretraining pipeline
        return sft_setup(cfg, dist, log)
    cfg = default_names(cfg)
    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    if not dist.is_main:
        barrier()
    data = resolve_data(cfg, seq_len, log=log if dist.is_main else (lambda *_: None))
    if dist.is_main:
        barrier()
    tokenizer = load_tokenizer(data.tokenizer_path)
    cfg = vocab_for(cfg, tokenizer.vocab_size)
    lengths = [d.seq_len for d in data.train]
    data_seq_len = min(lengths) if all(lengths) else None
    if data_seq_len is None:
        from lmforge.data.stream import open_dataset

        data_seq_len = min(open_dataset(d.path).sample_length(0) for d in data.train)
    if cfg.parameters.context_length and cfg.parameters.context_length > cfg.model.max_seq_len:
        cfg.model.max_seq_len = cfg.parameters.context_length
    probe = None
    if cfg.training_duration.unit == "ep":
        from lmforge.data.stream import open_dataset

        probe = sum(len(open_dataset(d.path)) for d in data.train)
    plan = make_plan(cfg, world_size=dist.world_size, device=dist.device,
                     samples_per_epoch=probe, data_seq_len=data_seq_len)
    return resolved_config(cfg, plan), plan, data, tokenizer


def train(cfg: RunConfig, *, overwrite: bool = False, log=print) -> TrainResult:
    from lmforge import secrets

    secrets.apply(cfg)  # credentials named by `secrets:` → this process's environment
    log = secrets.redacting(log)
    dist = init_distributed(cfg.compute.device)
    try:
        return _train(cfg, dist, overwrite=overwrite, log=log if dist.is_main else (lambda *_: None))
    finally:
        destroy()


def _train(cfg: RunConfig, dist: DistInfo, *, overwrite: bool, log) -> TrainResult:
    cfg, plan, data, tokenizer = setup(cfg, dist, log)
    icl = load_icl(cfg)
    # A remote save_folder is written to a local staging folder and uploaded in the background.
    device, save_folder = dist.device, remote_store.local_folder(cfg.save_folder)
    store = remote_store.open_store(cfg, log) if dist.is_main else None
    on_saved = store.checkpoint_saved if store else None
    identity = ckpt.run_identity(cfg)

    # --- save folder: same run → resume; a different run → refuse (unless --overwrite)
    if dist.is_main:
        if store:
            store.fetch_run_file()  # the identity check below then sees the remote run
        can_resume = ckpt.check_save_folder(save_folder, identity, overwrite=overwrite, autoresume=cfg.autoresume)
        if store:
            store.restore(resume=can_resume and cfg.autoresume, overwrite=overwrite)
        ckpt.write_run_file(save_folder, identity, redact_config(cfg.model_dump(mode="json")))
    barrier()
    resume_from = ckpt.latest_checkpoint(save_folder) if cfg.autoresume else None
    resume_from = broadcast_object(resume_from)

    # --- model, parallelism, optimizer (same seed on every rank → same initial weights)
    torch.manual_seed(cfg.parameters.seed)
    sharded = cfg.compute.data_parallel in SHARDED
    model = None
    if dist.is_main or not sharded:  # fsdp/hsdp: rank 0 alone builds the full init, on the CPU
        model = build_model(cfg.model, device="cpu" if sharded else device)
        if cfg.custom_weights_path and not resume_from:
            from lmforge.models.locate import load_model

            source, _, _ = load_model(cfg.custom_weights_path, device=model.output_weight.device)
            if source.state_dict().keys() != model.state_dict().keys() or any(
                    v.shape != model.state_dict()[k].shape for k, v in source.state_dict().items()):
                raise UserError(f"custom_weights_path: {cfg.custom_weights_path} holds a different model shape "
                                "than `model` in the config (leave `model` out to take the weights' own)")
            model.load_state_dict(source.state_dict(), strict=True)
            del source
            log(f"weights: starting from {cfg.custom_weights_path} (fresh optimizer and LR schedule)")
    if sharded:  # meta-device model, sharded, then each rank's shards filled from rank 0's init
        full = model.state_dict() if model is not None else None
        with torch.device("meta"):
            model = Transformer(cfg.model)
        train_model = parallelize(model, cfg.compute, dist, precision=plan.precision)
        materialize(model, device, full)
        del full
    else:
        train_model = parallelize(model, cfg.compute, dist, precision=plan.precision)
    p = cfg.parameters
    optimizer = build_optimizer(model, lr=plan.learning_rate, weight_decay=p.weight_decay,
                                betas=tuple(p.betas), eps=p.eps, device_type=device.type)
    stream = data.train_stream(plan, dist, cfg) if hasattr(data, "train_stream") else _stream(data, plan, dist, cfg)

    step, tokens, elapsed_before = 0, 0, 0.0
    if resume_from:
        state = ckpt.load_checkpoint(resume_from, model, optimizer, rank=dist.rank)
        stream.load_state_dict(state["data"])
        step, tokens, elapsed_before = state["step"], state["tokens"], state.get("elapsed_s", 0.0)
        log(f"resume: continuing from {resume_from} (step {step}, {tokens:,} tokens)")
        if state.get("world_size", dist.world_size) != dist.world_size:
            log(f"resume: checkpoint written by {state['world_size']} rank(s), resharded onto {dist.world_size}")
    restarted_from_elastic(save_folder, resume_from, step, dist, log)
    saver = ckpt.PendingSave() if cfg.compute.async_checkpoint else None

    from lmforge.tracking import build_trackers, mlflow_ui_command

    trackers = build_trackers(cfg.experiment_tracker, run_name=cfg.name, run_dir=save_folder,
                              resume=bool(resume_from), total_steps=plan.total_steps,
                              total_tokens=plan.total_tokens, is_main=dist.is_main)
    trackers.log_params(redact_config(cfg.model_dump(mode="json")) | {"plan": {
        "params_total": plan.params["total"], "params_active": plan.params["active"],
        "world_size": dist.world_size, "grad_accum": plan.grad_accum, "total_steps": plan.total_steps}})
    _announce(cfg, plan, dist, log)

    autocast = _autocast(device, plan.precision)
    spec = detect_device_spec(device)
    peak = peak_flops(spec, "bf16" if plan.precision == "bf16" else "fp32")
    bytes_per_token = {d.name: d.split_stats(split).get("bytes_per_token") for d, split in data.eval}

    def run_eval(at_step: int) -> dict:
        metrics = {}
        losses = []
        for d, split in data.eval:
            eval_stream = _stream(data, plan, dist, cfg, split=split, datasets=[d],
                                  global_batch=plan.micro_batch * dist.world_size)
            batches = _take(eval_stream, cfg.eval.max_batches)
            loss, n = heldout_loss(train_model, batches, device, autocast)
            eval_stream.close()
            prefix = "eval" if len(data.eval) == 1 else f"eval/{d.name}"
            metrics[f"{prefix}/loss"] = loss
            metrics[f"{prefix}/perplexity"] = math.exp(min(loss, 50))
            bpb = bits_per_byte(loss, bytes_per_token.get(d.name))
            if bpb is not None:
                metrics[f"{prefix}/bits_per_byte"] = bpb
            losses.append(loss)
        if len(losses) > 1:
            metrics["eval/loss"] = sum(losses) / len(losses)
        if hasattr(data, "eval_metrics"):  # fine-tuning: loss on held-out responses
            metrics |= data.eval_metrics(train_model, plan, dist, cfg, device, autocast)
        # FSDP: every rank takes part in each forward (same prompts, same seeds → same tokens).
        gens = []
        if dist.is_main or sharded:
            with autocast() if sharded else nullcontext():
                gens = _generations(model, tokenizer, cfg, at_step, compiled=cfg.compute.compile)
            gens = gens if dist.is_main else []
        for i, text in enumerate(gens):
            trackers.log_text(f"generation_{i}", text, at_step)
        if metrics:
            trackers.log_metrics(metrics, at_step)
        return metrics | {"_generations": gens}

    # --- graceful stop: SIGTERM / first Ctrl-C → checkpoint at the next step boundary, then exit
    stop = {"asked": False}

    def _ask_stop(signum, frame):
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True
        log("stop requested: saving a checkpoint after this step (Ctrl-C again to abort)")

    old_handlers = {s: signal.signal(s, _ask_stop) for s in (signal.SIGTERM, signal.SIGINT)} \
        if _in_main_thread() else {}

    last_eval: dict = {}
    status = "completed"
    loss_ema = None
    try:
        if plan.total_steps is not None and step >= plan.total_steps:
            log(f"run {cfg.name} already completed {step} steps; nothing to train")
        it = iter(stream)
        t_start = time.monotonic()
        t_log, tok_log = t_start, tokens
        train_model.train()
        norm_tokens = plan.micro_batch * (plan.context_length - 1) * plan.grad_accum
        while not _done(plan, step, elapsed_before + time.monotonic() - t_start):
            lr = plan.learning_rate * lr_factor(
                step, warmup_steps=plan.warmup_steps, total_steps=plan.total_steps or 0,
                schedule=p.schedule, min_ratio=p.min_lr_ratio,
                progress=None if plan.time_limit_s is None else
                (elapsed_before + time.monotonic() - t_start) / plan.time_limit_s)
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            aux_log: dict = {}
            batches = [next(it) for _ in range(plan.grad_accum)]
            # Fine-tuning batches average over their response tokens only (prompts are -100).
            step_norm = target_count(batches) or norm_tokens
            for micro, batch in enumerate(batches):
                inputs, targets, doc_ids = unpack_batch(batch, device)
                last = micro == plan.grad_accum - 1
                sync = no_grad_sync(train_model, skip=not last and dist.distributed)
                with sync:
                    with autocast():
                        logits, aux = train_model(inputs, return_aux=True, doc_ids=doc_ids)
                    # Predict token t+1 from tokens ≤ t; the last position has no target.
                    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets[:, 1:].flatten(),
                                         reduction="sum")
                    loss = ce / step_norm
                    if "aux_loss" in aux:
                        loss = loss + aux["aux_loss"] / plan.grad_accum
                        aux_log = aux
                    loss.backward()
                loss_sum += ce.detach() / step_norm
            # FSDP: a replicated DTensor holding the norm over all shards.
            grad_norm = local_value(torch.nn.utils.clip_grad_norm_(model.parameters(), p.grad_clip or float("inf")))
            loss_val = all_reduce_sum(loss_sum).item() / dist.world_size
            if not math.isfinite(loss_val) or not math.isfinite(float(grad_norm)):
                good = ckpt.latest_checkpoint(save_folder)
                raise TrainingDiverged(
                    f"loss became {loss_val} at step {step + 1} (grad norm {float(grad_norm):.3g}); stopped without "
                    f"saving. Last good checkpoint: {good or 'none'}. Try a lower parameters.learning_rate")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if saver is not None:
                saver.poll()  # rank 0 completes a background checkpoint as soon as it is written
            step += 1
            tokens += plan.tokens_per_step
            if loss_ema is not None and loss_val > 3 * loss_ema and step > plan.warmup_steps:
                log(f"warning: loss spike at step {step}: {loss_val:.3f} vs recent average {loss_ema:.3f}")
            loss_ema = loss_val if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_val

            if step % cfg.log_interval == 0 or step == 1 or _done(plan, step, 0):
                now = time.monotonic()
                tps = (tokens - tok_log) / max(now - t_log, 1e-9)
                t_log, tok_log = now, tokens
                metrics = {"train/loss": loss_val, "train/lr": lr, "train/grad_norm": float(grad_norm),
                           "train/tokens": tokens, "train/epoch": stream.epoch,
                           "throughput/tokens_per_s": tps,
                           "throughput/tokens_per_s_per_device": tps / dist.world_size,
                           "throughput/mfu": mfu(tps, plan.flops_per_token, dist.world_size, peak)}
                metrics |= live_cost(elapsed_before + now - t_start, dist.world_size, cfg.compute.price_per_gpu_hour)
                if device.type == "cuda":
                    metrics["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                if aux_log:
                    metrics["train/moe_lb_loss"] = float(aux_log["moe_lb_loss"])
                    metrics["train/moe_z_loss"] = float(aux_log["moe_z_loss"])
                    counts = aux_log["moe_tokens_per_expert"].float()
                    metrics["train/moe_max_expert_share"] = float(counts.max() / counts.sum().clamp(min=1))
                trackers.log_metrics(metrics, step)

            done = _done(plan, step, elapsed_before + time.monotonic() - t_start)
            stop_now = any_rank(stop["asked"], device)  # a stop asked on any rank stops all
            if step % plan.eval_interval == 0 and not done:
                last_eval = run_eval(step)
            if plan.icl_interval and step % plan.icl_interval == 0 and not done:
                trackers.log_metrics(run_icl(model, tokenizer, icl, cfg, dist), step)
            if (step % plan.save_interval == 0 and not done) or stop_now:
                _save(save_folder, step, tokens, model, optimizer, stream, cfg, dist,
                      elapsed_before + time.monotonic() - t_start, saver, on_complete=on_saved)
            if stop_now:
                status = "stopped"
                break

        if status == "completed":
            last_eval = run_eval(step)
            if not plan.total_steps or step > 0:
                _save(save_folder, step, tokens, model, optimizer, stream, cfg, dist,
                      elapsed_before + time.monotonic() - t_start, saver, on_complete=on_saved)
            icl_metrics = run_icl(model, tokenizer, icl, cfg, dist)
            if icl_metrics:
                trackers.log_metrics(icl_metrics, step)
                last_eval |= icl_metrics
        if saver is not None:
            saver.wait()  # the last checkpoint is complete before the run reports success
        final_dir = None
        if status == "completed":
            final_dir = _export(model, cfg, dist, os.path.join(save_folder, "final"), data.tokenizer_path)
        barrier()
        if final_dir:
            trackers.log_model(final_dir)  # model registries (MLflow, W&B); a failure there is only a warning
        trackers.finish(status)
        if store:
            store.finish()  # the run is complete only once the store has its last checkpoint and export
    except BaseException:
        trackers.finish("failed")
        if store:
            store.abort()
        raise
    finally:
        stream.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    gens = last_eval.pop("_generations", [])
    return TrainResult(status=status, step=step, tokens=tokens, save_folder=cfg.save_folder, final_dir=final_dir,
                       eval=last_eval, generations=gens, mlflow_ui=mlflow_ui_command(cfg.experiment_tracker))


def _done(plan: TrainPlan, step: int, elapsed: float) -> bool:
    if plan.total_steps is not None:
        return step >= plan.total_steps
    return elapsed >= (plan.time_limit_s or 0)


def _take(stream: TokenStream, n: int):
    it = iter(stream)
    for _ in range(n):
        yield next(it)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _save(save_folder, step, tokens, model, optimizer, stream, cfg, dist, elapsed, saver=None, on_complete=None):
    state = {"step": step, "tokens": tokens, "elapsed_s": elapsed, "data": stream.state_dict(),
             "world_size": dist.world_size, "config": redact_config(cfg.model_dump(mode="json"))}
    ckpt.save_checkpoint(save_folder, step, model, optimizer, state, rank=dist.rank,
                         keep=cfg.save_num_checkpoints_to_keep, pending=saver, on_complete=on_complete)


def _export(model, cfg: RunConfig, dist: DistInfo, final_dir: str, tokenizer_dir) -> str | None:
    """Write the final model on rank 0; FSDP first gathers the full weights (every rank takes part)."""
    if is_sharded(model):
        full = full_state_dict(model)
        if not dist.is_main:
            return None
        model = build_model(cfg.model, device="cpu", init=False)
        model.load_state_dict(full)
    elif not dist.is_main:
        return None
    save_pretrained(model, cfg.model, final_dir, tokenizer_dir=tokenizer_dir)
    return final_dir


def _generations(model, tokenizer, cfg: RunConfig, step: int, compiled: bool) -> list[str]:
    """Sample from each eval prompt with a fixed seed (never touches the training RNG)."""
    out = []
    stance = torch.compiler.set_stance("force_eager") if compiled else nullcontext()
    with stance:
        for i, prompt in enumerate(cfg.eval.prompts):
            ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
            new = generate(model, ids, cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
                           top_k=cfg.eval.top_k, top_p=cfg.eval.top_p, eos_id=tokenizer.eos_id,
                           seed=cfg.parameters.seed + i)
            if new and new[-1] == tokenizer.eos_id:
                new = new[:-1]
            out.append(prompt + tokenizer.decode(new))
    return out


def load_icl(cfg: RunConfig):
    """Read ICL tasks and the gauntlet once, before training, so bad files fail early."""
    if not cfg.eval.icl_tasks:
        return None
    from lmforge.eval.gauntlet import load_gauntlet
    from lmforge.eval.icl import load_tasks

    tasks = load_tasks(cfg.eval.icl_tasks, data_root=cfg.eval.data_root)
    return tasks, (load_gauntlet(cfg.eval.gauntlet) if cfg.eval.gauntlet else None)


def run_icl(model, tokenizer, icl, cfg: RunConfig, dist: DistInfo) -> dict:
    """In-context-learning accuracies (and gauntlet scores) as flat metrics, computed on rank 0.

    Every rank holds the whole model under DDP, so rank 0 alone can run it; under FSDP every
    rank runs the same examples in step (each forward gathers weights from all of them).
    """
    sharded = is_sharded(model)
    if not icl or not (dist.is_main or sharded):
        return {}
    from lmforge.eval.gauntlet import gauntlet_scores
    from lmforge.eval.icl import evaluate_icl

    tasks, gauntlet = icl
    with _autocast(dist.device, cfg.parameters.precision)() if sharded else nullcontext():
        results = evaluate_icl(model, tokenizer, tasks, limit=cfg.eval.icl_limit, max_seq_len=model.cfg.max_seq_len)
    if not dist.is_main:
        return {}
    metrics = {f"icl/{k}": v["accuracy"] for k, v in results.items() if isinstance(v, dict) and "accuracy" in v}
    if gauntlet is not None:
        scores = gauntlet_scores(results, gauntlet)
        for group in ("categories", "averages"):
            for k, v in (scores.get(group) or {}).items():
                if v is not None:
                    metrics[f"gauntlet/{k}"] = v
    return metrics


def _announce(cfg: RunConfig, plan: TrainPlan, dist: DistInfo, log) -> None:
    total = f"{plan.total_steps:,} steps ({plan.total_tokens:,} tokens)" if plan.total_steps else \
        f"{plan.time_limit_s:.0f}s of training"
    log(f"run {cfg.name}: {cfg.model.preset or 'custom'} model, {plan.params['total'] / 1e6:.1f}M params "
        f"({plan.params['active'] / 1e6:.1f}M active), {total}")
    log(f"  batch {plan.global_batch} × {plan.context_length} tokens = micro-batch {plan.micro_batch} × "
        f"{plan.grad_accum} accumulation × {dist.world_size} rank(s); lr {plan.learning_rate:.3g}, "
        f"warmup {plan.warmup_steps}, {cfg.parameters.schedule}; {plan.precision} on {dist.device}")
    log(f"  checkpoints and metrics: {cfg.save_folder}")
