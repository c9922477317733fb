"""Preference pairs: JSONL rows of prompt / chosen / rejected → token rows that keep each pair together.

Rows (``task_type: preference``), one pair each:

    {"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"}
    {"prompt": [{"role": "user", "content": "2 + 3?"}], "chosen": [{"role": "assistant", "content": "5"}],
     "rejected": [{"role": "assistant", "content": "6"}]}
    {"chosen": [{"role": "user", ...}, {"role": "assistant", ...}], "rejected": [{"role": "user", ...}, ...]}

- Strings are used as written: ``prompt + answer + <eos>`` (as ``instruction_finetune``).
- Messages are rendered with the tokenizer's own chat template (`data.chat`), else lmforge's
  plain one (`data.sft`), exactly as SFT renders them. ``chosen`` / ``rejected`` given as whole
  conversations without a ``prompt`` (UltraFeedback's layout) share their leading messages: those
  are the prompt. A string ``prompt`` with message answers is one user turn.
- Only the answer's tokens are scored (its assistant turns, with their end-of-turn token); the
  prompt, and any assistant turn inside it, is context.

Packing keeps a pair in one row: the chosen sequence, then the rejected one, each its own
document (``doc_ids`` 2k and 2k+1 for the row's k-th pair; padding after the last pair), so the
model never attends from one into the other and the losses see both answers of every pair in
the same micro-batch. ``sft.packing: false`` puts one pair per row.

A pair longer than the context is cut to fit, as TRL's DPO truncates: first its prompt, from the
left (the text nearest the answers stays; the tokenizer's BOS too), down to a quarter of the row
at least, then its answers from their ends (the longer one first). A pair that a cut leaves with
chosen and rejected identical is dropped (its loss would be a constant: no gradient, a tie in the
accuracy), as is one whose prompt leaves no room at all. Cuts and drops are counted and the rows
named in the run's first lines; only data with no pair left is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lmforge.config.schema import PREFERENCE_TASK
from lmforge.data.batch import IGNORE, Batch
from lmforge.data.rows.sft import SFTData, json_rows, packing_note, row_segments, tokenize_example
from lmforge.errors import UserError, json_kind

ROW_FIELDS = "prompt / chosen / rejected"


# --------------------------------------------------------------------------- reading rows

def _is_messages(v) -> bool:
    return isinstance(v, list)


def _conversations(row: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a chat row."""
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    for key, v in (("chosen", chosen), ("rejected", rejected)):
        if not _is_messages(v) or not v or not all(isinstance(m, dict) for m in v):
            raise UserError(f"{where}: field {key!r} must be a string or a non-empty list of {{role, content}} "
                            "messages (both answers of a row in the same form)")
    if _is_messages(prompt):
        if not prompt:
            raise UserError(f"{where}: field 'prompt' is an empty list of messages")
        return prompt, chosen, rejected
    if isinstance(prompt, str) and chosen[0].get("role") == "assistant" and rejected[0].get("role") == "assistant":
        return [{"role": "user", "content": prompt}], chosen, rejected
    if prompt is not None and not isinstance(prompt, str):
        raise UserError(f"{where}: field 'prompt' must be a string or a list of messages")
    # Whole conversations: the leading messages they share are the prompt.
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise UserError(f"{where}: 'chosen' and 'rejected' are whole conversations with no shared first message "
                        "to take as the prompt; give 'prompt' (messages) and the answers alone")
    return chosen[:k], chosen[k:], rejected[k:]


def _answer(template, prompt: list[dict], answer: list[dict], key: str, where: str):
    """Segments of ``prompt + answer`` with only the answer's assistant turns trained on."""
    if not any(m.get("role") == "assistant" for m in answer):
        raise UserError(f"{where}: field {key!r} has no assistant message to score")
    segments = row_segments({"messages": prompt + answer}, where, "chat_completion", template)
    context_turns = sum(m.get("role") == "assistant" for m in prompt)  # assistant turns inside the prompt
    out, seen = [], 0
    for text, trained in segments:
        if trained:
            seen += 1
            trained = seen > context_turns
        out.append((text, trained))
    return type(segments)(out)  # a tokenizer template's `Rendered` stays one (tokenized as one text)


def pair_segments(row, where: str, template=None) -> tuple[list, list]:
    """Validate one row; the (text, trained) segments of its chosen and its rejected sequence."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: {json_kind(row)}, expected a JSON object with {ROW_FIELDS}")
    for key in ("chosen", "rejected"):
        if key not in row:
            hint = " (a prompt/response row: task_type instruction_finetune)" if "response" in row else ""
            raise UserError(f"{where}: missing field {key!r} (each row needs {ROW_FIELDS}){hint}")
    chosen, rejected = row["chosen"], row["rejected"]
    for key, v in (("chosen", chosen), ("rejected", rejected)):  # each field blamed for itself
        if not isinstance(v, (str, list)):
            got = "null" if v is None else type(v).__name__
            raise UserError(f"{where}: field {key!r} is {got}; expected a string or a non-empty list of "
                            "{role, content} messages")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise UserError(f"{where}: 'chosen' is a {type(chosen).__name__} and 'rejected' a {type(rejected).__name__}; "
                        "give both answers of a row in the same form (strings, or lists of messages)")
    if chosen == rejected:
        raise UserError(f"{where}: 'chosen' and 'rejected' are identical; a pair needs two different answers")
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise UserError(f"{where}: field 'prompt' must be a string when the answers are strings"
                            if "prompt" in row else f"{where}: missing field 'prompt' (each row needs {ROW_FIELDS})")
        for key, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not v.strip():  # (as SFT refuses an empty response: a pair answers something)
                raise UserError(f"{where}: field {key!r} is empty")
        return [(prompt, False), (chosen, True)], [(prompt, False), (rejected, True)]
    prompt, chosen, rejected = _conversations(row, where)
    if chosen == rejected:
        raise UserError(f"{where}: 'chosen' and 'rejected' are identical after the shared prompt; a pair needs two "
                        "different answers")
    return _answer(template, prompt, chosen, "chosen", where), _answer(template, prompt, rejected, "rejected", where)


def read_pairs(paths: list[str], template=None) -> list[tuple[list, list, str]]:
    """Every row of every file as (chosen segments, rejected segments, "file:line"); the first bad
    row stops with its file:line. ``template``: the tokenizer's own chat template, or None."""
    pairs = [(*pair_segments(row, where, template), where) for row, where in json_rows(paths, ROW_FIELDS + " rows")]
    if not pairs:
        raise UserError(f"{', '.join(paths)}: no pairs (expected JSONL rows with {ROW_FIELDS})")
    return pairs


# --------------------------------------------------------------------------- tokenize and pack

Sequence = tuple[list[int], list[bool]]  # token ids, trained-on flags


def _prompt_length(trained: list[bool]) -> int:
    return next(i for i, t in enumerate(trained) if t)


@dataclass
class Fit:
    """One pair fitted to the context: its sequences, and what was done to it (``cut``: "" none,
    "answers", or "prompt" — from the left, the answers perhaps too; ``dropped``: why, or "")."""

    chosen: Sequence | None
    rejected: Sequence | None
    cut: str = ""
    dropped: str = ""


def _cut_prompt(seq: Sequence, keep: int, keep_first: int) -> Sequence:
    """``seq`` with its prompt cut from the left to ``keep`` tokens (its first ``keep_first``, the
    tokenizer's BOS, among them)."""
    ids, trained = seq
    p = _prompt_length(trained)
    if p <= keep:
        return seq
    start = keep_first + (p - keep)
    return ids[:keep_first] + ids[start:], trained[:keep_first] + trained[start:]


def fit_pair(chosen: Sequence, rejected: Sequence, seq_len: int, keep_first: int = 0) -> Fit:
    """Both sequences within ``seq_len`` tokens together. First the prompts are cut from the left
    (by as much as needed, each keeping at least a quarter of the row or all it has), then the
    answers from their ends, the longer first (each keeps at least half the row when both are
    long). A pair left without an answer token in both, or with chosen and rejected identical, is
    dropped. ``keep_first``: tokens every sequence starts with that are never cut (BOS)."""
    lc, lr = len(chosen[0]), len(rejected[0])
    if lc + lr <= seq_len:
        return Fit(chosen, rejected)
    floor = max(seq_len // 4, keep_first + 1)
    pc, pr = _prompt_length(chosen[1]), _prompt_length(rejected[1])
    excess = lc + lr - seq_len
    shave = -(-excess // 2)  # from each prompt
    keep_c, keep_r = max(pc - shave, min(pc, floor)), max(pr - shave, min(pr, floor))
    cut = "prompt" if (keep_c, keep_r) != (pc, pr) else "answers"
    chosen, rejected = _cut_prompt(chosen, keep_c, keep_first), _cut_prompt(rejected, keep_r, keep_first)
    lc, lr = len(chosen[0]), len(rejected[0])
    if lc + lr > seq_len:
        need_c, need_r = keep_c + 1, keep_r + 1  # the prompt and one answer token
        if need_c + need_r > seq_len:
            return Fit(None, None, cut, f"its prompt leaves no room for both answers within {seq_len} tokens")
        half = seq_len // 2
        end_c = lc if lc <= half else max(half, seq_len - lr)
        end_c = max(need_c, min(end_c, seq_len - need_r))
        end_r = min(lr, seq_len - end_c)
        chosen, rejected = (chosen[0][:end_c], chosen[1][:end_c]), (rejected[0][:end_r], rejected[1][:end_r])
    if chosen == rejected:  # what both answers kept is the same text: a constant loss
        return Fit(None, None, cut, "chosen and rejected are identical after the cut")
    return Fit(chosen, rejected, cut)


@dataclass
class PreferenceBatch(Batch):
    """A micro-batch of pairs: the rows' tokens as any `Batch` (doc ids 2k and 2k+1: the k-th pair's
    chosen and rejected sequence), which pairs each row holds, and the reference log-probs when
    they were computed before training."""

    pair_mask: torch.Tensor | None = None  # [B, P] bool: row b holds a k-th pair
    ref_logps: torch.Tensor | None = None  # [B, P, 2] fp32: reference log π(chosen), log π(rejected); or None

    def to(self, device: torch.device, non_blocking: bool = True) -> "PreferenceBatch":
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return PreferenceBatch(move(self.input_ids), move(self.targets), move(self.doc_ids),
                               pair_mask=move(self.pair_mask), ref_logps=move(self.ref_logps))

    def pin_memory(self) -> "PreferenceBatch":
        def pin(t):
            return None if t is None else t.pin_memory()

        return PreferenceBatch(pin(self.input_ids), pin(self.targets), pin(self.doc_ids), pair_mask=pin(self.pair_mask),
                               ref_logps=pin(self.ref_logps))

    def unscored(self) -> "PreferenceBatch":
        return PreferenceBatch(self.input_ids, torch.full_like(self.targets, IGNORE), self.doc_ids,
                               pair_mask=torch.zeros_like(self.pair_mask), ref_logps=self.ref_logps)

    def num_pairs(self) -> torch.Tensor:
        return self.pair_mask.sum()

    def answer_sums(self, values: torch.Tensor) -> torch.Tensor:
        """[B, P, 2]: ``values`` [B, T] (e.g. each target's log-probability, 0 where nothing is
        scored) summed over each pair's chosen (…, 0) and rejected (…, 1) sequence. Shapes come
        from the batch alone (no device wait); pairs a row does not hold sum to 0."""
        B, P = self.pair_mask.shape
        sums = torch.zeros(B, 2 * P + 1, dtype=values.dtype, device=values.device)
        sums.scatter_add_(1, self.doc_ids.long(), values)  # a target sits in its own sequence's document
        return sums[:, :2 * P].view(B, P, 2)

    def answer_tokens(self) -> torch.Tensor:
        """[B, P, 2]: how many tokens of each answer are scored."""
        return self.answer_sums((self.targets != IGNORE).float())


@dataclass
class PreferenceRows:
    """[N, L] token rows holding whole pairs, [N, P] which pairs each row holds, and (once
    computed) the reference log-probs [N, P, 2] of every pair."""

    tokens: torch.Tensor
    trained: torch.Tensor
    doc_ids: torch.Tensor
    pair_mask: torch.Tensor
    pairs: int
    truncated: int  # pairs cut to fit (answers or prompt)
    ref_logps: torch.Tensor | None = None
    prompts_cut: list[str] = field(default_factory=list)  # "file:line" of the pairs whose prompt was cut
    dropped: list[tuple[str, str]] = field(default_factory=list)  # ("file:line", why) of the pairs left out

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, idx) -> PreferenceBatch:
        b = Batch.from_masked(self.tokens[idx], self.trained[idx], self.doc_ids[idx])
        ref = None if self.ref_logps is None else self.ref_logps[idx]
        return PreferenceBatch(b.input_ids, b.targets, b.doc_ids, pair_mask=self.pair_mask[idx], ref_logps=ref)

    def fingerprint(self) -> str:
        """What the reference log-probs of these rows depend on (besides the weights): their tokens,
        what is scored, and how rows split into sequences."""
        import hashlib

        h = hashlib.sha256()
        for t in (self.tokens, self.trained, self.doc_ids, self.pair_mask):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def pack_pairs(pairs: list[tuple[Sequence, Sequence, str]], seq_len: int, pad_id: int, *, packing: bool = True,
               seed: int = 0, keep_first: int = 0) -> PreferenceRows:
    """Fill rows of ``seq_len`` with whole pairs in a seeded order (next-fit; with packing off, one
    pair per row), each pair as its chosen then its rejected sequence; pairs longer than a row are
    cut or dropped (`fit_pair`). Refused only when no pair is left."""
    fitted, truncated, prompts_cut, dropped = [], 0, [], []
    for chosen, rejected, where in pairs:
        fit = fit_pair(chosen, rejected, seq_len, keep_first)
        if fit.dropped:
            dropped.append((where, fit.dropped))
            continue
        fitted.append((fit.chosen, fit.rejected))
        truncated += bool(fit.cut)
        if fit.cut == "prompt":
            prompts_cut.append(where)
    if not fitted:
        raise UserError(f"{pairs[0][2].rsplit(':', 1)[0]}: no pair fits within context_length {seq_len} "
                        f"({dropped[0][0]}: {dropped[0][1]}); raise parameters.context_length or shorten the prompts")
    order = torch.randperm(len(fitted), generator=torch.Generator().manual_seed(seed)).tolist()
    rows: list[list[tuple[Sequence, Sequence]]] = []
    used = seq_len
    for k in order:
        c, r = fitted[k]
        size = len(c[0]) + len(r[0])
        if not packing or used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((c, r))
        used += size
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    flags = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    docs = torch.zeros((len(rows), seq_len), dtype=torch.int32)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        pos = 0
        for d, (ids, trained) in enumerate(seq for pair in row for seq in pair):
            tokens[i, pos:pos + len(ids)] = torch.tensor(ids)
            flags[i, pos:pos + len(ids)] = torch.tensor(trained)
            docs[i, pos:pos + len(ids)] = d
            pos += len(ids)
        docs[i, pos:] = 2 * len(row)  # padding: its own document, never trained on
        mask[i, :len(row)] = True
    return PreferenceRows(tokens, flags, docs, mask, pairs=len(fitted), truncated=truncated, prompts_cut=prompts_cut,
                          dropped=dropped)


def load_pairs(paths: list[str], tokenizer, seq_len: int, *, packing: bool, seed: int,
               template=None) -> PreferenceRows:
    pairs = [(tokenize_example(c, tokenizer), tokenize_example(r, tokenizer), where)
             for c, r, where in read_pairs(paths, template)]
    return pack_pairs(pairs, seq_len, tokenizer.pad_id, packing=packing, seed=seed,
                      keep_first=len(tokenizer.prefix_ids))


NAMED = 3  # rows named in a log line; the rest are counted


def _named(wheres: list[str]) -> str:
    more = len(wheres) - NAMED
    return ", ".join(wheres[:NAMED]) + (f" and {more} more" if more > 0 else "")


def fit_summary(rows: PreferenceRows, what: str = "") -> str:
    """What fitting the pairs to the context did, for the run's first lines ("" when nothing)."""
    parts = []
    if rows.truncated:
        prompts = f", {len(rows.prompts_cut)} of them in the prompt, from the left ({_named(rows.prompts_cut)})" \
            if rows.prompts_cut else ""
        parts.append(f"{rows.truncated} {what}cut to fit the context length{prompts}")
    if rows.dropped:
        whys = {}
        for where, why in rows.dropped:
            whys.setdefault(why, []).append(where)
        parts.append(f"{len(rows.dropped)} {what}dropped (" + "; ".join(f"{why}: {_named(ws)}"
                                                                       for why, ws in whys.items()) + ")")
    return "; ".join(parts)


# --------------------------------------------------------------------------- the data the trainer sees

@dataclass
class PreferenceData(SFTData):
    """Pairs (and held-out pairs): a `TrainingData` of kind ``"preference"``. Its batches are
    `PreferenceBatch`es, read as SFT rows are (`data.sft.SFTData`: the same deterministic,
    resumable order); the trainer's objective for this kind is the preference loss
    (`train.objective`)."""

    rows: PreferenceRows
    eval_rows: PreferenceRows | None
    chat_template: str | None = None
    kind: str = PREFERENCE_TASK

    def with_reference(self, train: torch.Tensor, held_out: torch.Tensor | None) -> "PreferenceData":
        """The same data with the reference log-probs of every pair attached to its batches."""
        eval_rows = None if self.eval_rows is None else replace(self.eval_rows, ref_logps=held_out)
        return replace(self, rows=replace(self.rows, ref_logps=train), eval_rows=eval_rows)


def load_preference_data(train_paths: list[str], eval_path: str | None, tokenizer, seq_len: int, *, packing: bool,
                         seed: int, template=None, chat_template: str | None = None, log=print) -> PreferenceData:
    """The train (and held-out) pairs of a run, tokenized and packed; one log line about them."""
    rows = load_pairs(train_paths, tokenizer, seq_len, packing=packing, seed=seed, template=template)
    eval_rows = None
    if eval_path:
        eval_rows = load_pairs([eval_path], tokenizer, seq_len, packing=packing, seed=seed, template=template)
    fits = [fit_summary(rows)] + ([fit_summary(eval_rows, "held-out ")] if eval_rows is not None else [])
    log(f"data: {rows.pairs} pairs in {len(rows)} rows of {seq_len} tokens{packing_note(rows.pairs, len(rows), packing, 'pair')}"
        + (f"; {eval_rows.pairs} held-out pairs" if eval_rows is not None else "")
        + "".join(f"; {f}" for f in fits if f))
    return PreferenceData(tokenizer.path, rows, eval_rows, chat_template=chat_template)
