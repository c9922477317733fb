"""Bad input, table-driven: every case is one command line with the files it needs, the exit code
it must end with, words its one `error:` line must hold, and files that must stay byte-identical.
On the code before issue 22 the same 73 cases gave 23 tracebacks (``was_traceback``), 13 inputs
accepted without a word and 8 misleading lines.

The commands run in this process through `lmforge.cli.main.main` (no interpreter start-up); the
few things only a real process shows (the supervisor not retrying, the registry's record) are the
subprocess tests at the end. Everything uses the session's tiny corpus and a 4-step tiny model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from conftest import SHARED, tiny_run_config
from train_helpers import assert_one_line_error, cli, lmforge, set_dotted, write_config

SHAKESPEARE = SHARED / "corpora" / "tinyshakespeare.txt"


@dataclass
class Case:
    id: str
    argv: list[str]  # {name} placeholders: see World.values, plus {dir} (this case's folder)
    words: list[str] = field(default_factory=list)  # all in the one error line
    files: dict = field(default_factory=dict)  # name in {dir} → str, bytes, a dict (YAML) or callable(world, dir)
    keep: list[str] = field(default_factory=list)  # paths (with placeholders) that must not change
    absent: list[str] = field(default_factory=list)  # paths that must not exist afterwards (a run's save folder)
    code: int = 2
    was_traceback: bool = False  # on the landed main, this input ended in a traceback (issue 22)


class World:
    """What the cases point at: the tiny corpus, its tokenizer and prepared data, a config, a run."""

    def __init__(self, root: Path, data):
        self.root, self.data = root, data
        run = root / "run"
        self.cfg = tiny_run_config(data, run, training_duration="4ba", save_interval="2ba",
                                   **{"parameters.global_batch_size": 4, "eval.interval": "4ba",
                                      "eval.max_batches": 1, "eval.prompts": []})
        self.cfg["name"] = "bad-input-run"
        self.cfg_path = write_config(root / "run.yaml", self.cfg)
        cli("train", "-f", self.cfg_path, "--no-supervisor", check=True)
        self.run = run
        (root / "lm.jsonl").write_text("".join(json.dumps({"context": f"def f{i}(", "continuation": "x):"}) + "\n"
                                               for i in range(4)))
        self.tasks = root / "tasks.yaml"
        self.tasks.write_text(yaml.safe_dump({"icl_tasks": [
            {"label": "lm", "dataset_uri": str(root / "lm.jsonl"), "num_fewshot": [0],
             "icl_task_type": "language_modeling"}]}))
        self.values = {"cfg": str(self.cfg_path), "run": str(run), "final": str(run / "final"),
                       "data": str(data.dataset), "tok": str(data.tokenizer), "raw": str(data.raw),
                       "tasks": str(self.tasks), "home": os.environ["LMFORGE_HOME"]}

    def config(self, **changes) -> dict:
        cfg = json.loads(json.dumps(self.cfg))
        set_dotted(cfg, changes)
        return cfg


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_data) -> World:
    return World(tmp_path_factory.mktemp("bad-input"), tiny_data)


# --------------------------------------------------------------------------- file makers


def damaged_final(how: str):
    """A copy of the run's final/ with its weights truncated, bit-flipped or with a broken header."""
    def make(world: World, d: Path) -> None:
        out = d / "final"
        shutil.copytree(world.run / "final", out)
        f = out / "model.safetensors"
        b = bytearray(f.read_bytes())
        if how == "truncated":
            b = b[: len(b) // 2]
        elif how == "header":
            b[20:60] = bytes(40)
        else:  # one bit of one weight
            b[-100] ^= 0x10
        f.write_bytes(bytes(b))
        if how == "no-digests":
            (out / "lmforge-checksums.json").unlink(missing_ok=True)
            f.write_bytes(bytes(b[: len(b) // 2]))
    return make


def run_copy(world: World, d: Path) -> None:
    shutil.copytree(world.run, d / "run", ignore=shutil.ignore_patterns("*.lock", "logs"))


def config(name: str, **changes):
    def make(world: World, d: Path) -> None:
        write_config(d / name, world.config(**({"save_folder": str(d / "run")} | changes)))
    return make


def resumed_config(**changes):
    """A copy of the trained run, and its config with ``changes`` pointing at the copy."""
    def make(world: World, d: Path) -> None:
        run_copy(world, d)
        write_config(d / "resume.yaml", world.config(save_folder=str(d / "run"), training_duration="6ba", **changes))
    return make


def text_of(name: str, text: str):
    return lambda world, d: (d / name).write_text(text)


def yaml_with(extra: str):
    return lambda world, d: (d / "c.yaml").write_text(world.cfg_path.read_text() + extra)


def tokenizer_of(vocab: int):
    def make(world: World, d: Path) -> None:
        from lmforge.data.text.tokenizer import train_tokenizer

        train_tokenizer([str(world.data.raw / "textwrap.py.txt")], vocab, str(d / "small-tok"))
    return make


def nonempty(name: str):
    def make(world: World, d: Path) -> None:
        (d / name).mkdir()
        (d / name / "notes.txt").write_text("mine\n")
    return make


def home_file(world: World, d: Path) -> None:
    """The home folder holds something to lose, whatever ran before in this session."""
    (Path(world.values["home"]) / "notes-59.txt").write_text("the registry, the caches\n")


# Commands that write a folder --out: `--out DIR [--overwrite]` is appended.
OUT_COMMANDS = [
    ("tokenizer", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "300"]),
    ("export", ["export", "--checkpoint", "{final}"]),
    ("prepare", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{tok}", "--seq-len", "64"]),
    ("dedup", ["data", "dedup", "--input", "{raw}", "--dedup", "exact"]),
]

BINARY = bytes(range(256)) * 4
LATIN1 = "name: café\n".encode("latin-1")
BIG_MODEL = {"d_model": 65536, "n_layers": 256, "n_heads": 512, "vocab_size": 65536, "max_seq_len": 64}

# --------------------------------------------------------------------------- the table

CASES = [
    # --- the run config: reading it
    Case("config-not-utf8", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["c.yaml", "not UTF-8", "line 1"],
         files={"c.yaml": LATIN1}, keep=["{dir}/c.yaml"], was_traceback=True),
    Case("config-binary", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["c.yaml", "binary"],
         files={"c.yaml": BINARY}, was_traceback=True),
    Case("config-is-a-folder", ["train", "-f", "{dir}", "--dry-run"], ["is a folder", "expected a file"],
         was_traceback=True),
    Case("config-missing", ["train", "-f", "{dir}/none.yaml", "--dry-run"], ["config file not found", "none.yaml"]),
    Case("config-bad-yaml", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["c.yaml", "line", "YAML"],
         files={"c.yaml": "model: [unclosed\n"}),
    Case("config-list", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["mapping", "list"], files={"c.yaml": "- a\n"}),
    Case("config-duplicate-key", ["train", "-f", "{dir}/c.yaml", "--dry-run"],
         ["training_duration", "twice", "lines"], files={"c.yaml": yaml_with("training_duration: 9ba\n")}),
    Case("config-duplicate-nested-key", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["learning_rate", "twice"],
         files={"c.yaml": lambda w, d: (d / "c.yaml").write_text(
             w.cfg_path.read_text().replace("  learning_rate:", "  learning_rate: 0.1\n  learning_rate:"))}),
    Case("config-unknown-key", ["train", "-f", "{dir}/c.yaml", "--dry-run"], ["training_duraton", "did you mean"],
         files={"c.yaml": yaml_with("training_duraton: 9ba\n")}),
    # --- durations and values
    Case("duration-overflow", ["train", "-f", "{cfg}", "--training-duration", "1e999ba", "--dry-run"],
         ["training_duration", "too large"], was_traceback=True),
    Case("duration-huge-tokens", ["train", "-f", "{cfg}", "--training-duration", "1e30tok", "--dry-run"],
         ["training_duration", "too large"]),
    Case("duration-zero", ["train", "-f", "{cfg}", "--training-duration", "0ba", "--dry-run"], ["positive"]),
    Case("duration-no-unit", ["train", "-f", "{cfg}", "--set", "training_duration=500", "--dry-run"], ["no unit"]),
    Case("duration-bad-unit", ["train", "-f", "{cfg}", "--training-duration", "5parsecs", "--dry-run"],
         ["unknown unit"]),
    Case("set-without-equals", ["train", "-f", "{cfg}", "--set", "parameters.learning_rate", "--dry-run"],
         ["KEY.PATH=VALUE"]),
    Case("holdout-fraction-1", ["train", "-f", "{cfg}", "--set", "eval.holdout_fraction=1.5", "--dry-run"],
         ["eval.holdout_fraction"]),
    Case("negative-lr", ["train", "-f", "{cfg}", "--set", "parameters.learning_rate=-1", "--dry-run"],
         ["parameters.learning_rate"]),
    Case("micro-batch-zero", ["train", "-f", "{cfg}", "--set", "parameters.micro_batch_size=0", "--dry-run"],
         ["micro_batch_size"]),
    Case("bad-device", ["train", "-f", "{cfg}", "--set", "compute.device=tpu", "--dry-run"], ["compute.device"]),
    Case("hang-timeout-tiny", ["train", "-f", "{cfg}", "--set", "compute.hang_timeout=1", "--dry-run"],
         ["hang_timeout", "floor"]),
    Case("plan-by-hand", ["train", "-f", "{cfg}", "--plan", "{{nope"], ["--plan", "not a launch plan"]),
    Case("no-config", ["train", "--model", "llama-tiny"], ["-f FILE"]),
    # --- secrets
    Case("secrets-binary", ["train", "-f", "{cfg}", "--set", "secrets.file={dir}/creds", "--dry-run"],
         ["secrets.file", "binary"], files={"creds": BINARY}, keep=["{dir}/creds"], was_traceback=True),
    Case("secrets-not-utf8", ["train", "-f", "{cfg}", "--set", "secrets.file={dir}/creds", "--dry-run"],
         ["secrets.file", "not UTF-8"], files={"creds": b"AWS_SECRET_ACCESS_KEY=caf\xe9\n"}, was_traceback=True),
    Case("secrets-missing", ["train", "-f", "{cfg}", "--set", "secrets.file={dir}/none.env", "--dry-run"],
         ["secrets.file", "none.env"]),
    Case("secrets-unknown-key", ["train", "-f", "{cfg}", "--set", "secrets.file={dir}/creds", "--dry-run"],
         ["unknown key", "PASSWORD"], files={"creds": "PASSWORD=hunter2\n"}),
    # --- refused before a run starts (preflight): nothing registered, nothing written
    Case("save-folder-is-a-file", ["train", "-f", "{cfg}", "--save-folder", "{dir}/f", "--no-supervisor"],
         ["save_folder", "not a folder"], files={"f": "precious\n"}, keep=["{dir}/f"]),
    Case("finetune-a-pretraining-config", ["finetune", "-f", "{cfg}", "--save-folder", "{dir}/ft", "--no-supervisor"],
         ["prepared pretraining dataset", "lmforge train", "continued_pretrain"], was_traceback=True),
    Case("sft-data-is-a-folder", ["finetune", "-f", "{cfg}", "--train-data", "{raw}", "--save-folder", "{dir}/ft",
                                  "--no-supervisor"], ["is a folder", "JSONL"], was_traceback=True),
    Case("tokenizer-smaller-than-data", ["train", "-f", "{cfg}", "--set", "tokenizer={dir}/small-tok",
                                         "--save-folder", "{dir}/r", "--no-supervisor"],
         ["prepared with a tokenizer of 512 tokens", "small-tok"], files={"small-tok": tokenizer_of(300)},
         was_traceback=True),
    Case("model-family-mismatch", ["train", "-f", "{cfg}", "--set", "model.family=gemma2", "--save-folder", "{dir}/r",
                                   "--no-supervisor"], ["model.family gemma2", "do not match"], absent=["{dir}/r"]),
    Case("vocab-smaller-than-data", ["train", "-f", "{cfg}", "--set", "model.vocab_size=64", "--save-folder",
                                     "{dir}/r", "--no-supervisor"], ["512 tokens", "model.vocab_size (64)"]),
    Case("model-does-not-fit", ["train", "-f", "{dir}/big.yaml", "--no-supervisor"],
         ["does not fit", "GB", "dry-run"], files={"big.yaml": config("big.yaml", model=BIG_MODEL)},
         was_traceback=True),
    Case("weights-truncated", ["train", "-f", "{cfg}", "--weights", "{dir}/final", "--save-folder", "{dir}/r",
                               "--no-supervisor"], ["model.safetensors", "truncated"],
         files={"final": damaged_final("truncated")}, was_traceback=True),
    Case("weights-bit-flip", ["train", "-f", "{cfg}", "--weights", "{dir}/final", "--save-folder", "{dir}/r",
                              "--no-supervisor"], ["model.safetensors", "sha256"],
         files={"final": damaged_final("flip")}),
    Case("weights-truncated-no-digests", ["train", "-f", "{cfg}", "--weights", "{dir}/final", "--save-folder",
                                          "{dir}/r", "--no-supervisor"], ["model.safetensors", "safetensors"],
         files={"final": damaged_final("no-digests")}, was_traceback=True),
    Case("weights-missing", ["train", "-f", "{cfg}", "--weights", "{dir}/none", "--save-folder", "{dir}/r",
                             "--no-supervisor"], ["none", "no such folder"]),
    # --- data
    Case("train-data-binary", ["train", "-f", "{cfg}", "--train-data", "{dir}/blob.txt", "--save-folder", "{dir}/r",
                               "--no-supervisor"], ["blob.txt", "no usable documents", "binary"], files={"blob.txt": BINARY}),
    Case("train-data-missing", ["train", "-f", "{cfg}", "--train-data", "{dir}/none.txt", "--save-folder", "{dir}/r",
                                "--no-supervisor"], ["train_data", "none.txt", "no such file or folder"],
         absent=["{dir}/r"]),
    Case("train-data-glob-matches-nothing", ["train", "-f", "{cfg}", "--train-data", "{dir}/*.txt", "--save-folder",
                                             "{dir}/r", "--no-supervisor"], ["train_data", "matches no files"],
         absent=["{dir}/r"]),
    Case("batch-not-whole-micro-batches", ["train", "-f", "{cfg}", "--set", "parameters.global_batch_size=6",
                                           "--save-folder", "{dir}/r", "--no-supervisor"],
         ["global_batch_size (6)", "micro_batch_size (4)"], absent=["{dir}/r"]),
    Case("batch-not-divisible-by-ranks", ["train", "-f", "{cfg}", "--set", "parameters.global_batch_size=6", "--set",
                                          "parameters.micro_batch_size=auto", "--set", "compute.ranks=4",
                                          "--save-folder", "{dir}/r"],
         ["global_batch_size (6)", "number of ranks (4)"], absent=["{dir}/r"]),
    Case("context-longer-than-prepared-data", ["train", "-f", "{cfg}", "--set", "parameters.context_length=128",
                                               "--save-folder", "{dir}/r", "--no-supervisor"],
         ["context_length (128)", "samples (64 tokens)", "--seq-len 128"], absent=["{dir}/r"]),
    Case("train-data-one-short-doc", ["train", "-f", "{cfg}", "--train-data", "{dir}/short.txt", "--save-folder",
                                      "{dir}/r", "--no-supervisor"],
         ["parameters.context_length", "larger than the data"], files={"short.txt": "just a few words\n"}),
    Case("prepare-eval-fraction", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{tok}", "--out", "{dir}/o",
                                   "--seq-len", "64", "--eval-fraction", "1.5"], ["--eval-fraction", "below 1"]),
    Case("prepare-seq-len-zero", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{tok}", "--out", "{dir}/o",
                                  "--seq-len", "0"], ["--seq-len"]),
    Case("prepare-nothing-to-hold-out", ["data", "prepare", "--input", "{dir}/one.txt", "--tokenizer", "{tok}",
                                         "--out", "{dir}/o", "--seq-len", "64", "--eval-fraction", "0.5"],
         ["--eval-fraction 0.5", "only 1 sample", "--eval-fraction 0"], files={"one.txt": "word " * 30}),
    Case("prepare-binary-input", ["data", "prepare", "--input", "{dir}/blob.txt", "--tokenizer", "{tok}", "--out",
                                  "{dir}/o", "--seq-len", "64", "--eval-fraction", "0.1"],
         ["blob.txt", "binary", "no usable documents"], files={"blob.txt": BINARY}),
    Case("prepare-out-not-empty", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{tok}", "--out", "{dir}/o",
                                   "--seq-len", "64"], ["--out", "notes.txt", "replaces only a prepared dataset"],
         files={"o": nonempty("o")}, keep=["{dir}/o"]),
    Case("prepare-tokenizer-missing", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{dir}/none",
                                       "--out", "{dir}/o", "--seq-len", "64"], ["none"]),
    # --- generate / export / eval on damaged weights
    Case("generate-truncated", ["generate", "--checkpoint", "{dir}/final", "--prompt", "x"],
         ["model.safetensors", "truncated"], files={"final": damaged_final("truncated")}, was_traceback=True),
    Case("generate-header", ["generate", "--checkpoint", "{dir}/final", "--prompt", "x"],
         ["model.safetensors", "sha256"], files={"final": damaged_final("header")}, was_traceback=True),
    Case("generate-bit-flip", ["generate", "--checkpoint", "{dir}/final", "--prompt", "x"],
         ["model.safetensors", "sha256"], files={"final": damaged_final("flip")}),
    Case("generate-truncated-no-digests", ["generate", "--checkpoint", "{dir}/final", "--prompt", "x"],
         ["model.safetensors", "not a readable safetensors"], files={"final": damaged_final("no-digests")},
         was_traceback=True),
    Case("generate-missing", ["generate", "--checkpoint", "{dir}/none", "--prompt", "x"], ["no such folder"]),
    Case("generate-empty-folder", ["generate", "--checkpoint", "{dir}/e", "--prompt", "x"], ["holds no model"],
         files={"e": lambda w, d: (d / "e").mkdir()}),
    Case("export-truncated", ["export", "--checkpoint", "{dir}/final", "--out", "{dir}/hf"],
         ["model.safetensors", "truncated"], files={"final": damaged_final("truncated")}, was_traceback=True),
    Case("export-bit-flip", ["export", "--checkpoint", "{dir}/final", "--out", "{dir}/hf"],
         ["model.safetensors", "sha256"], files={"final": damaged_final("flip")}),
    Case("export-out-not-empty", ["export", "--checkpoint", "{final}", "--out", "{dir}/hf"],
         ["notes.txt", "replaces only an export"], files={"hf": nonempty("hf")}, keep=["{dir}/hf"]),
    Case("export-bad-dtype", ["export", "--checkpoint", "{final}", "--out", "{dir}/hf", "--dtype", "int3"], ["--dtype"]),
    Case("eval-truncated", ["eval", "--checkpoint", "{dir}/final", "--tasks", "{tasks}"],
         ["model.safetensors", "truncated"], files={"final": damaged_final("truncated")}, was_traceback=True),
    Case("eval-run-folder-damaged", ["eval", "--checkpoint", "{dir}/run", "--tasks", "{tasks}"],
         ["model.safetensors", "truncated"], files={"run": run_copy, "x": lambda w, d: _truncate(
             d / "run" / "final" / "model.safetensors")}, was_traceback=True),
    Case("generate-checkpoint-bit-flip", ["generate", "--checkpoint", "{dir}/run/checkpoints/step_00000004",
                                          "--prompt", "x"], ["step_00000004", "distcp", "sha256"],
         files={"run": run_copy, "x": lambda w, d: [
             _flip(f) for f in (d / "run" / "checkpoints" / "step_00000004").glob("*.distcp")]}),
    Case("eval-tasks-binary", ["eval", "--checkpoint", "{final}", "--tasks", "{dir}/t.yaml"], ["tasks file", "binary"],
         files={"t.yaml": BINARY}, was_traceback=True),
    Case("eval-tasks-not-utf8", ["eval", "--checkpoint", "{final}", "--tasks", "{dir}/t.yaml"], ["not UTF-8"],
         files={"t.yaml": LATIN1}, was_traceback=True),
    Case("eval-tasks-duplicate-key", ["eval", "--checkpoint", "{final}", "--tasks", "{dir}/t.yaml"], ["twice"],
         files={"t.yaml": "icl_tasks: []\nicl_tasks: []\n"}),
    Case("eval-gauntlet-binary", ["eval", "--checkpoint", "{final}", "--tasks", "{tasks}", "--gauntlet", "{dir}/g.yaml"],
         ["gauntlet file", "binary"], files={"g.yaml": BINARY}, was_traceback=True),
    Case("eval-batch-size-zero", ["eval", "--checkpoint", "{final}", "--tasks", "{tasks}", "--batch-size", "0"],
         ["--batch-size"]),
    # --- output folders
    Case("tokenizer-out-not-empty", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "300", "--out", "{dir}/t"],
         ["--out", "notes.txt", "replaces only a tokenizer folder"], files={"t": nonempty("t")}, keep=["{dir}/t"]),
    Case("tokenizer-out-is-a-model", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "300", "--out",
                                      "{dir}/run/final"], ["is part of run 'bad-input-run'"],
         files={"run": run_copy}, keep=["{dir}/run/final"]),
    Case("tokenizer-out-is-a-file", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "300", "--out",
                                     "{dir}/t"], ["not a folder"], files={"t": "x\n"}, keep=["{dir}/t"], was_traceback=True),
    # output files replace what the same command wrote before, never another file (a config, a script)
    Case("report-out-is-a-config", ["report", "{run}", "--out", "{dir}/run.yaml"], ["--out", "not written by",
                                                                               "--overwrite"],
         files={"run.yaml": "name: mine\n"}, keep=["{dir}/run.yaml"]),
    Case("launch-output-is-the-config", ["launch", "slurm", "-f", "{dir}/job.yaml", "--nodes", "1",
                                         "--gpus-per-node", "1", "-o", "{dir}/job.yaml"],
         ["-o", "is the config"], files={"job.yaml": config("job.yaml")}, keep=["{dir}/job.yaml"]),
    Case("stats-plot-over-a-file", ["data", "stats", "{raw}", "--plot", "{dir}/notes.png"],
         ["--plot", "not written by", "--overwrite"], files={"notes.png": b"\x89PNG not ours"},
         keep=["{dir}/notes.png"]),
    Case("stats-plot-neither-png-nor-html", ["data", "stats", "{raw}", "--plot", "{dir}/p.pdf"],
         ["--plot", "p.pdf", ".png or .html"], absent=["{dir}/p.pdf"]),
    Case("tokenizer-vocab-tiny", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "10", "--out", "{dir}/t"],
         ["--vocab-size", "too small"]),
    Case("estimate-model-binary", ["estimate", "--model", "{dir}/m.yaml"], ["binary"], files={"m.yaml": BINARY},
         was_traceback=True),
    Case("estimate-model-duplicate-key", ["estimate", "--model", "{dir}/m.yaml"], ["twice"],
         files={"m.yaml": "model: llama-tiny\nmodel: llama-tiny\n"}),
    # --- resuming
    Case("resume-changed-global-batch", ["train", "-f", "{dir}/resume.yaml", "--no-supervisor"],
         ["global_batch_size is 8", "trained with 4"],
         files={"resume.yaml": resumed_config(**{"parameters.global_batch_size": 8})},
         keep=["{dir}/run/checkpoints", "{dir}/run/final"]),
    Case("resume-changed-context", ["train", "-f", "{dir}/resume.yaml", "--no-supervisor"],
         ["context_length is 32", "trained with 64"],
         files={"resume.yaml": resumed_config(**{"parameters.context_length": 32})},
         keep=["{dir}/run/checkpoints", "{dir}/run/final"]),
    Case("resume-every-checkpoint-corrupt", ["train", "-f", "{dir}/resume.yaml", "--no-supervisor"],
         ["lmforge-state.json", "no intact checkpoint", "--no-autoresume"],
         files={"resume.yaml": resumed_config(), "x": lambda w, d: [
             (p / "lmforge-state.json").write_text("{") for p in (d / "run" / "checkpoints").iterdir()]},
         keep=["{dir}/run/final"]),
    # --- issue 40: accepted without a word, or refused with a misleading line
    Case("betas-out-of-range", ["train", "-f", "{cfg}", "--set", "parameters.betas=[1.5, 0.95]", "--dry-run"],
         ["parameters.betas", "1.5", "[0, 1)"]),
    Case("duration-fractional-steps", ["train", "-f", "{cfg}", "--training-duration", "3.7ba", "--dry-run"],
         ["training_duration", "3.7ba", "whole number"]),
    Case("interval-fractional-tokens", ["train", "-f", "{cfg}", "--set", "save_interval=10.5tok", "--dry-run"],
         ["save_interval", "10.5tok", "whole number"]),
    Case("estimate-seq-len-zero", ["estimate", "--model", "llama-tiny", "--seq-len", "0"], ["--seq-len", "'0'"]),
    Case("name-with-a-path", ["train", "-f", "{cfg}", "--name", "a/../../b", "--dry-run"], ["name", "a/../../b", "'/'"]),
    Case("name-empty", ["train", "-f", "{cfg}", "--name", "", "--dry-run"], ["name", "empty"]),
    Case("nodes-without-endpoint", ["train", "-f", "{cfg}", "--nnodes", "2", "--dry-run"],
         ["compute.nodes", "compute.rdzv_endpoint", "HOST:PORT"]),
    Case("endpoint-not-a-host", ["train", "-f", "{cfg}", "--nnodes", "2", "--rdzv-endpoint", "not a host",
                                 "--dry-run"], ["compute.rdzv_endpoint", "not a host", "HOST:PORT"]),
    Case("tokenizer-train-vocab-tiny", ["train", "-f", "{dir}/c.yaml", "--dry-run"],
         ["tokenizer.train.vocab_size", "at least 64"],
         files={"c.yaml": lambda w, d: write_config(d / "c.yaml", w.config(tokenizer={"train": {"vocab_size": 5}}))}),
    Case("train-data-one-mapping-with-a-missing-field", ["train", "-f", "{dir}/c.yaml", "--save-folder", "{dir}/r",
                                                         "--no-supervisor"], ["docs.jsonl", 'no field "nosuch"'],
         files={"docs.jsonl": "".join(json.dumps({"text": f"def f{i}(x): return x"}) + "\n" for i in range(50)),
                "c.yaml": lambda w, d: write_config(d / "c.yaml", w.config(
                    train_data={"path": str(d / "docs.jsonl"), "text_field": "nosuch"}))}),
    Case("eval-checkpoint-missing", ["eval", "--checkpoint", "{dir}/none"], ["checkpoint", "none", "no such folder"]),
    Case("eval-gauntlet-missing", ["eval", "--checkpoint", "{final}", "--gauntlet", "{dir}/nosuch.yaml"],
         ["gauntlet", "nosuch.yaml"]),
    # --- issue 47: --overwrite deleted the command's own input
    Case("prepare-out-is-the-tokenizer", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{dir}/tok", "--out",
                                          "{dir}/tok", "--seq-len", "64", "--overwrite"], ["--out", "is the tokenizer"],
         files={"tok": lambda w, d: shutil.copytree(w.data.tokenizer, d / "tok")}, keep=["{dir}/tok"]),
    Case("prepare-out-is-the-input", ["data", "prepare", "--input", "{dir}/in", "--tokenizer", "{tok}", "--out",
                                      "{dir}/in", "--seq-len", "64", "--overwrite"], ["--out", "is the input"],
         files={"in": lambda w, d: shutil.copytree(w.data.raw, d / "in")}, keep=["{dir}/in"]),
    Case("export-out-is-the-run", ["export", "--checkpoint", "{dir}/run", "--out", "{dir}/run", "--overwrite"],
         ["--out", "is the checkpoint"], files={"run": run_copy}, keep=["{dir}/run"]),
    Case("export-out-is-final", ["export", "--checkpoint", "{dir}/run/final", "--out", "{dir}/run/final",
                                 "--overwrite"], ["--out", "is the checkpoint"], files={"run": run_copy},
         keep=["{dir}/run/final"]),
    Case("train-data-corrupt-gz", ["train", "-f", "{cfg}", "--train-data", "{dir}/bad.txt.gz", "--save-folder",
                                   "{dir}/r", "--no-supervisor"], ["bad.txt.gz", "corrupt"],
         files={"bad.txt.gz": lambda w, d: (d / "bad.txt.gz").write_bytes(_damaged_gzip())}, was_traceback=True),
    Case("preference-rejected-null", ["finetune", "-f", "{dir}/p.yaml", "--no-supervisor"],
         ["p.jsonl:1", "'rejected' is null"],
         files={"p.jsonl": json.dumps({"prompt": "2 + 3 =", "chosen": " 5", "rejected": None}) + "\n",
                "p.yaml": lambda w, d: write_config(d / "p.yaml", w.config(
                    task_type="preference", custom_weights_path=str(w.run / "final"), save_folder=str(d / "ft"),
                    train_data=str(d / "p.jsonl")))}),
    Case("finetune-raw-text", ["finetune", "-f", "{cfg}", "--train-data", "{dir}/a.txt", "--weights", "{final}",
                               "--save-folder", "{dir}/ft", "--no-supervisor"], ["a.txt", "raw text", "JSONL"],
         files={"a.txt": "plain words of a story\n" * 20}),
    Case("resume-shard-bit-flip-only-checkpoint", ["train", "-f", "{dir}/resume.yaml", "--no-supervisor"],
         ["distcp", "sha256"],
         files={"resume.yaml": resumed_config(save_num_checkpoints_to_keep=1), "x": lambda w, d: [
             _flip(f) for f in sorted((d / "run" / "checkpoints").glob("*/*.distcp"))]},
         keep=["{dir}/run/final"]),
    # --- issue 59: --overwrite replaced the home folder or another run's folder (exit 0, every file gone),
    # and a GGUF file target ended in a traceback
    *[Case(f"{name}-out-home-overwrite", argv + ["--out", "{home}", "--overwrite"], ["--out", "is the lmforge home folder"],
           files={"h": home_file}, keep=["{home}"]) for name, argv in OUT_COMMANDS],
    *[Case(f"{name}-out-other-run-overwrite", argv + ["--out", "{dir}/run", "--overwrite"],
           ["--out", "holds run 'bad-input-run'", f"replaces only {what}", "--overwrite or not"],
           files={"run": run_copy}, keep=["{dir}/run"])
      for (name, argv), what in zip(OUT_COMMANDS, ["a tokenizer folder", "an export", "a prepared dataset",
                                                    "a `data dedup` output"])],
    Case("export-gguf-over-a-file-overwrite", ["export", "--checkpoint", "{final}", "--format", "gguf", "--out",
                                               "{dir}/m.gguf", "--overwrite"], ["--out", "not a GGUF model"],
         files={"m.gguf": "my notes\n"}, keep=["{dir}/m.gguf"], was_traceback=True),
    Case("export-hf-over-a-file-overwrite", ["export", "--checkpoint", "{final}", "--out", "{dir}/m.bin", "--overwrite"],
         ["--out", "not a folder"], files={"m.bin": "my notes\n"}, keep=["{dir}/m.bin"], was_traceback=True),
    Case("train-save-folder-other-run-overwrite", ["train", "-f", "{cfg}", "--save-folder", "{dir}/run", "--name",
                                                   "someone-else", "--overwrite"],
         ["holds run 'bad-input-run'", "--overwrite replaces only a run of the same name"], files={"run": run_copy},
         keep=["{dir}/run"]),
    Case("train-save-folder-home-overwrite", ["train", "-f", "{cfg}", "--save-folder", "{home}", "--overwrite"],
         ["save_folder", "is the lmforge home folder"], files={"h": home_file}, keep=["{home}"]),
    Case("tokenizer-out-dataset-overwrite", ["tokenizer", "train", "--input", "{raw}", "--vocab-size", "300", "--out",
                                             "{dir}/ds", "--overwrite"], ["holds a prepared dataset"],
         files={"ds": lambda w, d: shutil.copytree(w.data.dataset, d / "ds")}, keep=["{dir}/ds"]),
    Case("prepare-out-holds-a-run-overwrite", ["data", "prepare", "--input", "{raw}", "--tokenizer", "{tok}", "--out",
                                               "{dir}/ds", "--seq-len", "64", "--overwrite"],
         ["holds run 'bad-input-run' in", "would remove it"],
         files={"ds": lambda w, d: shutil.copytree(w.data.dataset, d / "ds"),
                "x": lambda w, d: run_copy(w, d / "ds")}, keep=["{dir}/ds"]),
    Case("report-out-a-run-file", ["report", "{run}", "--out", "{dir}/run/metrics.jsonl", "--overwrite"],
         ["is part of run 'bad-input-run'"], files={"run": run_copy}, keep=["{dir}/run"]),
    Case("report-out-a-home-file", ["report", "{run}", "--out", "{home}/notes-59.txt", "--overwrite"],
         ["is part of the lmforge home folder"], files={"h": home_file}, keep=["{home}"]),
    Case("report-out-missing-folder", ["report", "{run}", "--out", "/nonexistent/dir/r.html"],
         ["--out", "/nonexistent/dir does not exist", "create it first"], absent=["/nonexistent"]),
    Case("launch-output-is-the-config-overwrite", ["launch", "slurm", "-f", "{dir}/job.yaml", "--nodes", "1",
                                                   "--gpus-per-node", "1", "-o", "{dir}/job.yaml", "--overwrite"],
         ["-o", "is the config"], files={"job.yaml": config("job.yaml")}, keep=["{dir}/job.yaml"]),
]


def _damaged_gzip() -> bytes:
    import gzip

    b = bytearray(gzip.compress(("hello world " * 4000).encode()))
    b[40] ^= 0x5A  # inside the deflate stream: zlib's "invalid ..." error, not a short read
    return bytes(b)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def _flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x01
    path.write_bytes(bytes(b))


def _digest(path: Path) -> dict:
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _fill(text: str, values: dict) -> str:
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text.replace("{{", "{")


def test_table_size():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, world: World, tmp_path):
    values = world.values | {"dir": str(tmp_path)}
    for name, content in case.files.items():
        if callable(content):
            content(world, tmp_path)
        elif isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content)
    kept = {p: _digest(Path(_fill(p, values))) for p in case.keep + ["{cfg}", "{final}"]}
    proc = cli(*[_fill(a, values) for a in case.argv])
    assert_one_line_error(proc, *case.words, code=case.code)
    for p, before in kept.items():
        assert _digest(Path(_fill(p, values))) == before, f"{p} changed"
    for p in case.absent:
        assert not Path(_fill(p, values)).exists(), f"{p} was written"


@pytest.mark.e2e
@pytest.mark.parametrize("fault,words", [
    ("kill:step=1.5", ["'step=1.5'", "whole number"]), ("kill:step=-1", ["'step=-1'", "at least 1"]),
    ("slow:rank=5", ["rank=5", "the run has 1 rank"]), ("slow:factor=nan", ["'factor=nan'", "finite"]),
    ("slow:factor=inf", ["'factor=inf'", "finite"])], ids=lambda v: v if isinstance(v, str) else None)
def test_fault_injection_is_refused_before_the_run(fault, words, world, tmp_path, monkeypatch):
    """Issue 59: each was accepted and did something else (truncated, never fired, trained at normal speed,
    hung at step 1); now one line before anything starts, the world size known (1 rank here)."""
    monkeypatch.setenv("LMFORGE_FAULT", fault)
    assert_one_line_error(cli("train", "-f", world.cfg_path, "--save-folder", tmp_path / "r"), "LMFORGE_FAULT", *words)
    assert not (tmp_path / "r").exists()


@pytest.mark.integration
def test_output_files_replace_their_own_kind(world, tmp_path):
    """The refusals above end with the remedy: a file the same command wrote is replaced without
    asking (re-running a report is routine), any other file with --overwrite."""
    job = write_config(tmp_path / "job.yaml", world.config(save_folder=str(tmp_path / "run")))
    for argv, out in ((["report", world.run, "--out"], tmp_path / "r.html"),
                      (["launch", "k8s", "-f", job, "--nodes", "2", "--gpus-per-node", "1", "--image", "x", "-o"],
                       tmp_path / "job-k8s.yaml"),
                      (["launch", "slurm", "-f", job, "--nodes", "2", "--gpus-per-node", "1", "-o"],
                       tmp_path / "job.sbatch"),
                      (["data", "stats", world.values["raw"], "--plot"], tmp_path / "stats.png")):
        out.write_text("someone else's\n")
        assert_one_line_error(cli(*argv, out), "not written by", "--overwrite")
        assert out.read_text() == "someone else's\n"
        cli(*argv, out, "--overwrite", check=True)
        written = out.read_bytes()
        cli(*argv, out, check=True)  # its own earlier output: replaced without --overwrite
        assert out.read_bytes() != b"someone else's\n" and len(out.read_bytes()) > 0 and written[:4] == out.read_bytes()[:4]


# --------------------------------------------------------------------------- what is no longer refused


@pytest.mark.e2e
@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="shared corpus not present")
def test_one_txt_file_trains_with_defaults(world, tmp_path):
    """One .txt file is one document: the held-out split is its tail, cut by tokens."""
    cfg = world.config(train_data=str(SHAKESPEARE), tokenizer={"train": {"vocab_size": 300}},
                       save_folder=str(tmp_path / "run"), training_duration="2ba", name="shakespeare")
    cfg["eval"].pop("interval")
    proc = cli("train", "-f", write_config(tmp_path / "c.yaml", cfg), "--no-supervisor", "--json", check=True)
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["status"] == "completed" and result["eval"]["eval/loss"] > 0


@pytest.mark.integration
def test_a_hugging_face_dataset_is_not_checked_as_an_object_store(world, tmp_path, monkeypatch):
    """hf://NAME/CONFIG:SPLIT is a dataset `datasets` loads, not a bucket: when it cannot load, the line
    says so (before: a credentials check quoting the hub client's complaint about the repository id)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = cli("train", "-f", world.cfg_path, "--train-data", "hf://nosuch/dataset:train", "--save-folder",
               tmp_path / "r", "--no-supervisor")
    assert_one_line_error(proc, "hf://nosuch/dataset:train", "Hugging Face dataset 'nosuch'", "offline")
    assert "credentials" not in proc.stderr


@pytest.mark.integration
def test_undecodable_text_and_broken_records_are_said_on_the_terminal(world, tmp_path):
    """Raw inputs a run prepares itself: bytes that are not UTF-8 and a JSONL line that is not JSON are
    warnings on the terminal (as `data prepare` prints them), not only counts in the dataset card."""
    text = (world.data.raw / "textwrap.py.txt").read_text()
    (tmp_path / "latin1.txt").write_bytes(("# café déjà vu\n" * 40 + text).encode("latin-1", errors="replace"))
    rows = [json.dumps({"text": text[i:i + 2000]}) for i in range(0, len(text), 2000)]
    (tmp_path / "docs.jsonl").write_text("\n".join(rows[:2] + ['{"text": "cut short'] + rows[2:]) + "\n")
    cfg = world.config(save_folder=str(tmp_path / "run"), training_duration="1ba", save_interval="1ba", name="warned",
                       train_data=[str(tmp_path / "latin1.txt"), str(tmp_path / "docs.jsonl")])
    out = cli("train", "-f", write_config(tmp_path / "c.yaml", cfg), "--no-supervisor", check=True).stdout
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: data ")]
    assert any("latin1.txt" in ln and "120 invalid UTF-8 sequences replaced" in ln for ln in warnings), out
    assert any("docs.jsonl" in ln and "skipped 1 records" in ln and "docs.jsonl:3" in ln for ln in warnings), out


def test_tail_holdout_when_documents_are_few(world, tmp_path):
    from lmforge.data.mds import MDSReader
    from lmforge.data.prepare.prepare import prepare

    text = (world.data.raw / "argparse.py.txt").read_text()
    (tmp_path / "one.txt").write_text(text)
    s = prepare([str(tmp_path / "one.txt")], str(world.data.tokenizer), str(tmp_path / "o"), 64, eval_fraction=0.05)
    train, val = s["splits"]["train"], s["splits"]["val"]
    n = train["samples"] + val["samples"]
    assert val["samples"] == round(0.05 * n) and val["held_out"].startswith("tail")
    # The tail: val's samples are the stream's last ones, after every train sample.
    last_train = MDSReader(str(tmp_path / "o" / "train")).get_tokens(train["samples"] - 1)
    first_val = MDSReader(str(tmp_path / "o" / "val")).get_tokens(0)
    ids = world_tokens(world, text)
    k = train["samples"]
    assert list(last_train) == ids[(k - 1) * 64: k * 64] and list(first_val) == ids[k * 64: (k + 1) * 64]


def test_short_jsonl_documents_get_a_held_out_split(world, tmp_path):
    """400 short documents: 1% of them make less than one sample, so the tail is held out."""
    from lmforge.data.prepare.prepare import prepare

    rows = "".join(json.dumps({"text": f"def f{i}(x): return x + {i}"}) + "\n" for i in range(400))
    (tmp_path / "docs.jsonl").write_text(rows)
    s = prepare([str(tmp_path / "docs.jsonl")], str(world.data.tokenizer), str(tmp_path / "o"), 64,
                eval_fraction=0.01)
    assert s["splits"]["val"]["samples"] >= 1 and s["splits"]["val"]["held_out"].startswith("tail")
    assert s["documents"] == 400


def world_tokens(world, text: str) -> list[int]:
    from lmforge.data.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(world.data.tokenizer))
    return list(tok.encode(text)) + [tok.eos_id]


@pytest.mark.e2e
def test_corrupt_latest_checkpoint_falls_back(world, tmp_path):
    """A damaged newest checkpoint: a warning line, and the run resumes from the previous one; the
    damaged one is pruned once an intact later one exists, and a completed run whose checkpoints
    are all damaged reports itself complete (exit 0) from its intact final model."""
    run_copy(world, tmp_path)
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert len(ckpts) == 2
    _flip(sorted(ckpts[-1].glob("*.distcp"))[0])
    cfg = write_config(tmp_path / "c.yaml", world.config(save_folder=str(tmp_path / "run"), training_duration="6ba"))
    proc = cli("train", "-f", cfg, "--no-supervisor", check=True)
    assert "warning: checkpoint" in proc.stdout and "sha256" in proc.stdout
    assert f"resume: continuing from {ckpts[0]} (step 2" in proc.stdout
    assert "completed after 6 steps" in proc.stdout
    # Issue 47: the damaged one, set aside, goes once an intact checkpoint of its step or later exists.
    assert not [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if ".damaged-" in p.name]
    # A completed run stays complete when every checkpoint of it is damaged: its final/ is intact.
    # (a copy, and a process of its own: this process holds the first folder's lock)
    done = tmp_path / "done"
    shutil.copytree(tmp_path / "run", done, ignore=shutil.ignore_patterns("*.lock", "logs"))
    final = _digest(done / "final")
    for ckpt in (done / "checkpoints").iterdir():
        _flip(sorted(ckpt.glob("*.distcp"))[0])
    cfg = write_config(tmp_path / "d.yaml", world.config(save_folder=str(done), training_duration="6ba"))
    again = lmforge("train", "-f", cfg, "--no-supervisor")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert "its final model" in again.stdout and "nothing to train" in again.stdout, again.stdout[-2000:]
    assert "completed after 6 steps" in again.stdout and _digest(done / "final") == final


@pytest.mark.e2e
def test_failed_first_start_does_not_block_a_fixed_config(world, tmp_path):
    """A start that failed before its first checkpoint leaves a run.json; the fixed config may go on."""
    save = tmp_path / "run"
    bad = world.config(save_folder=str(save), custom_weights_path=str(world.run / "final"))
    bad["model"]["d_model"] = 32  # not the weights' shape: found after the folder is claimed
    # (a process of its own: an in-process run holds its save folder's lock until the process exits)
    assert_one_line_error(lmforge("train", "-f", write_config(tmp_path / "bad.yaml", bad), "--no-supervisor"),
                          "different model shape")
    assert (save / "run.json").is_file()
    good = write_config(tmp_path / "good.yaml", world.config(save_folder=str(save), training_duration="2ba",
                                                            save_interval="2ba"))
    assert "completed after 2 steps" in cli("train", "-f", good, "--no-supervisor", check=True).stdout


@pytest.mark.integration
def test_explicit_max_seq_len_below_context_length_warns(world, tmp_path):
    cfg = world.config(save_folder=str(tmp_path / "run"), training_duration="1ba", save_interval="1ba")
    cfg["model"]["max_seq_len"] = 32
    proc = cli("train", "-f", write_config(tmp_path / "c.yaml", cfg), "--no-supervisor", check=True)
    assert "warning: parameters.context_length 64 is longer than model.max_seq_len 32" in proc.stdout


@pytest.mark.integration
def test_tokenizer_overwrite_replaces_only_a_tokenizer(world, tmp_path):
    """--overwrite replaces a tokenizer folder lmforge made, whole (a file added to it goes with it); a
    folder of other files is refused, --overwrite or not (issue 59)."""
    nonempty("t")(world, tmp_path)
    argv = ["tokenizer", "train", "--input", world.data.raw, "--vocab-size", "300", "--out"]
    assert_one_line_error(cli(*argv, tmp_path / "t", "--overwrite"), "notes.txt", "replaces only a tokenizer folder")
    assert (tmp_path / "t" / "notes.txt").read_text() == "mine\n"
    cli(*argv, tmp_path / "tok", check=True)
    (tmp_path / "tok" / "old-merges.txt").write_text("x")
    assert_one_line_error(cli(*argv, tmp_path / "tok"), "already holds a tokenizer folder", "--overwrite")
    cli(*argv, tmp_path / "tok", "--overwrite", check=True)
    assert not (tmp_path / "tok" / "old-merges.txt").exists() and (tmp_path / "tok" / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t", "tok"]  # nothing left beside it


@pytest.fixture
def small_disk(tmp_path):
    """A real, nearly full file system: a 512 KiB tmpfs (needs the right to mount; skipped without)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                                 capture_output=True).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.e2e
def test_disk_full_is_one_line_naming_path_and_errno(world, small_disk):
    """The first checkpoint does not fit on the disk: one line naming the file and ENOSPC."""
    cfg = write_config(small_disk.parent / "c.yaml", world.config(save_folder=str(small_disk / "run")))
    proc = cli("train", "-f", cfg, "--no-supervisor")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Trackers that lose their file say so in a warning line each; the run ends with one error line.
    assert all(ln.startswith("warning: ") for ln in lines[:-1]), lines
    assert lines[-1].startswith("error: ") and "ENOSPC" in lines[-1] and str(small_disk / "run") in lines[-1]


@pytest.mark.integration
def test_a_write_that_fails_leaves_no_half_written_files(world, tmp_path):
    """The kernel refuses every write past 1 MB of a file (RLIMIT_FSIZE, with SIGXFSZ ignored: EFBIG,
    as a full disk refuses with ENOSPC; no mount needed): the first checkpoint fails, and so does the
    report written as the run ends. One error line, and neither leaves its .tmp behind."""
    import resource
    import signal
    import sys

    from train_helpers import REPO, env

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    save = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", world.config(save_folder=str(save), name="small-files"))
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--no-supervisor"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300, preexec_fn=small_files)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "EFBIG" in lines[-1], lines
    assert any("report" in ln for ln in lines[:-1]), lines  # the report tracker's own warning line
    left = [str(p.relative_to(save)) for p in save.rglob("*") if ".tmp" in p.name]
    assert not left, left


@pytest.mark.e2e
def test_read_only_save_folder_is_refused_before_the_run(world, small_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    cfg = write_config(small_disk.parent / "c.yaml", world.config(save_folder=str(small_disk / "run")))
    assert_one_line_error(cli("train", "-f", cfg, "--no-supervisor"), "EROFS", str(small_disk / "run"))


# --------------------------------------------------------------------------- real processes: the supervisor


def test_rejected_config_is_not_registered(world, tmp_path):
    """A config refused before work starts never becomes a run (the supervised path: no --no-supervisor)."""
    from lmforge.runs.registry import Registry

    big = write_config(tmp_path / "big.yaml", world.config(model=BIG_MODEL, save_folder=str(tmp_path / "big")))
    before = {r["name"] for r in Registry().list()}
    assert_one_line_error(cli("train", "-f", big), "does not fit")  # (refused before the supervisor starts)
    assert {r["name"] for r in Registry().list()} == before
    assert not (tmp_path / "big").exists()


@pytest.mark.e2e
def test_supervisor_does_not_retry_a_full_disk(world, small_disk):
    """A run that fails in the trainer on a user's error (a full disk) is recorded with its reason
    and not retried; the supervisor's own log writer survives the full disk."""
    from lmforge.runs.registry import Registry

    cfg = world.config(save_folder=str(small_disk / "run"), name="bad-input-full", max_retries=2)
    proc = lmforge("train", "-f", write_config(small_disk.parent / "full.yaml", cfg))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr
    run = Registry().get("bad-input-full")
    assert run["status"] == "FAILED" and "ENOSPC" in run["reason"], run["reason"]
    assert len(run["resumptions"]) == 1


@pytest.mark.e2e
def test_run_rejected_by_its_trainer_is_not_kept(world, tmp_path):
    """Bad data is found by the trainer process (after the run was registered): one line, exit 2,
    no retry, and no FAILED entry left behind in `runs list`."""
    from lmforge.runs.registry import Registry

    (tmp_path / "blob.txt").write_bytes(BINARY)
    cfg = world.config(save_folder=str(tmp_path / "run"), name="bad-input-blob", train_data=str(tmp_path / "blob.txt"))
    proc = lmforge("train", "-f", write_config(tmp_path / "blob.yaml", cfg))
    assert_one_line_error(proc, "blob.txt", "binary")
    assert Registry().get("bad-input-blob") is None


@pytest.mark.e2e
@pytest.mark.parametrize("flags", [[], ["--no-supervisor"]], ids=["supervised", "no-supervisor"])
def test_bad_data_on_two_ranks_is_one_line(world, tmp_path, flags):
    """With compute.ranks: 2, rank 0 finds the bad data while rank 1 waits for it: rank 1 stops
    with rank 0's error instead of losing its peer (a traceback), only rank 0 prints it, and
    torchrun's lines about stopping its workers are not shown — one line, exit 2, no retry.
    Without a supervisor, the torchrun wrapper stops the restarts (else: 3 more attempts, then
    torchrun's ChildFailedError traceback and exit 1)."""
    (tmp_path / "blob.txt").write_bytes(BINARY)
    cfg = world.config(save_folder=str(tmp_path / "run"), name="bad-input-blob-2", train_data=str(tmp_path / "blob.txt"),
                       **{"compute.ranks": 2, "parameters.micro_batch_size": 2})
    proc = lmforge("train", "-f", write_config(tmp_path / "blob2.yaml", cfg), *flags)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "blob.txt" in errors[0] and "binary" in errors[0], out[-3000:]
    assert "Traceback" not in out and "signal" not in out and "OMP_NUM_THREADS" not in out, out[-3000:]


@pytest.mark.e2e
def test_a_bad_fine_tuning_row_on_two_ranks_is_said_once(world, tmp_path):
    """Every rank reads the fine-tuning rows: rank 0 reads them first, and the other stops with its
    error instead of saying the same line again (before: the line twice, once per rank)."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    proc = lmforge("finetune", "-f", world.cfg_path, "--train-data", tmp_path / "rows.jsonl", "--weights",
                   world.run / "final", "--save-folder", tmp_path / "ft", "--no-supervisor",
                   "--set", "compute.ranks=2", "--set", "parameters.micro_batch_size=1")
    out = proc.stdout + proc.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
    assert "rows.jsonl:2" in errors[0] and "'response'" in errors[0], errors
    assert "Traceback" not in out and not (tmp_path / "ft" / "checkpoints").exists()


@pytest.mark.e2e
def test_bad_data_on_two_nodes_is_one_line_on_each(world, tmp_path):
    """Two nodes (two `lmforge train --node-rank` on this machine, one rank each): rank 0 finds the
    bad data, and each node — wherever rank 0 landed — prints its one line and exits 2 at once.
    Before, the node without rank 0 retried, waited out a rendezvous timeout each time and ended
    in a traceback, and the node hosting no rendezvous store printed its lost connection."""
    import sys

    from train_helpers import REPO, communicate, env, free_port

    port = free_port()
    (tmp_path / "blob.txt").write_bytes(BINARY)
    cfg = world.config(save_folder=str(tmp_path / "run"), name="bad-input-blob-nodes", train_data=str(tmp_path / "blob.txt"),
                       **{"parameters.micro_batch_size": 2, "compute.data_parallel": "hsdp", "compute.nodes": 2,
                          "compute.rdzv_endpoint": f"127.0.0.1:{port}", "compute.rdzv_timeout_s": 60})
    path = write_config(tmp_path / "nodes.yaml", cfg)
    procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(path), "--node-rank", str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
             for r in (0, 1)]
    for p in procs:
        out, err = communicate(p, 120)
        errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert p.returncode == 2 and len(errors) == 1 and "binary" in errors[0], (p.args[-1], out[-4000:], err[-3000:])
        assert err.strip() == errors[0], err[-3000:]  # nothing else: no traceback, no torchrun warning


# --------------------------------------------------------------------------- issue 59: rows, BOMs, lines


def test_rows_that_are_json_but_not_objects_say_so(tmp_path):
    """A JSONL row that is an array was "not valid JSON (Extra data …)" (the file was read as one JSON
    array); now it is named for what it is, and the rows after it are read."""
    from lmforge.data.rows.sft import json_rows, row_segments
    from lmforge.data.text.sources import SourceStats, list_files, read_source
    from lmforge.errors import UserError

    rows = tmp_path / "rows.jsonl"
    rows.write_text('[1, 2]\n{"text": "kept"}\n7\n{"a": 1} {"b": 2}\n')
    stats = SourceStats()
    assert [d for s in list_files([str(rows)], stats) for d in read_source(s, stats=stats)] == ["kept"]
    assert stats.skipped_line_examples == [
        f'{rows}:1: an array, expected an object with a "text" field',
        f'{rows}:3: a number, expected an object with a "text" field',
        f"{rows}:4: more than one JSON value on the line (at column 10); JSONL holds one per line"]
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt": "a", "response": "b"}\n[{"prompt": "a", "response": "b"}]\n')
    with pytest.raises(UserError, match=r"sft.jsonl:2: an array, expected a JSON object with prompt/response"):
        [row_segments(r, w, "instruction_finetune") for r, w in json_rows([str(sft)])]
    sft.write_text('{"prompt": "a", "response": "b"} {"prompt": "c", "response": "d"}\n')
    with pytest.raises(UserError, match=r"sft.jsonl:1: more than one JSON value on the line"):
        list(json_rows([str(sft)]))


def test_a_utf8_bom_is_not_part_of_the_first_row(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) dropped row 1 as "not JSON"; it is stripped,
    in raw JSONL, a JSON array, a text file, fine-tuning rows and eval task files."""
    import gzip

    from lmforge.data.rows.sft import json_rows
    from lmforge.data.text.sources import SourceStats, list_files, read_source
    from lmforge.tasks.icl import _read_jsonl

    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "b.json").write_bytes(bom + b'[{"text": "third"}]')
    (tmp_path / "c.txt").write_bytes(bom + "fourth\n".encode())
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(bom + b'{"text": "fifth"}\n'))
    stats = SourceStats()
    docs = [d for s in list_files([str(tmp_path)], stats) for d in read_source(s, stats=stats)]
    assert sorted(docs) == ["fifth", "first", "fourth\n", "second", "third"] and stats.skipped_lines == 0
    (tmp_path / "sft.jsonl").write_bytes(bom + b'{"prompt": "a", "response": "b"}\n')
    assert [r for r, _ in json_rows([str(tmp_path / "sft.jsonl")])] == [{"prompt": "a", "response": "b"}]
    (tmp_path / "task.jsonl").write_bytes(bom + b'{"context": "x", "continuation": "y"}\n')
    assert _read_jsonl(str(tmp_path / "task.jsonl"), "task.jsonl", None)[0][0] == {"context": "x", "continuation": "y"}


def test_an_error_on_the_other_stream_starts_its_own_line(tmp_path):
    """Three fine-tune data errors were printed glued to the line before them: the trainer's stdout
    and stderr are two pipes the supervisor copies to one terminal, and an unbuffered print writes its
    text and its newline apart — the error came between them. Each copy now hands on whole lines."""
    import threading
    import time
    from collections import deque
    from types import SimpleNamespace

    from lmforge.runs.supervisor import EchoLines, Supervisor

    terminal = open(tmp_path / "terminal", "w")
    pipes = [os.pipe(), os.pipe()]  # the child's stdout, its stderr
    tails = [deque(), deque()]
    me = SimpleNamespace(_keep=lambda lines, tail: tail.extend(lines))
    threads = [threading.Thread(target=Supervisor._tee, args=(me, r, EchoLines(terminal, whole_lines=True), t))
               for (r, _), t in zip(pipes, tails)]
    for t in threads:
        t.start()
    os.write(pipes[0][1], "chat template: lmforge’s plain one".encode())  # print's text ...
    os.write(pipes[1][1], b"error: rows.jsonl:2: an array, expected a JSON object\n")
    deadline = time.monotonic() + 30
    while not tails[1] and time.monotonic() < deadline:  # the error line is on the terminal
        time.sleep(0.01)
    os.write(pipes[0][1], b"\n")  # ... and its newline, written apart
    for _, w in pipes:
        os.close(w)
    for t in threads:
        t.join(timeout=30)
    terminal.close()
    assert (tmp_path / "terminal").read_text().splitlines() == [
        "error: rows.jsonl:2: an array, expected a JSON object", "chat template: lmforge’s plain one"]
    echo = EchoLines(SimpleNamespace(buffer=open(tmp_path / "bar", "wb"), flush=lambda: None), whole_lines=True)
    echo.write(b"\r 10%")
    echo.write(b"\r 20%")  # a bar redrawn in place goes on at each redraw
    echo.close()
    echo.out.buffer.close()
    assert (tmp_path / "bar").read_bytes() == b"\r 10%\r 20%"
