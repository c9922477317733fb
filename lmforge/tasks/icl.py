"""ICL task definitions: LLM Foundry's task entries and their data, read the way Foundry reads them.

A task entry (one item of a ``tasks*.yaml`` ``icl_tasks:`` list) names a data file and how to
prompt it. Every key Foundry's task files use is accepted; a key Foundry would not accept, or
one this evaluator cannot honour, is refused with one line naming the file, line and key.

What Foundry does to the data before any prompt is built, and we do too:

- JSONL is split on "\\n" only (``str.splitlines`` would also split on U+0085 and other Unicode
  breaks, which occur inside Foundry's own triviaqa file).
- ``strip_dataset`` (default true) strips every top-level string field of every example;
  lists (choices, aliases) are left as they are.
- Generation tasks: the accepted answers are the set of the *unstripped* ``answer`` and the
  ``aliases``, collected before stripping.
- ``has_categories``: the examples are split by their ``category`` (sorted); each category is
  its own dataset (its own few-shot pool, random generator and answer budget).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import UserError, json_kind
from lmforge.frozen import thaw
from lmforge.tasks.yaml_lines import at, load_yaml

LANGUAGE_MODELING = "language_modeling"
MULTIPLE_CHOICE = "multiple_choice"
SCHEMA = "schema"
GENERATION = "generation_task_with_answers"
TASK_TYPES = (LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, GENERATION)
# Older LLM Foundry files call the generation task `question_answering`.
_TYPE_ALIASES = {"question_answering": GENERATION}

DEFAULT_TASKS = Path(__file__).with_name("tasks.yaml")

# Keys of a task entry for every task type (Foundry's names).
_COMMON_KEYS = {
    "label", "dataset_uri", "num_fewshot", "icl_task_type", "metric_names", "max_seq_len", "batch_size",
    "pad_tok_id", "has_categories", "hf_loading_vars", "hf_parsing_map", "fewshot_random_seed", "prompt_string",
    "example_delimiter", "continuation_delimiter", "prelimiter", "question_prelimiter", "strip_dataset",
    "generation_kwargs",
}
# Keys only one task type's dataset takes (Foundry's dataset classes reject the others).
_TYPE_KEYS = {
    LANGUAGE_MODELING: {"context_key"},
    MULTIPLE_CHOICE: {"context_key", "choices_key"},
    SCHEMA: {"choices_key"},
    GENERATION: {"cot_delimiter", "early_stopping_criteria", "do_normalization"},
}
# Foundry's metric names per task type, and the result key each one fills here.
METRICS = {
    LANGUAGE_MODELING: {"InContextLearningLMAccuracy": "accuracy",
                        "InContextLearningLMExpectedCalibrationError": "calibration_error"},
    MULTIPLE_CHOICE: {"InContextLearningMultipleChoiceAccuracy": "accuracy",
                      "InContextLearningMCExpectedCalibrationError": "calibration_error"},
    SCHEMA: {"InContextLearningMultipleChoiceAccuracy": "accuracy",
             "InContextLearningMCExpectedCalibrationError": "calibration_error"},
    GENERATION: {"InContextLearningGenerationExactMatchAccuracy": "accuracy"},
}
# `generation_kwargs` keys (Hugging Face `generate` arguments) that we implement. use_cache and
# pad_token_id change no output; num_beams must be 1 (no beam search).
GENERATION_KWARGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_beams", "use_cache",
                     "pad_token_id", "eos_token_id")

_REQUIRED = {
    LANGUAGE_MODELING: ("context", "continuation"),
    MULTIPLE_CHOICE: ("query", "choices", "gold"),
    SCHEMA: ("context_options", "continuation", "gold"),
    GENERATION: ("context", "answer"),
}


@dataclass
class ICLTask:
    """One benchmark: its examples (as prepared by Foundry's rules) and how to prompt them."""

    label: str
    task_type: str
    examples: list[dict[str, Any]]  # stripped (if strip_dataset); generation rows carry their answer set
    num_fewshot: list[int]
    source: str  # file or URI the examples came from (for error messages)
    locations: list[str] = field(default_factory=list)  # "file:line N" of each example
    raw: list[dict[str, Any]] = field(default_factory=list)  # the examples as read (unstripped)
    partitions: dict[str | None, list[int]] = field(default_factory=dict)  # category -> example indices
    prompt_string: str = ""
    example_delimiter: str = "\n"
    continuation_delimiter: str = " "
    prelimiter: str = ""
    cot_delimiter: str = ""
    fewshot_random_seed: int = 1234
    has_categories: bool = False
    strip_dataset: bool = True
    stop_sequences: list[str] = field(default_factory=list)  # generation: Foundry's early_stopping_criteria
    do_normalization: bool = True
    generation: dict[str, Any] = field(default_factory=dict)  # generation_kwargs
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])
    max_seq_len: int | None = None
    # Foundry's rule: a generation dataset with a chain_of_thought field shows it in demonstrations.
    has_cot: bool = False

    def __post_init__(self):
        if not self.partitions:
            self.partitions = {None: list(range(len(self.examples)))}
        if not self.raw:
            self.raw = self.examples
        if not self.locations:
            self.locations = [f"{self.source}:example {i + 1}" for i in range(len(self.examples))]


# ----------------------------------------------------------------------------- task entries


def load_tasks(path_or_list: str | Path | list | dict, data_root: str | Path | None = None) -> list[ICLTask]:
    """Load task definitions (a YAML file, ``"default"``, or a list of task mappings) and their data.

    Relative ``dataset_uri`` paths resolve against ``data_root`` when given, else against the
    YAML file's folder (the current directory for an inline list).
    """
    source: str | None
    if isinstance(path_or_list, (str, Path)):
        path = DEFAULT_TASKS if str(path_or_list) == "default" else Path(path_or_list).expanduser()
        doc = load_yaml(path, "tasks")
        source, where, base_dir = str(path), str(path), path.parent
    else:
        # a resolved run's tasks are frozen (tuples, FrozenDict): read back as the YAML a file would give
        doc, source, where, base_dir = thaw(path_or_list), None, "eval.icl_tasks", Path.cwd()
    entries = doc.get("icl_tasks") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: expected a non-empty list of tasks (or a mapping with `icl_tasks:`)")
    tasks: list[ICLTask] = []
    for i, entry in enumerate(entries):
        task = _parse_task(entry, i, source or where, source, base_dir, data_root)
        if any(t.label == task.label for t in tasks):
            raise UserError(f"{at(source, entry, 'label') or where}: icl_tasks[{i}]: duplicate label {task.label!r}")
        tasks.append(task)
    return tasks


def _parse_task(entry: Any, i: int, where: str, source: str | None, base_dir: Path, data_root) -> ICLTask:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: icl_tasks[{i}]: expected a mapping with label, dataset_uri, num_fewshot, "
                        "icl_task_type")
    for key in ("label", "dataset_uri", "icl_task_type"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise UserError(f"{at(source, entry) or where}: icl_tasks[{i}]: field {key!r} is required "
                            "(a non-empty string)")
    name = f"icl_tasks[{i}] ({entry['label']})"

    def bad(key: str, message: str) -> UserError:
        return UserError(f"{at(source, entry, key) or where}: {name}: {key}: {message}")

    if entry["icl_task_type"] == "code_evaluation":
        raise bad("icl_task_type", "code_evaluation (running generated code) is not supported; "
                                   f"supported types: {', '.join(TASK_TYPES)}")
    task_type = _TYPE_ALIASES.get(entry["icl_task_type"], entry["icl_task_type"])
    if task_type not in TASK_TYPES:
        raise bad("icl_task_type", f"unknown type {entry['icl_task_type']!r}; valid types: {', '.join(TASK_TYPES)}")
    allowed = _COMMON_KEYS | _TYPE_KEYS[task_type]
    for key in entry:
        if key in allowed:
            continue
        owners = [t for t, keys in _TYPE_KEYS.items() if key in keys]
        if owners:
            raise bad(key, f"applies only to {' and '.join(owners)} tasks, not {task_type}")
        raise bad(key, f"unknown key; valid keys for {task_type}: {', '.join(sorted(allowed))}")
    if "prelimiter" in entry and "question_prelimiter" in entry:
        raise bad("question_prelimiter", "give prelimiter or question_prelimiter (its old name), not both")

    shots = entry.get("num_fewshot", [0])
    shots = [shots] if _is_count(shots) else shots
    if not isinstance(shots, list) or not shots or not all(_is_count(k) for k in shots):
        raise bad("num_fewshot", f"expected a non-negative integer or a list of them, got {entry.get('num_fewshot')!r}")
    strings, flags = _strings_and_flags(entry, bad)
    seed = entry.get("fewshot_random_seed", 1234)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad("fewshot_random_seed", f"expected an integer, got {seed!r}")
    max_seq_len = entry.get("max_seq_len")
    if max_seq_len is not None and (not _is_count(max_seq_len) or max_seq_len < 2):
        raise bad("max_seq_len", f"expected an integer of at least 2, got {max_seq_len!r}")
    stops = entry.get("early_stopping_criteria") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("early_stopping_criteria", "expected a list of non-empty strings")
    generation = _generation_kwargs(entry.get("generation_kwargs"), lambda m: bad("generation_kwargs", m))
    metrics = _metric_names(entry.get("metric_names"), task_type, lambda m: bad("metric_names", m))
    loading_vars = entry.get("hf_loading_vars") or {}
    if not isinstance(loading_vars, dict):
        raise bad("hf_loading_vars", "expected a mapping of datasets.load_dataset arguments")
    parsing_map = entry.get("hf_parsing_map") or {}
    if not isinstance(parsing_map, dict) or not all(
            isinstance(v, list) and all(isinstance(c, str) for c in v) for v in parsing_map.values()):
        raise bad("hf_parsing_map", "expected a mapping of field name to a list of dataset column names")

    uri = entry["dataset_uri"]
    if uri.startswith("hf://"):
        rows = _read_hf(uri, loading_vars, parsing_map, f"{at(source, entry, 'dataset_uri') or where}: {name}")
        shown = uri
    else:
        shown = _resolve_uri(uri, base_dir, data_root)
        rows = _read_jsonl(shown, uri, data_root)
    keys = {"context_key": entry.get("context_key"), "choices_key": entry.get("choices_key")}
    task = ICLTask(label=entry["label"], task_type=task_type, examples=[], num_fewshot=shots, source=shown,
                   fewshot_random_seed=seed, stop_sequences=list(stops), generation=generation, metrics=metrics,
                   max_seq_len=max_seq_len, **strings, **flags)
    _prepare(task, rows, keys)
    return task


def _strings_and_flags(entry: dict, bad) -> tuple[dict, dict]:
    """A task entry's prompt strings (``question_prelimiter`` as ``prelimiter``) and its boolean flags."""
    strings, flags = {}, {}
    for key in ("prompt_string", "example_delimiter", "continuation_delimiter", "prelimiter", "question_prelimiter",
                "cot_delimiter", "context_key", "choices_key"):
        if key in entry and not isinstance(entry[key], str):
            raise bad(key, f"expected a string, got {type(entry[key]).__name__}")
    for key in ("prompt_string", "example_delimiter", "continuation_delimiter", "prelimiter", "cot_delimiter"):
        if key in entry:
            strings[key] = entry[key]
    if "question_prelimiter" in entry:
        strings["prelimiter"] = entry["question_prelimiter"]
    for key in ("has_categories", "strip_dataset", "do_normalization"):
        if key in entry:
            if not isinstance(entry[key], bool):
                raise bad(key, f"expected true or false, got {entry[key]!r}")
            flags[key] = entry[key]
    return strings, flags


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _generation_kwargs(value: Any, bad) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("expected a mapping of generation arguments")
    for key, v in value.items():
        if key not in GENERATION_KWARGS:
            raise bad(f"{key!r} is not supported; supported: {', '.join(GENERATION_KWARGS)}")
        if key in ("max_new_tokens", "top_k") and (not _is_count(v) or v < 1):
            raise bad(f"{key} must be a positive integer, got {v!r}")
        if key in ("do_sample", "use_cache") and not isinstance(v, bool):
            raise bad(f"{key} must be true or false, got {v!r}")
        if key in ("temperature", "top_p") and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
            raise bad(f"{key} must be a positive number, got {v!r}")
        if key == "num_beams" and v != 1:
            raise bad(f"num_beams {v!r}: beam search is not supported (greedy or sampled decoding only)")
        if key == "eos_token_id" and not (_is_count(v) or (isinstance(v, list) and v and all(map(_is_count, v)))):
            raise bad(f"eos_token_id must be a token id or a list of them, got {v!r}")
    return dict(value)


def _metric_names(value: Any, task_type: str, bad) -> list[str]:
    known = METRICS[task_type]
    if value is None:
        return ["accuracy"]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise bad("expected a non-empty list of metric names")
    for name in value:
        if name not in known:
            raise bad(f"{name!r} is not available for {task_type} tasks; available: {', '.join(known)}")
    # Accuracy is always computed (the gauntlet needs it); other metrics only when named.
    return ["accuracy"] + [known[m] for m in value if known[m] != "accuracy"]


def _resolve_uri(uri: str, base_dir: Path, data_root) -> str:
    if "://" in uri:
        return uri
    path = Path(uri).expanduser()
    if path.is_absolute():
        return str(path)
    base = Path(data_root).expanduser() if data_root else base_dir
    candidate = base / path
    if not candidate.exists() and "local_data" in path.parts:
        # Foundry's task files say `eval/local_data/<group>/<file>.jsonl`; let --data-root point
        # at the `local_data` folder itself.
        inner = base.joinpath(*path.parts[path.parts.index("local_data") + 1:])
        if inner.exists():
            return str(inner)
    return str(candidate)


# ----------------------------------------------------------------------------- reading data


def _read_jsonl(uri: str, given: str, data_root) -> list[tuple[dict, str]]:
    """(example, "file:line N") for each non-blank line."""
    try:
        if "://" in uri:
            import fsspec

            with fsspec.open(uri, "rb") as f:
                data = f.read()
        else:
            data = Path(uri).read_bytes()
        text = data.decode("utf-8-sig")  # a UTF-8 BOM (some editors write one) is not part of the first row
    except (FileNotFoundError, IsADirectoryError):
        hint = "" if data_root else " (pass --data-root DIR: the folder holding LLM Foundry's eval local_data files)"
        raise UserError(f"task data {uri} not found (dataset_uri {given!r}){hint}") from None
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{uri}:line {line}: not UTF-8 text (expected a UTF-8 JSONL file)") from None
    except OSError as e:
        raise UserError(f"task data {uri}: cannot read ({e})") from None
    rows = []
    # "\n" only: JSON strings may hold U+0085 or U+2028, which str.splitlines() would break on.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{uri}:line {number}"
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                            "expected one JSON object per line") from None
        if not isinstance(example, dict):
            raise UserError(f"{where}: expected a JSON object per line, got {json_kind(example)}")
        rows.append((example, where))
    if not rows:
        raise UserError(f"{uri}: no examples (empty file)")
    return rows


def _read_hf(uri: str, loading_vars: dict, parsing_map: dict, where: str) -> list[tuple[dict, str]]:
    """A Hugging Face dataset (``hf://name``), as Foundry loads it: ``load_dataset(name,
    **hf_loading_vars)``, then each field of ``hf_parsing_map`` is its columns joined by spaces."""
    name = uri.replace("hf://", "")
    try:
        import datasets
    except ImportError:
        raise UserError(f"{where}: dataset_uri {uri} needs the `datasets` package "
                        "(pip install 'lmforge[hf]')") from None
    try:
        ds = datasets.load_dataset(name, **loading_vars)
    except Exception as e:  # offline, unknown name, bad arguments: datasets raises many types
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"{where}: cannot load Hugging Face dataset {name!r} with hf_loading_vars {loading_vars} "
                        f"({msg}); it needs network access or a local copy in the datasets cache") from None
    if not isinstance(ds, datasets.Dataset):
        splits = ", ".join(getattr(ds, "keys", lambda: [])())
        raise UserError(f"{where}: {uri} has several splits ({splits}); pick one with hf_loading_vars: {{split: ...}}")
    rows = []
    for i, row in enumerate(ds):
        here = f"{uri} row {i + 1}"
        if parsing_map:
            missing = [c for cols in parsing_map.values() for c in cols if c not in row]
            if missing:
                raise UserError(f"{where}: hf_parsing_map names column {missing[0]!r}, which {uri} does not have "
                                f"(columns: {', '.join(row)})")
            row = {k: " ".join(str(row[c]) for c in cols) for k, cols in parsing_map.items()}
        rows.append((dict(row), here))
    if not rows:
        raise UserError(f"{where}: {uri} has no rows")
    return rows


# ----------------------------------------------------------------------------- preparing examples


def _prepare(task: ICLTask, rows: list[tuple[dict, str]], keys: dict[str, str | None]) -> None:
    """Validate each example, then apply Foundry's preprocessing (answer sets, stripping, categories)."""
    canonical = {"context_key": "query" if task.task_type == MULTIPLE_CHOICE else "context",
                 "choices_key": "context_options" if task.task_type == SCHEMA else "choices"}
    raw, prepared, locations = [], [], []
    for example, where in rows:
        example = dict(example)
        for option, name in keys.items():
            if name and name != canonical[option]:
                if name not in example:
                    raise UserError(f"{where}: missing field {name!r} (the task's {option})")
                example[canonical[option]] = example[name]
        _check_example(example, task.task_type, where)
        if task.has_categories:
            category = example.get("category")
            if not isinstance(category, str) or not category:
                raise UserError(f"{where}: field 'category' is required by has_categories (a non-empty string)")
        row = dict(example)
        if task.task_type == GENERATION:
            # Foundry collects the answer set before stripping: the unstripped answer counts.
            row["aliases"] = list(dict.fromkeys([example["answer"]] + list(example.get("aliases") or [])))
        if task.strip_dataset:
            row = {k: v.strip() if isinstance(v, str) else v for k, v in row.items()}
        raw.append(example)
        prepared.append(row)
        locations.append(where)
    task.raw, task.examples, task.locations = raw, prepared, locations
    task.has_cot = task.task_type == GENERATION and any("chain_of_thought" in r for r in raw)
    if task.has_categories:
        groups: dict[str | None, list[int]] = {}
        for i, row in enumerate(raw):
            groups.setdefault(row["category"], []).append(i)
        task.partitions = {c: groups[c] for c in sorted(groups)}
    else:
        task.partitions = {None: list(range(len(prepared)))}


def _check_example(ex: dict, task_type: str, where: str) -> None:
    for key in _REQUIRED[task_type]:
        if key not in ex:
            raise UserError(f"{where}: missing field {key!r} required by {task_type} "
                            f"(needs {', '.join(_REQUIRED[task_type])})")

    def text(key: str) -> None:
        if not isinstance(ex[key], str):
            raise UserError(f"{where}: field {key!r} must be a string, got {type(ex[key]).__name__}")

    def options(key: str) -> None:
        value = ex[key]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise UserError(f"{where}: field {key!r} must be a non-empty list of strings")
        gold = ex["gold"]
        if not isinstance(gold, int) or isinstance(gold, bool):
            raise UserError(f"{where}: field 'gold' must be an integer index into {key!r}")
        if not 0 <= gold < len(value):
            raise UserError(f"{where}: field 'gold' is {gold}, out of range for {len(value)} {key}")

    if task_type == LANGUAGE_MODELING:
        text("context")
        text("continuation")
    elif task_type == MULTIPLE_CHOICE:
        text("query")
        options("choices")
    elif task_type == SCHEMA:
        options("context_options")
        text("continuation")
    else:
        text("context")
        text("answer")
        aliases = ex.get("aliases")
        if aliases is not None and not (isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
            raise UserError(f"{where}: field 'aliases' must be a list of strings")
        if "chain_of_thought" in ex and not isinstance(ex["chain_of_thought"], str):
            raise UserError(f"{where}: field 'chain_of_thought' must be a string")


__all__ = ["TASK_TYPES", "LANGUAGE_MODELING", "MULTIPLE_CHOICE", "SCHEMA", "GENERATION", "METRICS", "ICLTask",
           "DEFAULT_TASKS", "load_tasks"]
