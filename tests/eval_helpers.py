"""Helpers for the ICL/gauntlet tests: a character tokenizer, tiny models, task files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmforge.config.model import ModelConfig
from lmforge.models import build_model

REPO = Path(__file__).resolve().parent.parent
SHARED_EVAL = REPO.parent / "shared" / "eval-data"
SHARED_TEXT = REPO.parent / "shared" / "corpora" / "tinyshakespeare.txt"


class CharTokenizer:
    """One token per character: encode/decode round-trip exactly, so a test can build a
    continuation from a model's own greedy tokens."""

    def __init__(self):
        chars = "\n" + "".join(chr(c) for c in range(32, 127))
        self.eos_id, self.pad_id, self.unk_id = 0, 1, 2
        self.bos_id = None
        self.itos = {i + 3: ch for i, ch in enumerate(chars)}
        self.stoi = {ch: i for i, ch in self.itos.items()}
        self.vocab_size = len(chars) + 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.stoi.get(ch, self.unk_id) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.itos.get(int(i), "") for i in ids)


def tiny_model(vocab_size: int, seed: int = 0, max_seq_len: int = 256):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return build_model(cfg).eval()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WORDS = ("apple river stone cloud green quick slow table mirror garden lantern bridge winter "
         "candle silver forest harbor meadow pepper violin").split()


def sentence(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))
