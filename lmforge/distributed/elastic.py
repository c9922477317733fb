"""Elastic recovery: torchelastic restarts every worker after a failure; record that it happened.

torchrun (``--max-restarts N``) restarts all workers when one dies and tells them how many
restarts happened so far in ``TORCHELASTIC_RESTART_COUNT``. The workers resume on their own
(autoresume from the latest complete checkpoint); this module only makes the restart visible:
one line in the log and one event in ``<save_folder>/events.jsonl``.
"""

from __future__ import annotations

import json
import os
import time

EVENTS_FILE = "events.jsonl"


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def append_event(save_folder: str, event: dict) -> None:
    os.makedirs(save_folder, exist_ok=True)
    with open(os.path.join(save_folder, EVENTS_FILE), "a") as f:
        f.write(json.dumps({"time": time.time()} | event) + "\n")


def restarted_from_elastic(save_folder: str, resume_from: str | None, step: int, dist, log) -> None:
    """Called once per worker start, after the checkpoint is loaded; rank 0 logs and records."""
    n = restart_count()
    if n == 0 or not dist.is_main:
        return
    where = f"checkpoint {resume_from} (step {step})" if resume_from else "the start (no complete checkpoint yet)"
    log(f"elastic: workers restarted after a failure (restart {n}, max "
        f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}); resuming from {where}")
    append_event(save_folder, {"event": "elastic_restart", "restart": n, "resumed_from": resume_from,
                               "step": step, "world_size": dist.world_size})
