"""Extend an imported model's BPE tokenizer with merges learned on the user's own text.

Continued pretraining on a new language or domain with the base model's tokenizer spends many
tokens per word. `extend_tokenizer` trains a BPE on the new data with the base tokenizer's own
normalizer and pre-tokenizer and walks the tokens it learned, in order. Appended merges rank
after every existing one, so the base's own merges always apply first; for a learned token the
extension therefore adds the merge that joins the two pieces the (extended) tokenizer leaves of
it — when it leaves exactly two — until the vocabulary reaches the requested size. Text the
base tokenized well keeps its pieces, and the new merges join what it left in pieces. Existing ids never change; new tokens take the ids
after the last one in use.

For each new token the ids of the base pieces it replaces (the base BPE applied to the token's
string) are saved in ``lmforge-vocab-extension.json`` next to ``tokenizer.json``;
`lmforge.models.resize.extend_embeddings` starts each new embedding row as their mean.
"""

from __future__ import annotations

import json
import os
import shutil

from lmforge.errors import UserError

EXTENSION_FILE = "lmforge-vocab-extension.json"
_COPIED = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def _merge_pair(m) -> tuple[str, str]:
    return tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))  # tokenizers ≥0.20 writes pairs


def _segment(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE on one pre-tokenized word: merge the best-ranked adjacent pair until none applies."""
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get((parts[j], parts[j + 1]), float("inf")), j) for j in range(len(parts) - 1))
        if rank == float("inf"):
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def extend_tokenizer(base_dir: str, inputs: list[str], vocab_size: int, out_dir: str, *, text_field: str = "text",
                     max_bytes: int | None = None):
    """Write the extended tokenizer folder to `out_dir`; returns the loaded `Tokenizer`."""
    from tokenizers import Tokenizer as Backend

    from lmforge.data.text.tokenizer import DEFAULT_MAX_TRAIN_BYTES, _sampled_documents, load_tokenizer

    path = os.path.join(base_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(f"tokenizer.extend: {base_dir} has no tokenizer.json to extend")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"tokenizer.extend: {base_dir} is a {model.get('type')} tokenizer; only BPE tokenizers "
                        "(Llama 3, Qwen, Mistral/Tekken, GPT-2 style and lmforge's own) can be extended")
    base = Backend.from_file(path)
    vocab: dict[str, int] = model["vocab"]
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    need = vocab_size - next_id
    if need <= 0:
        raise UserError(f"tokenizer.extend.vocab_size: {vocab_size} must be larger than the base tokenizer's "
                        f"{next_id} tokens")
    docs = [d for batch in _sampled_documents(inputs, text_field, max_bytes or DEFAULT_MAX_TRAIN_BYTES) for d in batch]
    new = _new_merges(base, data, docs, need)
    if len(new) < need:
        raise UserError(f"tokenizer.extend.vocab_size: the training data yields only {len(new)} new tokens "
                        f"(asked for {need}); ask for at most {next_id + len(new)} or give more text")
    merges_in = model.get("merges", [])
    as_pairs = bool(merges_in) and isinstance(merges_in[0], list)
    pieces: dict[int, list[int]] = {}
    for k, (a, b) in enumerate(new):
        token, tid = a + b, next_id + k
        pieces[tid] = [t.id for t in base.model.tokenize(token)]
        vocab[token] = tid
        merges_in.append([a, b] if as_pairs else f"{a} {b}")
    model["vocab"], model["merges"] = vocab, merges_in
    record = {"base": os.path.abspath(base_dir), "base_vocab_size": next_id, "vocab_size": vocab_size,
              "pieces": {str(k): v for k, v in pieces.items()}}
    _write_folder(data, base_dir, record, out_dir)
    return load_tokenizer(out_dir)


def _new_merges(base, data: dict, docs: list[str], need: int) -> list[tuple[str, str]]:
    """Up to ``need`` merges that extend the base BPE: larger and larger BPEs are trained on the
    documents until they teach enough merges the base lacks."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    model = data["model"]
    known = set(model["vocab"]) | {t["content"] for t in data.get("added_tokens", [])}
    base_ranks = {_merge_pair(m): i for i, m in enumerate(model.get("merges", []))}
    size, new = 256 + 2 * need, []
    while True:
        learner = Backend(models.BPE())
        learner.normalizer = base.normalizer
        learner.pre_tokenizer = base.pre_tokenizer
        alphabet = pre_tokenizers.ByteLevel.alphabet() if "ByteLevel" in json.dumps(data.get("pre_tokenizer")) else []
        trainer = trainers.BpeTrainer(vocab_size=size, min_frequency=2, initial_alphabet=alphabet, show_progress=False)
        learner.train_from_iterator(docs, trainer=trainer)
        learned = json.loads(learner.to_str())["model"]["merges"]
        tokens, new, ranks = set(known), [], dict(base_ranks)
        for a, b in map(_merge_pair, learned):
            if a + b in tokens:
                continue
            # The base's merges run first: add the merge that joins the two pieces they leave.
            parts = _segment(a + b, ranks)
            if len(parts) != 2 or parts[0] not in tokens or parts[1] not in tokens:
                continue
            ranks[tuple(parts)] = len(ranks)
            new.append(tuple(parts))
            tokens.add(a + b)
            if len(new) == need:
                break
        # enough, or the data has no more to teach (the BPE stopped short of its size), or hopeless
        if len(new) == need or len(learned) < size - 256 - 10 or size > 64 * (256 + need):
            return new
        size *= 2


def _write_folder(data: dict, base_dir: str, record: dict, out_dir: str) -> None:
    """The extended tokenizer.json, the base's other files and the extension record, published at once."""
    tmp = out_dir + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    for name in _COPIED:
        if os.path.isfile(os.path.join(base_dir, name)):
            shutil.copy2(os.path.join(base_dir, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, EXTENSION_FILE), "w") as f:
        json.dump(record, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def read_extension(tokenizer_dir: str | None) -> dict | None:
    """The extension record of a tokenizer folder written by `extend_tokenizer`, else None."""
    if not tokenizer_dir:
        return None
    path = os.path.join(tokenizer_dir, EXTENSION_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = json.load(f)
    record["pieces"] = {int(k): v for k, v in record["pieces"].items()}
    return record
