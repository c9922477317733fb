"""The learning-rate schedule: the LR multiplier (of the peak) over a run, as plain arithmetic.

Resolution builds it (`plan.run.make_schedule`), the trainer evaluates it every step
(`train.optim`), and a checkpoint records its signature to notice a changed schedule on resume.
The schedule is measured in the run's own unit: optimizer steps for step/token/epoch budgets,
seconds of training for wall-clock budgets (so warmup and decay are fractions of the elapsed
time, not of a guessed step count).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

@dataclass(frozen=True)
class Schedule:
    """The LR multiplier (of the peak) over a run.

    ``unit`` is ``"steps"`` (step/token/sample/epoch budgets) or ``"s"`` (wall-clock budgets):
    ``total`` and the decay are in it. The warmup has its own unit (a wall-clock run may still
    warm up over '100ba'). Shapes after the warmup:

    - ``wsd``: warmup–stable–decay; the peak until the last ``decay_fraction`` of the run, then
      linear to ``min_ratio`` (Hu et al. 2024, MiniCPM; Hägele et al. 2024);
    - ``cosine`` / ``linear``: from the end of the warmup to ``min_ratio`` at the end;
    - ``constant``: the peak.
    """

    kind: str
    unit: str  # "steps" | "s"
    total: float
    warmup: float
    warmup_unit: str  # "steps" | "s"
    decay_fraction: float = 0.2
    min_ratio: float = 0.0

    def factor(self, step: int, elapsed_s: float, step_s: float) -> float:
        """Multiplier for the optimizer step that starts after ``step`` steps and ``elapsed_s``
        seconds of training; ``step_s`` is the expected duration of one step (wall-clock warmup
        ramps to where this step will end, so the first step does not get a zero LR)."""
        start = float(step) if self.unit == "steps" else elapsed_s
        warm = 1.0
        if self.warmup > 0:
            end = step + 1 if self.warmup_unit == "steps" else elapsed_s + step_s
            warm = min(1.0, end / self.warmup)
        return warm * self.decay(start)

    def decay(self, position: float) -> float:
        """The post-warmup shape at ``position`` (in ``unit``) of the run."""
        if self.kind == "constant" or self.total <= 0:
            return 1.0
        progress = min(max(position / self.total, 0.0), 1.0)
        lo = self.min_ratio
        if self.kind == "wsd":
            start = 1.0 - self.decay_fraction
            return 1.0 if progress <= start else 1.0 - (1.0 - lo) * (progress - start) / self.decay_fraction
        begin = self.warmup / self.total if self.warmup_unit == self.unit else 0.0
        x = min(max((progress - begin) / max(1e-12, 1.0 - begin), 0.0), 1.0)
        if self.kind == "linear":
            return 1.0 - (1.0 - lo) * x
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * x))

    def position(self, step: int, elapsed_s: float) -> float:
        return float(step) if self.unit == "steps" else elapsed_s

    def signature(self, peak_lr: float) -> dict:
        """What a checkpoint records to notice a changed schedule on resume."""
        return asdict(self) | {"peak_lr": peak_lr}
