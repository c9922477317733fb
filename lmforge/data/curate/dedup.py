"""Document-level deduplication: exact (normalized-text hash) and near (MinHash LSH).

The keys and signatures here are what `data prepare` / `data dedup` compute for every document;
their decisions are taken across work units in stages (``crossdedup``). ``Deduplicator`` takes
the same decisions in one process, in input order (the first occurrence is kept): `data stats`'
duplicate rates.

Near-duplicates: each document's word ``ngram``-shingles are hashed (``text.ngram_hashes``) and
fed to datasketch's ``MinHash`` (its 32-bit affine scheme); datasketch's ``MinHashLSH`` finds
earlier candidates, and a candidate counts only when the signatures' estimated Jaccard
similarity reaches ``threshold``. The bands and rows are datasketch's choice for ``threshold``
with false negatives weighted 0.95 (``LSH_WEIGHTS``): with equal weights a pair at Jaccard 0.9
is missed 7% of the time at threshold 0.8; this way 0.1%, and the verification step removes
the extra candidates the wider net brings.
"""

from __future__ import annotations

import numpy as np

from lmforge.config.curation import DedupConfig
from lmforge.data.curate.text import exact_key, ngram_hashes, word_hashes, words
from lmforge.errors import UserError

_SEED = 1  # datasketch's default permutation seed; fixed so signatures compare across runs
LSH_WEIGHTS = (0.05, 0.95)  # (false positive, false negative) weights for datasketch's band/row choice


def _datasketch():
    try:
        import datasketch
    except ImportError:
        raise UserError("near-duplicate removal needs datasketch: pip install 'lmforge[curate]'") from None
    return datasketch


_PERMS: dict[int, tuple] = {}


def _minhash(num_perm: int, hashvalues=None):
    ds = _datasketch()
    if num_perm not in _PERMS:
        _PERMS[num_perm] = ds.MinHash(num_perm=num_perm, seed=_SEED, scheme="affine32").permutations
    return ds.MinHash(num_perm=num_perm, seed=_SEED, hashfunc=int, hashvalues=hashvalues,
                      permutations=_PERMS[num_perm], scheme="affine32")


def signature(text: str, cfg: DedupConfig, ws: list[bytes] | None = None) -> np.ndarray | None:
    """MinHash signature (uint32[num_perm]) of the document's word shingles; None without words."""
    shingles = ngram_hashes(word_hashes(text, ws), cfg.ngram, short=True)
    if not len(shingles):
        return None
    folded = np.unique((shingles >> np.uint64(32)) ^ (shingles & np.uint64(0xFFFFFFFF)))  # 32-bit inputs
    m = _minhash(cfg.num_perm)
    m.update_batch(folded.tolist())
    return m.hashvalues


def signatures(texts: list[str], cfg: DedupConfig) -> tuple[list[bytes | None], list[np.ndarray | None]]:
    """Per document: the exact key (when exact dedup is on) and the MinHash signature (when near is on)."""
    keys, sigs = [], []
    for t in texts:
        ws = words(t)
        keys.append(exact_key(t, ws) if cfg.exact else None)
        sigs.append(signature(t, cfg, ws) if cfg.near else None)
    return keys, sigs


class Deduplicator:
    """Keeps what it has seen; ``check`` says whether a document repeats an earlier one."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.exact: dict[bytes, int] = {}
        self.lsh = _datasketch().MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm,
                                            weights=LSH_WEIGHTS) if cfg.near else None
        self.kept_sigs: dict[int, np.ndarray] = {}

    def check(self, doc: int, key: bytes | None, sig: np.ndarray | None) -> tuple[str | None, int | None]:
        """(reason, index of the earlier document) for a duplicate, (None, None) for a new document."""
        if key is not None:
            first = self.exact.get(key)
            if first is not None:
                return "exact", first
        if sig is not None:
            m = _datasketch().LeanMinHash(seed=_SEED, hashvalues=sig, scheme="affine32")  # no permutations needed
            best, best_j = None, 0.0
            for cand in self.lsh.query(m):
                j = float(np.mean(self.kept_sigs[cand] == sig))
                if j >= self.cfg.threshold and j > best_j:
                    best, best_j = cand, j
            if best is not None:
                return "near", best
            self.lsh.insert(doc, m, check_duplication=False)
            self.kept_sigs[doc] = sig
        if key is not None:
            self.exact[key] = doc
        return None, None
