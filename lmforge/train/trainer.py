"""The trainer: one code path for one CPU process, N gloo ranks under torchrun, and GPUs.

Read it top to bottom:

- `Trainer.__init__` takes the run's parts as `train.build` makes them (the save folder claimed,
  the model sharded or replicated, the objective, the optimizer, the data streams, the checkpoint
  loaded, and what watches the loop) and the run's layout (`plan.layout`); it builds nothing;
- `train_step` is one optimizer step: forward and backward over the micro-batches of one global
  batch, gradient clipping, the update. It never waits for the device: its loss and gradient
  norm stay device tensors, read (with the non-finite check) only at log steps and before a
  checkpoint. A test or a profiler can call it alone;
- `evaluate` is the objective's held-out metrics (loss / perplexity / bits per byte, or a
  preference loss with its rewards and accuracy) and generations from the eval prompts;
- `save` writes checkpoints through state objects that carry their own ``state_dict()``: model
  and optimizer (DCP), data stream, counters (`train.resume.TrainState`), RNG;
- `fit` is the loop: steps, logging, periodic evaluation and checkpoints, a graceful stop on
  SIGTERM / Ctrl-C (`train.stop`), a hang watchdog fed after every step (`train.watchdog`),
  per-rank telemetry and the goodput conditions (`train.telemetry`), and at the end a final
  evaluation, checkpoint and export (`train.final`).

The trainer knows nothing of trackers, object stores or the run registry: they hook in through
`train.callbacks`. What it needs comes resolved by `resolve.resolve` (a `ResolvedRun`).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lmforge.data.batch import Batch
from lmforge.distributed.context_parallel import shard_rows
from lmforge.distributed.dist import DistInfo, all_reduce_sum, barrier
from lmforge.distributed.float8 import after_optimizer_step
from lmforge.distributed.parallelize import clip_grad_norm, compile_enabled, device_value, no_grad_sync
from lmforge.errors import UserError
from lmforge.eval.in_training import generations, run_icl
from lmforge.run_files import latest_checkpoint, list_checkpoints
from lmforge.plan.estimate import run_record
from lmforge.plan.hardware import MATMUL_SHARE_OF_PEAK, mfu
from lmforge.resolve import ResolvedRun
from lmforge.secrets import redact_config
from lmforge.train import checkpoint as ckpt
from lmforge.train.callbacks import Callbacks, RunInfo
from lmforge.train.final import write_final
from lmforge.train.optim import blended_lr
from lmforge.train.parts import TrainingParts


class TrainingDiverged(UserError):
    exit_code = 3


def failure_line(e: BaseException) -> str:
    """What ended a failed run, in one line: a UserError's own message, else the exception's type
    and the first line of its message."""
    if isinstance(e, UserError):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def divergence_message(step: int, loss: float, grad_norm: float, remedies: str) -> str:
    """The value that went non-finite at ``step`` first — the loss, else the gradient norm (the loss
    can stay finite for a step while the backward pass overflows) — and the other one beside it."""
    if math.isfinite(loss):
        head = f"gradient norm became {grad_norm} at step {step} (loss {loss:.4g})"
    else:
        head = f"loss became {loss} at step {step} (gradient norm {grad_norm:.4g})"
    return f"{head}; {remedies}"


def divergence_remedies(learning_rate: float, warmup_steps: int, grad_clip: float | None, precision: str) -> str:
    """The usual remedies for a diverged run, with this run's values."""
    clip = "off" if grad_clip is None else f"{grad_clip:g}"
    text = (f"Try a lower parameters.learning_rate ({learning_rate:.3g} now), a longer parameters.warmup "
            f"({warmup_steps} step{'' if warmup_steps == 1 else 's'} now), parameters.grad_clip ({clip} now)")
    wider = {"bf16": "fp32", "fp8": "bf16"}.get(precision)  # fewer mantissa bits: rounding can blow up
    return text + (f" or parameters.precision {wider} ({precision} now)" if wider else "")


@dataclass
class StepOutput:
    # Device scalars, so that a step never waits for the device: reading one (float(), .item())
    # waits for the step to finish. `Trainer._read` reads a log window's at once.
    loss: torch.Tensor  # the objective's mean loss of the step (per target, or per pair), all ranks (fp32)
    grad_norm: torch.Tensor  # before clipping
    lr: float
    moe: dict = field(default_factory=dict)  # MoE routing statistics of the last micro-batch
    stats: dict = field(default_factory=dict)  # the objective's step means, e.g. preference rewards




@dataclass
class TrainResult:
    status: str  # completed | stopped
    step: int
    tokens: int | None  # None: not known (a run found complete with only damaged checkpoints)
    save_folder: str
    final_dir: str | None
    eval: dict = field(default_factory=dict)
    generations: list[str] = field(default_factory=list)
    mlflow_ui: str | None = None  # filled in by the operations layer when MLflow tracks the run
    reshape: dict | None = None  # a goodput condition stopped the run to resume it (`Telemetry.act`)


class Trainer:
    """The loop over a run's parts (`train.build`), its evaluations and its checkpoints."""

    def __init__(self, run: ResolvedRun, parts: TrainingParts | None, dist: DistInfo, *, save_folder: str,
                 callbacks: Callbacks, log):
        """``parts``: as `train.build.build_parts` made them (None: the run completed before, its
        checkpoints damaged — `fit` says so). ``callbacks`` and ``log``: this rank's (rank 0's alone act)."""
        self.cfg, self.plan, self.tokenizer = run.config, run.plan, run.tokenizer
        self.layout = run.plan.layout  # the ranks and the batch split, as planned
        self.dist, self.device = dist, dist.device
        self.save_folder = save_folder  # local (a remote run's staging folder)
        self.callbacks, self.log = callbacks, log
        self.complete = parts is None
        self.reshape: dict | None = None
        self._t0: float | None = None  # when this attempt's loop started (see _elapsed)
        self._elapsed0 = 0.0
        self._evaluated: tuple[int, dict] | None = None  # (step, metrics) of the last held-out evaluation
        if self.complete:
            return
        self.state = parts.state
        self.model, self.train_forward, self.optimizer = parts.model, parts.train_forward, parts.optimizer
        self.objective, self.autocast, self.reading = parts.objective, parts.autocast, parts.layout
        self.data, self.stream, self.eval_sets = parts.data, parts.stream, parts.eval_sets
        self.icl, self.expert_health, self.saver = parts.icl, parts.expert_health, parts.saver
        self.stop, self.watchdog, self.telemetry = parts.stop, parts.watchdog, parts.telemetry
        self.local_folder = parts.local_folder  # the local checkpoint tier, if any
        self.resumed = bool(parts.resume_from)
        self.sequence_group = self.model.sequence_group  # context parallelism: the ranks a row is split over
        self._schedule_signature = self.plan.schedule.signature(self.plan.learning_rate)

    # ------------------------------------------------------------------ one step

    def learning_rate(self) -> float:
        """The LR of the next step: the plan's schedule in the run's own unit (steps, or seconds of
        training), blended in from the checkpoint's LR after a resume under another schedule."""
        plan, state = self.plan, self.state
        elapsed = self._elapsed()
        step_s = elapsed / state.step if state.step and elapsed > 0 else plan.step_time_s
        lr = plan.learning_rate * plan.schedule.factor(state.step, elapsed, step_s)
        ramp = plan.schedule.warmup if plan.schedule.warmup_unit == plan.schedule.unit else 0.0
        ramp = max(ramp, 0.02 * plan.schedule.total)
        return blended_lr(lr, state.lr_blend, plan.schedule, state.step, elapsed, ramp)

    def train_step(self, batches: Sequence[Batch]) -> StepOutput:
        """One optimizer step over this rank's micro-batches of one global batch.

        The loss is the mean over every unit of the global batch — a trained-on target, or a
        preference pair (`train.objective`): each micro-batch's summed loss is divided by the
        step's unit count (all ranks' mean under data parallelism, which averages gradients; under
        context parallelism each rank computes its part of the rows, `shard_rows`, against the
        same global count). Gradients are synchronized on the last micro-batch only. The step takes
        the objective's ``updates`` optimizer updates on its batches (one, but reinforcement
        learning's μ, ``rl.updates_per_batch``), at one LR; its loss and statistics are their means.
        Nothing here waits for the device: the returned loss, gradient norm and statistics are device
        tensors; a non-finite loss is caught when they are read (`_read`: at the next log step or
        checkpoint, which it then never reaches).
        """
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = self._unit_norm(batches)
        totals = None  # the step's summed loss, then the objective's summed statistics
        moe: dict = {}
        batches = [b.to(self.device) for b in batches]  # once: every update of the step reads them
        for _ in range(self.objective.updates):  # one, but reinforcement learning's μ
            for i, batch in enumerate(batches):
                skip_sync = i < len(batches) - 1 and self.dist.distributed
                with no_grad_sync(self.train_forward, skip=skip_sync), shard_rows(self.sequence_group, batch) as batch:
                    with self.autocast(), self.telemetry.section("forward"):
                        out = self.objective(self.train_forward, batch)
                    loss = out.loss_sum / norm
                    if out.aux_loss is not None:
                        loss = loss + out.aux_loss / len(batches)
                        moe = out.moe
                        self.expert_health.add(out.moe)
                    with self.telemetry.section("backward"):
                        loss.backward()
                sums = torch.stack([out.loss_sum.detach().float(), *out.stats.values()])
                totals = sums if totals is None else totals + sums
            clip = self.cfg.parameters.grad_clip or float("inf")
            # FSDP: a replicated DTensor holding the norm over all shards (an all-reduce: outside the timed
            # optimizer section, which telemetry scores as the rank's own time).
            grad_norm = device_value(clip_grad_norm(self.model.parameters(), clip))
            with self.telemetry.section("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        # one all-reduce: loss and statistics, means over the step's units (and updates)
        totals = all_reduce_sum(totals) / (norm * self.dist.world_size * self.objective.updates)
        loss, stats = totals[0], dict(zip(out.stats, totals[1:]))
        self.state.lr, self.state.schedule = lr, self._schedule_signature
        after_optimizer_step(self.model)  # FP8 under FSDP: next step's weight scales, in one all-reduce
        self.state.step += 1
        self.state.tokens += self.plan.tokens_per_step
        if self.expert_health is not None:
            self.expert_health.step()
        return StepOutput(loss=loss.detach(), grad_norm=grad_norm.detach(), lr=lr, moe=moe, stats=stats)

    def _unit_norm(self, batches: Sequence[Batch]) -> torch.Tensor | float:
        """The objective's units (targets, pairs) per rank in this step, counted on the host copies
        of the batches (no device wait). Pretraining rows all have the same count; fine-tuning
        rows differ, so their count is summed over ranks (a device tensor; each rank divides by
        the mean). Under context parallelism N ranks share each (whole, here) row: 1/N of its
        units each."""
        count = torch.stack([self.objective.units(b) for b in batches]).sum()
        cp = self.layout.context_parallel
        if self.data.kind != "pretrain" and self.dist.distributed:
            return (all_reduce_sum(count.to(self.device, torch.float32)) / self.dist.world_size).clamp(min=1.0) / cp
        return max(1.0, float(count)) / cp

    def _read(self, window: list[StepOutput]) -> list[tuple[float, float]]:
        """The (loss, grad norm) of each step of ``window`` on the host, in one device wait; the
        window is emptied. Raises TrainingDiverged (nothing saved) at the first non-finite one."""
        if not window:
            return []
        values = torch.stack([torch.stack([o.loss.float(), o.grad_norm.float()]) for o in window]).tolist()
        first_step = self.state.step - len(window) + 1
        window.clear()
        for i, (loss, grad_norm) in enumerate(values):
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                last = latest_checkpoint(self.save_folder) or "none"
                raise TrainingDiverged(divergence_message(
                    first_step + i, loss, grad_norm, f"stopped without saving. Last good checkpoint: {last}. "
                    + divergence_remedies(self.plan.learning_rate, self.plan.warmup_steps,
                                           self.cfg.parameters.grad_clip, self.plan.precision)))
        return values

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict:
        """The objective's held-out metrics of each eval set (loss / perplexity / bits per byte, or
        a preference loss, rewards and accuracy), then generations from the eval prompts; logged
        through the callbacks. Returns the metrics (``_generations`` too)."""
        metrics, losses = {}, []
        for es in self.eval_sets:
            values = self.objective.evaluate(self.model, es, self.device, self.autocast)
            metrics |= {f"{es.name}/{k}": v for k, v in values.items()}
            if "loss" in values:  # (reinforcement learning's held-out metric is a reward)
                losses.append(values["loss"])
        if len(losses) > 1:
            metrics["eval/loss"] = sum(losses) / len(losses)
        gens = []
        sharded = self.layout.sharded
        if self.dist.is_main or sharded:  # FSDP: every rank takes part in each forward
            with self.autocast() if sharded else nullcontext():
                gens = generations(self.model, self.tokenizer, self.cfg,
                                   compiled=compile_enabled(self.cfg.compute.compile, self.device))
            gens = gens if self.dist.is_main else []
        for i, text in enumerate(gens):
            self.callbacks.on_text(f"generation_{i}", text, self.state.step)
        if metrics:
            self.callbacks.on_metrics(metrics, self.state.step)
        self._evaluated = (self.state.step, metrics | {"_generations": gens})
        return metrics | {"_generations": gens}

    def evaluate_icl(self) -> dict:
        # ICL examples come in every length: compiled blocks (specialized to the training shape)
        # would recompile for each, so they run eagerly here.
        compiled = compile_enabled(self.cfg.compute.compile, self.device)
        with torch.compiler.set_stance("force_eager") if compiled else nullcontext():
            metrics = run_icl(self.model, self.tokenizer, self.icl, self.cfg, self.dist, self.layout.sharded,
                              self.autocast)
        if metrics:
            self.callbacks.on_metrics(metrics, self.state.step)
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def save(self, tier: str = "durable") -> None:
        """A checkpoint of the current step (asynchronous when compute.async_checkpoint) to ``tier``: the
        save folder ("durable"), or the local tier ("local"; its own keep-N, not mirrored). Collective."""
        self.state.elapsed_s = self._elapsed()
        state = self.state.state_dict() | {
            "data": self.stream.state_dict(), "world_size": self.dist.world_size,
            "config": redact_config(self.cfg.model_dump(mode="json"))}
        local = tier == "local"
        ckpt.save_checkpoint(self.local_folder if local else self.save_folder, self.state.step, self.model,
                             self.optimizer, state, rank=self.dist.rank, pending=self.saver,
                             keep=self.cfg.local_checkpoints.keep if local else self.cfg.save_num_checkpoints_to_keep,
                             on_complete=self.callbacks.on_checkpoint if self.dist.is_main and not local else None)

    def export(self) -> str | None:
        """The run's ``final/`` (on rank 0; every rank takes part in gathering sharded weights)."""
        return write_final(self.model, self.cfg, self.dist, self.save_folder, self.data.tokenizer_path,
                           self.data.chat_template)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        """Train until the duration is reached or a stop is asked; then evaluate, checkpoint and
        (when completed) export. Every rank calls it."""
        if self.complete:
            found = list_checkpoints(self.save_folder)
            return TrainResult(status="completed", step=found[-1][0] if found else 0, tokens=None,
                               save_folder=self.cfg.save_folder, final_dir=os.path.join(self.save_folder, "final"))
        self.callbacks.on_start(self._run_info())
        self._announce()
        try:
            # The stop handler stays through the final evaluation and export: those finish.
            with self.stop.handling_signals():
                try:
                    status = self._loop()
                finally:
                    self.watchdog.close()  # the end of the run is not timed
                last_eval = self._finish() if status == "completed" else {}
                with self.telemetry.blocked("checkpoint"):
                    if self.saver is not None:
                        self.saver.wait()  # the last checkpoint is complete before the run reports success
                    final_dir = self.export() if status == "completed" else None
                barrier()
                goodput = self.telemetry.close(status)
                if goodput:
                    self.callbacks.on_metrics(goodput, self.state.step)
            self.callbacks.on_end(status, final_dir)
        except BaseException as e:
            self.callbacks.on_end("failed", None, error=failure_line(e))
            raise
        finally:
            self.stream.close()
        gens = last_eval.pop("_generations", [])
        return TrainResult(status=status, step=self.state.step, tokens=self.state.tokens,
                           save_folder=self.cfg.save_folder, final_dir=final_dir, eval=last_eval, generations=gens,
                           reshape=self.reshape)

    def _finish(self) -> dict:
        """The end of a completed run: a last evaluation (unless the loop's last step was just
        evaluated: a wall-clock budget that ran out during it), checkpoint and ICL pass."""
        if self._evaluated is not None and self._evaluated[0] == self.state.step:
            metrics = dict(self._evaluated[1])
        else:
            with self.telemetry.blocked("evaluation"):
                metrics = self.evaluate()
        if self.plan.total_steps is None or self.state.step > 0:
            with self.telemetry.blocked("checkpoint"):
                self.save()
        with self.telemetry.blocked("evaluation"):
            return metrics | self.evaluate_icl()

    def _loop(self) -> str:
        plan, state = self.plan, self.state
        if plan.total_steps is not None and state.step >= plan.total_steps:
            self.log(f"run {self.cfg.name} already completed {state.step} steps; nothing to train")
        batches = iter(self.stream)
        self._start_clock()
        self.telemetry.start(state.step)
        meter = _Meter(state.tokens, self.telemetry.blocked_s())
        self.train_forward.train()
        phase = None
        window: list[StepOutput] = []  # steps whose loss and grad norm are still on the device
        out = None
        while not self._done():
            if self.stream.phase() not in (None, phase):  # a curriculum phase begins (or the run resumes in one)
                phase = self.stream.phase()
                self.log(f"data: {phase} from step {state.step}")
            with self.telemetry.section("data"):
                micro = [next(batches) for _ in range(plan.grad_accum)]
            saved = self.model.activation_meter  # what the blocks save for backward: counted before a log step
            if saved is not None and (state.step == 0 or (state.step + 1) % self.cfg.log_interval == 0):
                saved.arm()
            out = self.train_step(micro)
            self.telemetry.after_step(state.step, self.model)
            window.append(out)
            if self.saver is not None:
                self.saver.poll()  # rank 0 completes a background checkpoint as soon as it is written
            done = self._done()
            stop = self.stop.requested(state.step, self.device)
            # The last step is logged also when a stop ends the run: its checkpoint, the registry and
            # the report then agree on where it stopped.
            log_now = state.step % self.cfg.log_interval == 0 or state.step == 1 or done or stop
            tier = None if done else self.telemetry.checkpoint_due(state.step)  # "durable" | "local" | None
            save_now = tier is not None or stop
            decision = None
            if log_now or save_now:  # the only points that wait for the device
                first = state.step - len(window) + 1
                values = self._read(window)  # raises on a non-finite loss: never saved
                for i, (loss, _) in enumerate(values):
                    meter.watch_spike(loss, first + i, past_warmup=first + i > plan.warmup_steps, log=self.log)
                if log_now:
                    decision = self._log_step(out, values[-1], meter)
                    save_now = save_now or (decision is not None and not done)  # checkpoint, then act
            if state.step % plan.eval_interval == 0 and not done and decision is None:
                with self.watchdog.paused(), self.telemetry.blocked("evaluation"):
                    self.evaluate()
            if plan.icl_interval and state.step % plan.icl_interval == 0 and not done and decision is None:
                with self.watchdog.paused(), self.telemetry.blocked("evaluation"):
                    self.evaluate_icl()
            if save_now:
                tier = "durable" if stop or decision is not None else tier  # a stop or an action: the durable one
                with self.watchdog.paused(), self.telemetry.blocked("checkpoint"):
                    self.save(tier)
                self.telemetry.checkpointed(tier)  # its blocking time: an auto interval re-estimated (collective)
            self.watchdog.beat(state.step)
            if save_now and decision is not None:
                return self._act(decision)
            if stop:
                return "stopped"
        if window:  # a wall-clock budget ran out during an evaluation or checkpoint after the last step:
            # that step is logged too, so the registry, `runs list` and the report end where the run did
            self._log_step(out, self._read(window)[-1], meter)
        return "completed"

    def _log_step(self, out: StepOutput, read: tuple[float, float], meter: "_Meter"):
        """The metrics of the step just read (``read``: its loss and gradient norm), through the
        callbacks; returns the goodput decision of this log step (every rank: the same)."""
        loss, grad_norm = read
        goodput, decision = self.telemetry.interval()
        step_out = StepOutput(loss=loss, grad_norm=grad_norm, lr=out.lr, moe=out.moe, stats=out.stats)
        rate = meter.tokens_per_s(self.state.tokens, self.telemetry.blocked_s())
        self.callbacks.on_metrics(self._step_metrics(step_out, rate) | goodput, self.state.step)
        return decision

    def _act(self, decision) -> str:
        """A goodput condition holds: with its checkpoint written, diagnose and cordon as it asks; the
        job then reports it and the supervisor resumes on the nodes left."""
        with self.watchdog.paused():
            if self.saver is not None:
                with self.telemetry.blocked("checkpoint"):
                    self.saver.wait()  # the checkpoint the run resumes from is complete first
            # a healthy GPU's matmul rate, the diagnostic sweep's bar (CPUs are judged against their peers only)
            expected = self.layout.peak_flops * MATMUL_SHARE_OF_PEAK / 1e12 if self.device.type == "cuda" else None
            self.reshape = self.telemetry.act(decision, expected_tflops=expected)
        return "stopped"

    def _step_metrics(self, out: StepOutput, tokens_per_s: float) -> dict:
        world, peak = self.layout.ranks, self.layout.peak_flops
        metrics = {"train/loss": out.loss, "train/lr": out.lr, "train/grad_norm": out.grad_norm,
                   "train/tokens": self.state.tokens, "train/epoch": self.stream.epoch,
                   "throughput/tokens_per_s": tokens_per_s,
                   "throughput/tokens_per_s_per_device": tokens_per_s / world,
                   # the standard basis (6·N_active + 12·L·H·Dh·T), and 6·N_active alone
                   "throughput/mfu": mfu(tokens_per_s, self.plan.flops_per_token, world, peak),
                   "throughput/mfu_6n": mfu(tokens_per_s, self.plan.model_flops_per_token, world, peak),
                   "time/elapsed_s": self._elapsed(),  # training wall time over all attempts (ETA, cost)
                   "train/progress": self._progress()}  # the share done: `runs list`, the bar of a time budget
        metrics |= {f"train/{k}": float(v) for k, v in out.stats.items()}  # e.g. preference rewards
        metrics |= self.stream.metrics()  # e.g. the curriculum phase and its mix (of the next step)
        if self.device.type == "cuda":
            metrics["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        saved = self.model.activation_meter
        if saved is not None and saved.bytes is not None:  # bytes the blocks kept for backward, one micro-batch
            metrics["memory/activations_saved"] = saved.bytes
            if saved.host_bytes:
                metrics["memory/activations_offloaded"] = saved.host_bytes
        if out.moe:
            metrics["train/moe_lb_loss"] = float(out.moe["moe_lb_loss"])
            metrics["train/moe_z_loss"] = float(out.moe["moe_z_loss"])
        if self.expert_health is not None:  # per-layer routing over the log window (all ranks)
            metrics |= self.expert_health.report(self.log)
        return metrics

    def _progress(self) -> float:
        """The share of the run done: of its steps, or of a wall-clock budget's time."""
        if self.plan.total_steps is not None:
            return min(1.0, self.state.step / max(self.plan.total_steps, 1))
        return min(1.0, self._elapsed() / max(self.plan.time_limit_s or 0.0, 1e-9))

    def _done(self) -> bool:
        if self.plan.total_steps is not None:
            return self.state.step >= self.plan.total_steps
        return self._elapsed() >= (self.plan.time_limit_s or 0)

    def _start_clock(self) -> None:
        self._t0, self._elapsed0 = time.monotonic(), self.state.elapsed_s

    def _elapsed(self) -> float:
        """Training wall time of the run, including earlier attempts (0 before the loop starts)."""
        if self._t0 is None:
            return self.state.elapsed_s
        return self._elapsed0 + time.monotonic() - self._t0

    def _run_info(self) -> RunInfo:
        plan = self.plan
        return RunInfo(
            name=self.cfg.name, save_folder=self.save_folder, resumed=self.resumed,
            config=redact_config(self.cfg.model_dump(mode="json")),
            plan={"params_total": plan.params["total"], "params_active": plan.params["active"],
                  "world_size": self.layout.ranks, "grad_accum": plan.grad_accum, "total_steps": plan.total_steps,
                  "report": run_record(self.cfg, plan)},
            total_steps=plan.total_steps, total_tokens=plan.total_tokens)

    def _announce(self) -> None:
        cfg, plan = self.cfg, self.plan
        total = f"{plan.total_steps:,} steps ({plan.total_tokens:,} tokens)" if plan.total_steps else \
            f"{plan.time_limit_s:.0f}s of training"
        self.log(f"run {cfg.name}: {cfg.model.label()} model, {plan.params['total'] / 1e6:.1f}M params "
                 f"({plan.params['active'] / 1e6:.1f}M active), {total}")
        batch = f"{plan.global_batch} × {plan.context_length} tokens" if self.layout.group_size == 1 else \
            f"{plan.global_batch} prompts × {self.layout.group_size} completions"
        self.log(f"  batch {batch} = micro-batch {plan.micro_batch} × "
                 f"{plan.grad_accum} accumulation × {self.layout.describe()}; lr {plan.learning_rate:.3g}, "
                 f"warmup {_span(plan.schedule.warmup, plan.schedule.warmup_unit)}, {_schedule_text(plan.schedule)}; "
                 f"{plan.optimizer}; {plan.precision} on {self.device}")
        self.log(f"  checkpoints and metrics: {cfg.save_folder}")


def _span(value: float, unit: str) -> str:
    if unit == "steps":  # a warmup of one step starts at the peak: none (what `warmup: 0ba` asks for)
        return "none" if value <= 1 else f"{int(value)} steps"
    return f"{value:.3g}s" if value > 0 else "none"


def _schedule_text(s) -> str:
    if s.kind == "wsd":
        return f"wsd (decay over the last {s.decay_fraction:.0%} to {s.min_ratio:g}× peak)"
    return s.kind if s.kind == "constant" else f"{s.kind} to {s.min_ratio:g}× peak"


class _Meter:
    """Tokens/s of the steps between log steps — the time blocked by evaluation, checkpoints and
    generations left out (``blocked``: telemetry's running total of it, the goodput ledger's
    split), so throughput and MFU are the steps' own — and a loss-spike warning (an exponential
    average of the loss)."""

    def __init__(self, tokens: int, blocked: float = 0.0):
        self._t, self._tokens, self._blocked, self._ema = time.perf_counter(), tokens, blocked, None

    def tokens_per_s(self, tokens: int, blocked: float = 0.0) -> float:
        now = time.perf_counter()
        steps_s = (now - self._t) - (blocked - self._blocked)
        rate = (tokens - self._tokens) / max(steps_s, 1e-9)
        self._t, self._tokens, self._blocked = now, tokens, blocked
        return rate

    def watch_spike(self, loss: float, step: int, *, past_warmup: bool, log) -> None:
        # (a policy-gradient loss hovers around 0 and changes sign: "3× the average" says nothing there)
        if self._ema is not None and self._ema > 0 and loss > 3 * self._ema and past_warmup:
            log(f"warning: loss spike at step {step}: {loss:.3f} vs recent average {self._ema:.3f}")
        self._ema = loss if self._ema is None else 0.9 * self._ema + 0.1 * loss
