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
the same micro-batch. ``sft.packing: false`` puts one pair per row. A pair longer than the
context has its answers cut from the end (the longer one first), never its prompt; a prompt too
long to leave room for both answers is refused, naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmforge.data.batch import IGNORE, Batch
from lmforge.data.sft import SFTData, json_rows, row_segments, tokenize_example
from lmforge.errors import UserError

PREFERENCE_TASK = "preference"
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
        raise UserError(f"{where}: expected a JSON object with {ROW_FIELDS}")
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
        for key, v in (("chosen", chosen), ("rejected", rejected)):
            if not v.strip():
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


def fit_pair(chosen: Sequence, rejected: Sequence, seq_len: int, where: str) -> tuple[Sequence, Sequence, bool]:
    """Both sequences within ``seq_len`` tokens together: the answers are cut from their ends, the
    longer first (each keeps at least half the row when both are long). Returns (chosen,
    rejected, whether anything was cut); a prompt that leaves no room for an answer token in both
    is one line naming the row."""
    lc, lr = len(chosen[0]), len(rejected[0])
    if lc + lr <= seq_len:
        return chosen, rejected, False
    need_c, need_r = _prompt_length(chosen[1]) + 1, _prompt_length(rejected[1]) + 1  # prompt + one answer token
    if need_c + need_r > seq_len:
        raise UserError(f"{where}: the prompt ({need_c - 1} tokens) leaves no room for both answers within "
                        f"context_length {seq_len} (a pair's chosen and rejected sequences share one row); raise "
                        "parameters.context_length or shorten the prompt")
    half = seq_len // 2
    keep_c = lc if lc <= half else max(half, seq_len - lr)
    keep_c = max(need_c, min(keep_c, seq_len - need_r))
    keep_r = min(lr, seq_len - keep_c)
    return (chosen[0][:keep_c], chosen[1][:keep_c]), (rejected[0][:keep_r], rejected[1][:keep_r]), True


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
    truncated: int
    ref_logps: torch.Tensor | None = None

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
               seed: int = 0) -> PreferenceRows:
    """Fill rows of ``seq_len`` with whole pairs in a seeded order (next-fit; with packing off, one
    pair per row), each pair as its chosen then its rejected sequence."""
    fitted, truncated = [], 0
    for chosen, rejected, where in pairs:
        c, r, cut = fit_pair(chosen, rejected, seq_len, where)
        fitted.append((c, r))
        truncated += cut
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
    return PreferenceRows(tokens, flags, docs, mask, pairs=len(fitted), truncated=truncated)


def load_pairs(paths: list[str], tokenizer, seq_len: int, *, packing: bool, seed: int,
               template=None) -> PreferenceRows:
    pairs = [(tokenize_example(c, tokenizer), tokenize_example(r, tokenizer), where)
             for c, r, where in read_pairs(paths, template)]
    return pack_pairs(pairs, seq_len, tokenizer.pad_id, packing=packing, seed=seed)


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
    log(f"data: {rows.pairs} pairs in {len(rows)} rows of {seq_len} tokens{' (packed)' if packing else ''}"
        + (f"; {rows.truncated} cut to fit the context length" if rows.truncated else "")
        + (f"; {eval_rows.pairs} held-out pairs" if eval_rows is not None else ""))
    return PreferenceData(tokenizer.path, rows, eval_rows, chat_template=chat_template)
