"""Supervised fine-tuning data: JSONL rows → tokenized, loss-masked, packed examples.

Rows are either ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role", "content"}, ...]}``
(roles: system, user, assistant). Only response / assistant tokens (and the end-of-text token
that closes them) are trained on; everything else is context.

- ``instruction_finetune``: a prompt/response row is ``prompt + response + <eos>``, the prompt
  used exactly as written (put any instruction format in the data itself).
- ``chat_completion`` (and every ``messages`` row): the tokenizer's own chat template when it
  has one (``lmforge.data.chat``: Llama 3, Qwen, … instruct models keep their format), else the
  plain template below. That one is plain text, so it works with any tokenizer without new
  special tokens, and its Jinja form is written into the exported ``tokenizer_config.json`` so
  ``tokenizer.apply_chat_template`` produces the same text in transformers/vLLM.

Packing puts several examples into one ``context_length`` row; each token carries the index of
its example (``doc_ids``) and the model's attention is block-diagonal causal over them, so an
example never sees another one. Positions are not reset per example: RoPE scores depend only on
relative positions, so an example's logits are the same wherever it sits in a row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import torch

from lmforge.data.batch import Batch, EpochOrder, EvalSet, StreamLayout
from lmforge.data.chat import CHAT_TEMPLATE, render_chat
from lmforge.errors import UserError, json_error, json_kind
from lmforge.run_files import DATASET_MARKER

ROLES = ("system", "user", "assistant")



# --------------------------------------------------------------------------- reading rows

SFT_ROWS = "prompt/response or messages rows"


def task_data(rows: str) -> str:
    return (f"fine-tuning reads JSONL files of {rows} "
            "(`lmforge train` pretrains on raw text or prepared data)")


def json_rows(paths: list[str], rows: str = SFT_ROWS):
    """(row, "file:line") of every non-blank line of the JSONL files at ``paths``; a line that is
    not JSON stops with its file:line. ``rows``: what a row holds, for the error lines."""
    for path in paths:
        for name, i, line in open_lines(path, rows):
            if not line.strip():
                continue
            where = f"{name}:{i}"
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as e:
                if _raw_text_name(name):  # raw text given to a fine-tuning run: say so, not "bad JSON"
                    raise UserError(f"{name}: raw text, but {task_data(rows)}; for continued pretraining on "
                                    "it use `lmforge train` (task_type continued_pretrain)") from None
                raise UserError(f"{where}: {json_error(e)}") from None


def _raw_text_name(name: str) -> bool:
    """A file named as raw text (``.txt``, ``.md``, compressed or not)."""
    base = name.lower().removesuffix(".gz").removesuffix(".zst")
    return base.endswith((".txt", ".text", ".md"))


def open_lines(path: str, rows: str = SFT_ROWS):
    """(file, line number, line) of every line of the JSONL file(s) at ``path``; ``rows``: what
    a row holds, for the error lines."""
    import fsspec

    if os.path.isdir(path):
        prepared = " (a prepared pretraining dataset: fine-tune on it with task_type continued_pretrain)" \
            if os.path.exists(os.path.join(path, DATASET_MARKER)) else ""
        raise UserError(f"{path} is a folder{prepared}; {task_data(rows)}")
    try:
        # utf-8-sig: a byte-order mark (some editors write one) is dropped, not read as row 1's first character
        files = fsspec.open_files(path, "rt", compression="infer", encoding="utf-8-sig")
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot open ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not files:
        raise UserError(f"{path}: no such file (expected JSONL with {rows})")
    for f in files:
        try:
            with f as fh:
                for i, line in enumerate(fh, 1):
                    yield f.path, i, line
        except FileNotFoundError:
            raise UserError(f"{path}: no such file (expected JSONL with {rows})") from None
        except UnicodeDecodeError:
            raise UserError(f"{f.path}: not UTF-8 text; {task_data(rows)}") from None
        except (IsADirectoryError, NotADirectoryError) as e:
            raise UserError(f"{f.path}: {e.strerror}; {task_data(rows)}") from None


def row_segments(row, where: str, task: str, template=None) -> list[tuple[str, bool]]:
    """Validate one row and turn it into (text, trained) segments (`Rendered` ones with a
    tokenizer's chat template)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: {json_kind(row)}, expected a JSON object with prompt/response or messages")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"{where}: messages[{j}] needs 'role' and 'content'")
            if not isinstance(m["role"], str) or (template is None and m["role"] not in ROLES):
                raise UserError(f"{where}: messages[{j}].role {m['role']!r} is unknown; expected one of {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise UserError(f"{where}: messages[{j}].content must be a string")
            if m["role"] == "assistant" and not m["content"].strip():
                raise UserError(f"{where}: messages[{j}] is an empty assistant response")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: field 'messages' has no assistant message to learn from")
        return template.segments(msgs, where) if template is not None else render_chat(msgs)
    missing = [k for k in ("prompt", "response") if k not in row]
    if missing:
        raise UserError(f"{where}: missing field {missing[0]!r} (each row needs prompt and response, or messages)")
    prompt, response = row["prompt"], row["response"]
    for k, v in (("prompt", prompt), ("response", response)):
        if not isinstance(v, str):
            raise UserError(f"{where}: field {k!r} must be a string")
    if not response.strip():
        raise UserError(f"{where}: field 'response' is empty")
    if task == "chat_completion":
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return template.segments(turns, where) if template is not None else render_chat(turns)
    return [(prompt, False), (response, True)]


def read_examples(paths: list[str], task: str, template=None) -> list[list[tuple[str, bool]]]:
    """Every row of every file as template segments; the first bad row stops with file:line.
    `template`: the tokenizer's own chat template (`lmforge.data.chat`), or None for ours."""
    examples = [row_segments(row, where, task, template) for row, where in json_rows(paths)]
    if not examples:
        raise UserError(f"{', '.join(paths)}: no examples (expected JSONL rows with prompt/response or messages)")
    return examples


# --------------------------------------------------------------------------- tokenize and pack

def tokenize_example(segments: list[tuple[str, bool]], tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is trained on. Each trained segment ends with eos
    (a tokenizer's own chat template writes its own end-of-turn tokens instead). The example starts
    as its whole text would (the post-processor's BOS, once); its segments are encoded as pieces, so
    that no token straddles the prompt and the response (as LLM Foundry and TRL mask them)."""
    from lmforge.data.chat import Rendered, tokenize_rendered

    if isinstance(segments, Rendered):
        return tokenize_rendered(segments, tokenizer)
    ids: list[int] = list(tokenizer.prefix_ids)
    trained: list[bool] = [False] * len(ids)
    for text, is_target in segments:
        piece = tokenizer.encode(text, add_special_tokens=False) if text else []
        if is_target:
            piece = piece + [tokenizer.eos_id]
        ids += piece
        trained += [is_target] * len(piece)
    if trained:
        trained[0] = False  # nothing predicts the first token (keeps targets inside one example)
    return ids, trained


@dataclass
class PackedRows:
    """[N, L] tensors: token ids, trained-on flags and example index per position."""
    tokens: torch.Tensor
    trained: torch.Tensor
    doc_ids: torch.Tensor
    examples: int
    truncated: int
    dropped: int

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, idx) -> Batch:
        return Batch.from_masked(self.tokens[idx], self.trained[idx], self.doc_ids[idx])


def pack(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int, *, packing: bool = True,
         seed: int = 0) -> PackedRows:
    """Fill rows of `seq_len` with whole examples in a seeded order (next-fit; with packing off,
    one example per row). Longer examples are cut at `seq_len`; those left without a trained
    token are dropped. Padding is its own "example" and is never trained on."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    rows: list[list[tuple[list[int], list[bool]]]] = []
    used = seq_len  # forces a new row for the first example
    truncated = dropped = 0
    for k in order:
        ids, trained = examples[k]
        if len(ids) > seq_len:
            ids, trained = ids[:seq_len], trained[:seq_len]
            truncated += 1
        if not any(trained):
            dropped += 1
            continue
        if not packing or used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, trained))
        used += len(ids)
    if not rows:
        raise UserError(f"no example has a response token within context_length {seq_len}; "
                        "raise parameters.context_length or shorten the prompts")
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    flags = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    docs = torch.zeros((len(rows), seq_len), dtype=torch.int32)
    for r, row in enumerate(rows):
        pos = 0
        for d, (ids, trained) in enumerate(row):
            tokens[r, pos:pos + len(ids)] = torch.tensor(ids)
            flags[r, pos:pos + len(ids)] = torch.tensor(trained)
            docs[r, pos:pos + len(ids)] = d
            pos += len(ids)
        docs[r, pos:] = len(row)
    return PackedRows(tokens, flags, docs, examples=len(examples) - dropped, truncated=truncated, dropped=dropped)


def load_rows(paths: list[str], tokenizer, seq_len: int, *, task: str, packing: bool, seed: int,
              template=None) -> PackedRows:
    examples = [tokenize_example(s, tokenizer) for s in read_examples(paths, task, template)]
    return pack(examples, seq_len, tokenizer.pad_id, packing=packing, seed=seed)


# --------------------------------------------------------------------------- streaming

class SFTStream:
    """Deterministic, resumable micro-batches of packed rows, partitioned across ranks.

    A `BatchStream`, like ``TokenStream``; its batches carry ``doc_ids`` and targets only on
    response tokens. Global sample k of the run is row ``EpochOrder(N, seed)(k)``.
    """

    def __init__(self, rows: PackedRows, layout: StreamLayout):
        self.rows, self.seed, self.layout = rows, layout.seed, layout.layout  # the run's batch split
        self.mb, self.gbs, self.accum = self.layout.micro_batch, self.layout.global_batch, self.layout.grad_accum
        self.replica = layout.replica
        self.pin_memory = layout.pin_memory  # CUDA: page-locked batches, so host→device copies overlap compute
        self.micro = 0  # micro-batches this rank has yielded
        self._row = EpochOrder(len(rows), self.seed)

    def _indices(self, micro: int) -> list[int]:
        step, m = divmod(micro, self.accum)
        start = step * self.gbs + self.replica * self.layout.per_replica + m * self.mb
        return [self._row(k) for k in range(start, start + self.mb)]

    def __iter__(self):
        while True:
            idx = self._indices(self.micro)
            self.micro += 1
            batch = self.rows.batch(idx)
            yield batch.pin_memory() if self.pin_memory else batch

    @property
    def epoch(self) -> int:
        return (self.micro // self.accum) * self.gbs // len(self.rows)

    def state_dict(self) -> dict:
        # Saved at step boundaries, so the position is a whole number of optimizer steps,
        # which stays valid if the run resumes on a different number of ranks.
        return {"kind": "sft", "steps": self.micro // self.accum, "rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "sft" or state.get("rows") != len(self.rows):
            raise UserError("checkpoint: its data position belongs to different fine-tuning data "
                            f"({state.get('rows')} packed rows then, {len(self.rows)} now); "
                            "--no-autoresume starts fresh")
        self.micro = state["steps"] * self.accum

    def close(self) -> None:
        pass

    def phase(self) -> str | None:
        return None  # fine-tuning rows have no curriculum

    def metrics(self) -> dict:
        return {}


def eval_batches(rows: PackedRows, layout: StreamLayout, max_batches: int):
    """Each held-out row once (replica r of W takes rows r, r+W, ...), at most max_batches per rank.
    Every rank yields as many batches (under FSDP each forward gathers weights with every rank): one
    whose rows ran out yields a stand-in row with nothing scored."""
    micro_batch, replica, replicas = layout.micro_batch, layout.replica, layout.replicas
    mine = list(range(replica, len(rows), replicas))
    per_rank = -(-len(rows) // replicas)
    for b in range(min(max_batches, -(-per_rank // micro_batch))):
        idx = mine[b * micro_batch:(b + 1) * micro_batch]
        yield rows.batch(idx) if idx else rows.batch([0]).unscored()


@dataclass
class SFTData:
    """Packed fine-tuning rows (and held-out rows): a `TrainingData` of kind ``"sft"``.
    Held-out loss is over response tokens only."""

    tokenizer_path: str
    rows: PackedRows
    eval_rows: PackedRows | None
    kind: str = "sft"
    chat_template: str | None = CHAT_TEMPLATE

    def train_stream(self, layout: StreamLayout) -> SFTStream:
        return SFTStream(self.rows, layout)

    def eval_sets(self, layout: StreamLayout, max_batches: int) -> list[EvalSet]:
        if self.eval_rows is None:
            return []
        return [EvalSet("eval", partial(eval_batches, self.eval_rows, layout, max_batches))]


def packing_note(items: int, rows: int, packing: bool, what: str) -> str:
    """What packing did, for a data line: " (packed: 2.4 pairs a row)", or that nothing was packed."""
    if not packing:
        return ""
    if rows >= items:
        return f" (one {what} a row: sft.packing is on, but no two fit in one)"
    return f" (packed: {items / rows:.3g} {what}s a row)"

