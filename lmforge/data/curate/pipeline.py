"""The per-chunk work of `data prepare` / `data dedup`, in this process or in worker processes.

Two stages run on chunks of documents:

* ``signatures`` — each document's exact-dedup key and MinHash signature (``dedup.signatures``);
* ``documents`` — the per-document filters and decontamination, then (for `data prepare`) the
  tokenizer (an ``encoder``).

``ChunkPool.map`` keeps a bounded number of chunks in flight and yields the results in
submission order, so what is written does not depend on the number of workers.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator

from lmforge.config.curation import CurateConfig
from lmforge.data.curate.curator import DocChecker
from lmforge.data.curate.dedup import signatures
from lmforge.process import die_with_parent


STAGES = ("signatures", "documents")


class _State:
    """What one process needs for the stages."""

    def __init__(self, cfg_json: str | None, index, encoder: tuple[Callable, tuple] | None, stage: str):
        self.cfg = CurateConfig.model_validate_json(cfg_json) if cfg_json else None
        self.checker = self.encoder = None
        if stage == "documents":  # built now, while the parent reads the input (models load in seconds)
            self.checker = DocChecker(self.cfg, index) if self.cfg else None
            if self.checker is not None and not self.checker.active:
                self.checker = None
            self.encoder = encoder[0](*encoder[1]) if encoder else None
        elif self.cfg.dedup.near:
            from lmforge.data.curate.dedup import _minhash

            _minhash(self.cfg.dedup.num_perm)  # import datasketch (~1 s)

    def signatures(self, texts: list[str]):
        return signatures(texts, self.cfg.dedup)

    def documents(self, texts: list[str]):
        """(the kept texts, tokenized when there is an encoder; (position, reason, tasks) per match)."""
        matched = []
        if self.checker is not None:
            texts, matched = self.checker.run_chunk(texts)
        return (self.encoder.encode_chunk(texts) if self.encoder else texts), matched


_STATE: _State | None = None  # per worker process, built by the pool initializer


def _init(cfg_json, index, encoder, stage: str, threads: int, parent: int) -> None:
    global _STATE
    die_with_parent(parent)  # a killed `prepare` (or trainer preparing its data) leaves no worker behind
    # The tokenizer's Rust thread pool would otherwise start one thread per core in every worker.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    if threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE = _State(cfg_json, index, encoder, stage)


def _run(stage: str, texts: list[str]):
    return getattr(_STATE, stage)(texts)


def _ready():
    return True


class _Done:
    """A finished 'future': in-process results and pass-through items."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value

    def cancel(self):
        pass



class ChunkPool:
    """Runs one stage on chunks, in this process (``workers`` <= 1) or in ``workers`` processes."""

    def __init__(self, stage: str, cfg: CurateConfig | None, index=None,
                 encoder: tuple[Callable, tuple] | None = None, workers: int = 1):
        assert stage in STAGES, stage
        cfg_json = cfg.model_dump_json() if cfg is not None else None
        self.stage = stage
        self.workers = workers
        self.pool = None
        if workers <= 1:
            self.state = _State(cfg_json, index, encoder, stage)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // workers)
        # spawn, not fork: a forked copy of a tokenizer that already ran its thread pool can deadlock.
        ctx = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                        initargs=(cfg_json, index, encoder, stage, threads, os.getpid()))
        for _ in range(workers):  # start the workers (imports, models) while the parent reads the input
            self.pool.submit(_ready)

    def map(self, items: Iterable[tuple[object, list[str] | None]]) -> Iterator[tuple[object, list[str] | None, object]]:
        """(tag, texts, result) per (tag, texts) item, in order; an item whose texts are None passes
        through with result None (a marker, e.g. the end of a unit)."""
        stage = self.stage
        depth = 2 * self.workers if self.pool is not None else 0
        pending: collections.deque = collections.deque()

        def submit(texts):
            if texts is None:
                return _Done(None)
            if self.pool is None:
                return _Done(getattr(self.state, stage)(texts))
            return self.pool.submit(_run, stage, texts)

        try:
            for tag, texts in items:
                pending.append((tag, texts, submit(texts)))
                while len(pending) > depth:
                    tag_, texts_, fut = pending.popleft()
                    yield tag_, texts_, fut.result()
            while pending:
                tag_, texts_, fut = pending.popleft()
                yield tag_, texts_, fut.result()
        finally:
            for _, _, fut in pending:
                fut.cancel()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def __enter__(self) -> "ChunkPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
