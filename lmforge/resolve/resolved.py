"""What `resolve` returns: a run with every decision made, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lmforge.config.schema import RunConfig
from lmforge.plan.run import TrainPlan

if TYPE_CHECKING:  # the data layer imports torch: only the stages past "config" need it
    from lmforge.data.batch import TrainingData
    from lmforge.data.text.tokenizer import Tokenizer

Stage = Literal["config", "plan", "run"]


@dataclass(frozen=True)
class ResolvedRun:
    """A run with every decision made. ``plan``: from stage "plan" on; ``data`` and ``tokenizer``:
    stage "run" (what the trainer takes)."""

    config: RunConfig  # every default written in (stage "config": names and weights' shape only)
    plan: TrainPlan | None = None
    data: TrainingData | None = None
    tokenizer: Tokenizer | None = None
