"""What a run trains with, as `train.build` makes it and the `Trainer` takes it: one rank's parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lmforge.data.batch import EvalSet, StreamLayout, TrainingData
from lmforge.models.transformer import Transformer
from lmforge.train.checkpoint import PendingSave
from lmforge.train.expert_health import ExpertHealth
from lmforge.train.objective import Objective
from lmforge.train.resume import TrainState
from lmforge.train.stop import GracefulStop
from lmforge.train.telemetry import Telemetry
from lmforge.train.watchdog import HangWatchdog


@dataclass
class TrainingParts:
    state: TrainState  # the counters: fresh, or the checkpoint's
    model: Transformer  # the unwrapped model (its parameters are the trained ones: sharded under fsdp/hsdp)
    train_forward: torch.nn.Module  # what a step calls: the model as `parallelize` wrapped it
    objective: Objective
    optimizer: torch.optim.Optimizer
    layout: StreamLayout  # this rank's reading of the data
    data: TrainingData  # as the objective prepared it
    stream: object  # the training `BatchStream`
    eval_sets: list[EvalSet]
    autocast: Callable  # a context manager factory: bf16 autocast, or none
    resume_from: str | None  # the checkpoint loaded, if any
    icl: object  # the ICL tasks and gauntlet (`eval.in_training.load_icl`), or None
    expert_health: ExpertHealth | None  # MoE routing statistics
    saver: PendingSave | None  # the background checkpoint (compute.async_checkpoint)
    stop: GracefulStop
    watchdog: HangWatchdog
    telemetry: Telemetry
    local_folder: str | None = None  # the local checkpoint tier (`local_checkpoints`), if any
