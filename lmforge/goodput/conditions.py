"""Straggler scores and the conditions that trigger an action, from one log interval's numbers.

Every rank contributes one row per log interval (`ROW`: its seconds in each section, its step
time, and its node's latest health sample); the rows are all-gathered, so every rank runs
`Conditions.update` on the same numbers and reaches the same decision without another exchange.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lmforge.config.goodput import GoodputConfig
from lmforge.goodput.health import throttle_text
from lmforge.plan.layout import Layout

SECTIONS = ("data", "forward", "backward", "optimizer")
# One rank's row of an interval: section seconds (summed over the interval), the interval's wall
# seconds, the steps in it, and its node's health (XID code of a fatal event or 0, uncorrectable ECC
# errors, a failed row remapping (0/1), throttle-reason bits, temperature °C, power W, SM clock MHz).
HEALTH = ("xid", "ecc_uncorrected", "remap_failed", "throttle", "temperature_c", "power_w", "sm_clock_mhz")
ROW = (*SECTIONS, "wall", "steps", *HEALTH)


def scored_sections(layout: Layout, optimizer: str = "adamw") -> tuple[str, ...]:
    """The sections that hold no collective, whose time is the rank's own: a section that waits in one
    shows the *fast* ranks waiting for the slow one. Always the data wait; the forward under DDP (or no
    data parallelism) alone — FSDP/HSDP gather parameters there, context parallelism exchanges keys and
    values, expert parallelism sends tokens; the backward never (gradients are synchronized in it); the
    optimizer step (the trainer keeps the gradient clipping's all-reduce and the loss's out of it) except
    Muon's under FSDP/HSDP, which sends whole matrices between the ranks of a shard group (all-to-all)."""
    out = ["data"]
    if not layout.sharded and layout.context_parallel == 1 and layout.expert_parallel == 1:
        out.append("forward")
    if not (layout.sharded and optimizer == "muon"):
        out.append("optimizer")
    return tuple(out)


def peer_medians(times: list[float]) -> list[float]:
    """For each rank, the median of the other ranks' times: with two ranks the plain median is their
    mean, which would score a rank at half speed 1.33 instead of 2."""
    if len(times) < 2:
        return list(times)
    return [statistics.median(times[:i] + times[i + 1:]) for i in range(len(times))]


def scores(times: list[float]) -> list[float]:
    """Each rank's time over its peers' median (1.0 = typical, 2.0 = half speed)."""
    return [t / med if med > 0 else 1.0 for t, med in zip(times, peer_medians(times))]


CONDITIONS = ("straggler", "mfu_drop", "health")  # what a Flag is for; each its own event in events.jsonl


@dataclass(frozen=True)
class Flag:
    """One rank (or the whole run) past a threshold in one interval."""

    condition: str  # one of CONDITIONS
    rank: int | None
    node: str | None
    score: float
    section: str | None = None
    detail: str = ""

    def text(self) -> str:
        where = f"rank {self.rank} on {self.node}" if self.rank is not None else "the run"
        what = f" {self.section}" if self.section else ""
        return f"{self.condition}: {where}{what} score {self.score:.2f}" + (f" ({self.detail})" if self.detail else "")

    def event(self) -> dict:
        return {"event": self.condition, "rank": self.rank, "node": self.node, "score": round(self.score, 3),
                "section": self.section, "detail": self.detail}


@dataclass(frozen=True)
class Decision:
    """What the run does now: ``action`` for ``condition``; ``nodes``: the nodes it names (cordon)."""

    action: str  # restart | diagnose | cordon (log needs no decision)
    condition: str
    reason: str
    nodes: tuple[str, ...] = ()


@dataclass
class Conditions:
    """The conditions of `config.goodput`, fed one interval at a time (the same on every rank).

    `update` returns the flags that begin to hold in this interval (a straggler for ``intervals`` in a
    row, an MFU drop for ``intervals`` in a row, a node's first fatal health event: each an event on
    the run's timeline, once per streak), the decision to act, and the interval's scores as metrics."""

    cfg: GoodputConfig
    nodes: list[str]  # the node of each rank
    scored: tuple[str, ...] = ("data", "forward", "optimizer")  # `scored_sections`
    _straggler_run: dict[int, int] = field(default_factory=dict)  # rank → intervals in a row flagged
    _step_times: list[float] = field(default_factory=list)  # post-warm-up step times (the MFU baseline)
    _intervals: int = 0
    _mfu_run: int = 0
    _sick: set = field(default_factory=set)  # nodes whose fatal health event is known
    _throttled: set = field(default_factory=set)  # nodes throttling now (an event when it begins)

    def update(self, rows: list[list[float]]) -> tuple[list[Flag], Decision | None, dict[str, float]]:
        self._intervals += 1
        health = self._health(rows)
        alerts = self._throttling(rows)
        stragglers, mfu, metrics = [], [], {}
        if self.cfg.telemetry:
            stragglers, metrics = self._stragglers(rows)
            mfu = self._mfu(rows)
        held = [f for f in stragglers if self._straggler_run[f.rank] == self.cfg.straggler.intervals]
        held += [f for f in mfu if self._mfu_run == self.cfg.mfu_drop.intervals]
        return health + alerts + held, self._decide(health, stragglers), metrics

    def _throttling(self, rows: list[list[float]]) -> list[Flag]:
        """An event when a node's GPUs begin to throttle for power or heat (no action)."""
        bits = {}
        for rank, r in enumerate(rows):
            bits[self.nodes[rank]] = bits.get(self.nodes[rank], 0) | int(r[ROW.index("throttle")])
        out = [Flag("throttle", self.nodes.index(n), n, 0.0, None, throttle_text(b))
               for n, b in bits.items() if b and n not in self._throttled]
        self._throttled = {n for n, b in bits.items() if b}
        return out

    def _stragglers(self, rows: list[list[float]]) -> tuple[list[Flag], dict[str, float]]:
        """A rank's own seconds per step — the sum of its scored sections — against its peers' median. A
        slow device stretches every one of them alike; summed, one noisy section weighs less than it
        would scored alone. A rank is flagged past ``threshold`` and ``min_ms`` ahead of the median (a
        ratio alone would flag microsecond sections' noise), after the attempt's first intervals."""
        rule = self.cfg.straggler
        steps = max(1.0, rows[0][ROW.index("steps")])
        idx = [SECTIONS.index(s) for s in self.scored]
        local = [sum(r[i] for i in idx) / steps for r in rows]
        medians, rank_scores = peer_medians(local), scores(local)
        metrics = {f"straggler/score_rank{r}": round(s, 4) for r, s in enumerate(rank_scores)}
        metrics["straggler/max_score"] = round(max(rank_scores), 4)
        flagged = []
        if self._intervals > rule.warmup_intervals:
            for rank, (t, med, score) in enumerate(zip(local, medians, rank_scores)):
                if score > rule.threshold and t - med >= rule.min_ms / 1000:
                    flagged.append(Flag("straggler", rank, self.nodes[rank], score, self._worst_section(rows, rank),
                                        f"{'+'.join(self.scored)} {1000 * t:.1f} ms vs median {1000 * med:.1f} ms "
                                        "per step"))
        self._straggler_run = {f.rank: self._straggler_run.get(f.rank, 0) + 1 for f in flagged}
        return flagged, metrics

    def _worst_section(self, rows: list[list[float]], rank: int) -> str:
        """The scored section in which ``rank`` is furthest ahead of its peers' median (the event names it)."""
        def excess(name: str) -> float:
            times = [r[SECTIONS.index(name)] for r in rows]
            return times[rank] - peer_medians(times)[rank]

        return max(self.scored, key=excess)

    def _mfu(self, rows: list[list[float]]) -> list[Flag]:
        """Step time against the run's own post-warm-up median: MFU is tokens/s over a constant, so
        MFU below ``fraction`` × its median is a step longer than its median / ``fraction``."""
        rule = self.cfg.mfu_drop
        step = max(r[ROW.index("wall")] for r in rows) / max(1.0, rows[0][ROW.index("steps")])
        if self._intervals <= rule.warmup_intervals:
            return []
        base = statistics.median(self._step_times) if self._step_times else step
        ratio = base / step if step > 0 else 1.0  # this interval's MFU over the median's
        if ratio < rule.fraction:
            self._mfu_run += 1
            return [Flag("mfu_drop", None, None, ratio, None, f"step {1000 * step:.1f} ms vs median "
                         f"{1000 * base:.1f} ms: MFU at {ratio:.0%} of the run's median")]
        self._mfu_run = 0
        self._step_times.append(step)  # only healthy intervals make the baseline
        return []

    def _health(self, rows: list[list[float]]) -> list[Flag]:
        out, seen = [], set()
        for rank, r in enumerate(rows):
            node = self.nodes[rank]
            h = dict(zip(HEALTH, r[len(SECTIONS) + 2:]))
            why = []
            if h["xid"]:
                why.append(f"XID {int(h['xid'])}")
            if h["ecc_uncorrected"]:
                why.append(f"{int(h['ecc_uncorrected'])} uncorrectable ECC error(s)")
            if h["remap_failed"]:
                why.append("row remapping failed")
            if why and node not in seen and node not in self._sick:
                seen.add(node)
                out.append(Flag("health", rank, node, 1.0, None, ", ".join(why)))
        self._sick |= seen
        return out

    def _decide(self, health: list[Flag], stragglers: list[Flag]) -> Decision | None:
        """The first condition that holds and acts (health before stragglers before MFU)."""
        for f in health:
            if self.cfg.health.action != "log":
                return Decision(self.cfg.health.action, "health", f"fatal health event on {f.node}: {f.detail}",
                                (f.node,))
        rule = self.cfg.straggler
        for f in stragglers:
            if f.condition == "straggler" and self._straggler_run.get(f.rank, 0) >= rule.intervals \
                    and rule.action != "log":
                return Decision(rule.action, "straggler", f"rank {f.rank} on {f.node} a straggler for {rule.intervals} "
                                f"interval(s): {f.section} {f.score:.2f}× the median", (f.node,))
        if self._mfu_run >= self.cfg.mfu_drop.intervals and self.cfg.mfu_drop.action != "log":
            return Decision(self.cfg.mfu_drop.action, "mfu_drop", f"MFU below {self.cfg.mfu_drop.fraction:.0%} of "
                            f"the run's median for {self.cfg.mfu_drop.intervals} interval(s)")
        return None
