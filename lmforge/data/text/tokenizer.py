"""Tokenizers: train a byte-level BPE, load ours or a Hugging Face one, encode/decode.

A saved tokenizer folder holds ``tokenizer.json`` (the HF ``tokenizers`` format) plus
``tokenizer_config.json`` and ``special_tokens_map.json`` so that
``transformers.AutoTokenizer.from_pretrained(folder)`` loads it offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Iterator

from lmforge.errors import UserError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
# Tried in order when a foreign tokenizer does not say which token ends a document.
_EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
# Training reads at most this much text: BPE merges stabilise long before, and it keeps an
# 8k-vocabulary training on the builtin corpus to seconds (see train_tokenizer).
DEFAULT_MAX_TRAIN_BYTES = 64 << 20
_MAX_DOC_CHARS = 1 << 20  # longer documents are cut for training only (word counts, not merges, grow)


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` that knows its special-token ids."""

    def __init__(self, backend, *, eos_token: str, pad_token: str | None = None,
                 bos_token: str | None = None, path: str | None = None):
        self.backend = backend
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token
        self.bos_token = bos_token
        self.path = path
        self.eos_id = self._id(eos_token)
        self.pad_id = self._id(self.pad_token)
        self.bos_id = self._id(bos_token) if bos_token else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise UserError(f"tokenizer {self.path or ''}: special token {token!r} is not in the vocabulary")
        return i

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer's post-processor adds what
        it adds to a document (e.g. BOS), exactly as ``transformers`` does for ``tokenizer(text)``."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def prefix_ids(self) -> list[int]:
        """The special tokens the post-processor puts before a text (a BOS, or nothing): where a text
        encoded in pieces (``add_special_tokens=False``) starts, as the whole text would."""
        enc = self.backend.encode("a", add_special_tokens=True)
        first_text = next((i for i, special in enumerate(enc.special_tokens_mask) if not special), 0)
        return enc.ids[:first_text]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt to continue: the ids of `encode` — a BOS where the tokenizer's post-processor puts
        one, once, as transformers' ``tokenizer(text)`` (``bos_id`` only says that it does; adding it
        again gave Mistral/Gemma-style tokenizers two) — without an EOS a post-processor may append
        (a prompt goes on); never empty (EOS alone starts a text, as in pretraining)."""
        ids = self.encode(text)
        if len(ids) > 1 and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return ids or [self.eos_id]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking (tokenizers >= 0.21); same ids, less work.
        fast = getattr(self.backend, "encode_batch_fast", None)
        encs = fast(texts) if fast is not None else self.backend.encode_batch(texts)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.backend.to_str()

    @property
    def fingerprint(self) -> str:
        """Hash of tokenizer.json plus the special-token choice: equal means same token ids."""
        h = hashlib.sha256(self.to_json().encode())
        h.update(f"|{self.eos_token}|{self.pad_token}|{self.bos_token}".encode())
        return h.hexdigest()[:16]

    def save(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.backend.save(os.path.join(out_dir, "tokenizer.json"))
        special = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        if self.bos_token:
            special["bos_token"] = self.bos_token
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": bool(self.bos_token),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
        self.path = out_dir

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, path={self.path!r})"


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _token_name(value) -> str | None:
    """Special tokens in HF configs are a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_folder(folder: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(os.path.join(folder, "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise UserError(f"{os.path.join(folder, 'tokenizer.json')}: not a valid tokenizer file ({str(e).splitlines()[0][:200]})") from None
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
        p = os.path.join(folder, name)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    config.update({k: v for k, v in json.load(f).items() if v is not None})
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"{p}: not valid JSON ({e})") from None
    return _wrap(backend, config, folder)


def _wrap(backend, config: dict, path: str) -> Tokenizer:
    vocab = backend.get_vocab(with_added_tokens=True)
    eos = _token_name(config.get("eos_token"))
    if eos is None or eos not in vocab:
        eos = next((t for t in _EOS_GUESSES if t in vocab), None)
    if eos is None:
        raise UserError(f"tokenizer {path}: no end-of-text token (set eos_token in tokenizer_config.json)")
    pad = _token_name(config.get("pad_token"))
    bos = _token_name(config.get("bos_token")) if config.get("add_bos_token", False) else None
    return Tokenizer(backend, eos_token=eos, pad_token=pad if pad in vocab else None,
                     bos_token=bos if bos in vocab else None, path=path)


def load_tokenizer(path_or_name) -> Tokenizer:
    """A ``Tokenizer`` from a folder with tokenizer.json, a tokenizer.json file, a HF tokenizer
    folder (via transformers, converted to a fast tokenizer), or a HF hub name in the local cache."""
    if isinstance(path_or_name, Tokenizer):
        return path_or_name
    path = os.path.expanduser(str(path_or_name))
    if os.path.isfile(path) and path.endswith(".json"):
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_file(path)
        except Exception as e:
            raise UserError(f"{path}: not a valid tokenizer file ({str(e).splitlines()[0][:200]})") from None
        return _wrap(backend, {}, path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return _load_folder(path)
    if not os.path.isdir(path) and ("/" in path and not _looks_like_hub_name(path)):
        raise UserError(f"tokenizer {path_or_name}: no such folder (expected a folder with tokenizer.json or a HF tokenizer name)")
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise UserError(f"tokenizer {path_or_name}: cannot load it (not a folder with tokenizer.json, and "
                        f"transformers says: {str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"tokenizer {path_or_name}: only fast (tokenizer.json) tokenizers are supported")
    config = {"eos_token": hf.eos_token, "pad_token": hf.pad_token, "bos_token": hf.bos_token,
              "add_bos_token": bool(getattr(hf, "add_bos_token", False))}
    return _wrap(backend, config, path)


def _looks_like_hub_name(s: str) -> bool:
    return s.count("/") == 1 and not s.startswith((".", "/", "~"))


def _sampled_documents(inputs: list[str], text_field: str, max_bytes: int) -> Iterator[list[str]]:
    """Batches of training documents, at most ``max_bytes`` of text in total.

    When the inputs are larger than the budget, documents are kept by a hash of their content
    at the rate budget/size, so the sample spreads over all files (not just the first ones) and
    is the same on every run.
    """
    from lmforge.data.text.sources import SourceStats, iter_documents, list_files

    sizes = [s.size for s in list_files(inputs)]
    total = sum(s for s in sizes if s) if all(s is not None for s in sizes) else None
    rate = 1.0 if not total else min(1.0, max_bytes / total)
    threshold = int(rate * (1 << 64))
    seen = 0
    batch: list[str] = []
    for text in iter_documents(inputs, text_field, SourceStats()):
        if rate < 1.0:
            h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest(), "little")
            if h >= threshold:
                continue
        text = text[:_MAX_DOC_CHARS]
        batch.append(text)
        seen += len(text)
        if len(batch) >= 256:
            yield batch
            batch = []
        if seen >= max_bytes:
            break
    if batch:
        yield batch


def train_tokenizer(inputs: list[str] | str, vocab_size: int, out_dir: str, *, text_field: str = "text",
                    add_bos: bool = False, min_frequency: int = 2,
                    max_bytes: int = DEFAULT_MAX_TRAIN_BYTES) -> Tokenizer:
    """Train a byte-level BPE on ``inputs`` and save it to ``out_dir`` (loadable by transformers)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = [EOS_TOKEN, PAD_TOKEN] + ([BOS_TOKEN] if add_bos else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(specials)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise UserError(f"--vocab-size {vocab_size}: too small, need at least {minimum} "
                        f"({len(alphabet)} byte tokens + {len(specials)} special tokens)")
    if vocab_size > 1 << 22:
        raise UserError(f"--vocab-size {vocab_size}: too large (at most {1 << 22})")
    if min_frequency < 1:
        raise UserError(f"--min-frequency {min_frequency}: must be at least 1")

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(_sampled_documents(inputs, text_field, max_bytes), trainer=trainer)
    if add_bos:
        bos_id = backend.token_to_id(BOS_TOKEN)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = Tokenizer(backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN if add_bos else None)
    tok.save(out_dir)
    return tok
