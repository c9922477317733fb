"""In-context-learning (ICL) benchmarks: task files, prompts, batched scoring.

Reads the task format of LLM Foundry (its ``tasks*.yaml`` entries and ``local_data`` JSONL
files), so benchmark suites carry over unchanged. Four task types:

- ``language_modeling``: ``context``, ``continuation``; correct when the greedy argmax at every
  continuation position is the continuation token.
- ``multiple_choice``: ``query``, ``choices``, ``gold``; pick the choice with the lowest mean
  per-token negative log-likelihood (NLL).
- ``schema``: ``context_options``, ``continuation``, ``gold``; pick the context under which the
  shared continuation has the lowest mean NLL.
- ``generation_task_with_answers``: ``context``, ``answer``, ``aliases``; greedy generation until a
  stop sequence; correct when the normalized output starts with a normalized alias.

Context and continuation are tokenized separately and concatenated, so the scored tokens are
exactly the continuation's. Sequences are right-padded: with a causal model the real positions
never see padding, so batch size does not change any score.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from lmforge.config.load import load_yaml_text, read_text_file
from lmforge.errors import UserError

LANGUAGE_MODELING = "language_modeling"
MULTIPLE_CHOICE = "multiple_choice"
SCHEMA = "schema"
GENERATION = "generation_task_with_answers"
TASK_TYPES = (LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, GENERATION)
# Older LLM Foundry files call the generation task `question_answering`.
_TYPE_ALIASES = {"question_answering": GENERATION}

DEFAULT_TASKS = Path(__file__).with_name("tasks.yaml")

# Keys of an LLM Foundry task entry that we honour.
_TASK_KEYS = {
    "label", "dataset_uri", "num_fewshot", "icl_task_type", "prompt_string", "example_delimiter",
    "continuation_delimiter", "fewshot_random_seed", "has_categories", "early_stopping_criteria",
    "generation_kwargs", "do_normalization",
}
# Keys Foundry files carry that only tune Foundry's own dataloader; accepted and ignored.
_IGNORED_TASK_KEYS = {"batch_size", "icl_subset_num_batches", "metric_names", "max_seq_len", "pad_tok_id"}


@dataclass
class ICLTask:
    """One benchmark: its examples (already validated) and how to prompt them."""

    label: str
    task_type: str
    examples: list[dict[str, Any]]
    num_fewshot: list[int]
    source: str  # file or URI the examples came from (for error messages)
    lines: list[int] = field(default_factory=list)  # JSONL line number of each example
    prompt_string: str = ""
    example_delimiter: str = "\n"
    continuation_delimiter: str = " "
    fewshot_random_seed: int = 1234
    has_categories: bool = False
    stop_sequences: list[str] | None = None  # generation; default: example delimiter and "\n"
    max_new_tokens: int | None = None  # generation; default: longest tokenized answer/alias
    do_normalization: bool = True


@dataclass
class ExampleResult:
    """The outcome of one example at one shot count."""

    index: int  # position of the example in ICLTask.examples
    correct: bool
    prediction: int | str | None  # chosen option (multiple choice/schema) or generated text
    scores: list[float]  # mean NLL per option; [mean NLL of the continuation] for LM; [] for generation
    category: str | None = None


# ----------------------------------------------------------------------------- loading


def load_tasks(path_or_list: str | Path | list | dict, data_root: str | Path | None = None) -> list[ICLTask]:
    """Load task definitions (a YAML file, ``"default"``, or a list of task mappings) and their data.

    Relative ``dataset_uri`` paths resolve against ``data_root`` when given, else against the
    YAML file's folder (the current directory for an inline list).
    """
    if isinstance(path_or_list, (str, Path)):
        path = DEFAULT_TASKS if str(path_or_list) == "default" else Path(path_or_list).expanduser()
        where = str(path)
        if not path.is_file():
            raise UserError(f"tasks file {path} not found")
        doc = load_yaml_text(read_text_file(str(path), "tasks file"), str(path))
        base_dir = path.parent
    else:
        doc, where, base_dir = path_or_list, "eval.icl_tasks", Path.cwd()
    entries = doc.get("icl_tasks") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: expected a non-empty list of tasks (or a mapping with `icl_tasks:`)")
    tasks: list[ICLTask] = []
    for i, entry in enumerate(entries):
        task = _parse_task(entry, f"{where}: icl_tasks[{i}]", base_dir, data_root)
        if any(t.label == task.label for t in tasks):
            raise UserError(f"{where}: icl_tasks[{i}]: duplicate label {task.label!r}")
        tasks.append(task)
    return tasks


def _parse_task(entry: Any, where: str, base_dir: Path, data_root: str | Path | None) -> ICLTask:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: expected a mapping with label, dataset_uri, num_fewshot, icl_task_type")
    unknown = set(entry) - _TASK_KEYS - _IGNORED_TASK_KEYS
    if unknown:
        raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}; valid keys: {', '.join(sorted(_TASK_KEYS))}")
    for key in ("label", "dataset_uri", "icl_task_type"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise UserError(f"{where}: field {key!r} is required (a non-empty string)")
    where = f"{where} ({entry['label']})"
    task_type = _TYPE_ALIASES.get(entry["icl_task_type"], entry["icl_task_type"])
    if task_type not in TASK_TYPES:
        raise UserError(f"{where}: unknown icl_task_type {entry['icl_task_type']!r}; "
                        f"valid types: {', '.join(TASK_TYPES)}")
    shots = entry.get("num_fewshot", [0])
    shots = [shots] if isinstance(shots, int) and not isinstance(shots, bool) else shots
    if not isinstance(shots, list) or not shots or not all(_is_count(k) for k in shots):
        raise UserError(f"{where}: num_fewshot must be a non-negative integer or a list of them, "
                        f"got {entry.get('num_fewshot')!r}")
    strings = {}
    for key in ("prompt_string", "example_delimiter", "continuation_delimiter"):
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where}: {key} must be a string, got {type(value).__name__}")
        if value is not None:
            strings[key] = value
    seed = entry.get("fewshot_random_seed", 1234)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{where}: fewshot_random_seed must be an integer")
    stops = entry.get("early_stopping_criteria")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise UserError(f"{where}: early_stopping_criteria must be a list of non-empty strings")
    gen_kwargs = entry.get("generation_kwargs") or {}
    if not isinstance(gen_kwargs, dict) or set(gen_kwargs) - {"max_new_tokens"}:
        raise UserError(f"{where}: generation_kwargs supports only max_new_tokens (greedy decoding)")
    max_new = gen_kwargs.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new < 1):
        raise UserError(f"{where}: generation_kwargs.max_new_tokens must be a positive integer")

    uri = _resolve_uri(entry["dataset_uri"], base_dir, data_root)
    examples, lines = _read_examples(uri, task_type, entry["dataset_uri"], data_root)
    if max(shots) >= len(examples):
        raise UserError(
            f"{where}: num_fewshot {max(shots)} needs at least {max(shots) + 1} examples "
            f"(the example itself is never a shot); {uri} has {len(examples)}"
        )
    return ICLTask(
        label=entry["label"], task_type=task_type, examples=examples, lines=lines, num_fewshot=shots,
        source=uri, fewshot_random_seed=seed, has_categories=bool(entry.get("has_categories", False)),
        stop_sequences=stops, max_new_tokens=max_new, do_normalization=bool(entry.get("do_normalization", True)),
        **strings,
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _resolve_uri(uri: str, base_dir: Path, data_root: str | Path | None) -> str:
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


_REQUIRED = {
    LANGUAGE_MODELING: ("context", "continuation"),
    MULTIPLE_CHOICE: ("query", "choices", "gold"),
    SCHEMA: ("context_options", "continuation", "gold"),
    GENERATION: ("context",),
}


def _read_examples(uri: str, task_type: str, given: str, data_root) -> tuple[list[dict], list[int]]:
    try:
        if "://" in uri:
            import fsspec

            with fsspec.open(uri, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = Path(uri).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        hint = "" if data_root else " (pass --data-root DIR: the folder holding LLM Foundry's eval local_data files)"
        raise UserError(f"task data {uri} not found (dataset_uri {given!r}){hint}") from None
    except UnicodeDecodeError:
        raise UserError(f"{uri}: not a UTF-8 JSONL file") from None
    except OSError as e:
        raise UserError(f"task data {uri}: cannot read ({e})") from None
    examples, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{uri}:line {number}: not valid JSON ({e.msg}); "
                            "expected one JSON object per line") from None
        if not isinstance(example, dict):
            raise UserError(f"{uri}:line {number}: expected a JSON object, got {type(example).__name__}")
        _check_example(example, task_type, f"{uri}:line {number}")
        examples.append(example)
        lines.append(number)
    if not examples:
        raise UserError(f"{uri}: no examples (empty file)")
    return examples, lines


def _check_example(ex: dict, task_type: str, where: str) -> None:
    for key in _REQUIRED[task_type]:
        if key not in ex:
            raise UserError(f"{where}: missing field {key!r} required by {task_type} "
                            f"(needs {', '.join(_REQUIRED[task_type])})")

    def text(key: str, allow_empty: bool = False) -> None:
        if not isinstance(ex[key], str) or (not allow_empty and not ex[key]):
            raise UserError(f"{where}: field {key!r} must be a non-empty string")

    def options(key: str) -> None:
        value = ex[key]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise UserError(f"{where}: field {key!r} must be a non-empty list of non-empty strings")
        gold = ex["gold"]
        if not isinstance(gold, int) or isinstance(gold, bool):
            raise UserError(f"{where}: field 'gold' must be an integer index into {key!r}")
        if not 0 <= gold < len(value):
            raise UserError(f"{where}: field 'gold' is {gold}, out of range for {len(value)} {key}")

    if task_type == LANGUAGE_MODELING:
        text("context", allow_empty=True)
        text("continuation")
    elif task_type == MULTIPLE_CHOICE:
        text("query", allow_empty=True)
        options("choices")
    elif task_type == SCHEMA:
        options("context_options")
        text("continuation")
    else:
        text("context", allow_empty=True)
        if "aliases" not in ex and "answer" not in ex:
            raise UserError(f"{where}: missing field 'aliases' (or 'answer') required by {task_type}")
        if "answer" in ex:
            text("answer")
        aliases = ex.get("aliases", [ex.get("answer")])
        if not isinstance(aliases, list) or not aliases or not all(isinstance(a, str) for a in aliases):
            raise UserError(f"{where}: field 'aliases' must be a non-empty list of strings")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# ----------------------------------------------------------------------------- prompts


def fewshot_indices(task: ICLTask, index: int, k: int) -> list[int]:
    """The k demonstration examples for example `index`: seeded per (task, example), never itself."""
    if k == 0:
        return []
    rng = random.Random(f"{task.fewshot_random_seed}/{task.label}/{index}")
    # Sample from the other n-1 examples by skipping over `index`.
    return [j + (j >= index) for j in rng.sample(range(len(task.examples) - 1), k)]


def _split_delimiter(delimiter: str, answer: str) -> tuple[str, str]:
    """Give the delimiter's trailing whitespace to the answer.

    A prompt ending in a space tokenizes unnaturally for BPE vocabularies (the space belongs to
    the next word), so "Answer: " + "Paris" is scored as "Answer:" then " Paris", as Foundry does.
    """
    head = delimiter.rstrip()
    tail = delimiter[len(head):]
    if tail and not answer[:1].isspace():
        answer = tail + answer
    return head, answer


def _demonstration(task: ICLTask, ex: dict) -> tuple[str, str]:
    """(context, answer) of an example shown as a solved demonstration."""
    if task.task_type == LANGUAGE_MODELING:
        return ex["context"], ex["continuation"]
    if task.task_type == MULTIPLE_CHOICE:
        return ex["query"], ex["choices"][ex["gold"]]
    if task.task_type == SCHEMA:
        return ex["context_options"][ex["gold"]], ex["continuation"]
    return ex["context"], ex.get("answer") or ex["aliases"][0]


def fewshot_prefix(task: ICLTask, index: int, k: int) -> str:
    """`prompt_string` followed by k solved demonstrations, joined by the example delimiter."""
    text = task.prompt_string
    for j in fewshot_indices(task, index, k):
        context, answer = _demonstration(task, task.examples[j])
        head, answer = _split_delimiter(task.continuation_delimiter, answer)
        if text:
            text += task.example_delimiter
        text += context + head + answer
    return text


def build_prompt(task: ICLTask, prefix: str, context: str, answer: str) -> tuple[str, str]:
    """(context text, continuation text) of one scored sequence."""
    head, answer = _split_delimiter(task.continuation_delimiter, answer)
    if prefix:
        prefix += task.example_delimiter
    return prefix + context + head, answer


# ----------------------------------------------------------------------------- scoring


def evaluate_icl(
    model: torch.nn.Module,
    tokenizer,
    tasks: list[ICLTask],
    *,
    batch_size: int = 8,
    max_seq_len: int | None = None,
    limit: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Accuracy per task and shot count: ``{"<label>/<n>-shot": {"accuracy", "n"}}``.

    Tasks with ``has_categories`` also get ``"categories": {name: {"accuracy", "n"}}``.
    The model is put in eval mode (its mode is restored afterwards) and run without gradients.
    """
    bar = _Progress(progress)
    results: dict[str, dict[str, Any]] = {}
    try:
        for task in tasks:
            for k in task.num_fewshot:
                key = f"{task.label}/{k}-shot"
                rows = score_task(model, tokenizer, task, k, batch_size=batch_size, max_seq_len=max_seq_len,
                                  limit=limit, device=device, progress=bar.start(key))
                results[key] = _summarize(rows, task.has_categories)
    finally:
        bar.close()
    return results


def _summarize(rows: list[ExampleResult], with_categories: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"accuracy": sum(r.correct for r in rows) / len(rows), "n": len(rows)}
    if with_categories:
        groups: dict[str, list[bool]] = {}
        for r in rows:
            groups.setdefault(str(r.category), []).append(r.correct)
        out["categories"] = {c: {"accuracy": sum(v) / len(v), "n": len(v)} for c, v in sorted(groups.items())}
    return out


def score_task(
    model: torch.nn.Module,
    tokenizer,
    task: ICLTask,
    num_fewshot: int,
    *,
    batch_size: int = 8,
    max_seq_len: int | None = None,
    limit: int | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[ExampleResult]:
    """Score the first `limit` examples of one task at one shot count, one result per example."""
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if limit is not None and limit < 1:
        raise UserError(f"limit must be at least 1, got {limit}")
    if num_fewshot >= len(task.examples):
        raise UserError(f"task {task.label!r}: num_fewshot {num_fewshot} needs more than {len(task.examples)} examples")
    max_seq_len = max_seq_len or _model_max_seq_len(model)
    device = torch.device(device) if device is not None else _model_device(model)
    indices = list(range(len(task.examples)))[:limit]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            score = _score_generation if task.task_type == GENERATION else _score_likelihood
            return score(model, tokenizer, task, num_fewshot, indices, batch_size, max_seq_len, device, progress)
    finally:
        model.train(was_training)


def _score_likelihood(model, tokenizer, task: ICLTask, k: int, indices: list[int], batch_size: int,
                      max_seq_len: int, device, progress) -> list[ExampleResult]:
    # One request per (example, option): (example position, context ids, continuation ids).
    requests: list[tuple[int, list[int], list[int]]] = []
    for pos, i in enumerate(indices):
        ex, prefix = task.examples[i], fewshot_prefix(task, i, k)
        if task.task_type == LANGUAGE_MODELING:
            pairs = [(ex["context"], ex["continuation"])]
        elif task.task_type == MULTIPLE_CHOICE:
            pairs = [(ex["query"], choice) for choice in ex["choices"]]
        else:
            pairs = [(option, ex["continuation"]) for option in ex["context_options"]]
        encoded: dict[str, list[int]] = {}  # multiple-choice options share one context
        for context, answer in pairs:
            ctx_text, cont_text = build_prompt(task, prefix, context, answer)
            if ctx_text not in encoded:
                encoded[ctx_text] = tokenizer.encode(ctx_text)
            cont = _encode_continuation(tokenizer, cont_text)
            if not cont:
                raise UserError(f"{task.source}:line {task.lines[i]}: continuation {cont_text!r} encodes to no tokens")
            ctx = _truncate(encoded[ctx_text], cont, max_seq_len, tokenizer, task, i)
            requests.append((pos, ctx, cont))

    nll = [0.0] * len(requests)
    greedy = [False] * len(requests)
    # Longest first so each batch pads little; results go back to their request's slot.
    order = sorted(range(len(requests)), key=lambda r: -(len(requests[r][1]) + len(requests[r][2])))
    pad = _pad_id(tokenizer)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        seqs = [(requests[r][1] + requests[r][2])[:-1] for r in chunk]  # the last token predicts nothing
        logits = _forward(model, _right_pad(seqs, pad, device))
        for row, r in enumerate(chunk):
            ctx, cont = requests[r][1], requests[r][2]
            first = len(ctx) - 1  # position whose logits predict cont[0]
            lp = F.log_softmax(logits[row, first:first + len(cont)].float(), dim=-1)
            target = torch.tensor(cont, device=lp.device)
            nll[r] = -lp.gather(1, target[:, None]).mean().item()
            greedy[r] = bool((lp.argmax(dim=-1) == target).all())
        if progress:
            progress(len(chunk), len(requests))

    by_example: dict[int, list[int]] = {}
    for r, (pos, _, _) in enumerate(requests):
        by_example.setdefault(pos, []).append(r)
    results = []
    for pos, i in enumerate(indices):
        ex, rs = task.examples[i], by_example[pos]
        scores = [nll[r] for r in rs]
        if task.task_type == LANGUAGE_MODELING:
            correct, pred = greedy[rs[0]], None
        else:
            pred = min(range(len(scores)), key=scores.__getitem__)  # first of equal minima
            correct = pred == ex["gold"]
        results.append(ExampleResult(i, correct, pred, scores, ex.get("category")))
    return results


def _encode_continuation(tokenizer, text: str) -> list[int]:
    # A tokenizer that adds BOS to every encode must not add it inside the scored continuation.
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def _start_id(tokenizer) -> int:
    bos = getattr(tokenizer, "bos_id", None)
    return bos if bos is not None else tokenizer.eos_id


def _truncate(ctx: list[int], cont: list[int], max_seq_len: int, tokenizer, task: ICLTask, i: int) -> list[int]:
    """Drop context tokens from the left so context + continuation fits the model."""
    if not ctx:
        # The first continuation token needs a position to be predicted from.
        ctx = [_start_id(tokenizer)]
    if len(cont) >= max_seq_len:
        raise UserError(
            f"{task.source}:line {task.lines[i]}: continuation is {len(cont)} tokens, longer than the "
            f"model's context ({max_seq_len}) leaves room for"
        )
    return ctx[-(max_seq_len - len(cont)):]


def _score_generation(model, tokenizer, task: ICLTask, k: int, indices: list[int], batch_size: int,
                      max_seq_len: int, device, progress) -> list[ExampleResult]:
    max_new = task.max_new_tokens or _longest_answer(task, tokenizer)
    max_new = max(1, min(max_new, max_seq_len - 1))
    stops = task.stop_sequences or [s for s in dict.fromkeys([task.example_delimiter, "\n"]) if s]
    prompts = []
    for i in indices:
        ex = task.examples[i]
        # The answer placeholder is empty: the prompt is the context plus the delimiter's head.
        ctx_text, _ = build_prompt(task, fewshot_prefix(task, i, k), ex["context"], "")
        ids = tokenizer.encode(ctx_text) or [_start_id(tokenizer)]
        prompts.append(ids[-(max_seq_len - max_new):])
    texts: list[str] = [""] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda p: -len(prompts[p]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        outs = greedy_generate(model, [prompts[p] for p in chunk], max_new, tokenizer, stops, device)
        for p, text in zip(chunk, outs):
            texts[p] = text
        if progress:
            progress(len(chunk), len(prompts))
    results = []
    for pos, i in enumerate(indices):
        ex = task.examples[i]
        aliases = ex.get("aliases") or [ex["answer"]]
        correct = answer_matches(texts[pos], aliases, task.do_normalization)
        results.append(ExampleResult(i, correct, texts[pos], [], ex.get("category")))
    return results


def _longest_answer(task: ICLTask, tokenizer) -> int:
    longest = 1
    for ex in task.examples:
        for alias in (ex.get("aliases") or []) + ([ex["answer"]] if "answer" in ex else []):
            longest = max(longest, len(_encode_continuation(tokenizer, " " + alias)))
    return longest


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, tokenizer, stops: list[str],
                    device) -> list[str]:
    """Greedy continuations of a batch of prompts, each cut before its first stop sequence.

    Right-padded, re-running the whole batch per step (no KV cache): answers are a few tokens,
    and this keeps every row's positions 0..T-1 exactly as when run alone.
    """
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    pad = _pad_id(tokenizer)
    for _ in range(max_new_tokens):
        if not active:
            break
        logits = _forward(model, _right_pad([seqs[a] for a in active], pad, device))
        still = []
        for row, a in enumerate(active):
            token = int(logits[row, len(seqs[a]) - 1].float().argmax())
            if token == tokenizer.eos_id:
                continue
            seqs[a].append(token)
            new[a].append(token)
            if not any(s in tokenizer.decode(new[a]) for s in stops):
                still.append(a)
        active = still
    texts = []
    for tokens in new:
        text = tokenizer.decode(tokens)
        cut = min((text.find(s) for s in stops if s in text), default=len(text))
        texts.append(text[:cut])
    return texts


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD-style)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_matches(output: str, aliases: list[str], normalize: bool = True) -> bool:
    """True when the generated output starts with any alias."""
    if normalize:
        output = normalize_answer(output)
        return any(output.startswith(normalize_answer(a)) for a in aliases)
    output = output.lstrip()
    return any(output.startswith(a) for a in aliases)


# ----------------------------------------------------------------------------- model plumbing


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    if isinstance(out, (tuple, list)):  # e.g. (logits, aux_loss) from an MoE model
        out = out[0]
    return getattr(out, "logits", out)


def _right_pad(seqs: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), width), pad, dtype=torch.long)
    for row, s in enumerate(seqs):
        batch[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return batch.to(device)


def _pad_id(tokenizer) -> int:
    # Padding sits after every real token, so its value never reaches a scored position.
    pad = getattr(tokenizer, "pad_id", None)
    return pad if pad is not None else (tokenizer.eos_id if tokenizer.eos_id is not None else 0)


def _model_max_seq_len(model) -> int:
    for attr in ("cfg", "config", "model_config"):
        value = getattr(getattr(model, attr, None), "max_seq_len", None)
        if isinstance(value, int):
            return value
    return 2048


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


class _Progress:
    """A rich progress bar on stderr, one line per task and shot count; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=False)
            self.bar.start()

    def start(self, name: str) -> Callable[[int, int], None] | None:
        if self.bar is None:
            return None
        task_id = self.bar.add_task(name, total=None)

        def advance(done: int, total: int) -> None:
            self.bar.update(task_id, advance=done, total=total)

        return advance

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = [
    "TASK_TYPES", "ICLTask", "ExampleResult", "load_tasks", "evaluate_icl", "score_task", "fewshot_indices",
    "fewshot_prefix", "build_prompt", "greedy_generate", "normalize_answer", "answer_matches",
]
