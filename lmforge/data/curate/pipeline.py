"""The curation pipeline over chunks of documents, in-process or across worker processes.

    read (parent) → signatures (workers) → dedup decisions (parent, input order)
        → filters + decontamination [+ tokenizing, for `data prepare`] (workers) → parent

Both worker stages share one process pool; each keeps a bounded number of chunks in flight and
results are consumed in submission order, so the output is the same for any number of workers.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator

from lmforge.config.curation import CurateConfig
from lmforge.data.curate.curator import Curator, DocChecker
from lmforge.data.curate.dedup import signatures
from lmforge.process import die_with_parent


class _State:
    """What one process needs for the worker stages."""

    def __init__(self, cfg_json: str | None, index, encoder: tuple[Callable, tuple] | None):
        self.cfg = CurateConfig.model_validate_json(cfg_json) if cfg_json else None
        self.checker = DocChecker(self.cfg, index) if self.cfg else None
        self.encoder = encoder[0](*encoder[1]) if encoder else None
        if self.cfg and self.cfg.dedup and self.cfg.dedup.near:
            from lmforge.data.curate.dedup import _minhash

            _minhash(self.cfg.dedup.num_perm)  # import datasketch (~1 s) now, while the parent reads input

    @property
    def has_stage_b(self) -> bool:
        return self.encoder is not None or (self.checker is not None and self.checker.active)

    def stage_a(self, texts: list[str]):
        return signatures(texts, self.cfg.dedup)

    def stage_b(self, texts: list[str]):
        matched = []
        if self.checker is not None and self.checker.active:
            texts, matched = self.checker.run_chunk(texts)
        return (self.encoder.encode_chunk(texts) if self.encoder else texts), matched


_STATE: _State | None = None  # per worker process, built by the pool initializer


def _init(cfg_json, index, encoder, threads: int, parent: int) -> None:
    global _STATE
    die_with_parent(parent)  # a killed `prepare` (or trainer preparing its data) leaves no worker behind
    # The tokenizer's Rust thread pool would otherwise start one thread per core in every worker.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    if threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE = _State(cfg_json, index, encoder)


def _stage_a(texts):
    return _STATE.stage_a(texts)


def _stage_b(texts):
    return _STATE.stage_b(texts)


def _ready():
    return True


def _ordered(submit, items: Iterable, depth: int) -> Iterator:
    """(item, result) in order, keeping at most ``depth`` submitted items in flight."""
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append((item, submit(item)))
            while len(pending) > depth:
                it, fut = pending.popleft()
                yield it, fut.result()
        while pending:
            it, fut = pending.popleft()
            yield it, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()


class _Done:
    """A finished 'future' for the in-process path."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value

    def cancel(self):
        pass


def run(chunks: Iterable[list[str]], curator: Curator | None, *, workers: int = 1,
        encoder: tuple[Callable, tuple] | None = None) -> Iterator[tuple[list[str], object]]:
    """Per input chunk: (the texts that reached stage B, its result: encoded chunk or kept texts).

    Removals are counted in ``curator``. ``encoder`` = (factory, args) builds, in each process, an
    object whose ``encode_chunk(texts)`` is applied to the surviving texts.
    """
    cfg_json = curator.cfg.model_dump_json() if curator else None
    index = curator.index if curator else None
    do_a = curator is not None and curator.dedup is not None
    next_id = [0]

    def numbered(src):
        for texts in src:
            ids = list(range(next_id[0], next_id[0] + len(texts)))
            next_id[0] += len(texts)
            if curator:
                curator.count_in(texts)
            yield texts, ids

    def deduped(stage_a_results):
        for (texts, ids), sigs in stage_a_results:
            yield curator.dedup_chunk(texts, ids, sigs)

    def finish(stage_b_results):
        for (texts, ids), (result, matched) in stage_b_results:
            if curator and matched:
                curator.count_checked(texts, ids, matched)
            yield texts, result

    # Stage B runs only when there is something to do per document (dedup alone ends in the parent).
    do_b = encoder is not None or (curator is not None and bool(curator.cfg.filters.enabled() or index is not None))
    if workers <= 1:
        state = _State(cfg_json, index, encoder)
        src = numbered(chunks)
        if do_a:
            src = deduped(_ordered(lambda c: _Done(state.stage_a(c[0])), src, 0))
        if not do_b:
            yield from ((texts, texts) for texts, ids in src)
            return
        yield from finish(_ordered(lambda c: _Done(state.stage_b(c[0])), src, 0))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn, not fork: a forked copy of a tokenizer that already ran its thread pool can deadlock.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                             initargs=(cfg_json, index, encoder, threads, os.getpid())) as pool:
        for _ in range(workers):  # start the workers (imports, models) while the parent reads the input
            pool.submit(_ready)
        src = numbered(chunks)
        if do_a:
            src = deduped(_ordered(lambda c: pool.submit(_stage_a, c[0]), src, 2 * workers))
        if not do_b:
            yield from ((texts, texts) for texts, ids in src)
            return
        yield from finish(_ordered(lambda c: pool.submit(_stage_b, c[0]), src, 2 * workers))
