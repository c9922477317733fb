"""Pipelines: stages (e.g. pretrain → sft → dpo) run in order, each a normal run.

    name: ladder
    save_root: runs/ladder          # stage N saves into <save_root>/<stage name>
    stages:
      - name: pretrain
        config: pretrain.yaml       # a run config file (relative to this file) or an inline mapping
      - name: sft
        command: finetune           # default: finetune for SFT and preference task types, else train
        config: {task_type: instruction_finetune, train_data: sft.jsonl, training_duration: 2ep}
      - name: dpo
        config: {task_type: preference, train_data: pairs.jsonl, training_duration: 1ep}

Every stage after the first starts from the previous stage's ``final/`` (its
``custom_weights_path``, unless the stage sets one). A stage whose ``final/`` already exists
is skipped, so re-running the pipeline continues where it stopped; an unfinished stage resumes
from its own latest checkpoint like any run. Each stage runs as its own ``lmforge train`` /
``lmforge finetune`` process (so multi-rank stages, trackers and crash handling are the usual ones).
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from lmforge.config.load import read_yaml
from lmforge.config.schema import FINETUNE_TASKS
from lmforge.errors import UserError
from lmforge.run_files import MODEL_CONFIG_FILE

STAGE_KEYS = {"name", "config", "command"}
COMMANDS = ("train", "finetune")


def load_pipeline(path: str) -> dict:
    spec = read_yaml(path)
    if not isinstance(spec.get("stages"), list) or not spec["stages"]:
        raise UserError(f"{path}: `stages` must be a non-empty list of {{name, config}}")
    base = os.path.dirname(os.path.abspath(path))
    name = spec.get("name") or os.path.splitext(os.path.basename(path))[0]
    root = spec.get("save_root") or os.path.join("runs", name)
    stages, seen = [], set()
    for i, st in enumerate(spec["stages"]):
        where = f"{path}: stages[{i}]"
        if not isinstance(st, dict) or "name" not in st or "config" not in st:
            raise UserError(f"{where}: needs `name` and `config` (a run config file or mapping)")
        extra = set(st) - STAGE_KEYS
        if extra:
            raise UserError(f"{where}: unknown key {sorted(extra)[0]!r}; expected {', '.join(sorted(STAGE_KEYS))}")
        if st["name"] in seen:
            raise UserError(f"{where}: stage name {st['name']!r} is used twice")
        seen.add(st["name"])
        cfg = st["config"]
        if isinstance(cfg, str):
            cfg_path = cfg if os.path.isabs(cfg) else os.path.join(base, cfg)
            cfg = read_yaml(cfg_path)
        elif not isinstance(cfg, dict):
            raise UserError(f"{where}: `config` must be a file path or a mapping")
        cfg = dict(cfg)
        # A stage always lives in save_root/<stage> (a reused run config keeps its own folder untouched).
        cfg["name"] = f"{name}-{st['name']}"
        cfg["save_folder"] = os.path.join(root, st["name"])
        command = st.get("command") or ("finetune" if cfg.get("task_type") in FINETUNE_TASKS else "train")
        if command not in COMMANDS:
            raise UserError(f"{where}: command {command!r} is unknown; expected one of {', '.join(COMMANDS)}")
        stages.append({"name": st["name"], "command": command, "config": cfg})
    return {"name": name, "save_root": root, "stages": stages}


def is_completed(save_folder: str) -> bool:
    return os.path.isfile(os.path.join(save_folder, "final", MODEL_CONFIG_FILE))


def run_pipeline(path: str, log=print, extra_env: dict | None = None) -> list[dict]:
    """Run the stages in order; returns [{name, status, save_folder}]."""
    spec = load_pipeline(path)
    os.makedirs(spec["save_root"], exist_ok=True)
    results, previous = [], None
    for i, st in enumerate(spec["stages"]):
        cfg = st["config"]
        if previous and not cfg.get("custom_weights_path"):
            cfg["custom_weights_path"] = os.path.join(previous, "final")
        save_folder = cfg["save_folder"]
        label = f"stage {i + 1}/{len(spec['stages'])} {st['name']!r}"
        if is_completed(save_folder):
            log(f"{label}: already completed ({save_folder}/final), skipping")
            results.append({"name": st["name"], "status": "skipped", "save_folder": save_folder})
            previous = save_folder
            continue
        stage_file = os.path.join(spec["save_root"], f"{st['name']}.yaml")
        with open(stage_file, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        log(f"{label}: lmforge {st['command']} -f {stage_file}")
        code = subprocess.call([sys.executable, "-m", "lmforge", st["command"], "-f", stage_file],
                               env=os.environ | (extra_env or {}))
        if code != 0 or not is_completed(save_folder):
            raise UserError(f"{label} did not complete (exit status {code}); fix it and re-run the pipeline "
                            "to resume from that stage")
        results.append({"name": st["name"], "status": "completed", "save_folder": save_folder})
        previous = save_folder
    return results
