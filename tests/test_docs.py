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


def _help(*argv: str) -> str:
    """What `lmforge ARGV` prints and exits 0 with (--help and the like), in this process."""
    import contextlib
    import io

    from lmforge.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(argv))
    assert code == 0, buf.getvalue()
    return buf.getvalue()


def _pages():
    """(command words, parser) of every command and subcommand."""
    import argparse

    from lmforge.cli.main import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield [*path, name], sub
                    yield from walk(sub, [*path, name])
    return list(walk(build_parser(), []))


def test_train_and_finetune_help_pages_are_alike_and_the_keys_come_on_request():
    """`train --help` lists its options (not ~200 config keys after them), `finetune --help` the same
    options and ending; `--config-keys` prints the keys with their defaults for both."""
    train, finetune = _help("train", "--help"), _help("finetune", "--help")
    for page in (train, finetune):
        assert "--config-keys" in page and "save_num_checkpoints_to_keep" not in page
        assert len(page.splitlines()) < 100, len(page.splitlines())
    assert train.split("options:")[1] == finetune.split("options:")[1]
    keys = _help("train", "--config-keys")
    assert re.search(r"parameters\.weight_decay +0\.1 ", keys) and "save_num_checkpoints_to_keep" in keys
    assert keys == _help("finetune", "--config-keys")


def test_every_help_page_starts_with_a_sentence():
    """A command's page opens with sentences (its one-line summary in the parent's list stays
    lower case): no page starts in lower case where its neighbours start in upper case."""
    bad = [" ".join(words) + ": " + sub.description[:40] for words, sub in _pages()
           if not sub.description[:1].isupper() or not sub.description.rstrip().endswith((".", ")"))]
    assert not bad, bad


def test_device_pipeline_and_export_say_the_same_everywhere():
    """--device is one option in eval and generate; pipeline is described as the README does;
    export names every family it writes, Gemma's too."""
    pages = {" ".join(w): p for w, p in _pages()}
    devices = [next(a for a in pages[c]._actions if "--device" in a.option_strings) for c in ("eval", "generate")]
    assert devices[0].help == devices[1].help and devices[0].choices is devices[1].choices is None
    assert "cuda:N" in devices[0].help and "mps" in devices[0].help
    from lmforge.cli.common import torch_device
    from lmforge.errors import UserError

    assert str(torch_device("cpu")) == "cpu"
    with pytest.raises(UserError, match="--device 'gpu0': not a torch device"):
        torch_device("gpu0")
    readme = (REPO / "README.md").read_text()
    summary = pages["pipeline"].description.split(";")[0]  # the README's words, as the page's first sentence
    assert f"| {summary[0].lower()}{summary[1:]};" in readme and summary in _help("pipeline", "--help")
    assert "stages (e.g. pretrain → SFT → DPO)" in _help("--help")
    export = _help("export", "--help").replace("\n", " ")
    for family in ("Gemma", "Gemma2", "Gemma3", "Qwen3", "Olmo2", "Mixtral"):
        assert f"{family}ForCausalLM" in export.replace(" ", ""), family


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


def test_each_command_module_registers_the_commands_its_row_names():
    """`cli.main.COMMANDS` is what a command's start-up imports (its module alone): a row that names
    a command its module does not register, or misses one, would break or slow that command."""
    import importlib

    from lmforge.cli.common import OneLineParser
    from lmforge.cli.main import COMMANDS, build_parser

    for name, commands in COMMANDS:
        sub = OneLineParser(prog="lmforge").add_subparsers(dest="command")
        importlib.import_module(name).register(sub)
        assert tuple(sub.choices) == commands, name
    for _, commands in COMMANDS:
        for command in commands:
            only = build_parser(command)._subparsers._group_actions[0].choices
            assert command in only and len(only) == len(commands)
