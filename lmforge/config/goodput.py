"""The `goodput:` section of a run config: which conditions are watched and what each one does.

A distributed run (several ranks) times each rank's sections and scores them every log interval
(`train.telemetry`); a node's GPUs are sampled for health (`goodput.health`). Three conditions
can trigger an action:

- a **straggler**: a rank's section time past ``threshold`` × the median of the other ranks' for ``intervals``
  log intervals in a row;
- an **MFU drop**: the step time past 1 / ``fraction`` × the run's own post-warm-up median for
  ``intervals`` log intervals (MFU is tokens/s over a constant: a longer step is a lower MFU);
- a **fatal health event** on a node (an XID from ``fatal_xids``, an uncorrectable ECC error, a
  row remapping failure).

Actions: ``log`` (an event on the run's timeline, nothing else), ``restart`` (checkpoint, stop,
resume on the same nodes), ``diagnose`` (checkpoint, stop, sweep every node — matmul and
all-reduce tests — cordon the nodes that fail, resume on the rest) and ``cordon`` (checkpoint,
stop, cordon the node the condition names, resume on the rest). docs/goodput.md has the details.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from lmforge.config.checked import Strict
from lmforge.config.limits import MAX_NODES, MAX_XID

ACTIONS = ("log", "restart", "diagnose", "cordon")
RESUMING_ACTIONS = ("restart", "diagnose", "cordon")  # they stop the run and start it again
Action = Literal["log", "restart", "diagnose", "cordon"]
# NVIDIA's XIDs that mean the GPU (or its link) cannot be trusted until it is serviced: 48 double-bit
# ECC, 64 row remapping failure, 74 NVLink error, 79 fallen off the bus, 95 uncontained ECC,
# 119/120 GSP errors (NVIDIA's XID catalogue).
FATAL_XIDS = (48, 64, 74, 79, 95, 119, 120)


_Strict = Strict  # unknown keys, booleans as numbers and inf/nan refused (`config.checked`)


class StragglerRule(_Strict):
    threshold: float = Field(
        1.5, gt=1, le=100, description="a rank whose own time per step (its sections without a collective) is past "
        "this many times the other ranks' median is a straggler (2 = half speed)")
    intervals: int = Field(3, ge=1, le=1000, description="log intervals in a row before the condition holds")
    min_ms: float = Field(
        2.0, ge=0, le=60_000, description="and only when it is at least this many milliseconds per step ahead of "
        "the median: a ratio alone would flag the noise of sections of a few microseconds")
    warmup_intervals: int = Field(1, ge=0, le=1000, description="log intervals after each start not scored (the "
                                  "first steps allocate, build DDP's buckets, compile)")
    action: Action = Field("log", description="log | restart | diagnose | cordon (the straggler's node)")


class MfuRule(_Strict):
    fraction: float = Field(
        0.5, gt=0, lt=1, description="the condition holds when MFU falls below this fraction of the run's own "
        "post-warm-up median")
    intervals: int = Field(3, ge=1, le=1000, description="log intervals in a row before the condition holds")
    warmup_intervals: int = Field(3, ge=0, le=1000, description="log intervals after each start not counted "
                                  "(compilation, warm-up)")
    action: Action = Field("log", description="log | restart | diagnose (cordon names no node here)")


class HealthRule(_Strict):
    source: Literal["auto", "nvml", "off"] = Field(
        "auto", description="where GPU health comes from: nvml (nvidia-ml-py, lmforge[gpu]), off; auto: NVML on "
        "CUDA when installed, else none (fault injection drives it on any machine)")
    interval_s: float = Field(10.0, ge=0.1, le=3600, description="seconds between two samples of a node's GPUs")
    fatal_xids: tuple[Annotated[int, Field(strict=True, gt=0, le=MAX_XID)], ...] = Field(
        tuple(FATAL_XIDS), description="XIDs (whole numbers ≥ 1) that make a node's health event fatal")
    action: Action = Field("cordon", description="what a fatal health event does: log | restart | diagnose | "
                           "cordon (the node)")


class DiagnoseRule(_Strict):
    matmul_fraction: float = Field(
        0.8, gt=0, le=1, description="a node fails when its slowest device's matmul TFLOP/s is below this fraction "
        "of its peers' median (or of the device's expected rate, on GPUs)")
    bandwidth_fraction: float = Field(
        0.5, gt=0, le=1, description="a link between neighbouring nodes fails below this fraction of the links' "
        "median all-reduce bus bandwidth (a node fails when all its links do)")
    seconds: float = Field(2.0, gt=0, le=600, description="time each test runs, per node")


class GoodputConfig(_Strict):
    telemetry: bool = Field(True, description="several ranks: time each rank's sections and score them every "
                            "log interval (one small all-gather)")
    straggler: StragglerRule = Field(default_factory=StragglerRule, description="a slow rank")
    mfu_drop: MfuRule = Field(default_factory=MfuRule, description="the run slows down")
    health: HealthRule = Field(default_factory=HealthRule, description="GPU health (XID, ECC, throttling)")
    diagnose: DiagnoseRule = Field(default_factory=DiagnoseRule, description="the diagnostic sweep's pass marks")
    min_nodes: int = Field(1, ge=1, le=MAX_NODES, description="fewest nodes a run resumes on after a cordon")
    max_actions: int = Field(
        10, ge=0, le=1000, description="goodput actions (restart, diagnose, cordon) one run takes; each resumes it, "
        "apart from max_retries (which count crashes and hangs); past it a condition stops the run with its checkpoint")
    too_few_nodes: Literal["stop", "wait"] = Field(
        "stop", description="when fewer than min_nodes would remain: stop (the run ends, with its checkpoint), or "
        "wait (resume with every node asked for: the rendezvous waits for replacements to join)")

    def actions(self) -> dict[str, str]:
        """Each condition's action (the ones telemetry feeds count only with it on)."""
        out = {"health": self.health.action}
        if self.telemetry:
            out |= {"straggler": self.straggler.action, "mfu_drop": self.mfu_drop.action}
        return out

    def check(self, *, nodes: int, autoresume: bool) -> None:
        """Settings that cannot work together (a ValueError naming the key), checked with the run's."""
        if not self.telemetry:
            for key in ("straggler", "mfu_drop"):
                if getattr(self, key).action != "log":
                    raise ValueError(f"goodput.{key}.action: {getattr(self, key).action} needs goodput.telemetry: "
                                     "true (the condition is measured by it)")
        if self.mfu_drop.action == "cordon":
            raise ValueError("goodput.mfu_drop.action: cordon names no node (the whole run slows down); use "
                             "diagnose, which finds the node, or restart / log")
        # Only actions other than their default: the default health action (cordon) degrades to
        # checkpoint-and-stop in a run that cannot resume, rather than refusing every such config. (Not
        # `model_fields_set`: a resolved config is written out whole and read again, every field set.)
        resuming = {k: a for k, a in self.actions().items()
                    if a in RESUMING_ACTIONS and a != type(getattr(self, k)).model_fields["action"].default}
        if resuming and not (autoresume and self.max_actions >= 1):
            key, action = next(iter(resuming.items()))
            raise ValueError(f"goodput.{key}.action: {action} resumes the run from its checkpoint, which needs "
                             f"autoresume: true and goodput.max_actions ≥ 1 (now {str(autoresume).lower()} and "
                             f"{self.max_actions}); set them, or action: log")
        if self.min_nodes > nodes:
            raise ValueError(f"goodput.min_nodes: {self.min_nodes} is more than the run's compute.nodes ({nodes})")
