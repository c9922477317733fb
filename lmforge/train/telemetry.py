"""Per-rank telemetry, node health, conditions and their actions: the trainer's goodput hooks.

The loop calls, on every rank, in this order:

- `start` when it begins (the node of each rank is all-gathered once; the ledger's ``start``);
- `section(name)` around a step's data wait, forward, backward and optimizer: timed in the device's
  time — CUDA events on GPUs (recorded without a host sync, read at the log step, where the loop
  waits for the device anyway), the process's CPU time on CPUs. Fault injection's ``slow`` stretches
  a rank's forward, backward and optimizer here, inside their timing, as a slow device would;
- `after_step` after each step: injected faults due now;
- `interval` at each log step: one all-gather of every rank's row (`goodput.conditions.ROW`:
  section seconds and its node's health), the conditions of `config.goodput` on it — the same
  numbers on every rank, so the same decision — flagged ranks as events (rank 0 writes
  ``events.jsonl``), scores and health as metrics, and the `Decision` to act, if any;
- `blocked(kind)` around checkpoint writes and evaluation (for the goodput ledger);
- `checkpoint_due(step)` and, after each checkpoint, `checkpointed(tier)`: the checkpoint schedule
  (`goodput.interval`: with ``save_interval: auto`` re-estimated from the slowest rank's measured
  blocking time, the step time and the failures the run has seen — the same numbers on every rank);
- `act(decision)` after the checkpoint a decision asks for: the diagnostic sweep
  (`distributed.diagnose`), the cordon list, the events; returns what the job reports to the
  supervisor, which resumes on the nodes left.

A rank's score is its own time — the sum of its sections without a collective
(`goodput.conditions.scored_sections`: data + forward + optimizer under DDP, data + optimizer under
FSDP/HSDP, …) — against its peers' median; the rest of the step waits for the slowest rank.
`act` reports where the run resumes (`goodput.cordon.resume_layout`): node 0's supervisor restarts on
it, the other nodes left rejoin by themselves (`distributed.torchrun.rejoin`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from lmforge.config.goodput import GoodputConfig
from lmforge.distributed.elastic import append_event
from lmforge.goodput import ledger
from lmforge.goodput.conditions import ROW, SECTIONS, Conditions, Decision
from lmforge.goodput.cordon import add_to_cordon, resume_layout
from lmforge.goodput.diagnosis import verdict
from lmforge.goodput.faults import FAULT_ENV, Injector, parse_faults
from lmforge.goodput.interval import CheckpointSchedule, History
from lmforge.goodput.health import HealthSampler, InjectedHealth, open_source
from lmforge.process import attempt_started_at, marks, node_name

STRETCHED = ("forward", "backward", "optimizer")  # the device's compute: what a slow device (fault) stretches
RETIME_AFTER_STEPS = 10  # steps measured before an auto checkpoint interval is counted in them


class _Timer:
    """Seconds per section over the current log interval: the device's time — CUDA events on GPUs, the
    process's CPU time on CPUs. (Not wall time on CPUs: a rank the OS has descheduled is not a slow
    device, and on an oversubscribed machine — ranks sharing cores — identical ranks' wall times per
    section differ by 2–3× from one step to the next.)"""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(SECTIONS, 0.0)
        self.pending: list[tuple[str, object, object]] = []  # CUDA: (section, start event, end event)

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.process_time()

    def add(self, name: str, start, end) -> None:
        if self.cuda:
            self.pending.append((name, start, end))  # read at `read`
        else:
            self.totals[name] += end - start

    def read(self) -> dict[str, float]:
        """This interval's totals (CUDA: waits for its last event only), and starts the next interval."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for name, a, b in self.pending:
                self.totals[name] += a.elapsed_time(b) / 1000.0
        out, self.totals, self.pending = self.totals, dict.fromkeys(SECTIONS, 0.0), []
        return out


class Telemetry:
    def __init__(self, cfg: GoodputConfig, dist, *, folder: str, log, scored: tuple[str, ...] = SECTIONS,
                 node_rank: int = 0, environ=None, schedule: CheckpointSchedule | None = None):
        import os

        environ = os.environ if environ is None else environ
        self.cfg, self.dist, self.folder, self.log, self.scored = cfg, dist, folder, log, scored
        self.node = node_name()
        self.timer = _Timer(dist.device)
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        injected = InjectedHealth() if local_rank == 0 else None
        self.faults = Injector(parse_faults(environ.get(FAULT_ENV)), rank=dist.rank, local_rank=local_rank,
                               node=self.node, folder=folder, health=injected)
        sources = []
        if local_rank == 0:  # one sampler per node
            real = open_source(cfg.health.source, dist.device.type, cfg.health.fatal_xids, log)
            sources = [s for s in (real, injected) if s is not None]
        self.health = HealthSampler(sources, cfg.health.interval_s) if sources else None
        self.ledger = ledger.Ledger(folder if dist.is_main else None, attempt_started_at() or time.time())
        self.node_rank = node_rank  # compute.node_rank of this process
        self.nodes: list[str] = [self.node]  # the node of each rank
        self.node_ranks: dict[str, int] = {self.node: node_rank}  # each node → its node rank
        self.conditions: Conditions | None = None
        self._interval_t0 = 0.0
        self._steps = 0
        self._steps_total = 0  # steps of this attempt
        self._intervals = 0  # log intervals of this attempt
        self._measured = [0.0, 0]  # the slowest rank's seconds and the steps since the first log interval
        self._blocked = {"checkpoint": 0.0, "evaluation": 0.0}
        self._last_blocked = 0.0  # seconds of the last `blocked` section
        self.schedule = schedule or CheckpointSchedule(None, 1 << 62)
        self._blocked_mark = 0.0  # blocked seconds at the start of this interval
        self._loop_t0 = 0.0
        self.step = 0

    # ------------------------------------------------------------------ the loop's hooks

    def start(self, step: int) -> None:
        mine = (self.node, self.node_rank)
        pairs = [mine] * self.dist.world_size
        if self.dist.distributed:
            torch.distributed.all_gather_object(pairs, mine)
        self.nodes = [n for n, _ in pairs]
        self.node_ranks = dict(pairs)
        nodes = self.nodes
        self.conditions = Conditions(self.cfg, nodes, self.scored)
        self._loop_t0 = self._interval_t0 = time.perf_counter()
        self.step = step
        # how far into its start-up each stage was reached (`process.mark`: imports, process group, resolution)
        phases = {k: round(t - self.ledger.process_start, 3) for k, t in marks().items()}
        self.ledger.write("start", process_start=round(self.ledger.process_start, 3), step=step,
                          world_size=self.dist.world_size, nodes=sorted(set(nodes)), phases=phases)
        self._start_schedule()

    @contextmanager
    def section(self, name: str):
        if not (self.cfg.telemetry or self.faults.active):  # off: nothing timed (the health exchange stays)
            yield
            return
        slow = self.faults.slow_factor(self.step + 1) if self.faults.active and name in STRETCHED else 1.0
        start = self.timer.mark()
        yield
        if slow > 1:
            self._stretch(start, slow)
        self.timer.add(name, start, self.timer.mark())

    def _stretch(self, start, factor: float) -> None:
        """Fault injection's slow device: the section just run takes ``factor`` × its own time, inside
        its timing — as a throttled device's compute would, wherever its collectives are. On CUDA the
        host sleeps (the GPU idles between the section's events; reading its time is a sync: the fault's
        cost, not telemetry's); on CPUs it spins, since a slow CPU's extra time is CPU time."""
        if self.timer.cuda:
            end = self.timer.mark()
            end.synchronize()
            time.sleep((factor - 1) * start.elapsed_time(end) / 1000.0)
            return
        until = time.process_time() + (factor - 1) * (time.process_time() - start)
        while time.process_time() < until:
            pass

    def after_step(self, step: int, model: torch.nn.Module) -> None:
        self.step = step
        self._steps += 1
        self._steps_total += 1
        self.ledger.progress(**self._times())  # a kill leaves this as the attempt's last record
        if self.faults.active and self.faults.after_step(step):
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(math.nan)

    @contextmanager
    def blocked(self, kind: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._last_blocked = time.perf_counter() - t0
            self._blocked[kind] += self._last_blocked

    # ------------------------------------------------------------------ the checkpoint schedule

    def checkpoint_due(self, step: int) -> str | None:
        """The tier a checkpoint after ``step`` goes to ("durable" | "local"), or None."""
        return self.schedule.due(step)

    def checkpointed(self, tier: str) -> None:
        """After a checkpoint (its `blocked` section just ended), on every rank: the slowest rank's
        blocking time and step time re-estimate an ``auto`` interval. Collective."""
        if self._measured[1] >= RETIME_AFTER_STEPS:  # the step time `_retime` uses (the first log interval, with
            step_s = self._measured[0] / self._measured[1]  # its compilation, left out): one figure, not two
        else:
            step_s = self._times()["steps_s"] / max(1, self._steps_total)
        blocking, step_s = self._max([self._last_blocked, step_s])
        line = self.schedule.measured(tier, blocking, step_s, self.step)
        self.ledger.write("checkpoint", tier=tier, step=self.step, blocking_s=round(blocking, 4))
        if line:
            self.log(line)
            self._interval_records(tier)

    def _start_schedule(self) -> None:
        """The failures the run has seen before this attempt (rank 0's ledger, broadcast) set the
        schedule's failure rate; each tier's interval is recorded with why."""
        history = History.of(ledger.account(ledger.read_ledger(self.folder))) if self.dist.is_main else None
        if self.dist.distributed:
            box = [history]
            torch.distributed.broadcast_object_list(box, src=0)
            history = box[0]
        self.schedule.history = history
        plan = self.schedule.plan
        for line in self.schedule.start(plan.step_s if plan else 0.0):
            self.log(line)
        self._interval_records()

    def _interval_records(self, tier: str | None = None) -> None:
        for t in self.schedule.tiers:
            if tier in (None, t.name):
                self.ledger.write("interval", tier=t.name, steps=t.every, step=self.step, why=self.schedule.why(t.name))

    def _max(self, values: list[float]) -> list[float]:
        """The maximum of each value over the ranks (one small all-reduce)."""
        if not self.dist.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.dist.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()

    def blocked_s(self) -> float:
        """Seconds the loop was blocked (checkpoints, evaluation) so far in this attempt: what the
        trainer's throughput leaves out, as the ledger's split does."""
        return sum(self._blocked.values())

    def tick(self, kind: str = "tick", **fields) -> None:
        """A ledger record with this attempt's time so far (rank 0)."""
        self.ledger.write(kind, **self._times(), **fields)

    def _times(self) -> dict:
        loop = time.perf_counter() - self._loop_t0
        return {"step": self.step, "steps_s": round(loop - sum(self._blocked.values()), 3),
                "checkpoint_s": round(self._blocked["checkpoint"], 3),
                "evaluation_s": round(self._blocked["evaluation"], 3)}

    def interval(self) -> tuple[dict[str, float], Decision | None]:
        """At a log step, on every rank: (metrics, a decision to act or None)."""
        now = time.perf_counter()
        sections = self.timer.read()
        # An injected fault reports at a step: sampled now, not at the sampler's next tick.
        health = None if self.health is None else self.health.poll() if self.faults.active else self.health.latest()
        blocked = sum(self._blocked.values())
        row = [sections[s] for s in SECTIONS] + [now - self._interval_t0 - (blocked - self._blocked_mark), self._steps]
        row += health.row() if health is not None else [0.0] * (len(ROW) - len(row))
        rows = self._gather(row)
        self._interval_t0, self._steps, self._blocked_mark = now, 0, blocked
        flags, decision, metrics = self.conditions.update(rows)
        for f in flags:
            self.log(f"goodput: {f.text()}")
            if self.dist.is_main:
                append_event(self.folder, f.event() | {"step": self.step})
        self.tick()
        self._retime(rows)
        return metrics | self._health_metrics(rows), decision

    def _retime(self, rows: list[list[float]]) -> None:
        """The checkpoint schedule counted in the step time measured so far: the slowest rank's seconds
        over this attempt's steps since its first log interval (which holds the start's slow steps) —
        the same numbers on every rank, and steady enough not to move the interval at every step."""
        self._intervals += 1
        if self._intervals == 1:
            return
        self._measured[0] += max(r[ROW.index("wall")] for r in rows)
        self._measured[1] += rows[0][ROW.index("steps")]
        if self._measured[1] < RETIME_AFTER_STEPS:
            return
        lines = self.schedule.stepped(self._measured[0] / self._measured[1], self.step)
        for line in lines:
            self.log(line)
        if lines:
            self._interval_records()

    # ------------------------------------------------------------------ acting on a decision

    def act(self, decision: Decision, *, expected_tflops: float | None = None) -> dict:
        """After the decision's checkpoint, on every rank: diagnose (when asked), cordon, record.
        Returns the report for the supervisor: {"action", "cause", "cordon": [nodes]}."""
        self.log(f"goodput: {decision.reason}; action: {decision.action}")
        self.ledger.write("detected", step=self.step, cause=decision.reason, action=decision.action)
        cordon = dict.fromkeys(decision.nodes, decision.reason) if decision.action == "cordon" else {}
        if decision.action == "diagnose":
            cordon = self._diagnose(decision, expected_tflops)
        if self.dist.is_main:
            if cordon:
                add_to_cordon(self.folder, cordon, self.step)
            append_event(self.folder, {"event": "goodput_action", "action": decision.action,
                                       "condition": decision.condition, "cause": decision.reason,
                                       "cordoned": sorted(cordon), "step": self.step})
        if cordon:
            self.log(f"goodput: cordoned {', '.join(f'{n} ({why})' for n, why in cordon.items())}; the run "
                     "resumes on the nodes left from this step's checkpoint")
        self.tick("tick")
        layout = resume_layout(self.node_ranks, sorted(cordon), min_nodes=self.cfg.min_nodes,
                               too_few_nodes=self.cfg.too_few_nodes)
        return {"action": decision.action, "cause": decision.reason, "cordon": sorted(cordon)} | layout

    def _diagnose(self, decision: Decision, expected_tflops: float | None) -> dict[str, str]:
        from lmforge.distributed.diagnose import sweep

        t0 = time.perf_counter()
        if self.dist.distributed:
            result = sweep(self.nodes, self.dist.rank, self.dist.device, self.cfg.diagnose.seconds,
                           slow_factor=self.faults.diag_factor(), expected_tflops=expected_tflops)
        else:  # one process: the matmul test alone
            from lmforge.distributed.diagnose import matmul_tflops
            from lmforge.goodput.diagnosis import Sweep

            result = Sweep({self.node: [matmul_tflops(self.dist.device, self.cfg.diagnose.seconds,
                                                      self.faults.diag_factor())]}, expected_tflops=expected_tflops)
        failing, notes = verdict(result, self.cfg.diagnose)
        self.log(f"goodput: diagnostic sweep ({time.perf_counter() - t0:.1f}s): "
                 + ("; ".join(f"{n} fails: {why}" for n, why in failing.items()) or "every node passes")
                 + "".join(f"; {n}" for n in notes))
        if self.dist.is_main:
            append_event(self.folder, {"event": "diagnosis", "failing": failing, "notes": notes,
                                       "step": self.step} | result.summary())
        return failing

    def close(self, status: str) -> dict[str, float]:
        """The attempt's last ledger record; rank 0 returns the run's goodput so far as metrics."""
        if self.health is not None:
            self.health.close()
        self.tick("end", status=status)
        acc = ledger.account(ledger.read_ledger(self.folder)) if self.dist.is_main else None
        if acc is not None:
            self.log(f"goodput: {ledger.format_goodput(acc)}")
        return ledger.metrics(acc) if acc is not None else {}

    # ------------------------------------------------------------------ helpers

    def _gather(self, row: list[float]) -> list[list[float]]:
        if not self.dist.distributed:
            return [row]
        device = self.dist.device
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        out = [torch.zeros_like(mine) for _ in range(self.dist.world_size)]
        torch.distributed.all_gather(out, mine)
        return torch.stack(out).tolist()

    def _health_metrics(self, rows: list[list[float]]) -> dict[str, float]:
        """Each node's GPU temperature, power and SM clock as system metrics (when measured)."""
        out = {}
        for rank, r in enumerate(rows):
            h = dict(zip(ROW, r))
            if h["temperature_c"] or h["power_w"]:
                node = self.nodes[rank]
                out |= {f"system/{node}/gpu_temperature_c": h["temperature_c"],
                        f"system/{node}/gpu_power_w": h["power_w"], f"system/{node}/gpu_sm_clock_mhz": h["sm_clock_mhz"]}
        return out
