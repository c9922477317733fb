"""The one guard of every destructive step (`lmforge.guard`): its rules as unit tests on real
folders, and the pruning of damaged checkpoints it removes through (issue 47)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.guard import (check_run_folder, check_run_place, check_target, checkpoint_reads, foreign_files,
                           remove_inside)


def refused(target, *words, reads=()) -> str:
    with pytest.raises(UserError) as e:
        check_target(str(target), "--out", reads)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--out {target}")
    for w in words:
        assert w in line, (w, line)
    return line


def test_root_home_and_working_directory_are_refused(tmp_path, monkeypatch):
    refused("/", "filesystem root")
    refused("/.", "filesystem root")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "work").mkdir(parents=True)
    refused(tmp_path / "home", "home folder")
    refused(tmp_path, "contains", "home folder")  # a folder above the home folder holds it
    monkeypatch.chdir(tmp_path / "home" / "work")
    refused(".", "working directory")
    refused("..", "home folder")
    check_target(str(tmp_path / "home" / "work" / "out"), "--out")  # inside them is where outputs go


def test_a_tilde_the_shell_left_is_refused_not_written_beside_its_check(tmp_path, monkeypatch):
    """`--out=~/m` reaches lmforge as is: the writers would make ./~/m while the check looked at $HOME/m."""
    monkeypatch.chdir(tmp_path)
    for target in ("~/m", "~"):
        with pytest.raises(UserError, match=r"^--out ~.*: '~' is not expanded here; expected the full path \(/"):
            check_target(target, "--out")
    assert not (tmp_path / "~").exists()


def test_a_downloaded_tokenizer_is_not_replaced_by_overwrite(tmp_path):
    """Only a tokenizer folder lmforge wrote (its marker) is replaced; a downloaded one holds the same
    other files and is the user's."""
    from lmforge.guard import check_output
    from lmforge.run_files import TOKENIZER_MARKER

    hub = tmp_path / "tok"
    hub.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hub / name).write_text("{}")
    with pytest.raises(UserError, match=r"^--out .*tok"):
        check_output(str(hub), "--out", "tokenizer", overwrite=True)
    (hub / TOKENIZER_MARKER).write_text("{}")
    assert check_output(str(hub), "--out", "tokenizer", overwrite=True) is True


def test_a_target_that_is_holds_or_lies_inside_an_input(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("x")
    reads = [("the input", str(data))]
    refused(data, "is the input", reads=reads)
    refused(data / "sub", "lies inside the input", reads=reads)
    refused(tmp_path, "contains the input", reads=reads)
    refused(data, "contains the tokenizer", reads=[("the tokenizer", str(data / "a.txt"))])
    refused(str(data) + "/./", "is the input", reads=reads)  # spelled another way, the same folder
    check_target(str(tmp_path / "data-out"), "--out", reads)  # a sibling with a common prefix is another folder
    check_target(str(tmp_path / "out"), "--out", [("the input", None), ("the input", "builtin:python-stdlib")])


def test_a_link_resolves_to_what_it_names(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "alias")
    refused(tmp_path / "alias", "is the input", reads=[("the input", str(tmp_path / "data"))])


def test_a_glob_reads_its_files_not_its_folder(tmp_path):
    reads = [("the input", str(tmp_path / "data" / "*.txt"))]
    check_target(str(tmp_path / "data" / "prepared"), "--out", reads)
    refused(tmp_path / "data", "contains the input", reads=reads)


def test_object_store_targets(tmp_path):
    refused("s3://bucket", "root of bucket 'bucket'")
    refused("s3://bucket/", "root of bucket")
    refused("s3://bucket/data/", "is the input", reads=[("the input", "s3://bucket/data")])
    refused("s3://bucket/data/x", "lies inside", reads=[("the input", "s3://bucket//data")])
    check_target("s3://bucket/out", "--out", [("the input", "s3://bucket/data"), ("the input", str(tmp_path))])
    check_target("gs://bucket/data", "--out", [("the input", "s3://bucket/data")])  # another store


def test_a_checkpoint_read_protects_its_run(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    reads = checkpoint_reads(str(run / "checkpoints" / "step_00000004"))
    assert ("the run", str(run.resolve())) in reads
    refused(run / "hf", "lies inside the run", reads=reads)
    refused(run / "final", "is the checkpoint", reads=checkpoint_reads(str(run / "final")))
    refused(run, "is the checkpoint", reads=checkpoint_reads(str(run)))
    check_target(str(tmp_path / "hf"), "--out", checkpoint_reads(str(run / "final")))
    assert checkpoint_reads("hf:/models/llama") == [("the checkpoint", "hf:/models/llama")]


def test_a_save_folder_of_other_files_is_refused_unless_it_is_a_run(tmp_path):
    check_run_place(str(tmp_path / "new"))
    (tmp_path / "empty").mkdir()
    check_run_place(str(tmp_path / "empty"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match=r"save_folder .*mine: holds files that are not an lmforge run \(thesis.tex\)"):
        check_run_place(str(mine))
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / ".lmforge.lock").write_text("")
    assert foreign_files(str(run)) == []  # a first attempt that failed before run.json
    check_run_place(str(run))
    (mine / "run.json").write_text(json.dumps({"identity": {}}))
    check_run_place(str(mine))  # a run's folder, with the user's notes beside it
    with pytest.raises(UserError, match="filesystem root"):
        check_run_place("/")
    with pytest.raises(UserError, match="is the training data"):
        check_run_place(str(tmp_path / "d"), reads=[("the training data", str(tmp_path / "d"))])


def test_runs_delete_purges_only_a_run_folder(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not deleting it"):
        check_run_folder(str(mine), "runs delete r --purge")


def test_remove_inside_never_leaves_its_folder(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "f").write_text("keep")
    os.symlink(precious, ckpts / "step_00000002")  # a link named as a checkpoint
    remove_inside(str(ckpts / "step_00000002"), str(ckpts))
    assert not (ckpts / "step_00000002").exists() and (precious / "f").read_text() == "keep"
    for outside in (str(ckpts / ".." / ".." / "precious"), str(ckpts)):
        with pytest.raises(UserError, match="not inside"):
            remove_inside(outside, str(ckpts))
    assert (precious / "f").exists()


def _checkpoint(root: Path, step: int, name: str | None = None) -> Path:
    path = root / (name or f"step_{step:08d}")
    path.mkdir(parents=True)
    (path / "lmforge-state.json").write_text(json.dumps({"step": step}))
    return path


def test_damaged_checkpoints_are_pruned_once_a_later_intact_one_exists(tmp_path):
    """`.damaged-*` folders were never removed (3 cycles: 3 × 38 MB): a damaged one goes when a
    checkpoint of its step or later completes; a later damaged one stays until then."""
    from lmforge.run_files import damaged_checkpoints
    from lmforge.train.checkpoint import _complete

    root = tmp_path / "run" / "checkpoints"
    _checkpoint(root, 2)
    _checkpoint(root, 4, "step_00000004.damaged-20261127-101010")
    _checkpoint(root, 8, "step_00000008.damaged-20261127-101011")
    tmp = root / ".step_00000006.tmp"
    tmp.mkdir()
    _complete(str(tmp_path / "run"), str(tmp), str(root / "step_00000006"), {"step": 6}, rank=0, keep=2,
              on_complete=None, digests={})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000006",
                                                      "step_00000008.damaged-20261127-101011"]
    assert [s for s, _ in damaged_checkpoints(str(tmp_path / "run"))] == [8]
