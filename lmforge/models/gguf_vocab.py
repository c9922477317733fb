"""A tokenizer as llama.cpp reads it from a GGUF file: the fields that make llama.cpp tokenize
exactly as `tokenizers` does (torch-free; `lmforge.models.gguf` writes them).

llama.cpp's byte-level BPE (`tokenizer.ggml.model = gpt2`) re-implements the Hugging Face
pipeline: a pre-tokenizer splits text into words by a regular expression it knows by *name*
(`tokenizer.ggml.pre`), each word's bytes are mapped to printable characters (GPT-2's byte
table, as `ByteLevel` does) and merged by rank. So the vocabulary and merges travel as they are,
and the pre-tokenizer is named by what tokenizer.json says it does:

| tokenizer.json pre-tokenizer                              | llama.cpp name | who          |
|-----------------------------------------------------------|----------------|--------------|
| ByteLevel with its own (GPT-2) regex, no prefix space       | gpt-2          | lmforge's own (`train_tokenizer`) |
| Split(Llama 3's regex) then ByteLevel without regex        | llama-bpe      | Llama 3.x     |
| Split(Qwen 2's regex) then ByteLevel without regex         | qwen2          | Qwen 2 / 2.5 / 3 |

Anything else (a SentencePiece-style tokenizer with byte fallback as Gemma's and Mistral's
first ones, another regex, a normalizer llama.cpp does not run) is refused in one line naming
what is missing: a GGUF whose tokenizer only looks right would tokenize prompts differently.

Special tokens are CONTROL tokens (llama.cpp matches them in text, as `tokenizers` does with
its added special tokens); other added tokens USER_DEFINED; rows of the model's vocabulary past
the tokenizer's (lmforge pads it to a multiple of 64) are UNUSED `[PAD<id>]` entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lmforge.errors import UserError

# GGUF token types (llama.cpp's llama_token_type; gguf.TokenType has the same numbers)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# The regexes of the pre-tokenizers llama.cpp implements, as tokenizer.json writes them.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}
SUPPORTED = "gpt-2 (a byte-level BPE as `lmforge tokenizer train` makes), llama-bpe (Llama 3), qwen2 (Qwen 2/3)"


@dataclass(frozen=True)
class GGUFVocab:
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]  # by id, as long as the model's vocabulary
    types: list[int]
    merges: list[str]  # "left right", by rank
    bos_id: int
    eos_id: int
    pad_id: int
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def gguf_vocab(tokenizer, n_vocab: int, chat_template: str | None = None) -> GGUFVocab:
    """The GGUF fields of a `lmforge.data.text.tokenizer.Tokenizer` for a model with `n_vocab` rows."""
    spec = json.loads(tokenizer.to_json())
    where = f"tokenizer {tokenizer.path or ''}".rstrip()
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "a BPE with byte fallback (SentencePiece style)" if model.get("byte_fallback") else model.get("type")
        raise UserError(f"{where}: its model is {kind}; the GGUF export writes byte-level BPE tokenizers only "
                        f"({SUPPORTED})")
    pre = pre_tokenizer_name(spec, where)
    if spec.get("normalizer") is not None and not (pre == "qwen2" and spec["normalizer"].get("type") == "NFC"):
        # Qwen's NFC: llama.cpp skips it, which changes nothing on text that is already NFC (nearly all)
        raise UserError(f"{where}: has a normalizer ({spec['normalizer'].get('type')}) that llama.cpp does not run; "
                        "its tokens would differ")
    tokens, types = _tokens(model["vocab"], spec.get("added_tokens") or [], n_vocab, where)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    ids = tokenizer.encode("a")
    add_bos = bool(tokenizer.prefix_ids)
    add_eos = len(ids) > 1 and ids[-1] == tokenizer.eos_id
    # Without a BOS of its own, the end-of-text token starts a text (as GPT-2's); llama.cpp
    # would otherwise fall back to id 11.
    bos = tokenizer.prefix_ids[0] if add_bos else (tokenizer.bos_id if tokenizer.bos_id is not None
                                                    else tokenizer.eos_id)
    return GGUFVocab(pre=pre, tokens=tokens, types=types, merges=merges, bos_id=bos, eos_id=tokenizer.eos_id,
                     pad_id=tokenizer.pad_id, add_bos=add_bos, add_eos=add_eos, chat_template=chat_template)


def pre_tokenizer_name(spec: dict, where: str = "tokenizer") -> str:
    """llama.cpp's name for tokenizer.json's pre-tokenizer (see the table above), or one line saying why none."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            return "gpt-2"
        raise UserError(f"{where}: its ByteLevel pre-tokenizer {'adds a prefix space' if pre.get('add_prefix_space') else 'splits no words'}, "
                        f"which no llama.cpp pre-tokenizer does (supported: {SUPPORTED})")
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and len(steps) == 2:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
                and regex in SPLIT_PRE and byte_level.get("type") == "ByteLevel"
                and not byte_level.get("use_regex", True) and not byte_level.get("add_prefix_space")):
            return SPLIT_PRE[regex]
    raise UserError(f"{where}: its pre-tokenizer ({_describe(pre)}) is none llama.cpp implements "
                    f"(supported: {SUPPORTED})")


def _describe(pre: dict) -> str:
    if pre.get("type") == "Sequence":
        return " then ".join(p.get("type", "?") for p in pre.get("pretokenizers") or [])
    return pre.get("type") or "none"


def _tokens(vocab: dict[str, int], added: list[dict], n_vocab: int, where: str) -> tuple[list[str], list[int]]:
    size = max([*vocab.values(), *(a["id"] for a in added)], default=-1) + 1
    if size > n_vocab:
        raise UserError(f"{where}: has {size} tokens, more than the model's vocabulary of {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for a in added:
        tokens[a["id"]], types[a["id"]] = a["content"], CONTROL if a.get("special") else USER_DEFINED
    return tokens, types
