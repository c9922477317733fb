"""Read what a run left in its save folder (local or in an object store) into one `RunData`.

Only the folder's small top-level files are read — ``metrics.jsonl``, ``generations.jsonl``,
``events.jsonl``, ``run.json`` (identity and resolved config) and ``plan.json`` (what
``lmforge estimate`` said when the run started) — plus the run's registry entry when the caller
gives this machine's registry (`RunIndex`: statuses, resumptions, failure reasons). So a report can be
made of any save folder, also one copied from another machine or read from ``s3://``.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Protocol

from lmforge.errors import UserError
from lmforge.goodput.ledger import LEDGER_FILE, PROGRESS_FILE, account, ledger_records

METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "generations.jsonl"
EVENTS_FILE = "events.jsonl"
RUN_FILE = "run.json"
PLAN_FILE = "plan.json"
REPORT_FILE = "report.html"


@dataclass
class RunData:
    name: str
    folder: str  # local path or URI
    config: dict = field(default_factory=dict)  # the resolved config (run.json)
    records: list[dict] = field(default_factory=list)  # metrics.jsonl, in file order
    generations: list[dict] = field(default_factory=list)  # {"step", "time", "key", "text"}
    events: list[dict] = field(default_factory=list)  # {"time", "type", "message"}, by time
    resumptions: list[dict] = field(default_factory=list)  # {"idx", "started_at", "ended_at", "status", "reason"}
    status: str | None = None
    reason: str | None = None  # why it ended (a failed run's error line), when it has ended early
    plan: dict | None = None  # plan.json
    goodput: dict | None = None  # where the wall time went (`goodput.ledger.account` of goodput.jsonl)
    _by_key: dict | None = field(default=None, repr=False, compare=False)
    _indexed: int = field(default=0, repr=False, compare=False)

    def _index(self) -> dict[str, dict[int, float]]:
        """key -> {step: value}, built once in one pass over the records; a step logged again after
        a resume keeps its last value."""
        if self._by_key is None or self._indexed != len(self.records):
            index: dict[str, dict[int, float]] = {}
            for rec in self.records:
                step = rec.get("step")
                if step is None:
                    continue
                for key, value in rec.items():
                    if value is not None and key not in ("step", "time"):
                        index.setdefault(key, {})[int(step)] = value
            self._by_key, self._indexed = index, len(self.records)
        return self._by_key

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, by step."""
        by_step = self._index().get(key, {})
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]

    def keys(self) -> set[str]:
        return set(self._index())

    def last(self, key: str) -> float | None:
        _, values = self.series(key)
        return values[-1] if values else None

    def last_record(self, key: str = "train/loss") -> dict:
        """The latest record holding ``key`` (the last training step by default)."""
        for rec in reversed(self.records):
            if rec.get(key) is not None:
                return rec
        return {}


# --------------------------------------------------------------------------- reading files

def _reader(folder: str):
    """A function name -> file text (None when absent), for a local folder or a URI."""
    from lmforge.data import remote

    if not remote.is_remote(folder):
        base = remote.local_path(folder)

        def read_local(name: str) -> str | None:
            try:
                with open(os.path.join(base, name), encoding="utf-8") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        return read_local

    fs, root = remote.fs_and_path(folder)
    root = root.rstrip("/")
    try:
        fs.invalidate_cache(root)
    except Exception:  # noqa: BLE001 - a cache refresh is only an optimisation
        pass

    def read_remote(name: str) -> str | None:
        try:
            return fs.cat_file(f"{root}/{name}").decode("utf-8")
        except FileNotFoundError:
            return None
        except PermissionError as e:
            raise UserError(f"{folder}/{name}: access denied ({e})") from None
    return read_remote


def _jsonl(text: str | None) -> list[dict]:
    """Records of a JSONL text; a half-written last line (a live writer) is skipped."""
    out = []
    for line in (text or "").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _json(text: str | None) -> dict | None:
    try:
        value = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _folder_exists(folder: str) -> bool:
    from lmforge.data import remote

    if remote.is_remote(folder):
        return remote.exists(folder)
    return os.path.isdir(remote.local_path(folder))


class RunIndex(Protocol):
    """Where runs are found by name: this machine's run registry (`runs.registry.RegistryIndex`).
    Given to `load_run` by the caller, so that reading a folder needs no registry."""

    def row(self, name: str) -> dict | None:
        """The registry row of ``name`` (with resumptions and events), or None."""

    def names(self) -> list[str]:
        """Every registered run name."""


def find_run(ref: str, index: RunIndex | None = None) -> tuple[str, dict | None]:
    """(save folder, registry row or None) for a run name or a save folder path/URI."""
    from lmforge.data import remote

    row = None if remote.is_remote(ref) or index is None else index.row(ref)
    if row is not None and row.get("save_folder"):
        return row["save_folder"], row
    if _folder_exists(ref):
        return ref, None
    close = difflib.get_close_matches(ref, index.names(), n=3, cutoff=0.5) if index is not None else []
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UserError(f"{ref!r} is neither a run in the registry nor a save folder{hint}")


def load_run(ref: str, *, name: str | None = None, status: str | None = None,
             index: RunIndex | None = None) -> RunData:
    """Everything a report shows about one run; ``ref`` is a run name (found in ``index``) or a
    save folder.

    ``name``/``status`` override what the files say (the trainer knows both before the
    registry does).
    """
    folder, row = find_run(ref, index)
    read = _reader(folder)
    metrics_text = read(METRICS_FILE)
    records = _jsonl(metrics_text)
    if not records:
        why = "has no metrics.jsonl" if metrics_text is None else "has an empty metrics.jsonl"
        raise UserError(f"save folder {folder} {why} (not an lmforge run, or it has not logged a step yet)")
    run_file = _json(read(RUN_FILE)) or {}
    config = run_file.get("config") or (row or {}).get("config") or {}
    run_name = name or (row or {}).get("name") or (run_file.get("identity") or {}).get("name") \
        or config.get("name") or os.path.basename(folder.rstrip("/"))
    if row is None and index is not None:
        candidate = index.row(run_name)
        # A folder named on the command line is only matched with the registry entry that points
        # to it (a name may have been reused for another folder); the trainer names its own run.
        if candidate is not None and (name is not None or _same_folder(candidate.get("save_folder"), folder)):
            row = candidate
    data = RunData(name=run_name, folder=folder, config=config, records=records,
                   generations=_jsonl(read(GENERATIONS_FILE)), plan=_json(read(PLAN_FILE)),
                   goodput=account(ledger_records(read(LEDGER_FILE), read(PROGRESS_FILE))))
    folder_events = _jsonl(read(EVENTS_FILE))
    _fill_history(data, row, folder_events)
    data.status = status or (row or {}).get("status") or _status_from_events(folder_events)
    if data.status in ("FAILED", "STOPPED"):
        # The registry's reason is the supervisor's last word (a kill, a hang, retries used up);
        # the trainer's own error line is in the folder before the registry has it.
        data.reason = (row or {}).get("reason") or _error_from_events(folder_events)
    return data


def _same_folder(a: str | None, b: str) -> bool:
    from lmforge.data import remote

    if not a:
        return False
    if remote.is_remote(a) or remote.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(remote.local_path(b))


def _error_from_events(events: list[dict]) -> str | None:
    last = next((e for e in reversed(events) if e.get("event") == "finished"), None)
    return (last or {}).get("error")


def _status_from_events(events: list[dict]) -> str | None:
    for e in reversed(events):
        if e.get("event") == "finished":
            return str(e.get("status", "")).upper() or None
        if e.get("event") in ("started", "resumed"):
            return "RUNNING"
    return None


def _fill_history(data: RunData, row: dict | None, folder_events: list[dict]) -> None:
    """Events and resumptions: the registry's when it knows the run, else the folder's own."""
    events: list[dict] = []
    if row is not None:
        data.resumptions = list(row.get("resumptions") or [])
        events = [{"time": e["time"], "type": e["type"], "message": e.get("message") or ""}
                  for e in row.get("events") or []]
        # The registry already has starts and ends; the folder adds what only the trainer saw.
        folder_events = [e for e in folder_events if e.get("event") not in ("started", "resumed", "finished")]
    else:
        data.resumptions = _resumptions_from_events(folder_events, data.records)
    for e in folder_events:
        if "time" not in e:
            continue
        what = e.get("event", "event")
        message = ", ".join(f"{k} {v}" for k, v in e.items() if k not in ("time", "event"))
        events.append({"time": e["time"], "type": what, "message": message})
    data.events = sorted(events, key=lambda e: e["time"])


def _resumptions_from_events(events: list[dict], records: list[dict]) -> list[dict]:
    """Segments of training between a start/resume and its end, from events.jsonl (or the
    metrics' own timestamps when the folder has no events)."""
    out: list[dict] = []
    for e in events:
        kind = e.get("event")
        if kind in ("started", "resumed"):
            if out and out[-1]["ended_at"] is None:
                out[-1].update(ended_at=e["time"], status="FAILED", reason="ended without a record (crash or kill)")
            out.append({"idx": len(out), "started_at": e["time"], "ended_at": None, "status": "RUNNING",
                        "reason": f"resumed at step {e.get('step')}" if kind == "resumed" else None})
        elif kind == "finished" and out:
            out[-1].update(ended_at=e["time"], status=str(e.get("status", "completed")).upper())
    if not out:
        times = [r["time"] for r in records if "time" in r]
        if times:
            out.append({"idx": 0, "started_at": min(times), "ended_at": max(times), "status": "?", "reason": None})
    last_time = max((r.get("time", 0) for r in records), default=None)
    if out and out[-1]["ended_at"] is None and last_time:
        out[-1]["ended_at"] = last_time  # still running (or lost): as far as the metrics go
    return out
