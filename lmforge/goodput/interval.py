"""When a run checkpoints, and to which tier: the plan's intervals, and with ``auto`` re-estimated at
run time from what the run measures (`plan.goodput` has the model).

The plan chose each tier's interval from a checkpoint's modelled cost ``δ``, the failure rate it
assumed and its expected step time. The run knows better once it has written a few checkpoints:
every rank times each checkpoint's blocking part, the slowest rank's time counts (they all wait for
it), and after `MIN_SAMPLES` of a tier the interval becomes Daly's optimum for the median measured
``δ`` at the measured step time. The failure rate is re-estimated from the failures the run has seen
(its ledger: resumptions that were not a user's stop) over its wall time so far, with the planned
rate as a prior worth one failure: ``1/M = (n + 1) / (T + M_plan)`` — the plan's rate until the run
has seen failures, then what they say. A change of more than `CHANGE` is said in one line and
recorded in the ledger (``interval``, with why); `runs describe` and the report show the last one.

Every rank decides alike: the measured times are all-reduced (the maximum) and the history is rank
0's, broadcast at the start (`train.telemetry` does both); this module only computes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from lmforge.plan.goodput import GoodputPlan, daly_interval, span

MIN_SAMPLES = 3  # checkpoints of a tier measured before its interval is re-estimated
CHANGE = 0.2  # a new interval within this share of the current one is no change


@dataclass
class History:
    """What the run has seen before this attempt (rank 0 reads it from its ledger)."""

    failures: int = 0  # resumptions that were not a user's stop
    wall_s: float = 0.0  # from the run's first process start to this attempt's start
    restart_s: float | None = None  # their mean seconds from the last step to the next first step

    @classmethod
    def of(cls, acc: dict | None) -> "History":
        """From the ledger's accounting (`goodput.ledger.account`)."""
        if not acc:
            return cls()
        failed = [r for r in acc["resumptions"] if not str(r.get("cause", "")).startswith("ended ")]
        restarts = [r.get("recovery_s", 0.0) + r.get("startup_s", 0.0) for r in failed]
        return cls(len(failed), float(acc["wall_s"]), sum(restarts) / len(restarts) if restarts else None)


@dataclass
class TierSchedule:
    name: str  # "durable" | "local"
    every: int  # steps between two checkpoints
    auto: bool
    covers: float  # the share of failures it is resumed from
    samples: list[float] = field(default_factory=list)  # measured blocking seconds


class CheckpointSchedule:
    """Which tier a step checkpoints to (`due`), and the intervals re-estimated from measurements."""

    def __init__(self, goodput: GoodputPlan | None, durable_every: int, local_every: int | None = None,
                 history: History | None = None):
        self.plan = goodput
        self.history = history or History()
        self._step_s: float | None = None  # the measured step time the intervals were last counted in
        self.tiers = [TierSchedule("durable", durable_every, bool(goodput and goodput.durable.auto),
                                   goodput.durable.covers if goodput else 1.0)]
        if local_every is not None:
            local = goodput.local if goodput else None
            self.tiers.append(TierSchedule("local", local_every, bool(local and local.auto),
                                           local.covers if local else 0.0))

    def due(self, step: int) -> str | None:
        """The tier a checkpoint at ``step`` goes to (the durable one when both are due), or None."""
        return next((t.name for t in self.tiers if step % t.every == 0), None)

    def every(self, tier: str = "durable") -> int:
        return self._tier(tier).every

    def mtbf_s(self) -> float:
        """The run's mean time between failures: the plan's, moved by the failures the run has seen."""
        planned = self.plan.mtbf_s if self.plan else math.inf
        if not math.isfinite(planned):
            return planned
        return (self.history.wall_s + planned) / (self.history.failures + 1)

    def start(self, step_s: float) -> list[str]:
        """At an attempt's start: the intervals for the failures seen so far (``step_s``: the plan's step
        time, nothing measured yet). Returns the lines saying what changed."""
        if not self.history.failures:
            return []
        return [line for t in self.tiers if t.auto and self.plan is not None
                for line in [self._retime(t, self._planned(t).blocking_s, step_s, "the start")] if line]

    def stepped(self, step_s: float, step: int) -> list[str]:
        """At a log step, with the measured ``step_s`` (the slowest rank's): the plan counted its intervals
        in steps of its own expected step time, which a run may beat or miss many times over; an auto
        tier is retimed in steps of the measured one (the first time, and when it moves by more than
        CHANGE). Returns the lines saying what changed."""
        if self.plan is None or step_s <= 0:
            return []
        if self._step_s is not None and abs(step_s - self._step_s) <= CHANGE * self._step_s:
            return []
        self._step_s = step_s
        lines = []
        for t in self.tiers:
            if t.auto:
                cost = statistics.median(t.samples) if len(t.samples) >= MIN_SAMPLES else self._planned(t).blocking_s
                line = self._retime(t, cost, step_s, f"step {step}")
                lines += [line] if line else []
        return lines

    def measured(self, tier: str, blocking_s: float, step_s: float, step: int) -> str | None:
        """After a checkpoint of ``tier`` that blocked every rank for ``blocking_s`` (the slowest), at a
        measured ``step_s`` per step: the line saying the interval changed, or None."""
        t = self._tier(tier)
        t.samples.append(blocking_s)
        if not t.auto or self.plan is None or len(t.samples) < MIN_SAMPLES or step_s <= 0:
            return None
        return self._retime(t, statistics.median(t.samples), step_s, f"step {step}")

    def why(self, tier: str = "durable") -> str:
        """Why ``tier``'s interval is what it is, in words."""
        t = self._tier(tier)
        if not t.auto:
            return "as set" if self.plan is None else self.plan.reason(self._planned(t))
        if len(t.samples) >= MIN_SAMPLES:
            cost = f"a checkpoint blocking {span(statistics.median(t.samples))} (the median of {len(t.samples)} measured)"
        else:
            cost = f"a checkpoint blocking {span(self._planned(t).blocking_s)} (planned)"
        seen = f"{self.history.failures} seen in {span(self.history.wall_s)}" if self.history.failures else \
            "planned: none seen yet"
        return f"Daly's optimum for {cost} and a failure every {span(self.mtbf_s() / t.covers)} ({seen})"

    def _retime(self, t: TierSchedule, blocking_s: float, step_s: float, when: str) -> str | None:
        tau = daly_interval(blocking_s, self.mtbf_s() / t.covers) if t.covers > 0 else math.inf
        if self.plan is not None and self.plan.step_s > 0:  # an asynchronous write: the next waits for it
            planned = self._planned(t)
            tau = max(tau, planned.write_s - planned.blocking_s)
        steps = max(1, round(tau / step_s)) if math.isfinite(tau) else 1_000_000_000
        if self.plan is not None and self.plan.total_steps:
            steps = min(steps, self.plan.total_steps)  # (past the end: the last checkpoint is the run's own)
        self._step_s = step_s
        if abs(steps - t.every) <= CHANGE * t.every:
            return None
        was, t.every = t.every, steps
        where = "save_interval" if t.name == "durable" else "local_checkpoints.interval"
        return f"{where} (auto): every {steps} steps from {when} (was {was}): {self.why(t.name)}"

    def _planned(self, t: TierSchedule):
        return self.plan.durable if t.name == "durable" else self.plan.local

    def _tier(self, name: str) -> TierSchedule:
        return next(t for t in self.tiers if t.name == name)
