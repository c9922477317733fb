"""The reference log-probs of DPO and IPO, computed once from the starting weights and kept with the run.

DPO and IPO score the policy against the reference model — the weights training started from.
The data is fixed, so the reference's log-probability of each answer is a fixed number: it is
computed once, before the first step, with the run's own forward (same precision, same rows),
and stored. That gives the numbers a frozen copy of the model would give at every step, without
the copy's memory (a second set of weights on every GPU) and with one forward per pair per run
instead of one per pair per epoch. (With LoRA the reference can also be the base with its
adapters off, at every step: ``preference.reference: live``, `train.objective`.)

The work is split over the ranks like the data (rank r takes rows r, r+W, …, in micro-batches of
the run's size; every rank runs the same number of forwards, as FSDP needs) and gathered with one
all-reduce per chunk of rows. Finished chunks are written to ``save_folder/.reference/``, so a
precomputation that is interrupted continues where it stopped; the complete result is one
top-level file, ``save_folder/reference-logps.safetensors`` (mirrored to a remote save folder
with the run's other top-level files and restored with its checkpoints), tagged with the
fingerprint of the rows it belongs to and the content of the starting weights (`weights_tag`:
not their folder's path or file times, so a moved run resumes). A resumed run reads it back; a run with checkpoints but no
such file cannot get its reference back (the starting weights have been trained on) and stops
with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import torch

from lmforge.checksums import EXPORT_FILE, sha256_files
from lmforge.data.batch import StreamLayout
from lmforge.data.rows.preference import PreferenceData, PreferenceRows
from lmforge.distributed.dist import DistInfo, all_reduce_sum, broadcast_object
from lmforge.errors import UserError
from lmforge.run_files import read_state
from lmforge.resolve.weights import locate

REFERENCE_FILE = "reference-logps.safetensors"
PARTS_DIR = ".reference"
CHUNK_ROWS = 2048  # rows per gathered (and saved) chunk: at most this much work is lost to an interruption


def attach_reference(model: torch.nn.Module, data: PreferenceData, layout: StreamLayout, save_folder: str,
                     dist: DistInfo, autocast, *, weights: str, resuming: bool, log=print,
                     chunk_rows: int = CHUNK_ROWS, legacy_weights: str | None = None) -> PreferenceData:
    """``data`` with the reference log-probs of every train and held-out pair: read back from
    ``save_folder``, or computed now with ``model`` (which must hold the starting weights, of
    which ``weights`` is the `weights_tag`; a file stored under ``legacy_weights``, the tag of an
    earlier version, is read too)."""
    splits = {"train": data.rows} | ({"eval": data.eval_rows} if data.eval_rows is not None else {})
    tags = {name: f"{rows.fingerprint()}:{weights}" for name, rows in splits.items()}
    path = os.path.join(save_folder, REFERENCE_FILE)
    found = None
    if dist.is_main:
        found = read_reference(path, tags)
        if found is None and legacy_weights:
            found = read_reference(path, {name: f"{rows.fingerprint()}:{legacy_weights}"
                                          for name, rows in splits.items()})
    stored = broadcast_object(found)
    if stored is not None:
        log(f"reference: log-probs of {sum(r.pairs for r in splits.values()):,} pairs read from {path}")
    elif resuming:
        why = broadcast_object(_mismatch(path, tags) if dist.is_main else None)
        raise UserError(f"{path}: {why}, but this run resumes from a checkpoint: the reference log-probs came from "
                        "the starting weights, which have been trained since; bring back the file this run wrote "
                        "(or the starting weights it was made from), or start over with --no-autoresume")
    else:
        stored = {}
        for name, rows in splits.items():
            stored[name] = _compute(model, rows, name, tags[name], layout, save_folder, dist, autocast, log,
                                    chunk_rows)
        if dist.is_main:
            _write(path, stored, tags)
            shutil.rmtree(os.path.join(save_folder, PARTS_DIR), ignore_errors=True)
        log(f"reference: log-probs of {sum(r.pairs for r in splits.values()):,} pairs computed from the starting "
            f"weights, saved to {path}")
    return data.with_reference(stored["train"], stored.get("eval"))


# The files whose content is the starting weights: tensors and the shape (tokenizer files, which a
# user may edit after an export on purpose, are covered by the rows' fingerprint: their token ids).
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|distcp)$|\.metadata$|lmforge-model\.json$|config\.json$")


def weights_tag(custom_weights_path: str | None, seed: int) -> str:
    """Which starting weights a reference belongs to, by their content: the sha256 of their weight
    and config files as the folder records them (an export's lmforge-checksums.json, a checkpoint's
    state file), or computed here where it records none (a Hugging Face download); the seed of a
    freshly initialized model. A moved or copied folder keeps its tag; a folder trained again
    changes it."""
    if not custom_weights_path:
        return f"init-{seed}"
    loc = locate(custom_weights_path)
    recorded = _recorded_digests(loc.kind, loc.path)
    names = sorted(n for n in (recorded or os.listdir(loc.path)) if _WEIGHT_FILES.match(n)
                   and (recorded or os.path.isfile(os.path.join(loc.path, n))))
    digests = [recorded[n]["sha256"] for n in names] if recorded else \
        sha256_files([os.path.join(loc.path, n) for n in names])
    return hashlib.sha256(json.dumps(list(zip(names, digests))).encode()).hexdigest()[:16]


def _recorded_digests(kind: str, folder: str) -> dict:
    """name → {bytes, sha256} that ``folder`` records of its files (every one with a sha256), or {}."""
    if kind == "dcp":
        files = read_state(folder).get("files") or {}
    else:
        try:
            with open(os.path.join(folder, EXPORT_FILE)) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
    return files if files and all("sha256" in d for d in files.values()) else {}


def legacy_weights_tag(custom_weights_path: str | None, seed: int) -> str:
    """The tag of references stored before tags were by content (the folder's path and its files'
    sizes and times): such a file is still read, so that those runs resume where they are."""
    if not custom_weights_path:
        return f"init-{seed}"
    folder = locate(custom_weights_path).path
    h = hashlib.sha256(os.path.abspath(folder).encode())
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            h.update(f"|{entry.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _mismatch(path: str, tags: dict[str, str]) -> str:
    """Why the stored file at ``path`` does not serve ``tags``: missing, other rows, other weights."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return "missing"
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - any damage reads as "unreadable"
        return "unreadable (damaged)"
    stored = {name: str(meta.get(name, "")).split(":", 1) for name in tags}
    if any(stored[name][0] != tag.split(":", 1)[0] for name, tag in tags.items()):
        return "made for other data (the pairs, the tokenizer or the context length differ)"
    return ("made from other starting weights than custom_weights_path holds now (their content differs: "
            "trained again, or another folder)")


def read_reference(path: str, tags: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The stored log-probs of each split, or None when the file is missing or belongs to other
    rows or weights (its tags differ)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if any(meta.get(name) != tag for name, tag in tags.items()):
                return None
            return {name: f.get_tensor(name) for name in tags}
    except Exception:  # a damaged file is recomputed (before training) or refused (on resume) like a missing one
        return None


def _write(path: str, tensors: dict[str, torch.Tensor], tags: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=tags)
    os.replace(tmp, path)


@torch.no_grad()
def _compute(model, rows: PreferenceRows, name: str, tag: str, layout: StreamLayout, save_folder: str,
             dist: DistInfo, autocast, log, chunk_rows: int) -> torch.Tensor:
    """[N, P, 2] reference log-probs of ``rows``, chunk by chunk; chunks saved by an earlier attempt
    (same rows) are read back instead."""
    parts = os.path.join(save_folder, PARTS_DIR)
    was_training = model.training
    model.eval()
    out = []
    reused = 0
    for start in range(0, len(rows), chunk_rows):
        end = min(start + chunk_rows, len(rows))
        part = os.path.join(parts, f"{name}-{start:010d}-{end:010d}.safetensors")
        done = broadcast_object(read_reference(part, {"logps": tag}) if dist.is_main else None)
        if done is not None:
            out.append(done["logps"])
            reused += 1
            continue
        logps = _chunk(model, rows, start, end, layout, dist, autocast)
        if dist.is_main:
            os.makedirs(parts, exist_ok=True)
            _write(part, {"logps": logps}, {"logps": tag})
        out.append(logps)
    model.train(was_training)
    if reused:
        log(f"reference: {reused} chunk(s) of the {name} rows read back from an interrupted precomputation")
    return torch.cat(out)


def _chunk(model, rows: PreferenceRows, start: int, end: int, layout: StreamLayout, dist: DistInfo,
           autocast) -> torch.Tensor:
    mine = list(range(start + layout.replica, end, layout.replicas))
    per_rank = -(-(end - start) // layout.replicas)
    steps = -(-per_rank // layout.micro_batch)  # the same on every rank
    out = torch.zeros(end - start, rows.pair_mask.shape[1], 2, dtype=torch.float32, device=dist.device)
    for b in range(steps):
        idx = mine[b * layout.micro_batch:(b + 1) * layout.micro_batch]
        # A rank whose rows ran out still takes part in the forward (FSDP gathers weights with every
        # rank): it runs a stand-in row and keeps nothing of it.
        batch = rows.batch(idx or [start]).to(dist.device)
        with autocast():
            token_logp = model.training_loss(batch.input_ids, batch.targets, doc_ids=batch.doc_ids,
                                             per_token=True).token_logp
        if idx:
            out[torch.tensor(idx, device=dist.device) - start] = batch.answer_sums(token_logp).float()
    return all_reduce_sum(out).cpu()  # each row was filled by exactly one rank
