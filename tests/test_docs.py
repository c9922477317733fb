"""README and --help stay true to the code."""

from __future__ import annotations

import re

from conftest import REPO
from lmforge.config.reference import render_markdown
from train_helpers import lmforge


def test_readme_config_reference_matches_the_schema():
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S)
    assert block, "README lost its config reference markers"
    assert block.group(1) == render_markdown(), (
        "README's config reference is stale: regenerate it with "
        "python -c 'from lmforge.config.reference import render_markdown; print(render_markdown())'")


def test_train_help_shows_config_defaults():
    out = lmforge("train", "--help", check=True).stdout
    assert "parameters.weight_decay" in out and "0.1" in out
    assert "save_num_checkpoints_to_keep" in out


def test_examples_are_valid_configs():
    from lmforge.config.load import load_config

    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_config(str(path))
