"""What a run resumes from: the counters a checkpoint carries (`TrainState`), the checks that a
checkpoint can be continued under this config, and loading it into a run's built parts.

`train.build` calls `resume` once, after the parts are built and before the trainer gets them:
the trainer starts from the state it is handed and never loads anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from lmforge.errors import UserError
from lmforge.run_files import read_state
from lmforge.train import checkpoint as ckpt


@dataclass
class TrainState:
    """The counters a checkpoint carries (besides model, optimizer, data position and RNG)."""

    step: int = 0  # optimizer steps taken
    tokens: int = 0  # tokens trained on, all ranks
    elapsed_s: float = 0.0  # training wall time, summed over resumptions
    lr: float | None = None  # the LR of the last step
    schedule: dict | None = None  # the schedule that LR came from (`Schedule.signature`)
    lr_blend: dict | None = None  # after a resume under another schedule: where the LR blends from

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s, "lr": self.lr,
                "schedule": self.schedule, "lr_blend": self.lr_blend}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.elapsed_s = float(state.get("elapsed_s", 0.0))
        self.lr, self.schedule = state.get("lr"), state.get("schedule")
        self.lr_blend = state.get("lr_blend")


def check_resumable(state: dict, cfg, path: str) -> None:
    """A resumed run keeps its global batch and context length (the data position, the step count
    and a token-based duration are all measured in them) and its optimizer (whose state it loads)."""
    old = (state.get("config") or {}).get("parameters") or {}
    new = cfg.parameters
    for key in ("global_batch_size", "context_length"):
        was, now = old.get(key), getattr(new, key)
        if was is not None and now is not None and str(was) != str(now):
            raise UserError(f"parameters.{key} is {now}, but the checkpoint {path} was trained with {was}; a run "
                            f"resumes with the batch it started with: set it back to {was}, or start a new run "
                            "(--no-autoresume, or another --save-folder)")
    was = old.get("optimizer")
    if was not in (None, "auto") and was != new.optimizer:  # (checkpoints record the optimizer resolved)
        raise UserError(f"parameters.optimizer resolves to {new.optimizer}, but the checkpoint {path} was trained with "
                        f"{was} and holds its state (auto: Muon for a model trained from scratch with ≤5M "
                        f"non-embedding parameters, else AdamW); set parameters.optimizer: {was} to continue it, or "
                        "start a new run (--no-autoresume, or another --save-folder)")


def resume(path: str, cfg, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, stream, rank: int,
           world_size: int, schedule_signature: dict, checked: Collection[str] = (), log) -> TrainState:
    """Model, optimizer and this rank's RNG from the checkpoint ``path``, then the stream's position;
    returns its counters. ``checked``: its files whose digests were verified already (by rank 0,
    choosing it)."""
    check_resumable(read_state(path), cfg, path)
    saved = ckpt.load_checkpoint(path, model, optimizer, rank=rank, checked=checked)
    stream.load_state_dict(saved["data"])
    state = TrainState()
    state.load_state_dict(saved)
    log(f"resume: continuing from {path} (step {state.step}, {state.tokens:,} tokens)")
    if state.lr is not None and state.schedule not in (None, schedule_signature):
        # Another duration or LR than the checkpoint's: no jump, blend in from where it was.
        state.lr_blend = {"lr": state.lr, "step": state.step, "elapsed_s": state.elapsed_s}
        log(f"resume: the LR schedule changed (training_duration, LR or schedule); the LR moves "
            f"linearly from {state.lr:.3g} to the new schedule's over one warmup (≥ 2% of the run)")
    if saved.get("world_size", world_size) != world_size:
        log(f"resume: checkpoint written by {saved['world_size']} rank(s), resharded onto {world_size}")
    return state
