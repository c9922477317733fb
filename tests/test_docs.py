"""README and --help stay true to the code."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from lmforge.config.reference import render_markdown
from train_helpers import lmforge


def test_readme_config_reference_matches_the_schema():
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S)
    assert block, "README lost its config reference markers"
    assert block.group(1) == render_markdown(), (
        "README's config reference is stale: regenerate it with `python -m lmforge.config.reference`")


@pytest.mark.e2e
def test_train_help_shows_config_defaults():
    out = lmforge("train", "--help", check=True).stdout
    assert "parameters.weight_decay" in out and "0.1" in out
    assert "save_num_checkpoints_to_keep" in out


def test_examples_are_valid_configs():
    from lmforge.config.load import build_config, load_config, read_yaml
    from lmforge.runs.stages import load_pipeline

    for name in ("quickstart.yaml", "pretrain.yaml"):
        load_config(str(REPO / "examples" / name))
    # sft.yaml takes model and tokenizer from its (not yet trained) weights: check the rest of it
    for name in ("sft.yaml", "lora.yaml"):
        sft = read_yaml(str(REPO / "examples" / name)) | {"model": "llama-tiny", "tokenizer": "tok"}
        assert build_config(sft).task_type == "instruction_finetune"
    assert [s["name"] for s in load_pipeline(str(REPO / "examples" / "pipeline.yaml"))["stages"]]


def test_no_merge_conflict_markers_are_left_anywhere():
    """A merge's leftovers (`<<<<<<< `, `>>>>>>> ` at a line's start) in code, docs or benches."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    bad = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".sh", ".yaml", ".toml", ".txt", ".json") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                bad.append(f"{name}:{i}")
    assert not bad, bad
