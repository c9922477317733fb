"""Goodput planned before a run: how often it will be interrupted, what one checkpoint costs, the
checkpoint interval that maximises goodput, and the goodput that results.

**Inputs.** The run's devices ``N`` (GPUs, or CPU ranks) and one device's failure rate ``λ``
(``goodput.failures_per_gpu_hour``; by default Llama 3's: 419 unexpected interruptions in 54 days
on 16,384 GPUs, Dubey et al. 2024 §3.3.4) give the run's mean time between failures
``M = 1 / (λ·N)``. A checkpoint holds the model and optimizer states (`checkpoint_bytes`: fp32
weights, AdamW's two moments or Muon's one), written by every rank in parallel shards, so a node
writes ``bytes / nodes`` at its tier's bandwidth (``goodput.write_gb_per_s`` per node for the
durable ``save_folder``, `LOCAL_BYTES_PER_S` for a local tier; the run's own measurement replaces
them). The loop is **blocked** for ``δ`` per checkpoint: the whole write, or with
``compute.async_checkpoint`` only the copy of a device's shard to host memory; an asynchronous
checkpoint becomes **usable** ``L`` later, when its write ends (``L = 0`` when synchronous). A
failure costs ``R`` (``goodput.restart_s``: detection, the restart and start-up to the first
productive step; by default `RESTART_S`), plus the work since the newest usable checkpoint.

**The model.** Training runs in periods of ``τ`` seconds of steps and one checkpoint,
``P = τ + δ``. Failures arrive at random (a Poisson process of rate ``1/M``); each one loses, in
expectation, ``R + L + P/2`` seconds of wall time. So a share ``f = (R + L + P/2) / M`` of the wall
is lost (clipped to 1), and of the rest a share ``δ / P`` goes to checkpoints::

    goodput G(τ) = (1 − f) · τ / P

with its parts — the same ones the run's ledger measures (`goodput.ledger`) — adding up to 1::

    restart R/M,   lost (L + P/2)/M,   checkpoint (1 − f)·δ/P,   productive G.

A local tier (``local_checkpoints``) covers a share ``p`` of the failures (`LOCAL_COVERS`: those that
leave a node's own storage readable) at its own period ``P_l = τ_l + δ_l``; the durable tier the
rest: ``f = (R + p·(L_l + P_l/2) + (1 − p)·(L_d + P_d/2)) / M`` and
``G = (1 − f) · (1 − δ_l/P_l − δ_d/P_d)``.

**The optimum.** For ``δ, τ ≪ M``, ``1 − G ≈ δ/τ + τ/(2M) + (R + L)/M``, smallest at Young's
``τ = √(2δM)``. lmforge takes Daly's higher-order estimate (Daly 2006, "A higher order estimate of
the optimum checkpoint interval for restart dumps"), the optimum of the exact model in which
failures also strike during restarts and checkpoints::

    τ* = √(2δM) · (1 + √(δ/(2M))/3 + δ/(18M)) − δ      (δ < 2M; else τ* = M)

per tier, with ``M / p`` for the local tier and ``M / (1 − p)`` for the durable one. An interval
is at least one step, and an asynchronous tier's at least its write (the next checkpoint waits for
the last one). ``save_interval: auto`` takes ``τ*`` in steps of the plan's step time; the run
re-estimates it from its own checkpoint times and failures (`goodput.interval`). An interval set
by hand that costs at least `WORTH_NAMING` points of goodput against ``τ*`` is named, with its cost.

The run's first start takes ``S`` once (``goodput.start_s``; else ``goodput.restart_s`` when given,
else `START_S`): a share
``S / (run_s/G + S)`` of a run whose steps take ``run_s`` (the other parts shrink by the rest). Evaluation is left out (it is the run's
own choice of how often).
No torch: `lmforge estimate` and the dry run plan with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config.goodput import LLAMA3_FAILURES_PER_GPU_HOUR
from lmforge.frozen import freeze

# One device's interruptions per hour (the default: `config.goodput.LLAMA3_FAILURES_PER_GPU_HOUR`).
FAILURE_RATE_SOURCE = "Llama 3's: 419 unexpected interruptions in 54 days on 16,384 GPUs"
# Seconds from a failure to the next productive step where the run has not measured its own: on one
# machine a process restart, start-up and checkpoint load; on several nodes also the detection of a
# lost peer (a collective's timeout), the job's rescheduling and collective start-up at scale.
RESTART_S = 600.0
RESTART_S_ONE_NODE = 60.0
# A run's first start: imports, data, the model built and loaded, the process group (on several nodes
# at scale: minutes). With `goodput.restart_s` given, the first start is taken to cost as much.
START_S = 300.0
START_S_ONE_NODE = 10.0
# A node's write bandwidth to the durable store (a parallel file system or object store: ~1-3 GB/s
# per node; Llama 3's Tectonic: 2-7 TB/s for ~2,000 nodes) and to a local tier (NVMe: one drive
# writes ~5 GB/s); a CPU machine writes to its own disk.
DURABLE_BYTES_PER_S = 2e9
LOCAL_BYTES_PER_S = 5e9
CPU_DISK_BYTES_PER_S = 1e9
# An asynchronous checkpoint blocks the loop only while a device's shard is copied to host memory.
STAGING_BYTES_PER_S = 10e9
# What each checkpoint costs beside its bytes: DCP's planning and metadata, barriers, the state file
# and its fsync, the rename (measured ~0.05 s for a tiny model on one node); more across GPU nodes.
FIXED_S = 0.05
FIXED_S_NODES = 1.0
# The share of interruptions a local tier covers: those that leave a node's own storage readable (a
# GPU, a network link, software: ~90% of Llama 3's; not a lost host or its SSD).
LOCAL_COVERS = 0.9
WORTH_NAMING = 0.5  # points of goodput an interval set by hand may cost before the plan names it
# Bytes per parameter a checkpoint holds: fp32 weights, and the optimizer's fp32 states per trained
# parameter (AdamW: two moments; Muon: one momentum for its matrices, AdamW's two for the rest, ~one).
WEIGHT_BYTES = 4
OPTIMIZER_BYTES = {"adamw": 8, "muon": 4}


def checkpoint_bytes(params: int, trained: int, optimizer: str) -> float:
    """Bytes of one checkpoint: the weights and the optimizer states of the trained parameters."""
    return float(WEIGHT_BYTES * params + OPTIMIZER_BYTES.get(optimizer, 8) * trained)


def mtbf_s(failures_per_device_hour: float, devices: int) -> float:
    """The run's mean time between failures, in seconds."""
    return 3600.0 / (failures_per_device_hour * max(1, devices))


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum of the seconds of steps between two checkpoints of cost ``delta``."""
    if delta <= 0:
        return 0.0
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def young_interval(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier: its blocking cost, when its checkpoints become usable, and its period."""

    name: str  # "durable" | "local"
    blocking_s: float  # δ: the loop waits this long per checkpoint
    lag_s: float  # L: from the end of the blocking part to the checkpoint being usable
    interval_s: float  # τ: seconds of steps between two of its checkpoints (inf: none but the last)
    covers: float  # the share of failures it is resumed from


def goodput_at(tiers: list[Tier], mtbf: float, restart_s: float, run_s: float = math.inf,
               startup_s: float = 0.0) -> dict:
    """The model's goodput and its parts (shares of the wall time that add up to 1) for ``tiers``; a
    tier's interval is at most the run (``run_s`` of steps: its last checkpoint ends it); the run's
    first start (``startup_s``, once) takes its share of a finite run's wall."""
    lost = cost = 0.0
    for t in tiers:
        period = min(t.interval_s, run_s) + t.blocking_s
        lost += t.covers * (t.lag_s + period / 2)
        cost += t.blocking_s / period if math.isfinite(period) and period > 0 else 0.0
    f = min(1.0, (restart_s + lost) / mtbf) if mtbf > 0 else 1.0
    restart = min(f, restart_s / mtbf) if mtbf > 0 else 1.0
    checkpoint = (1 - f) * min(1.0, cost)
    parts = {"goodput": (1 - f) - checkpoint, "restart": restart, "lost": f - restart, "checkpoint": checkpoint,
             "startup": 0.0}
    if startup_s > 0 and math.isfinite(run_s) and parts["goodput"] > 0:
        wall = run_s / parts["goodput"]  # the steady state's wall for the run's steps, then its first start
        parts = {k: v * wall / (wall + startup_s) for k, v in parts.items()} | {"startup": startup_s / (wall + startup_s)}
    return parts


def exact_goodput(interval_s: float, blocking_s: float, mtbf: float, restart_s: float) -> float:
    """Daly's complete model of one tier (failures strike during restarts and checkpoints too):
    work over expected wall time, ``τ / (M · e^{R/M} · (e^{(τ+δ)/M} − 1))``. The plan uses the
    additive first-order model above, whose parts the ledger measures; this one checks it."""
    return interval_s / (mtbf * math.exp(restart_s / mtbf) * math.expm1((interval_s + blocking_s) / mtbf))


@dataclass(frozen=True)
class TierPlan:
    name: str
    bytes_per_node: float
    bytes_per_s: float  # a node's write bandwidth to this tier
    bandwidth_source: str
    blocking_s: float
    write_s: float  # from the start of a checkpoint to its being usable
    optimal_s: float  # τ* (seconds of steps)
    interval_steps: int  # the interval the run takes (auto: τ* in steps)
    auto: bool
    covers: float
    rule: str = "as set"  # where an interval not auto comes from

    def tier(self, step_s: float, steps: int | None = None) -> Tier:
        steps = self.interval_steps if steps is None else steps
        return Tier(self.name, self.blocking_s, max(0.0, self.write_s - self.blocking_s), steps * step_s, self.covers)


@dataclass(frozen=True)
class GoodputPlan:
    """The projection a run is planned with (`plan_goodput`); a view shows it, the report compares it."""

    devices: int
    failures_per_device_hour: float
    failure_source: str
    mtbf_s: float
    run_s: float  # the steps' planned seconds (without failures)
    total_steps: int | None  # the run's steps (None: a wall-clock run)
    interruptions: float  # expected over the run's wall time
    checkpoint_bytes: float
    restart_s: float
    restart_source: str
    step_s: float
    tiers: tuple[TierPlan, ...]  # the durable tier first, then the local one
    goodput: float  # at the intervals the run takes
    parts: dict  # restart, lost, checkpoint, goodput (shares)
    optimal_goodput: float  # at τ* for every tier
    note: str | None = None  # an interval set by hand that costs WORTH_NAMING points or more

    def __post_init__(self):  # deep-frozen, as the plan it is part of
        object.__setattr__(self, "parts", freeze(self.parts))

    @property
    def durable(self) -> TierPlan:
        return self.tiers[0]

    @property
    def local(self) -> TierPlan | None:
        return self.tiers[1] if len(self.tiers) > 1 else None

    def reason(self, tier: TierPlan | None = None) -> str:
        """Why a tier's interval is what it is, in one line."""
        t = tier or self.durable
        how = "save_interval: auto" if t.name == "durable" else "local_checkpoints.interval: auto"
        if not t.auto:
            return (f"{t.interval_steps} steps ≈ {_span(t.interval_steps * self.step_s)} ({t.rule}; the optimum is "
                    f"{_span(t.optimal_s)})")
        every = f"{t.interval_steps} steps ≈ {_span(t.interval_steps * self.step_s)}"
        if t.optimal_s >= self.run_s > 0:
            every = f"{t.interval_steps} steps, the run's end"
        return (f"{every} ({how}: Daly's optimum for a checkpoint blocking {_span(t.blocking_s)} and a failure every "
                f"{_span(self.mtbf_s / t.covers)} is {_span(t.optimal_s)})")


def interval_steps(seconds: float, step_s: float, total_steps: int | None) -> int:
    """Seconds of steps as a whole number of steps (at least one; past the run's end: its end)."""
    if not math.isfinite(seconds) or step_s <= 0:
        return total_steps or 1_000_000
    steps = max(1, round(seconds / step_s))
    return min(steps, total_steps) if total_steps else steps


def plan_goodput(*, devices: int, nodes: int, device: str, params: int, trained: int, optimizer: str,
                 step_s: float, run_s: float, total_steps: int | None, async_checkpoint: bool,
                 failures_per_device_hour: float | None = None, restart_s: float | None = None,
                 start_s: float | None = None,
                 write_bytes_per_s: float | None = None, save_interval: int | None = None, save_rule: str = "as set",
                 local_interval: int | None | str = "none", local_bytes_per_s: float | None = None) -> GoodputPlan:
    """The goodput projection of a run. ``save_interval`` None: auto (τ* in steps); ``local_interval``
    "none": no local tier, None: auto, else its steps."""
    rate = failures_per_device_hour or LLAMA3_FAILURES_PER_GPU_HOUR
    failure_source = FAILURE_RATE_SOURCE if rate == LLAMA3_FAILURES_PER_GPU_HOUR else "goodput.failures_per_gpu_hour"
    mtbf = mtbf_s(rate, devices)
    size = checkpoint_bytes(params, trained, optimizer)
    if start_s is None:
        start_s = restart_s if restart_s is not None else START_S_ONE_NODE if nodes == 1 else START_S
    if restart_s is None:
        restart_s, restart_source = (RESTART_S_ONE_NODE, "assumed for one node") if nodes == 1 else \
            (RESTART_S, "assumed for several nodes")
    else:
        restart_source = "goodput.restart_s"
    fixed = FIXED_S if nodes == 1 or device == "cpu" else FIXED_S_NODES  # (CPU "nodes": gloo, mostly one host)
    has_local = local_interval != "none"

    def tier(name: str, bandwidth: float, source: str, given: int | None, covers: float) -> TierPlan:
        per_node = size / max(1, nodes)
        write = fixed + per_node / bandwidth
        blocking = fixed + size / max(1, devices) / STAGING_BYTES_PER_S if async_checkpoint else write
        optimal = daly_interval(blocking, mtbf / covers) if covers > 0 else math.inf
        if async_checkpoint:
            optimal = max(optimal, write - blocking)  # the next checkpoint waits for this one's write
        optimal = max(optimal, step_s)
        steps = interval_steps(optimal, step_s, total_steps) if given is None else given
        return TierPlan(name, per_node, bandwidth, source, blocking, write, optimal, steps, given is None, covers,
                        save_rule if name == "durable" else "as set")

    disk = CPU_DISK_BYTES_PER_S if device == "cpu" else DURABLE_BYTES_PER_S
    durable_source = "goodput.write_gb_per_s" if write_bytes_per_s else \
        ("assumed for a local disk" if device == "cpu" else "assumed for a parallel file system or object store")
    local_covers = LOCAL_COVERS if has_local else 0.0
    tiers = [tier("durable", write_bytes_per_s or disk, durable_source, save_interval, 1.0 - local_covers)]
    if has_local:
        tiers.append(tier("local", local_bytes_per_s or LOCAL_BYTES_PER_S,
                          "measured" if local_bytes_per_s else "assumed for a local NVMe drive",
                          None if local_interval is None else int(local_interval), local_covers))
    run = run_s if run_s > 0 else math.inf
    used = goodput_at([t.tier(step_s) for t in tiers], mtbf, restart_s, run, startup_s=start_s)
    best = goodput_at([Tier(t.name, t.blocking_s, max(0.0, t.write_s - t.blocking_s), t.optimal_s, t.covers)
                       for t in tiers], mtbf, restart_s, run, startup_s=start_s)
    wall = run_s / used["goodput"] if used["goodput"] > 0 else math.inf  # (with its first start)
    plan = GoodputPlan(devices=devices, failures_per_device_hour=rate, failure_source=failure_source, mtbf_s=mtbf,
                       run_s=run_s, total_steps=total_steps, interruptions=wall / mtbf, checkpoint_bytes=size,
                       restart_s=restart_s,
                       restart_source=restart_source, step_s=step_s, tiers=tuple(tiers), goodput=used["goodput"],
                       parts=used, optimal_goodput=best["goodput"])
    return _with_note(plan)


def _with_note(plan: GoodputPlan) -> GoodputPlan:
    """Name an interval set by hand that costs WORTH_NAMING points of goodput or more."""
    cost = 100 * (plan.optimal_goodput - plan.goodput)
    hand = [t for t in plan.tiers if not t.auto]
    if not hand or cost < WORTH_NAMING:
        return plan
    t = hand[0]
    key = "save_interval" if t.name == "durable" else "local_checkpoints.interval"
    used = t.interval_steps * plan.step_s
    ratio = used / t.optimal_s if t.optimal_s > 0 else math.inf
    how = f"{ratio:.1f}× the" if ratio >= 1 else f"1/{1 / ratio:.1f} of the"
    note = (f"{key}: {t.interval_steps} steps ({_span(used)}) is {how} interval that maximises goodput "
            f"({_span(t.optimal_s)}): it costs {cost:.1f} points ({100 * plan.goodput:.1f}% instead of "
            f"{100 * plan.optimal_goodput:.1f}%); {key}: auto takes the optimum")
    return GoodputPlan(**{**plan.__dict__, "note": note})


def _span(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    if seconds >= 2 * 365 * 86400:
        return f"{seconds / (365 * 86400):.0f} years"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    return f"{1000 * seconds:.0f} ms"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


span = _span  # the one way a goodput duration is written (views, the run's lines)


def goodput_view(plan: GoodputPlan) -> dict:
    """The projection as a JSON-ready dict: what `lmforge estimate`, the dry run and the report show."""
    tiers = [{"tier": t.name, "interval_steps": t.interval_steps, "interval_s": t.interval_steps * plan.step_s,
              "optimal_s": t.optimal_s if math.isfinite(t.optimal_s) else None, "auto": t.auto,
              "blocking_s": t.blocking_s, "write_s": t.write_s,
              "bytes_per_node": t.bytes_per_node, "bytes_per_s": t.bytes_per_s, "bandwidth_source": t.bandwidth_source,
              "covers": t.covers, "reason": plan.reason(t)} for t in plan.tiers]
    return {"devices": plan.devices, "failures_per_device_hour": plan.failures_per_device_hour,
            "failure_source": plan.failure_source, "mtbf_s": plan.mtbf_s,
            "interruptions": plan.interruptions if math.isfinite(plan.interruptions) else None,  # (None: unbounded)
            "checkpoint_bytes": plan.checkpoint_bytes, "restart_s": plan.restart_s,
            "restart_source": plan.restart_source, "step_s": plan.step_s, "tiers": tiers,
            "goodput": plan.goodput, "parts": dict(plan.parts), "optimal_goodput": plan.optimal_goodput, "note": plan.note}


def format_goodput_rows(view: dict) -> list[tuple[str, str]]:
    """The projection as rows of the plan's table (`plan.estimate.format_plan`)."""
    p = view["parts"]
    n = view["interruptions"]
    expected = (f"{n:,.0f}" if n is not None and n >= 10 else f"{n:.2g}") + " expected" if n is not None else \
        "more than the run survives (restarts alone outlast the time between failures)"
    rows = [("failures", f"{expected}: one every {span(view['mtbf_s'])} on "
                              f"{view['devices']} device(s) at {view['failures_per_device_hour']:.3g} per device-hour "
                              f"({view['failure_source']})"),
            ("restart", f"{span(view['restart_s'])} from a failure to the next productive step "
                        f"({view['restart_source']})")]
    for t in view["tiers"]:
        where = "save_folder" if t["tier"] == "durable" else "local tier"
        usable = f", usable after {span(t['write_s'])}" if t["write_s"] > t["blocking_s"] else ""
        label = "checkpoint" if t["tier"] == "durable" else "local tier"
        rows.append((label, f"{_gb(view['checkpoint_bytes'])}, {_gb(t['bytes_per_node'])} "
                     f"per node to the {where} at {t['bytes_per_s'] / 1e9:.3g} GB/s ({t['bandwidth_source']}): "
                     f"blocks {span(t['blocking_s'])}{usable}; every {t['reason']}"))
    rows.append(("goodput", f"{100 * view['goodput']:.1f}% planned (restarts {100 * p['restart']:.1f}%, lost work "
                            f"{100 * p['lost']:.1f}%, checkpoints {100 * p['checkpoint']:.1f}%, the first start "
                            f"{100 * p.get('startup', 0.0):.1f}%); {100 * view['optimal_goodput']:.1f}% at the optimal "
                            "interval"))
    return rows
