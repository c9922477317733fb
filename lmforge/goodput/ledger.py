"""Where a run's wall time went: the ledger each training attempt writes, and the accounting from it.

Rank 0 of each attempt appends to ``<save_folder>/goodput.jsonl`` (`Ledger`):

- ``start`` when its loop begins: the process's start time and the step it resumes from;
- ``tick`` at each log step and after each checkpoint: this attempt's seconds so far in steps,
  checkpoint writes (the blocking part) and evaluation, which add up to the time since ``start``;
- ``detected`` when a condition stops the run (its cause); ``end`` when the attempt finishes.

`account` splits the wall time — from the first attempt's process start to the last record — into
parts that add up to it exactly:

- ``startup``: process start to the first step of each attempt (imports, data, model build,
  checkpoint load — and compilation, which happens in the first step: counted as steps);
- ``productive``: steps whose result was kept; ``lost``: steps redone after a restart (those past
  the checkpoint the next attempt resumed from), at their attempt's mean step time;
- ``checkpoint`` and ``evaluation``: time the loop was blocked by them;
- ``recovery``: from an attempt's last record to the next attempt's process start (detection,
  diagnosis, the restart; a crash also loses here the part of a log interval it cut short);
- ``other``: what remains (0 for sequential attempts; kept so that the parts always add up).

Time between an attempt that ended as asked — completed, or stopped on request (`runs stop`, a
signal) with no condition detected — and the next attempt's start is nobody's recovery: the run
was not meant to be running (a finished run started again, a stopped run restarted the next day).
It is ``idle_s``, outside the wall time, so that such a wait never lowers the run's goodput.

goodput = productive / wall.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

LEDGER_FILE = "goodput.jsonl"
PARTS = ("productive", "startup", "checkpoint", "evaluation", "recovery", "lost", "other")


class Ledger:
    """Appends this attempt's records (rank 0 only; ``folder`` None: writes nothing)."""

    def __init__(self, folder: str | None, process_start: float):
        self.path = os.path.join(folder, LEDGER_FILE) if folder else None
        self.attempt = f"{os.getpid()}@{process_start:.3f}"
        self.process_start = process_start

    def write(self, kind: str, **fields) -> None:
        if self.path is None:
            return
        rec = {"kind": kind, "time": round(time.time(), 3), "attempt": self.attempt} | fields
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError:  # a full disk ends the run elsewhere, with its own line; accounting is not worth a crash
            pass


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file a run appends to ([] when missing; a half-written line skipped)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_ledger(folder: str) -> list[dict]:
    return [r for r in read_jsonl(os.path.join(folder, LEDGER_FILE)) if "attempt" in r and "time" in r]


@dataclass
class _Attempt:
    start: dict
    last: dict  # the last tick or end


def _attempts(records: list[dict]) -> list[_Attempt]:
    out: dict[str, _Attempt] = {}
    for rec in records:
        if rec["kind"] == "start":
            out[rec["attempt"]] = _Attempt(rec, rec | {"steps_s": 0.0, "checkpoint_s": 0.0, "evaluation_s": 0.0})
        elif rec["kind"] in ("tick", "end") and rec["attempt"] in out:
            out[rec["attempt"]].last = rec
    return sorted(out.values(), key=lambda a: a.start["process_start"])


def account(records: list[dict]) -> dict | None:
    """{"wall_s", "goodput", "parts": {part: seconds}, "idle_s", "resumptions": [...]} or None without
    records."""
    attempts = _attempts(records)
    if not attempts:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    idle = 0.0
    resumptions = []
    for i, a in enumerate(attempts):
        parts["startup"] += max(0.0, a.start["time"] - a.start["process_start"])
        steps_s, s0, s1 = a.last.get("steps_s", 0.0), a.start.get("step", 0), a.last.get("step", 0)
        parts["checkpoint"] += a.last.get("checkpoint_s", 0.0)
        parts["evaluation"] += a.last.get("evaluation_s", 0.0)
        lost = 0.0
        if i + 1 < len(attempts):
            nxt = attempts[i + 1].start
            redone = max(0, s1 - nxt.get("step", 0))
            lost = steps_s * min(1.0, redone / (s1 - s0)) if s1 > s0 else 0.0
            gap = max(0.0, nxt["process_start"] - a.last["time"])
            if _ended_as_asked(records, a.start["attempt"]):
                idle += gap
            else:
                parts["recovery"] += gap
            resumptions.append({"time": nxt["time"], "step": nxt.get("step", 0), "steps_redone": redone,
                                "cause": _cause(records, a.start["attempt"])})
        parts["lost"] += lost
        parts["productive"] += steps_s - lost
    wall = attempts[-1].last["time"] - attempts[0].start["process_start"] - idle
    parts["other"] = wall - sum(v for k, v in parts.items() if k != "other")
    return {"wall_s": wall, "goodput": parts["productive"] / wall if wall > 0 else 0.0,
            "parts": {k: round(v, 3) for k, v in parts.items()}, "idle_s": round(idle, 3),
            "resumptions": resumptions}


def _ended_as_asked(records: list[dict], attempt: str) -> bool:
    """The attempt wrote its end as completed or stopped, and no condition stopped it: whatever came
    next was a new request (a restart, a longer run), not a recovery."""
    mine = [r for r in records if r["attempt"] == attempt]
    end = next((r for r in mine if r["kind"] == "end"), None)
    return end is not None and end.get("status") in ("completed", "stopped") and \
        not any(r["kind"] == "detected" for r in mine)


def _cause(records: list[dict], attempt: str) -> str:
    detected = [r for r in records if r["attempt"] == attempt and r["kind"] == "detected"]
    if detected:
        return detected[-1].get("cause", "a condition")
    end = next((r for r in records if r["attempt"] == attempt and r["kind"] == "end"), None)
    return f"ended {end.get('status')}" if end else "the attempt ended without a record (a crash, a kill or a hang)"


def format_goodput(acc: dict) -> str:
    """One line: goodput and where the wall time went."""
    p = acc["parts"]
    names = {"productive": "steps", "startup": "start-up", "checkpoint": "checkpoints", "evaluation": "eval",
             "recovery": "recovery", "lost": "lost work", "other": "other"}
    spent = ", ".join(f"{names[k]} {p[k]:.1f}s" for k in PARTS if k == "productive" or abs(p[k]) >= 0.05)
    idle = acc.get("idle_s", 0.0)
    return (f"{100 * acc['goodput']:.1f}% of {acc['wall_s']:.1f}s wall ({spent})"
            + (f"; {idle:.1f}s idle between attempts not counted" if idle >= 0.05 else ""))


def metrics(acc: dict) -> dict[str, float]:
    """The accounting as tracker metrics (`goodput/…`)."""
    return {"goodput/fraction": round(acc["goodput"], 4), "goodput/wall_s": round(acc["wall_s"], 3),
            "goodput/idle_s": acc.get("idle_s", 0.0)} | {f"goodput/{k}_s": v for k, v in acc["parts"].items()}
