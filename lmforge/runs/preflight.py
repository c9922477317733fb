"""Checks of a run before it starts: done in the process the user started, before the run is
registered or anything is written, so that a config that cannot work is refused in a second with
one line — not registered, started, crashed late and retried.

The run is planned as its ranks will plan it — `resolve` up to the plan, on this machine described
and measuring nothing (`plan_run`): its batch split, mesh, context, precision, model family and
memory verdict are the plan's own rules, not copies of them. Beside it only what needs the file
system:

- the command fits the task: `finetune` reads JSONL, not a prepared pretraining dataset;
- local training data exists;
- the save folder can be a folder, can be written, and holds no other run's checkpoints;
- `custom_weights_path` is a readable model (its recorded digests hold, its safetensors headers parse);
- the tokenizer covers the ids of prepared training data.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from lmforge.config.model import padded_vocab
from lmforge.config.schema import FINETUNE_TASKS, RunConfig
from lmforge.data.remote import is_remote, local_path
from lmforge.errors import UserError, environment_error
from lmforge.guard import check_run_owner
from lmforge.run_files import DATASET_MARKER



def preflight(cfg: RunConfig, command: str, world_size: int = 1, overwrite: bool = False) -> None:
    """``world_size``: the ranks the run will have (every node's); ``overwrite``: --overwrite."""
    check_task(cfg, command)
    check_train_data(cfg)
    if cfg.custom_weights_path:
        check_weights(cfg.custom_weights_path)
    if cfg.model != "auto":  # model: auto chooses its shape (and vocabulary) later, to fit the budget
        check_vocab(cfg)
    check_save_folder_writable(cfg)
    check_fault_injection(world_size)
    check_run_owner(cfg.save_folder, cfg.name, overwrite=overwrite)  # another run's folder: never replaced
    plan_run(cfg, world_size)


def check_fault_injection(world_size: int) -> None:
    """``LMFORGE_FAULT``, if set, names faults that can fire in a run of ``world_size`` ranks: refused
    now, in one line, rather than a run that never fails the way it was asked to (or never ends)."""
    from lmforge.goodput.faults import FAULT_ENV, check_faults, parse_faults

    check_faults(parse_faults(os.environ.get(FAULT_ENV)), world_size)


def plan_run(cfg: RunConfig, world_size: int) -> None:
    """The run planned as its ranks will plan it (`resolve` up to the plan) on ``world_size`` ranks of
    this machine, timing nothing: its UserError is the run's."""
    from lmforge.distributed.torchrun import resolve_device_kind
    from lmforge.plan.run import NotKnownYet
    from lmforge.resolve import resolve
    from lmforge.train.machine import cpu_machine, planned_machine

    # On a CPU this process never imports torch (a second of every start): the machine is described
    # from its flags, and no cached speed is read — a speed only sharpens the plan's times (and the
    # check that a time budget holds a step, which the ranks then make with it).
    if resolve_device_kind(cfg.compute.device) == "cpu":
        machine = cpu_machine(world_size, measure=False, speeds=False)
    else:
        machine = planned_machine(cfg.compute, world_size, measure=False)  # torch: the GPUs' facts
    try:
        resolve(cfg, machine, until="plan", log=lambda *_: None)
    except NotKnownYet:
        pass  # an epoch of raw text: the ranks plan it once the data is prepared


def check_task(cfg: RunConfig, command: str) -> None:
    if cfg.task_type not in FINETUNE_TASKS:
        return
    for d in cfg.train_data:
        if not is_remote(d.path) and os.path.isfile(os.path.join(d.path, DATASET_MARKER)):
            verb = "`lmforge finetune`" if command == "finetune" else f"task_type {cfg.task_type}"
            raise UserError(f"train_data {d.path}: a prepared pretraining dataset, but {verb} reads JSONL "
                            "prompt/response or messages rows; use `lmforge train` (or task_type "
                            "continued_pretrain) to train on it")


def check_train_data(cfg: RunConfig) -> None:
    """Local inputs (`data.sources.is_local_input`) exist; a glob matches a file."""
    from lmforge.data.text.sources import GLOB_CHARS, is_local_input

    for d in cfg.train_data:
        if not is_local_input(d.path):
            continue
        path = os.path.expanduser(local_path(d.path))
        if any(c in path for c in GLOB_CHARS):
            if not any(os.path.isfile(m) for m in glob.iglob(path, recursive=True)):
                raise UserError(f"train_data {d.path}: the pattern matches no files")
        elif not os.path.exists(path):
            raise UserError(f"train_data {d.path}: no such file or folder")


def _prepared(cfg: RunConfig) -> list[tuple[str, dict]]:
    """(path, marker) of each local prepared dataset in train_data; a marker that cannot be read
    is left to the run, which reports it."""
    from lmforge.data.prepare.prepare import read_summary

    out = []
    for d in cfg.train_data:
        if is_remote(d.path) or not os.path.isfile(os.path.join(d.path, DATASET_MARKER)):
            continue
        try:
            out.append((d.path, read_summary(d.path)))
        except UserError:
            continue
    return out


def check_save_folder_writable(cfg: RunConfig) -> None:
    folder = cfg.save_folder
    if not folder or is_remote(folder):
        return
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"save_folder {folder}: exists and is not a folder; choose another --save-folder")
    # Nothing is created: a test file in the folder, or in its nearest existing parent, is
    # written and removed at once.
    probe_dir = os.path.abspath(folder)
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise UserError(f"save_folder {folder}: {probe_dir} is a file, not a folder; choose another --save-folder")
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".lmforge-write-test-"):
            pass
    except OSError as e:
        err = environment_error(OSError(e.errno, e.strerror, f"save_folder {folder}"))
        if err is None:
            raise UserError(f"save_folder {folder}: cannot be written ({e.strerror or e})") from None
        raise err from None


def check_weights(path: str) -> None:
    """What `load_model` would refuse, found from headers and digests (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    from lmforge.checksums import verify_export
    from lmforge.resolve.weights import locate

    loc = locate(path)
    if loc.kind == "dcp":
        from lmforge.train.checkpoint import verify_checkpoint

        verify_checkpoint(loc.path)
        return
    verify_export(loc.path)
    for name in sorted(os.listdir(loc.path)):
        if name.endswith(".safetensors"):
            f = os.path.join(loc.path, name)
            try:
                with safe_open(f, framework="pt") as st:
                    st.keys()
            except (SafetensorError, OSError) as e:
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f"custom_weights_path: {f} is not a readable safetensors file ({why[:200]}); "
                                "it may be truncated or damaged") from None


def _tokenizer_vocab(cfg: RunConfig) -> int | None:
    tok = cfg.tokenizer
    if not isinstance(tok, str) or is_remote(tok):
        return None
    path = tok if tok.endswith(".json") else os.path.join(tok, "tokenizer.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        vocab = doc["model"]["vocab"]
        ids = list(vocab.values()) + [t["id"] for t in doc.get("added_tokens") or []]
        return max(ids) + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not a local tokenizer.json (a hub name, or read later with its own error)


def check_vocab(cfg: RunConfig) -> None:
    """Prepared data whose tokenizer has more ids than this run's model vocabulary."""
    tok_vocab = _tokenizer_vocab(cfg)
    model_vocab = cfg.model.vocab_size or (padded_vocab(tok_vocab) if tok_vocab else None)
    if model_vocab is None:
        return
    for path, summary in _prepared(cfg):
        data_tok = summary.get("tokenizer") or {}
        vocab = data_tok.get("vocab_size")
        if isinstance(vocab, int) and vocab > model_vocab:
            whose = f"model.vocab_size ({model_vocab})" if cfg.model.vocab_size else \
                f"the tokenizer {cfg.tokenizer} ({tok_vocab} tokens)"
            raise UserError(f"train_data {path}: prepared with a tokenizer of {vocab} tokens, more than {whose} "
                            f"covers; use the tokenizer the data was prepared with ({data_tok.get('path')}) or "
                            "prepare the data again with this one")
