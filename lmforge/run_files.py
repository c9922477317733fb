"""The names of what lmforge writes to disk, and how a save folder is read back — without torch.

One place for the file and folder names that several layers read: the trainer writes them
(`train.checkpoint`, `models.io`, `data.prepare`), while resolution (`resolve`), the run registry
(`runs`), preflight and reports only read them. Reading a folder's layout needs no torch, so
`lmforge --help`, `estimate` and a run's resolution stay light.

Layout of a ``save_folder``::

    run.json                      identity of the run (name, model shape, data) — guards overwrites
    checkpoints/step_00000100/    one complete checkpoint (`train.checkpoint`)
        lmforge-state.json        step, tokens, data-stream state, resolved config, file digests
    final/                        model.safetensors + lmforge-model.json + tokenizer (the export)
"""

from __future__ import annotations

import json
import os
import re

from lmforge.errors import UserError

DAMAGED = ".damaged-"  # a damaged checkpoint set aside: step_N.damaged-<time>
STATE_FILE = "lmforge-state.json"  # a checkpoint's JSON state, written last: its presence completes it
RUN_FILE = "run.json"  # a save folder's run identity and resolved config
MODEL_CONFIG_FILE = "lmforge-model.json"  # an exported model's shape (`models.io`)
DATASET_MARKER = "lmforge-dataset.json"  # a prepared dataset's summary, written last (`data.prepare`)
DEDUP_MARKER = "curation.json"  # a `data dedup` output's summary, written last (`data.prepare.dedup`)
TOKENIZER_MARKER = "lmforge-tokenizer.json"  # in a folder `tokenizer train` (or a run's tokenizer: train) wrote
# What `data.tokenizer.Tokenizer.save` writes: a folder of only these (with tokenizer.json) is a
# tokenizer lmforge wrote before it marked its tokenizers (`guard`).
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Every name a run writes at the top of its save folder (the trainer, the trackers, the report, the
# supervisor's lock and logs, a remote run's staging): a folder holding anything else, and no
# run.json, is not a run's (`guard.check_run_place`).
RUN_FOLDER_NAMES = frozenset({
    RUN_FILE, RUN_FILE + ".tmp", "checkpoints", "final", "logs", "metrics.jsonl", "generations.jsonl",
    "events.jsonl", "goodput.jsonl", "goodput.progress", "faults.jsonl", "cordon.json", "plan.json", "plan.json.tmp", "report.html", "report.html.tmp", "trackers.json",
    "trackers.json.tmp", ".lmforge.lock", "reference-logps.safetensors", "reference-logps.safetensors.tmp",
    ".reference", ".uploads", "wandb"})
# A run's statuses, as the registry records them and a report reads them back.
STATUSES = ("PENDING", "STARTING", "RUNNING", "TERMINATING", "COMPLETED", "FAILED", "STOPPED")
ACTIVE = ("PENDING", "STARTING", "RUNNING", "TERMINATING")  # still going
TERMINAL = ("COMPLETED", "FAILED", "STOPPED")  # ended


def checkpoints_dir(save_folder: str) -> str:
    return os.path.join(save_folder, "checkpoints")


def list_checkpoints(save_folder: str) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(save_folder)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, STATE_FILE)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def damaged_checkpoints(save_folder: str) -> list[tuple[int, str]]:
    """Checkpoints set aside as damaged (``step_N.damaged-<time>``, `train.checkpoint.intact_checkpoint`),
    oldest step first."""
    root = checkpoints_dir(save_folder)
    names = os.listdir(root) if os.path.isdir(root) else []
    found = [(m, name) for name in names if DAMAGED in name and (m := _STEP_DIR.match(name.split(DAMAGED)[0]))]
    return sorted((int(m.group(1)), os.path.join(root, name)) for m, name in found)


def checkpoint_step(path: str) -> int | None:
    """The step of a checkpoint folder ``.../step_00000100`` (None for any other name)."""
    m = _STEP_DIR.match(os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


def latest_checkpoint(save_folder: str) -> str | None:
    found = list_checkpoints(save_folder)
    return found[-1][1] if found else None


def read_state(path: str) -> dict:
    """A checkpoint's JSON state (one line naming the checkpoint when it cannot be read)."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path} is corrupt ({STATE_FILE}: {e}); "
                        "--no-autoresume starts fresh (keeping it aside)") from None


def read_run_file(save_folder: str) -> dict | None:
    """The folder's run.json ({"identity", "config"}; {} when unreadable), None when it has none."""
    path = os.path.join(save_folder, RUN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            existing = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return existing if isinstance(existing, dict) else {}


def holds_saved_run(save_folder: str) -> bool:
    """Whether a local save folder holds anything of a run to protect: a checkpoint or a final model."""
    return bool(list_checkpoints(save_folder)) or os.path.isdir(os.path.join(save_folder, "final"))


def is_variant(name: str, requested: str) -> bool:
    """Whether ``name`` is the run name ``requested`` or the unique variant ``<requested>-xxxx``
    that `runs.start` gives a run whose name another run already holds."""
    return name == requested or re.fullmatch(re.escape(requested) + r"-[0-9a-f]{4}", name) is not None


def different_run_error(save_folder: str, existing: dict) -> UserError:
    what = (existing.get("identity") or {}).get("name") or "another run"
    return UserError(f"save_folder {save_folder} holds checkpoints of a different run ({what!r}: other "
                     "name, model or data); choose another --save-folder or pass --overwrite to replace it")
