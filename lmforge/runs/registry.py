"""The run registry: one SQLite file, ``$LMFORGE_HOME/runs.db``.

Several processes use it at once (supervisors of runs side by side, ``lmforge runs list``,
the SDK), so it runs in WAL mode (readers never wait for a writer), every write is one short
``BEGIN IMMEDIATE`` transaction, and a busy timeout absorbs brief contention. A file that is
locked for longer, or is not a registry, is reported as one clear error and never recreated
over (it may be the only record of someone's runs).

Tables: ``runs`` (one row per run: its unique name, its ``run_uid``, and its ``lifecycle``, every
status it went through with the time), ``resumptions`` (one per start of the training
process: the first start, automatic retries, torchelastic restarts, ``runs restart``) and
``events`` (what happened, when).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from contextlib import contextmanager

from lmforge.errors import UserError
from lmforge.home import lmforge_home
from lmforge.run_files import ACTIVE, STATUSES, TERMINAL  # noqa: F401 - a run's statuses (reports read them too)
from lmforge.process import process_alive, read_status, this_host

SCHEMA_VERSION = 2  # 2: run_uid and lifecycle
# A supervisor on another host cannot be probed; without a heartbeat for this long it is lost.
REMOTE_HEARTBEAT_TIMEOUT_S = 600
TORCHRUN_RESTART = "a rank failed; torchrun restarted the ranks"


def status_file(log_dir: str, idx: int) -> str:
    """Where rank 0 of the training process started for resumption ``idx`` reports to the
    supervisor (its torchelastic attempt, how training ended); it stays for the later restarts."""
    return os.path.join(log_dir, f"resumption-{idx}.status.json")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY,
    run_uid TEXT,
    lifecycle TEXT,
    run_type TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    updated_at REAL NOT NULL,
    completed_at REAL,
    model TEXT,
    config TEXT,
    identity TEXT,
    save_folder TEXT,
    log_dir TEXT,
    command TEXT,
    cwd TEXT,
    host TEXT,
    supervisor_pid INTEGER,
    supervisor_start TEXT,
    child_pid INTEGER,
    ranks INTEGER,
    max_retries INTEGER,
    metrics TEXT
);
CREATE TABLE IF NOT EXISTS resumptions (
    run_name TEXT NOT NULL,
    idx INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    status TEXT NOT NULL,
    reason TEXT,
    exit_code INTEGER,
    log_path TEXT,
    PRIMARY KEY (run_name, idx)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_name TEXT NOT NULL,
    time REAL NOT NULL,
    type TEXT NOT NULL,
    message TEXT
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_name, id);
"""

_JSON_FIELDS = ("config", "identity", "command", "metrics", "lifecycle")


def registry_path() -> str:
    return os.path.join(lmforge_home(), "runs.db")


def _timeout() -> float:
    return float(os.environ.get("LMFORGE_REGISTRY_TIMEOUT", "15"))


# --------------------------------------------------------------------------- the registry

class Registry:
    """Short-lived connection per operation; rows come back as plain dicts."""

    def __init__(self, path: str | None = None):
        self.path = path or registry_path()

    @contextmanager
    def _connect(self, write: bool = False):
        if not os.path.exists(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            con = sqlite3.connect(self.path, timeout=_timeout(), isolation_level=None)
        except sqlite3.Error as e:
            raise self._error(e) from None
        try:
            con.row_factory = sqlite3.Row
            try:
                self._init(con)
                if write:
                    con.execute("BEGIN IMMEDIATE")
                yield con
                if write:
                    con.execute("COMMIT")
            except sqlite3.Error as e:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise self._error(e) from None
        finally:
            con.close()

    def _init(self, con) -> None:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise UserError(f"run registry {self.path} was written by a newer lmforge (schema {version}); "
                            "upgrade lmforge or set LMFORGE_HOME to another folder")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 1 and "runs" in tables:
            self._migrate_v1(con)
            return
        if tables - {"sqlite_sequence"}:
            # Tables of something else: not ours to alter.
            raise UserError(f"{self.path} is an SQLite file but not an lmforge run registry (tables: "
                            f"{', '.join(sorted(tables))}); move it aside or set LMFORGE_HOME")
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(_SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};")

    @staticmethod
    def _migrate_v1(con) -> None:
        """Schema 1 → 2: add run_uid and lifecycle; every old run gets an id (one transaction)."""
        con.execute("BEGIN IMMEDIATE")
        if con.execute("PRAGMA user_version").fetchone()[0] == 1:  # not done by another process meanwhile
            con.execute("ALTER TABLE runs ADD COLUMN run_uid TEXT")
            con.execute("ALTER TABLE runs ADD COLUMN lifecycle TEXT")
            for (name,) in con.execute("SELECT name FROM runs").fetchall():
                con.execute("UPDATE runs SET run_uid=? WHERE name=?", (uuid.uuid4().hex[:12], name))
            con.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        con.execute("COMMIT")

    def _error(self, e: sqlite3.Error) -> UserError:
        msg = str(e)
        if "locked" in msg or "busy" in msg:
            return UserError(f"run registry {self.path} is locked by another process (waited {_timeout():g}s); "
                             "try again, or find the process holding it")
        if "not a database" in msg or "malformed" in msg or "corrupt" in msg or "no such table" in msg:
            return UserError(f"run registry {self.path} is corrupt ({msg}); lmforge will not recreate it: "
                             "move it aside (your checkpoints in each run's save_folder are untouched)")
        return UserError(f"run registry {self.path}: {msg}")

    # --- reads

    def get(self, name: str, *, details: bool = True) -> dict | None:
        """The run called ``name`` (or whose run_uid is ``name``)."""
        with self._connect() as con:
            row = con.execute("SELECT * FROM runs WHERE name=?", (name,)).fetchone() or \
                con.execute("SELECT * FROM runs WHERE run_uid=?", (name,)).fetchone()
            if row is None:
                return None
            run = _row(row)
            name = run["name"]
            if details:
                run["resumptions"] = [dict(r) for r in con.execute(
                    "SELECT idx, started_at, ended_at, status, reason, exit_code, log_path FROM resumptions "
                    "WHERE run_name=? ORDER BY idx", (name,))]
                run["events"] = [dict(r) for r in con.execute(
                    "SELECT time, type, message FROM events WHERE run_name=? ORDER BY id", (name,))]
            return run

    def list(self, status: str | None = None) -> list[dict]:
        with self._connect() as con:
            if status:
                rows = con.execute("SELECT * FROM runs WHERE status=? ORDER BY created_at", (status,))
            else:
                rows = con.execute("SELECT * FROM runs ORDER BY created_at")
            return [_row(r) for r in rows]

    def saved_in(self, save_folder: str) -> list[dict]:
        """The runs whose save folder is ``save_folder``."""
        with self._connect() as con:
            return [_row(r) for r in con.execute("SELECT * FROM runs WHERE save_folder=? ORDER BY created_at",
                                                 (save_folder,))]

    def names(self) -> list[str]:
        with self._connect() as con:
            return [r[0] for r in con.execute("SELECT name FROM runs")]

    # --- writes

    def put(self, name: str, fields: dict, *, event: tuple[str, str] | None = None) -> None:
        """Insert or update the row of ``name`` (JSON fields are encoded here)."""
        fields = {k: (json.dumps(v) if k in _JSON_FIELDS and v is not None else v) for k, v in fields.items()}
        now = fields["updated_at"] = time.time()
        with self._connect(write=True) as con:
            exists = con.execute("SELECT status, lifecycle FROM runs WHERE name=?", (name,)).fetchone()
            if "status" in fields and (exists is None or exists["status"] != fields["status"]):
                lifecycle = json.loads(exists["lifecycle"] or "[]") if exists else []
                fields["lifecycle"] = json.dumps(lifecycle + [{"status": fields["status"], "time": now}])
            if exists:
                sets = ", ".join(f"{k}=?" for k in fields)
                con.execute(f"UPDATE runs SET {sets} WHERE name=?", (*fields.values(), name))
            else:
                fields = {"name": name, "created_at": fields.get("started_at") or time.time()} | fields
                cols = ", ".join(fields)
                con.execute(f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' * len(fields))})",
                            tuple(fields.values()))
            if event:
                _add_event(con, name, *event)

    def replace(self, name: str, fields: dict, event: tuple[str, str]) -> None:
        """Drop an old finished run of this name (its files stay) and register a new one."""
        with self._connect(write=True) as con:
            for table, col in (("runs", "name"), ("resumptions", "run_name"), ("events", "run_name")):
                con.execute(f"DELETE FROM {table} WHERE {col}=?", (name,))
        self.put(name, fields, event=event)

    def event(self, name: str, type_: str, message: str) -> None:
        with self._connect(write=True) as con:
            _add_event(con, name, type_, message)

    def start_resumption(self, name: str, log_dir: str) -> tuple[int, str]:
        """A new resumption of ``name``; returns its index and the path of its log file."""
        with self._connect(write=True) as con:
            idx = con.execute("SELECT COALESCE(MAX(idx) + 1, 0) FROM resumptions WHERE run_name=?",
                              (name,)).fetchone()[0]
            log_path = os.path.join(log_dir, f"resumption-{idx}.log")
            con.execute("INSERT INTO resumptions (run_name, idx, started_at, status, log_path) VALUES (?,?,?,?,?)",
                        (name, idx, time.time(), "STARTING", log_path))
            return idx, log_path

    def set_resumption(self, name: str, idx: int, **fields) -> None:
        with self._connect(write=True) as con:
            sets = ", ".join(f"{k}=?" for k in fields)
            con.execute(f"UPDATE resumptions SET {sets} WHERE run_name=? AND idx=?", (*fields.values(), name, idx))

    def delete(self, name: str) -> None:
        with self._connect(write=True) as con:
            for table, col in (("runs", "name"), ("resumptions", "run_name"), ("events", "run_name")):
                con.execute(f"DELETE FROM {table} WHERE {col}=?", (name,))

    def mark_lost_if_dead(self, run: dict) -> dict:
        """An active run whose supervisor is gone is FAILED (lost); returns the fresh row.

        The supervisor writes its final status before it exits, so "dead and still active" means
        it was killed or the machine went down. The update re-checks the status in the same
        transaction so a run that finished a moment ago is never overwritten.
        """
        if run["status"] not in ACTIVE or not supervisor_gone(run):
            return run
        now = time.time()
        with self._connect(write=True) as con:
            lifecycle = json.dumps((run.get("lifecycle") or []) + [{"status": "FAILED", "time": now}])
            cur = con.execute(
                "UPDATE runs SET status='FAILED', reason='lost', completed_at=?, updated_at=?, lifecycle=? WHERE "
                f"name=? AND status IN ({','.join('?' * len(ACTIVE))}) AND supervisor_pid IS ?",
                (now, now, lifecycle, run["name"], *ACTIVE, run["supervisor_pid"]))
            if cur.rowcount:
                _record_unseen_restarts(con, run)
                con.execute("UPDATE resumptions SET status='FAILED', reason='lost', ended_at=? WHERE run_name=? "
                            "AND ended_at IS NULL", (now, run["name"]))
                _add_event(con, run["name"], "lost", f"supervisor process {run['supervisor_pid']} on "
                           f"{run['host']} is gone (killed, or the machine restarted) without recording an end")
        fresh = self.get(run["name"], details="resumptions" in run)
        return fresh or run


def _record_unseen_restarts(con, run: dict) -> None:
    """Restarts torchrun made that the lost supervisor had not seen yet become resumptions too.

    The supervisor learns of a restart from the attempt number in the status file (it polls);
    killed between a restart and its next look, it never records it. The status file is still
    there: the newest one at or before the open resumption tells how many attempts its training
    process made, and each one the registry lacks is added (all write to the open one's log)."""
    row = con.execute("SELECT idx, log_path FROM resumptions WHERE run_name=? AND ended_at IS NULL "
                      "ORDER BY idx DESC LIMIT 1", (run["name"],)).fetchone()
    if row is None or not run.get("log_dir"):
        return
    last, log_path = row
    first = next((i for i in range(last, -1, -1) if os.path.exists(status_file(run["log_dir"], i))), None)
    if first is None:
        return
    path = status_file(run["log_dir"], first)
    try:
        attempt = int(read_status(path).get("attempt") or 0)
        started = os.path.getmtime(path)  # written as the newest attempt started
    except (OSError, ValueError, TypeError):
        return
    for idx in range(last, last + attempt - (last - first)):
        con.execute("UPDATE resumptions SET status='FAILED', reason=?, ended_at=? WHERE run_name=? AND idx=?",
                    (TORCHRUN_RESTART, started, run["name"], idx))
        con.execute("INSERT INTO resumptions (run_name, idx, started_at, status, log_path) VALUES (?,?,?,?,?)",
                    (run["name"], idx + 1, started, "STARTING", log_path))
        _add_event(con, run["name"], "retry", f"resumption {idx}: {TORCHRUN_RESTART} (recorded after the "
                   "supervisor was lost; its output is in the same log)")


def supervisor_gone(run: dict) -> bool:
    if run["host"] and run["host"] != this_host():
        return time.time() - (run["updated_at"] or 0) > REMOTE_HEARTBEAT_TIMEOUT_S
    if not run["supervisor_pid"]:
        # Registered but never claimed by a supervisor: give a starting one a moment.
        return time.time() - (run["updated_at"] or 0) > 60
    return not process_alive(run["supervisor_pid"], run["supervisor_start"])


def _add_event(con, name: str, type_: str, message: str) -> None:
    con.execute("INSERT INTO events (run_name, time, type, message) VALUES (?,?,?,?)",
                (name, time.time(), type_, message))


def _row(row) -> dict:
    d = dict(row)
    for k in _JSON_FIELDS:
        if d.get(k) is not None:
            try:
                d[k] = json.loads(d[k])
            except (TypeError, json.JSONDecodeError):
                pass
    return d


class RegistryIndex:
    """This machine's registry as a report reads it (`report.load.RunIndex`): rows by name, lost
    runs marked; it never creates a registry, and a locked or corrupt one finds nothing (the
    folder's own files still tell the story)."""

    def row(self, name: str) -> dict | None:
        if not name or not os.path.exists(registry_path()):
            return None
        reg = Registry()
        try:
            row = reg.get(name)
            return reg.mark_lost_if_dead(row) if row else None
        except UserError:
            return None

    def names(self) -> list[str]:
        if not os.path.exists(registry_path()):
            return []
        try:
            return Registry().names()
        except UserError:
            return []
