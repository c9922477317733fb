"""In-context-learning (ICL) benchmarks in LLM Foundry's format, scored by Foundry's rules.

The parts: ``icl_tasks`` reads task entries and their data, ``icl_prompts`` chooses few-shot
demonstrations and builds the token sequences, ``icl_metrics`` holds the answer and calibration
rules; this module runs the model. Four task types:

- ``language_modeling``: ``context``, ``continuation``; correct when the greedy argmax at every
  continuation position is the continuation token.
- ``multiple_choice``: ``query``, ``choices``, ``gold``; the choice with the lowest mean per-token
  negative log-likelihood (NLL) is the prediction (first one on ties).
- ``schema``: ``context_options``, ``continuation``, ``gold``; the context under which the shared
  continuation has the lowest mean NLL.

That ``accuracy`` is Foundry's rule (lowest mean loss per token, `ACCURACY_RULE`). The same
log-likelihoods give lm-evaluation-harness's two (0.4: its ``acc`` and ``acc_norm``), reported
beside it for these two types so that a number compares with either ecosystem: ``acc``, the
highest *summed* log-likelihood (a longer choice pays for every token), and ``acc_norm``, the
summed log-likelihood divided by the choice's length in characters (the option's text; schema
tasks share their continuation, so there both equal ``acc``).
- ``generation_task_with_answers``: ``context``, ``answer``, ``aliases``; greedy generation up to
  the longest answer's length (or ``generation_kwargs.max_new_tokens``) or EOS, graded by
  ``icl_metrics``.

Sequences are right-padded in batches: with a causal model the real positions never see the
padding, so the batch size does not change any score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from lmforge.errors import UserError
from lmforge.eval.icl_metrics import (
    answer_matches, calibration_error, choice_confidence, final_answer, lm_confidence, normalize_answer,
    settled_length,
)
from lmforge.eval.icl_prompts import (
    answer_budget, fewshot_choices, fewshot_indices, generation_prompt, likelihood_sequences, needs_prefix_space,
    preamble_text,
)
from lmforge.tasks.icl import (
    DEFAULT_TASKS, GENERATION, LANGUAGE_MODELING, SCHEMA, TASK_TYPES, ICLTask, load_tasks,
)


# What each accuracy of a likelihood-scored choice task means (`summarize` names them with its results).
ACCURACY_RULE = "LLM Foundry's: the option with the lowest mean loss per token"
LM_EVAL_RULES = {"acc": "lm-evaluation-harness's acc: the highest summed log-likelihood",
                 "acc_norm": "lm-evaluation-harness's acc_norm: the highest summed log-likelihood per character of "
                             "the option"}


@dataclass
class ExampleResult:
    """The outcome of one example at one shot count."""

    index: int  # position of the example in ICLTask.examples
    correct: bool
    prediction: int | str | None  # chosen option (multiple choice/schema) or graded answer (generation)
    scores: list[float]  # mean NLL per option; [mean NLL of the continuation] for LM; [] for generation
    category: str | None = None
    # (confidence, right) as the calibration metric sees it; only when the task asks for it.
    calibration: tuple[float, bool] | None = None
    # lm-evaluation-harness's rules (multiple choice, schema): right by the summed NLL, and by it per character
    acc: bool | None = None
    acc_norm: bool | None = None


# ----------------------------------------------------------------------------- entry points


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
    """Results per task and shot count: ``{"<label>/<n>-shot": {"accuracy", "n", "size", ...}}``.

    ``n`` is how many examples were scored (``limit``), ``size`` how many the task has (the
    gauntlet's sample-size weights use it). Tasks with ``has_categories`` also get
    ``"categories": {name: {"accuracy", "n", "size"}}``; tasks whose ``metric_names`` ask for a
    calibration error get ``"calibration_error"`` (per category too). The model is put in eval
    mode (restored afterwards) and run without gradients.
    """
    bar = _Progress(progress)
    results: dict[str, dict[str, Any]] = {}
    try:
        for task in tasks:
            for k in task.num_fewshot:
                key = f"{task.label}/{k}-shot"
                rows = score_task(model, tokenizer, task, k, batch_size=batch_size, max_seq_len=max_seq_len,
                                  limit=limit, device=device, progress=bar.start(key))
                results[key] = summarize(task, rows)
    finally:
        bar.close()
    return results


def summarize(task: ICLTask, rows: list[ExampleResult]) -> dict[str, Any]:
    def stats(part: list[ExampleResult], size: int) -> dict[str, Any]:
        out: dict[str, Any] = {"accuracy": sum(r.correct for r in part) / len(part), "n": len(part), "size": size}
        if part and part[0].acc is not None:  # lm-eval's rules beside Foundry's
            out["acc"] = sum(bool(r.acc) for r in part) / len(part)
            out["acc_norm"] = sum(bool(r.acc_norm) for r in part) / len(part)
        if "calibration_error" in task.metrics:
            out["calibration_error"] = calibration_error([r.calibration for r in part])
        return out

    out = stats(rows, len(task.examples))
    if "acc" in out:
        out["rules"] = {"accuracy": ACCURACY_RULE} | LM_EVAL_RULES
    if task.has_categories:
        groups: dict[str, list[ExampleResult]] = {}
        for r in rows:
            groups.setdefault(str(r.category), []).append(r)
        out["categories"] = {c: stats(groups[c], len(task.partitions[c])) for c in task.partitions if c in groups}
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
    max_seq_len = task.max_seq_len or max_seq_len or _model_max_seq_len(model)
    device = torch.device(device) if device is not None else _model_device(model)
    indices = list(range(len(task.examples)))[:limit]
    demos = fewshot_choices(task, num_fewshot, limit=len(indices))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            score = _score_generation if task.task_type == GENERATION else _score_likelihood
            return score(model, tokenizer, task, num_fewshot, indices, demos, batch_size, max_seq_len, device,
                         progress)
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- likelihood tasks


def _score_likelihood(model, tokenizer, task: ICLTask, k: int, indices: list[int], demos: dict[int, list[int]],
                      batch_size: int, max_seq_len: int, device, progress) -> list[ExampleResult]:
    prefix_space = needs_prefix_space(tokenizer)
    calibrate = "calibration_error" in task.metrics
    # One request per (example, option): (example position, context ids, continuation ids).
    requests: list[tuple[int, list[int], list[int]]] = []
    for pos, i in enumerate(indices):
        for ctx, cont in likelihood_sequences(task, tokenizer, i, demos[i], max_seq_len, prefix_space):
            # Foundry cannot score a continuation with no context before it; we give it a start token.
            requests.append((pos, ctx or [_start_id(tokenizer)], cont))

    nll = [0.0] * len(requests)
    summed = [0.0] * len(requests)
    greedy = [False] * len(requests)
    confidence = [0.0] * len(requests)
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
            picked = lp.gather(1, target[:, None])[:, 0]
            mean, total = torch.stack([picked.mean(), picked.sum()]).tolist()  # one device read, not two
            nll[r], summed[r] = -mean, -total
            greedy[r] = bool((lp.argmax(dim=-1) == target).all())
            if calibrate:
                confidence[r] = lm_confidence(lp) if task.task_type == LANGUAGE_MODELING else \
                    float(picked.exp().mean())
        if progress:
            progress(len(chunk), len(requests))

    by_example: dict[int, list[int]] = {}
    for r, (pos, _, _) in enumerate(requests):
        by_example.setdefault(pos, []).append(r)
    results = []
    for pos, i in enumerate(indices):
        ex, rs = task.examples[i], by_example[pos]
        scores = [nll[r] for r in rs]
        calibration = acc = acc_norm = None
        if task.task_type == LANGUAGE_MODELING:
            correct, pred = greedy[rs[0]], None
            if calibrate:
                calibration = (confidence[rs[0]], correct)
        else:
            pred = min(range(len(scores)), key=scores.__getitem__)  # first of equal minima
            correct = pred == ex["gold"]
            if calibrate:
                best, conf = choice_confidence([confidence[r] for r in rs])
                calibration = (conf, best == ex["gold"])
            sums = [summed[r] for r in rs]
            chars = [max(1, len(c)) for c in (ex["choices"] if task.task_type != SCHEMA else
                                              [ex["continuation"]] * len(rs))]
            acc = min(range(len(sums)), key=sums.__getitem__) == ex["gold"]  # lm-eval: argmax, first of ties
            acc_norm = min(range(len(sums)), key=lambda k: sums[k] / chars[k]) == ex["gold"]
        results.append(ExampleResult(i, correct, pred, scores, ex.get("category"), calibration, acc, acc_norm))
    return results


# ----------------------------------------------------------------------------- generation tasks


def _score_generation(model, tokenizer, task: ICLTask, k: int, indices: list[int], demos: dict[int, list[int]],
                      batch_size: int, max_seq_len: int, device, progress) -> list[ExampleResult]:
    prefix_space = needs_prefix_space(tokenizer)
    wanted = set(indices)
    prompts: dict[int, list[int]] = {}
    budgets: dict[int, int] = {}
    for members in task.partitions.values():
        if not wanted.intersection(members):
            continue
        # Foundry measures the answer budget on the whole dataset (each category on its own).
        budget = answer_budget(task, tokenizer, members)
        if budget >= max_seq_len:
            raise UserError(f"{task.source}: the longest answer is {budget} tokens, which leaves no room for a "
                            f"prompt in max_seq_len {max_seq_len}")
        max_new = task.generation.get("max_new_tokens", max(budget, 1))
        # Room for the prompt: Foundry keeps max_seq_len - budget tokens; a larger max_new_tokens
        # than the budget must still fit the model, so the prompt gives way to it.
        room = min(max_seq_len - budget, max_seq_len - max_new + 1)
        if room < 1:
            raise UserError(f"{task.source}: generation_kwargs.max_new_tokens {max_new} leaves no room for a "
                            f"prompt in max_seq_len {max_seq_len}")
        for i in members:
            if i in wanted:
                prompts[i] = generation_prompt(task, tokenizer, i, demos[i], room) or [_start_id(tokenizer)]
                budgets[i] = max_new

    eos = task.generation.get("eos_token_id", tokenizer.eos_id)
    stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pick = _picker(task)

    def done(tokens: list[int]) -> bool:
        # Without stop sequences Foundry generates the whole budget (or to EOS).
        return bool(task.stop_sequences) and settled_length(_decode(tokenizer, tokens, prefix_space),
                                                             task.stop_sequences)

    texts: dict[int, str] = {}
    order = sorted(indices, key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        outs = generate_batch(model, [prompts[i] for i in chunk], [budgets[i] for i in chunk], stop_ids, pick,
                              done, _pad_id(tokenizer), device)
        for i, tokens in zip(chunk, outs):
            texts[i] = _decode(tokenizer, tokens, prefix_space)
        if progress:
            progress(len(chunk), len(indices))

    results = []
    for i in indices:
        ex = task.examples[i]
        answer = final_answer(texts[i], task.stop_sequences, task.cot_delimiter)
        correct = answer_matches(answer, ex["aliases"], task.do_normalization)
        results.append(ExampleResult(i, correct, answer, [], ex.get("category")))
    return results


def _decode(tokenizer, tokens: list[int], prefix_space: bool) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    # Composer's generation puts a space back in front for SentencePiece-style tokenizers.
    return text if prefix_space else " " + text


def _picker(task: ICLTask) -> Callable[[torch.Tensor], int]:
    """Next-token choice: greedy, or sampled when generation_kwargs says do_sample (with
    Hugging Face's defaults: temperature 1, top_k 50, top_p 1), seeded per task."""
    g = task.generation
    if not g.get("do_sample", False):
        return lambda logits: int(logits.argmax())
    from lmforge.models.generate import _sample

    gen = torch.Generator().manual_seed(task.fewshot_random_seed)
    temperature, top_k, top_p = float(g.get("temperature", 1.0)), g.get("top_k", 50), g.get("top_p", 1.0)
    return lambda logits: _sample(logits.float(), temperature, top_k, top_p, gen)


def generate_batch(model, prompts: list[list[int]], max_new: list[int], stop_ids: set[int],
                   pick: Callable[[torch.Tensor], int], done: Callable[[list[int]], bool], pad: int,
                   device) -> list[list[int]]:
    """New tokens for each prompt: until a stop token (not included), `done(tokens)`, or max_new."""
    if _can_cache(model):
        return [_generate_cached(model, p, n, stop_ids, pick, done, device) for p, n in zip(prompts, max_new)]
    # Any other causal LM: right-padded batch, re-run in full per step (no cache to rely on).
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    active = [a for a in range(len(prompts)) if max_new[a] > 0]
    while active:
        logits = _forward(model, _right_pad([seqs[a] for a in active], pad, device))
        still = []
        for row, a in enumerate(active):
            token = pick(logits[row, len(seqs[a]) - 1])
            if token in stop_ids:
                continue
            seqs[a].append(token)
            new[a].append(token)
            if len(new[a]) < max_new[a] and not done(new[a]):
                still.append(a)
        active = still
    return new


def _can_cache(model) -> bool:
    weight = getattr(getattr(model, "tok_embeddings", None), "weight", None)
    # Sharded (DTensor) weights take the plain path, which every rank runs in step.
    return hasattr(model, "new_kv_cache") and hasattr(model, "decode") and weight is not None \
        and not hasattr(weight, "placements")


def _generate_cached(model, prompt: list[int], max_new: int, stop_ids: set[int], pick, done, device) -> list[int]:
    new: list[int] = []
    if max_new < 1:
        return new
    cache = model.new_kv_cache(1, len(prompt) + max_new - 1)
    logits = _forward_cached(model, prompt, cache, 0, device)
    pos = len(prompt)
    while True:
        token = pick(logits)
        if token in stop_ids:
            break
        new.append(token)
        if len(new) >= max_new or done(new):
            break
        logits = _forward_cached(model, [token], cache, pos, device)
        pos += 1
    return new


def _forward_cached(model, ids: list[int], cache, start: int, device) -> torch.Tensor:
    return model.decode(torch.tensor([ids], dtype=torch.long, device=device), cache, start_pos=start)[0, -1]


# ----------------------------------------------------------------------------- model plumbing


def _start_id(tokenizer) -> int:
    bos = getattr(tokenizer, "bos_id", None)
    return bos if bos is not None else tokenizer.eos_id


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
    "TASK_TYPES", "DEFAULT_TASKS", "ICLTask", "ExampleResult", "load_tasks", "evaluate_icl", "score_task",
    "summarize", "fewshot_indices", "fewshot_choices", "preamble_text", "generate_batch", "normalize_answer",
    "answer_matches", "final_answer",
]
