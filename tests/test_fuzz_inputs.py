"""The input surface, fuzzed (issue 47): the config schema's every field, every command's typed
flags, and malformed files (config YAML, JSONL rows, compressed text, checkpoint state), with
Hypothesis. Every case ends clean — bad input is one `error:` line naming what is wrong (exit 2, no
traceback) — or is accepted as documented, with a finite value in its range. The issue's own
inputs are named regression cases at the top; a few drawn inputs run as real processes at the end.

Examples are derandomized (the same inputs every run) and few per test: the suite stays fast.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from lmforge.cli.main import build_parser
from lmforge.config.load import _inner_model, build_config, load_config, set_path
from lmforge.data.rows.preference import pair_segments
from lmforge.data.text.sources import list_files, read_source
from lmforge.guard import check_target
from lmforge.train.checkpoint import verify_checkpoint
from lmforge.config.schema import RunConfig
from lmforge.errors import UserError
from train_helpers import cli, lmforge

FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
EACH = settings(FAST, max_examples=12)  # per field / per flag: every one of them is tried

BASE = {"model": "llama-tiny", "train_data": "/nonexistent/data.txt", "training_duration": "10ba"}


def one_clean_line(proc, *words: str) -> str:
    """Bad input ended as the product says: exit 2, one `error:` line (≤ 5 lines in all), no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], err[-1000:])
    assert "Traceback" not in err + proc.stdout, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and len(err.splitlines()) <= 5, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- the issue's inputs

@pytest.fixture(scope="module")
def cfg_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "c.yaml").write_text(yaml.safe_dump(BASE))
    (d / "noweights.yaml").write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "model"}))
    (d / "other").mkdir()
    (d / "other" / "thesis.tex").write_text("years of work\n")
    return d


DRY = ["train", "-f", "{d}/c.yaml", "--dry-run"]
ISSUE_47 = [  # id, argv, words of the one error line
    # silent before: accepted, then trained (or never stepped) without a word
    ("save-folder-root", DRY + ["--save-folder", "/"], ["save_folder /", "filesystem root"]),
    ("save-folder-of-other-files", DRY + ["--save-folder", "{d}/other"], ["not an lmforge run", "thesis.tex"]),
    ("save-folder-empty", DRY + ["--set", "save_folder="], ["save_folder", "empty"]),
    ("lr-inf", DRY + ["--set", "parameters.learning_rate=.inf"], ["parameters.learning_rate", "finite"]),
    ("lr-1e10", DRY + ["--set", "parameters.learning_rate=1e10"], ["parameters.learning_rate", "less than"]),
    ("lr-true", DRY + ["--set", "parameters.learning_rate=true"], ["parameters.learning_rate", "boolean"]),
    ("weight-decay-1e9", DRY + ["--set", "parameters.weight_decay=1e9"], ["parameters.weight_decay"]),
    ("batch-1e12-tokens", DRY + ["--set", "parameters.global_batch_size=1e12 tok"],
     ["parameters.global_batch_size", "too large"]),
    ("yarn-original-above-max", DRY + ["--set", "model={preset: llama-tiny, rope_scaling: {type: yarn, factor: 4, "
                                       "original_max_seq_len: 4096}}"],
     ["original_max_seq_len (4096)", "max_seq_len (512)"]),
    ("linear-factor-1e308", DRY + ["--set", "model={preset: llama-tiny, rope_scaling: {type: linear, "
                                   "factor: 1.0e+308}}"], ["model.rope_scaling.factor"]),
    ("rope-scaling-from-scratch", DRY + ["--set", "model={preset: llama-tiny, rope_scaling: {type: linear, "
                                         "factor: 2}}"], ["model.rope_scaling", "custom_weights_path"]),
    ("gpus-zero", DRY + ["--set", "compute.gpus=0"], ["compute.gpus"]),
    ("max-retries-1e12", DRY + ["--set", "max_retries=1e12"], ["max_retries"]),
    ("max-retries-flag-1e12", DRY + ["--max-retries", "1000000000000"], ["--max-retries"]),
    ("name-1000-chars", DRY + ["--name", "n" * 1000], ["name", "too long"]),
    ("prepare-seq-len-1", ["data", "prepare", "--input", "x", "--tokenizer", "t", "--out", "{d}/o", "--seq-len", "1"],
     ["--seq-len", "at least 2"]),
    ("generate-max-new-tokens-1e8", ["generate", "--checkpoint", "x", "--prompt", "a", "--max-new-tokens",
                                     "100000000"], ["--max-new-tokens", "at most"]),
    ("runs-stop-timeout-negative", ["runs", "stop", "x", "--timeout", "-1"], ["--timeout", "at least 0"]),
    # tracebacks before (and retried by the supervisor as crashes)
    ("seed-negative", DRY + ["--set", "parameters.seed=-1"], ["parameters.seed"]),
    ("seed-1e30", DRY + ["--set", "parameters.seed=1.0e+30"], ["parameters.seed"]),
    ("generate-temperature-nan", ["generate", "--checkpoint", "x", "--prompt", "a", "--temperature", "nan"],
     ["--temperature", "'nan'"]),
    # misleading before
    ("finetune-without-weights", ["finetune", "-f", "{d}/noweights.yaml", "--dry-run"],
     ["custom_weights_path", "--weights"]),
    ("duration-negative", DRY + ["--training-duration", "-1ba"], ["training_duration", "positive", "-1ba"]),
    ("estimate-time-negative", ["estimate", "--model", "auto", "--time", "-5min"], ["--time", "-5min"]),
    ("estimate-params-negative", ["estimate", "--params", "-7B", "--tokens", "1T"], ["--params", "-7B"]),
    ("language-bogus", ["data", "dedup", "--input", "{d}/c.yaml", "--out", "{d}/dd", "--filter", "language",
                        "--language", "xx-bogus"], ["language", "'xx-bogus'", "lid.176"]),
]


# Issue 55's activation settings: refused at validation where the form is wrong, at planning (the
# dry run) where only the model's depth or the device says so.
ISSUE_55 = [
    ("ac-range-backwards", DRY + ["--set", "compute.activation_checkpointing={granularity: mlp, layers: 'range(5,2)'}"],
     ["compute.activation_checkpointing.layers", "range(5,2) is empty"]),
    ("ac-past-depth", DRY + ["--set", "compute.activation_checkpointing={granularity: block, layers: 'range(2,9)'}"],
     ["compute.activation_checkpointing.layers", "past the model's 6 blocks"]),
    ("ac-unknown-granularity", DRY + ["--set", "compute.activation_checkpointing={granularity: heads}"],
     ["compute.activation_checkpointing.granularity"]),
    ("ac-experts-of-dense", DRY + ["--set", "compute.activation_checkpointing={granularity: experts}"],
     ["compute.activation_checkpointing.granularity", "dense"]),
    ("compression-kind", DRY + ["--set", "compute.activation_compression={kind: fp4}"],
     ["compute.activation_compression.kind"]),
    ("compression-past-depth", DRY + ["--set", "compute.activation_compression={kind: int8, layers: last-9}"],
     ["compute.activation_compression.layers", "more blocks than the model's 6"]),
    ("offload-on-cpu", DRY + ["--set", "compute.activation_offload=true", "--set", "compute.device=cpu"],
     ["compute.activation_offload", "needs CUDA"]),
    ("estimate-ac-form", ["estimate", "--model", "llama-tiny", "--activation-checkpointing", "mlp:first-x"],
     ["--activation-checkpointing", "first-x"]),
]


@pytest.mark.parametrize("case", ISSUE_47 + ISSUE_55, ids=[c[0] for c in ISSUE_47 + ISSUE_55])
def test_issue_47_input(case, cfg_file):
    _, argv, words = case
    one_clean_line(cli(*[a.replace("{d}", str(cfg_file)) for a in argv]), *words)
    assert not (cfg_file / "o").exists() and not (cfg_file / "dd").exists()
    assert (cfg_file / "other" / "thesis.tex").read_text() == "years of work\n"


# --------------------------------------------------------------------------- the schema, every field

def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of every field of the config, sections opened (the model shape through a preset)."""
    out = []
    for name, field in model.model_fields.items():
        inner = _inner_model(field.annotation)
        if inner is not None and name not in ("model", "train_data", "curriculum"):
            out += leaf_fields(inner, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


FIELDS = leaf_fields(RunConfig) + [f"model.{k}" for k in ("d_model", "n_layers", "max_seq_len", "rope_theta",
                                                          "vocab_size", "n_experts", "init_std")]
# Keys that take a value or a section, as a whole (`activation_checkpointing: full | {granularity, layers}`).
FIELDS += ["compute.activation_checkpointing", "compute.activation_compression"]
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 1e308, -0.0, 1e-320, 2**63]),
    st.text(max_size=30), st.sampled_from(["", " ", "-1ba", "1e400tok", "auto", "true", "nan", "x" * 300, "/"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def finite_numbers(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(finite_numbers(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(finite_numbers(v) for v in obj)
    return True


@pytest.mark.parametrize("key", FIELDS)
@EACH
@given(value=HOSTILE)
def test_every_config_field_takes_a_value_or_names_itself(key, value):
    raw = json.loads(json.dumps(BASE))
    if key.startswith("model."):
        raw["model"] = {"preset": "llama-tiny"}
    set_path(raw, key, value)
    try:
        cfg = build_config(raw)
    except UserError as e:
        line = str(e)
        assert "\n" not in line and len(line) < 600, line
        assert key.split(".")[0] in line or key.split(".")[-1] in line, (key, line)
        return
    dumped = cfg.model_dump(mode="json")
    assert finite_numbers(dumped), (key, value)
    for k in ("learning_rate", "weight_decay", "seed"):
        v = dumped["parameters"][k]
        assert v is None or (not isinstance(v, bool) and v >= 0), (k, v)


# --------------------------------------------------------------------------- every command's flags

def typed_flags() -> list[tuple[list[str], argparse.Action]]:
    """(command words, action) of every flag that parses a number, in every command."""
    found = []

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, words + [name])
            elif action.option_strings and action.type not in (None, str) and action.choices is None:
                found.append((words, action))

    walk(build_parser(), [])
    return found


FLAGS = typed_flags()
FLAG_VALUES = st.one_of(st.sampled_from(["nan", "inf", "-inf", "-1", "-1ba", "-5min", "-7B", "0", "1e400",
                                         "100000000000000000000", "true", "", " ", "1.5", "--x"]),
                        st.integers(min_value=-10**12, max_value=10**12).map(str), st.text(max_size=8))


def test_every_typed_flag_is_found():
    assert len(FLAGS) >= 30, [(w, a.option_strings) for w, a in FLAGS]


def _flag_case(i: int):
    words, action = FLAGS[i]
    return pytest.param(i, id=" ".join(words + action.option_strings[-1:]))


@pytest.mark.parametrize("i", [_flag_case(i) for i in range(len(FLAGS))])
@EACH
@given(value=FLAG_VALUES)
def test_every_typed_flag_parses_a_value_or_names_itself(i, value):

    words, action = FLAGS[i]
    flag = action.option_strings[-1]
    try:
        expected = action.type(value)
    except (argparse.ArgumentTypeError, ValueError, TypeError, UserError):
        expected = None
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args([*words, f"{flag}={value}"])
            code = 0
        except SystemExit as e:
            code = e.code
    text = err.getvalue().strip()
    assert "Traceback" not in text
    if expected is None:  # refused: one line naming the flag
        assert code == 2 and len(text.splitlines()) == 1 and flag in text, (flag, value, text)
    elif code == 0:
        got = getattr(args, action.dest)
        assert not isinstance(got, float) or math.isfinite(got)
    else:  # the value was fine; another required argument is missing
        assert code == 2 and len(text.splitlines()) == 1 and "required" in text, text


# --------------------------------------------------------------------------- malformed files

@FAST
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                      st.sampled_from(["model: [", "a: 1\na: 2\n", "- 1\n", "model: llama-tiny\n" * 2, "{}",
                                       "train_data: {x: {path: 1}}\n", "!!python/object:os.system {}"])))
def test_a_config_file_of_any_text_is_read_or_refused_in_one_line(text):

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        try:
            load_config(path)
        except UserError as e:
            assert "\n" not in str(e) or str(e).count("\n") < 5, str(e)
        assert os.listdir(d) == ["c.yaml"]  # reading writes nothing


ROW_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10),
                      st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]),
                                               st.one_of(st.text(max_size=5), st.none()), max_size=3), max_size=3))


@FAST
@given(row=st.one_of(st.dictionaries(st.sampled_from(["prompt", "chosen", "rejected", "response", "messages"]),
                                     ROW_VALUE, max_size=4), ROW_VALUE))
def test_a_preference_row_of_any_shape_is_read_or_names_its_field(row):

    try:
        pair_segments(row, "pairs.jsonl:1")
    except UserError as e:
        assert str(e).startswith("pairs.jsonl:1") and "\n" not in str(e)


@FAST
@given(data=st.binary(max_size=300), kind=st.sampled_from([".txt.gz", ".jsonl.gz", ".txt.zst", ".txt", ".jsonl"]),
       gz_head=st.booleans())
def test_a_damaged_or_odd_text_file_is_read_or_refused_in_one_line(data, kind, gz_head):

    if gz_head and kind.endswith(".gz"):  # a real gzip stream, damaged after its header
        good = gzip.compress(b"hello world\n" * 50)
        data = good[:12] + data + good[12 + len(data):]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f" + kind)
        with open(path, "wb") as f:
            f.write(data)
        try:
            for src in list_files([path]):
                for doc in read_source(src):
                    assert isinstance(doc, str)
        except UserError as e:
            assert "\n" not in str(e) and "f" + kind in str(e), str(e)


@settings(FAST, max_examples=30)
@given(state=st.one_of(st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                       st.dictionaries(st.sampled_from(["step", "files", "config"]),
                                       st.one_of(st.none(), st.integers(), st.text(max_size=5),
                                                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)),
                                       max_size=3).map(json.dumps)))
def test_a_checkpoint_state_of_any_content_is_refused_by_name(state):

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "lmforge-state.json"), "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(state)
        try:
            verify_checkpoint(d)
        except UserError as e:
            assert d in str(e) and "\n" not in str(e), str(e)


# --------------------------------------------------------------------------- the guard, against an oracle

PARTS = st.lists(st.sampled_from(["a", "b", "..", "."]), min_size=1, max_size=4)


@FAST
@given(target=PARTS, read=PARTS)
def test_the_guard_refuses_exactly_what_overlaps(target, read):
    """Never writes where it reads: a target is refused iff it and the read are one folder or one
    holds the other (paths resolved, `..` included)."""
    with tempfile.TemporaryDirectory() as root:
        base = os.path.join(root, "w", "x", "y", "z")  # deep enough that `..` stays inside root
        t, r = os.path.realpath(os.path.join(base, *target)), os.path.realpath(os.path.join(base, *read))
        overlap = os.path.commonpath([t, r]) in (t, r)
        try:
            check_target(os.path.join(base, *target), "--out", [("the input", os.path.join(base, *read))])
            refused = False
        except UserError:
            refused = True
        assert refused == overlap, (t, r)


# --------------------------------------------------------------------------- a few real processes

@pytest.mark.e2e
@pytest.mark.parametrize("argv,words", [
    (["train", "-f", "{d}/c.yaml", "--set", "parameters.learning_rate=true", "--save-folder", "{d}/r"],
     ["parameters.learning_rate", "boolean"]),
    (["train", "-f", "{d}/c.yaml", "--save-folder", "{d}/other"], ["not an lmforge run"]),
    (["estimate", "--model", "llama-tiny", "--tokens", "1B", "--gpus", "-2"], ["--gpus"]),
], ids=["bool-lr-supervised", "foreign-save-folder", "negative-gpus"])
def test_bad_input_in_a_real_process_is_one_line_and_never_retried(argv, words, cfg_file):
    """Through the supervisor: exit 2, one line, no run kept, nothing written into the folders."""
    proc = lmforge(*[a.replace("{d}", str(cfg_file)) for a in argv], timeout=120)
    one_clean_line(proc, *words)
    assert "restart" not in proc.stderr and not (cfg_file / "r").exists()
    assert sorted(os.listdir(cfg_file / "other")) == ["thesis.tex"]


# --------------------------------------------------------------------------- --overwrite targets (issue 59)

# A world of what lmforge keeps and what it reads, each place labelled by what it is (independently of
# the guard's own reading): the kind of lmforge output it is, "run:NAME", "home" (LMFORGE_HOME),
# "input" (what the commands read), "foreign" (someone's files), "part" (inside an output), "holds"
# (a folder holding outputs), "new" (missing) or "empty".
PLACES = {
    "": "holds", "home": "home", "home/cache": "holds", "home/cache/data": "holds", "home/cache/data/k1": "dataset",
    "home/cache/data/k1/train": "part", "home/cache/tokenizers/k2": "tokenizer", "home/mlruns": "foreign",
    "runs": "holds", "runs/a": "run:a", "runs/a/final": "part", "runs/a/checkpoints": "part", "runs/a/hf": "new",
    "runs/b": "run:b", "runs/b/final": "part", "inputs": "input", "inputs/raw": "input", "tok": "tokenizer",
    "data": "dataset", "data/train": "part", "export": "export", "dedup": "dedup", "mine": "foreign",
    "mine/notes": "foreign", "mine/empty": "empty", "new": "new", "new/deeper": "new", "data/../tok": "tokenizer",
    "runs/a/../b": "run:b", "holder": "holds"}
OUT_KINDS = {"tokenizer": "tokenizer", "export": "export", "prepare": "dataset", "dedup": "dedup"}


@pytest.fixture(scope="module")
def overwrite_world(tmp_path_factory) -> Path:
    """The world of `PLACES`, made by lmforge itself where lmforge would have made it."""
    import shutil

    import torch

    from lmforge.checksums import write_export_digests
    from lmforge.cli.main import main
    from lmforge.config.model import ModelConfig
    from lmforge.data.prepare.prepare import prepare
    from lmforge.models import build_model, save_pretrained

    root = tmp_path_factory.mktemp("overwrite") / "world"
    raw = root / "inputs" / "raw"
    raw.mkdir(parents=True)
    (raw / "a.py.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    (raw / "b.txt").write_text("a few words of a story, told again. " * 60)
    assert main(["tokenizer", "train", "--input", str(raw), "--vocab-size", "300", "--out", str(root / "tok")]) == 0
    prepare([str(raw)], str(root / "tok"), str(root / "data"), 16, workers=1)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32, vocab_size=300)
    for name in ("a", "b"):
        run = root / "runs" / name
        save_pretrained(build_model(cfg), cfg, run / "final", tokenizer_dir=root / "tok")
        write_export_digests(str(run / "final"))
        (run / "checkpoints" / "step_00000002").mkdir(parents=True)
        (run / "checkpoints" / "step_00000002" / "lmforge-state.json").write_text('{"step": 2}')
        (run / "run.json").write_text(json.dumps({"identity": {"name": name}, "config": {}}))
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    shutil.copytree(root / "runs" / "a" / "final", root / "export")
    (root / "dedup").mkdir()
    (root / "dedup" / "documents.jsonl").write_text('{"text": "kept"}\n')
    (root / "dedup" / "curation.json").write_text(json.dumps({"format": "lmforge-curation"}))
    home = root / "home"
    (home / "mlruns" / "0").mkdir(parents=True)
    (home / "mlruns" / "0" / "meta.yaml").write_text("name: Default\n")
    (home / "runs.db").write_bytes(b"SQLite format 3\0 the registry")
    shutil.copytree(root / "data", home / "cache" / "data" / "k1")
    shutil.copytree(root / "tok", home / "cache" / "tokenizers" / "k2")
    (root / "mine" / "notes").mkdir(parents=True)
    (root / "mine" / "empty").mkdir()
    (root / "mine" / "thesis.tex").write_text("years of work\n")
    (root / "mine" / "notes" / "n.txt").write_text("notes\n")
    (root / "holder").mkdir()
    shutil.copytree(root / "runs" / "b", root / "holder" / "old-run")  # a folder holding a run
    return root


def _files(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _replaceable(label: str, kind: str, overwrite: bool) -> bool:
    """The oracle: what the rule lets a command of ``kind`` take (the guard's part: a prepared dataset or a
    dedup output of the same kind passes it without --overwrite, its command then resumes or refuses)."""
    return label in ("new", "empty") or (label == kind and (overwrite or kind in ("dataset", "dedup")))


@FAST
@given(place=st.sampled_from(sorted(PLACES)), kind=st.sampled_from(sorted(set(OUT_KINDS.values()))),
       overwrite=st.booleans())
def test_the_rule_of_overwrite_against_an_oracle(place, kind, overwrite, overwrite_world):
    """Every --out target of the world, every kind of output, --overwrite or not: the guard lets a command
    take a target exactly when it is new, empty or an output of the same kind lmforge made (never the
    home folder, a run, an input, someone's files, a part of an output or a folder holding one)."""
    from unittest import mock

    from lmforge.guard import check_output

    with mock.patch.dict(os.environ, {"LMFORGE_HOME": str(overwrite_world / "home")}):
        try:
            check_output(str(overwrite_world / place), "--out", kind, overwrite=overwrite,
                         reads=[("the input", str(overwrite_world / "inputs" / "raw"))])
            allowed = True
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith("--out "), str(e)
            allowed = False
    assert allowed == _replaceable(PLACES[place], kind, overwrite), (place, kind, overwrite)


@FAST
@given(place=st.sampled_from(sorted(PLACES)), name=st.sampled_from(["a", "b", "c"]), overwrite=st.booleans())
def test_a_save_folder_is_never_another_runs_or_someone_elses(place, name, overwrite, overwrite_world):
    """A run's save folder, drawn from the same world: refused unless new, empty or a run of its own
    name (train --overwrite then replaces that run's checkpoints, nothing else)."""
    from unittest import mock

    from lmforge.guard import check_run_owner, check_run_place

    folder = str(overwrite_world / place)
    with mock.patch.dict(os.environ, {"LMFORGE_HOME": str(overwrite_world / "home")}):
        try:
            check_run_place(folder, reads=[("the training data", str(overwrite_world / "inputs" / "raw"))])
            check_run_owner(folder, name, overwrite=overwrite)
            allowed = True
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith("save_folder "), str(e)
            allowed = False
    assert allowed == (PLACES[place] in ("new", "empty", f"run:{name}")), (place, name, overwrite)


def _command(kind: str, world: Path, out: Path) -> list[str]:
    raw = str(world / "inputs" / "raw")
    return {"tokenizer": ["tokenizer", "train", "--input", raw, "--vocab-size", "300"],
            "export": ["export", "--checkpoint", str(world / "runs" / "b" / "final")],
            "prepare": ["data", "prepare", "--input", raw, "--tokenizer", str(world / "tok"), "--seq-len", "16",
                        "--workers", "1"],
            "dedup": ["data", "dedup", "--input", raw, "--dedup", "exact", "--workers", "1"]}[kind] + ["--out", str(out)]


@pytest.mark.integration
@settings(FAST, max_examples=40)
@given(place=st.sampled_from(sorted(p for p in PLACES if p)), command=st.sampled_from(sorted(OUT_KINDS)),
       overwrite=st.booleans())
def test_overwrite_through_the_commands_never_loses_a_file(place, command, overwrite, overwrite_world,
                                                           tmp_path_factory):
    """The commands themselves, in this process, on a fresh copy of the world: a refusal is one line and
    leaves every file as it was (hashed before and after); a command that goes ahead changes nothing
    but its target, and only a target that was new, empty or its own kind of output."""
    import shutil
    from unittest import mock

    from train_helpers import cli

    world = tmp_path_factory.mktemp("overwrite-run") / "world"
    shutil.copytree(overwrite_world, world, symlinks=True)
    argv = _command(command, world, world / place) + (["--overwrite"] if overwrite else [])
    with mock.patch.dict(os.environ, {"LMFORGE_HOME": str(world / "home")}):
        before = _files(world)
        proc = cli(*argv)
        after = _files(world)
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 2), proc.stderr[-2000:]
    if proc.returncode == 2:
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
        assert after == before, (place, command, proc.stderr)
        return
    label, target = PLACES[place], os.path.realpath(world / place)
    assert label in ("new", "empty", OUT_KINDS[command]), (place, command, label)
    outside = {k: v for k, v in before.items() if not os.path.realpath(world / k).startswith(target + os.sep)}
    assert {k: v for k, v in after.items() if k in outside} == outside, (place, command)
    shutil.rmtree(world.parent, ignore_errors=True)
