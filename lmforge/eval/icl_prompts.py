"""Few-shot choice, prompt text and token sequences, following LLM Foundry's rules exactly.

Few-shot choice: each dataset (a task at one shot count; with ``has_categories``, each category)
owns one ``random.Random(fewshot_random_seed)``, consumed example after example in dataset order.
For example i it draws ``sample(range(n), k)`` (k capped at n-1) into a set; if i was drawn, it
is removed and replaced by ``choice(range(n))`` redrawn until it is neither i nor already
chosen. Demonstrations follow in the set's iteration order.

Prompt text: the *preamble* is ``prompt_string`` followed by the demonstrations, each written as
``[example_delimiter] prelimiter context continuation_delimiter answer`` (the delimiter only when
text precedes it). The example itself follows as ``[example_delimiter] prelimiter context
continuation_delimiter``, right-stripped when ``strip_dataset`` is on. Schema tasks differ: a
demonstration is ``prelimiter [example_delimiter] option continuation_delimiter continuation``,
and each option of the example is ``prelimiter example_delimiter option delimiter`` after a
preamble (the delimiter right-stripped with ``strip_dataset``) or just ``prelimiter option``.

Tokens: the preamble is tokenized on its own *with* the tokenizer's special tokens (so BOS, if
the tokenizer adds one, comes first; a trailing EOS is dropped), the example's text *without*
them, and the two are concatenated. The answer is tokenized without special tokens, after a
leading space is added when the tokenizer keeps a space as part of the next word (GPT-2-style
BPE: " a" is one token) and the answer has none. Contexts are trimmed from the left so that
context + answer fit in max_seq_len.
"""

from __future__ import annotations

import random
from typing import Any

from lmforge.errors import UserError
from lmforge.tasks.icl import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, ICLTask

# Foundry lets chain-of-thought answers run this many tokens past the longest one in the data.
COT_ANSWER_SLACK = 10


# ----------------------------------------------------------------------------- few-shot choice


def sample_fewshot(n: int, k: int, index: int, rng: random.Random) -> list[int]:
    """Positions of the k demonstrations for position `index` of an n-example dataset."""
    k = min(n - 1, k)
    chosen = set(rng.sample(range(n), k))
    if index in chosen:
        chosen.discard(index)
        if len(chosen) < n - 1:
            extra = rng.choice(range(n))
            while extra == index or extra in chosen:
                extra = rng.choice(range(n))
            chosen.add(extra)
    # Set iteration order is part of the rule: it decides the order of the demonstrations.
    return list(chosen)


def fewshot_choices(task: ICLTask, k: int, limit: int | None = None) -> dict[int, list[int]]:
    """Demonstration indices (into task.examples) for each of the first `limit` examples."""
    out: dict[int, list[int]] = {}
    for members in task.partitions.values():
        rng = random.Random(task.fewshot_random_seed)
        for pos, i in enumerate(members):
            if limit is not None and i >= limit:
                break  # members are in file order, so the rest are past the limit too
            out[i] = [members[j] for j in sample_fewshot(len(members), k, pos, rng)] if k > 0 else []
    return out


def fewshot_indices(task: ICLTask, index: int, k: int) -> list[int]:
    """The demonstrations of one example (computed through its dataset's generator)."""
    return fewshot_choices(task, k, limit=index + 1)[index]


# ----------------------------------------------------------------------------- prompt text


def demonstration_answer(task: ICLTask, ex: dict[str, Any]) -> str:
    """The answer shown after a solved demonstration (never given an extra leading space)."""
    if task.task_type == LANGUAGE_MODELING:
        return ex["continuation"]
    if task.task_type == MULTIPLE_CHOICE:
        return ex["choices"][ex["gold"]]
    if task.task_type == SCHEMA:
        return ex["continuation"]
    if task.has_cot:
        return f"{ex.get('chain_of_thought') or ''}{task.cot_delimiter}{ex['answer']}"
    return ex["answer"]


def _context_field(task: ICLTask, ex: dict[str, Any]) -> str:
    return ex["query"] if task.task_type == MULTIPLE_CHOICE else ex["context"]


def preamble_text(task: ICLTask, demos: list[int]) -> str:
    """``prompt_string`` followed by the solved demonstrations."""
    text = task.prompt_string
    for j in demos:
        ex = task.examples[j]
        if task.task_type == SCHEMA:
            option = ex["context_options"][ex["gold"]]
            if text:
                option = task.example_delimiter + option
            text += f"{task.prelimiter}{option}{task.continuation_delimiter}{ex['continuation']}"
        else:
            piece = task.prelimiter + _context_field(task, ex)
            if text:
                piece = task.example_delimiter + piece
            text += piece + task.continuation_delimiter + demonstration_answer(task, ex)
    return text


def example_text(task: ICLTask, ex: dict[str, Any], preamble: str) -> str:
    """The example's own context (LM, multiple choice, generation), after the preamble."""
    text = task.prelimiter + _context_field(task, ex)
    if preamble:
        text = task.example_delimiter + text
    text += task.continuation_delimiter
    # A prompt ending in a space tokenizes unnaturally; the answer gets the space instead.
    return text.rstrip() if task.strip_dataset else text


def schema_texts(task: ICLTask, ex: dict[str, Any], preamble: str) -> list[str]:
    """One context per option of a schema example, after the preamble."""
    if not preamble:
        return [task.prelimiter + c for c in ex["context_options"]]
    delimiter = task.continuation_delimiter.rstrip() if task.strip_dataset else task.continuation_delimiter
    return [f"{task.prelimiter}{task.example_delimiter}{c}{delimiter}" for c in ex["context_options"]]


# ----------------------------------------------------------------------------- tokens


def needs_prefix_space(tokenizer) -> bool:
    """True for GPT-2-style BPE (the space belongs to the next word), false for SentencePiece."""
    return len(tokenizer.encode(" a", add_special_tokens=False)) == 1


def encode_preamble(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=True)
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and len(ids) > 1 and ids[-1] == eos:
        ids = ids[:-1]  # a tokenizer that appends EOS must not put it mid-prompt
    return ids


def _answer_ids(tokenizer, answer: str, prefix_space: bool) -> list[int]:
    if prefix_space and not answer.startswith(" "):
        answer = " " + answer
    return tokenizer.encode(answer, add_special_tokens=False)


def _trim(ctx: list[int], cont: list[int], max_seq_len: int, where: str) -> list[int]:
    if len(cont) >= max_seq_len:
        raise UserError(f"{where}: the answer is {len(cont)} tokens, which leaves no room for context "
                        f"in the model's {max_seq_len}")
    return ctx[-(max_seq_len - len(cont)):] if len(ctx) + len(cont) > max_seq_len else ctx


def likelihood_sequences(task: ICLTask, tokenizer, index: int, demos: list[int], max_seq_len: int,
                         prefix_space: bool) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) for each option of a likelihood-scored example
    (one for language modeling)."""
    ex, where = task.examples[index], task.locations[index]
    preamble = preamble_text(task, demos)
    head = encode_preamble(tokenizer, preamble)
    if task.task_type == SCHEMA:
        cont = _answer_ids(tokenizer, ex["continuation"], prefix_space)
        contexts = [head + tokenizer.encode(c, add_special_tokens=False) for c in schema_texts(task, ex, preamble)]
        pairs = [(ctx, cont) for ctx in contexts]
    else:
        ctx = head + tokenizer.encode(example_text(task, ex, preamble), add_special_tokens=False)
        answers = [ex["continuation"]] if task.task_type == LANGUAGE_MODELING else ex["choices"]
        pairs = [(ctx, _answer_ids(tokenizer, a, prefix_space)) for a in answers]
    out = []
    for ctx, cont in pairs:
        if not cont:
            raise UserError(f"{where}: an answer encodes to no tokens (empty after stripping?)")
        out.append((_trim(ctx, cont, max_seq_len, where), cont))
    return out


def answer_budget(task: ICLTask, tokenizer, members: list[int]) -> int:
    """Foundry's longest answer of a generation dataset, in tokens (special tokens included),
    over every accepted answer as read (unstripped), plus slack for chain-of-thought tasks."""
    texts = []
    for i in members:
        cot = task.raw[i].get("chain_of_thought") or "" if task.has_cot else None
        for alias in task.examples[i]["aliases"]:
            texts.append(f"{cot}{task.cot_delimiter}{alias}" if cot is not None else alias)
    batch = getattr(tokenizer, "encode_batch", None)
    lengths = [len(ids) for ids in batch(texts)] if batch else [len(tokenizer.encode(t)) for t in texts]
    return max(lengths, default=0) + (COT_ANSWER_SLACK if task.cot_delimiter else 0)


def generation_prompt(task: ICLTask, tokenizer, index: int, demos: list[int], room: int) -> list[int]:
    """The prompt ids of a generation example, trimmed from the left to `room` tokens."""
    preamble = preamble_text(task, demos)
    ids = encode_preamble(tokenizer, preamble) + tokenizer.encode(
        example_text(task, task.examples[index], preamble), add_special_tokens=False)
    return ids[-room:] if len(ids) > room else ids


__all__ = ["sample_fewshot", "fewshot_choices", "fewshot_indices", "preamble_text", "example_text", "schema_texts",
           "needs_prefix_space", "likelihood_sequences", "answer_budget", "generation_prompt"]
