"""Tokenizing documents and packing them into fixed-length samples (the work of one unit).

Every document is encoded, followed by EOS, and appended to its split's token stream; the
stream is cut into samples of exactly ``seq_len`` tokens (a document's remainder continues into
the next sample); the final partial sample of each split of a unit is dropped and counted.

Split: a document goes to ``val`` when blake2b(its UTF-8 bytes), read as a number in [0, 1),
is below ``eval_fraction`` -- a pure function of its content, so re-runs and added files never
move a document between splits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import numpy as np

SPLITS = ("train", "val")
# A chunk is the unit of work sent to a worker: big enough to amortise inter-process transfer
# and to keep the tokenizer's own batch parallelism busy, small enough to bound memory.
# In-process (workers=1) the tokenizer's own threads split a chunk's documents, so chunks are
# bigger; with worker processes smaller chunks balance the load and shorten the pipeline's tail.
CHUNK_CHARS = 1 << 20
CHUNK_CHARS_POOL = 1 << 18
CHUNK_DOCS = 2048


class Encoder:
    """Tokenizes a chunk of documents and routes each to its split (runs in workers)."""

    def __init__(self, tokenizer_json: str, eos_id: int, eval_fraction: float):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_str(tokenizer_json)
        self.eos_id = eos_id
        self.threshold = int(eval_fraction * (1 << 64))

    def encode_chunk(self, texts: list[str]) -> dict:
        """Per split: all tokens (each document + EOS) as one uint32 array, documents, bytes."""
        fast = getattr(self.backend, "encode_batch_fast", None)
        encodings = fast(texts) if fast is not None else self.backend.encode_batch(texts)
        flat = {s: [] for s in SPLITS}
        docs = {s: 0 for s in SPLITS}
        nbytes = {s: 0 for s in SPLITS}
        for text, enc in zip(texts, encodings):
            raw = text.encode("utf-8")
            split = "val" if self.threshold and split_value(raw) < self.threshold else "train"
            ids = flat[split]
            ids.extend(enc.ids)
            ids.append(self.eos_id)
            docs[split] += 1
            nbytes[split] += len(raw)
        return {s: (np.array(flat[s], dtype=np.uint32), docs[s], nbytes[s]) for s in SPLITS}


def split_value(raw: bytes) -> int:
    """A document's position in [0, 2**64): the val split is everything below eval_fraction·2**64."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def chunk_documents(docs: Iterable, max_chars: int | None = None, text=lambda d: d) -> Iterator[list]:
    """Documents in lists of about ``max_chars`` characters (at most CHUNK_DOCS): the unit a worker
    encodes. ``text`` gives a document's text when the items carry more (an index with it)."""
    max_chars = max_chars or CHUNK_CHARS
    batch: list = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(text(doc))
        if size >= max_chars or len(batch) >= CHUNK_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Packer:
    """Cuts one split's token stream into seq_len samples and writes them to an MDS folder."""

    def __init__(self, out_dir: str, seq_len: int, dtype: str, compression: str | None, prefix: str = ""):
        from lmforge.data.mds import MDSWriter

        self.writer = MDSWriter(out_dir, {"tokens": f"ndarray:{dtype}"}, compression=compression, prefix=prefix)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.samples = 0
        self.documents = 0
        self.tokens = 0
        self.bytes = 0

    def add(self, tokens: np.ndarray, documents: int, nbytes: int) -> None:
        self.documents += documents
        self.bytes += nbytes
        self.tokens += len(tokens)
        if not len(tokens):
            return
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        if self.pending_len < self.seq_len:
            return
        buf = np.concatenate(self.pending).astype(self.dtype, copy=False)
        n = len(buf) // self.seq_len
        for i in range(n):
            self.writer.write({"tokens": buf[i * self.seq_len : (i + 1) * self.seq_len]})
        rest = buf[n * self.seq_len :]
        self.pending, self.pending_len = [rest], len(rest)
        self.samples += n

    def finish(self) -> dict:
        """The split's counts and its shard entries (``index.json``'s, in order)."""
        self.writer.finish()
        return {
            "documents": self.documents,
            "tokens": self.tokens,  # document tokens including each document's EOS (and BOS)
            "bytes": self.bytes,  # UTF-8 bytes of the documents
            "samples": self.samples,
            "dropped_tokens": self.pending_len,  # the final partial sample
            "shard_entries": self.writer.shards,
        }
