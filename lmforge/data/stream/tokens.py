"""The training data stream: MDS datasets -> deterministic, resumable batches of token ids.

Samples. A sample of the stream is one row of ``seq_len`` tokens. A stored sample longer than
that is split into ``⌊L / seq_len⌋`` pieces (`data.pieces`), each a sample of its own: dataset
``i`` of ``n_i`` stored samples of ``L_i`` tokens holds ``n_i * k_i`` samples (``k_i`` pieces
each), sample ``q`` being piece ``q % k_i`` of stored sample ``q // k_i``. Below, "samples" and
sizes count these pieces; with data prepared at ``seq_len`` a piece is a whole stored sample.

Order. Each epoch of the (mixed) stream holds ``c_i = round(p_i * N)`` samples of dataset ``i``
(``N`` = total samples of all datasets, ``p_i`` the normalized proportions; without proportions
``c_i`` is the dataset's size). Dataset ``i`` contributes the first ``c_i`` entries of a chain of
seeded permutations of its samples (a prefix when ``c_i`` is smaller than the dataset, further
permutations when larger), and the datasets are interleaved by a seeded shuffle of the
multiset of dataset ids. Everything is a pure function of (seed, epoch, sizes, proportions),
and epochs follow one another forever. The pieces of one stored sample are shuffled like any
other samples: they land in different batches, and one epoch trains every piece once.

Ranks. Global sample ``s`` is position ``s % E`` of epoch ``s // E``. Global batch ``t`` is
global samples ``[t*G, (t+1)*G)``; data-parallel replica ``r`` of ``W`` takes the contiguous slice
``[t*G + r*G/W, t*G + (r+1)*G/W)`` in micro-batches — the split of the run's layout
(`plan.layout.Layout`: ``G``, ``W``, the micro-batch), which the stream reads and never works out
again. The global batch does not depend on the number of ranks or the micro-batch size.

Resume. ``state_dict()`` records the global samples consumed in whole global batches (plus
this rank's progress inside the current one, honoured only when ranks, micro-batch and global
batch are unchanged; otherwise the partial global batch is replayed from its start) and a
fingerprint of the data (seed, dataset names, stored sizes, pieces per stored sample where more
than one, proportions). Loading it jumps straight to that sample: nothing is replayed or re-read.

Curriculum. With ``phases`` the global sample axis is cut into consecutive phases at given
global samples (whole global batches: the trainer puts them on optimizer-step boundaries). Each
phase has its own mix over the same datasets and its own order, built exactly as above with the
seed extended by the phase number (phase 0 keeps the plain seed, so a one-phase curriculum is the
plain mix); sample ``s`` of phase ``k`` is position ``s - start_k`` of that order. Everything stays
a pure function of (seed, sizes, phases), so resume stays O(1) and rank-count independent.

Workers. With ``num_workers > 0`` a DataLoader runs the same generator in worker processes:
worker ``k`` builds micro-batches ``k, k+n, k+2n, ...`` and the DataLoader hands them out
round-robin, so the batch sequence is identical to ``num_workers=0``. Consumption is counted in
the main process, so prefetched batches are not counted as consumed.
"""

from __future__ import annotations

import gc
import hashlib
import os
import signal
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lmforge.data import remote
from lmforge.data.batch import Batch
from lmforge.data.mds import INDEX, MDSReader, read_index
from lmforge.data.pieces import pieces_per_sample
from lmforge.plan.layout import Layout
from lmforge.errors import UserError
from lmforge.home import cache_dir as lmforge_cache
from lmforge.process import die_with_parent

STATE_VERSION = 1


@dataclass
class DatasetSpec:
    """One dataset of a mix: a name, an MDS path/URI, and an optional proportion."""

    name: str
    path: str
    proportion: float | None = None


# ----------------------------------------------------------------------------- opening datasets


def _resolve_local(path: str, split: str) -> Path:
    root = Path(remote.local_path(path))
    if (root / INDEX).is_file():
        return root
    if (root / split / INDEX).is_file():
        return root / split
    if not root.exists():
        raise UserError(f"{path}: dataset path not found")
    raise UserError(
        f"{path}: no {INDEX} (expected an MDS folder, or a prepared dataset with {split}/{INDEX})"
    )


def _open_remote(uri: str, split: str, cache_dir: str | None) -> MDSReader:
    uri = uri.rstrip("/")
    for base in (uri, remote.join(uri, split)):
        if remote.exists(remote.join(base, INDEX)):
            break
    else:
        raise UserError(
            f"{uri}: no {INDEX} found (expected an MDS folder, or a prepared dataset with {split}/{INDEX})"
        )
    local = Path(cache_dir) if cache_dir else Path(lmforge_cache("mds"), hashlib.sha256(base.encode()).hexdigest()[:16])
    local.mkdir(parents=True, exist_ok=True)
    fresh = local / f".{INDEX}.{os.getpid()}.new"  # per process: ranks may share a cache
    remote.download(remote.join(base, INDEX), str(fresh))
    old = local / INDEX
    if old.is_file() and old.read_bytes() != fresh.read_bytes():
        # The remote dataset changed: cached shards may be stale.
        for p in local.glob("shard.*"):
            p.unlink()
    fresh.replace(old)
    sizes = {}
    for s in read_index(old, remote.join(base, INDEX)):
        for info in (s["raw_data"], s.get("zip_data")):
            if info:
                sizes[info["basename"]] = info.get("bytes")

    def fetch(basename: str) -> None:
        remote.download(remote.join(base, basename), str(local / basename), size=sizes.get(basename))

    return MDSReader(str(local), fetch=fetch, name=base)


def open_dataset(path: str, split: str = "train", cache_dir: str | None = None) -> MDSReader:
    """Open an MDS folder, or the ``split`` subfolder of a prepared dataset; local or remote.

    Remote datasets are cached under ``cache_dir`` (default ``$LMFORGE_HOME/cache/mds/<hash of URI>``):
    ``index.json`` on open, shards on first use. For local compressed datasets, ``cache_dir``
    is where shards are decompressed.
    """
    if remote.is_remote(path):
        return _open_remote(path, split, cache_dir)
    return MDSReader(str(_resolve_local(path, split)), cache_dir=cache_dir, name=path)


# ----------------------------------------------------------------------------- the order


class _Order:
    """Maps global sample index -> (dataset, sample) following the module docstring."""

    def __init__(self, sizes: list[int], counts: list[int], seed: int, phase: int = 0):
        self.sizes = sizes
        self.counts = counts
        self.seed = seed
        self._key = [seed] if phase == 0 else [seed, 0x9A5E, phase]  # phase 0: the plain mix's order
        self.epoch_len = sum(counts)
        self._epoch = -1
        self._src: np.ndarray | None = None
        self._ordinal: np.ndarray | None = None
        self._perms: list[np.ndarray] = []

    def _plan(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        k = len(self.sizes)
        id_dtype = np.uint8 if k < 256 else np.uint16
        rng = np.random.default_rng([*self._key, epoch, 0x5EED])
        src = np.repeat(np.arange(k, dtype=id_dtype), self.counts)
        rng.shuffle(src)
        # ordinal[p] = how many earlier positions of the epoch come from the same dataset.
        order = np.argsort(src, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        idx_dtype = np.int32 if max(self.epoch_len, *self.sizes) < 2**31 else np.int64
        ordinal = np.empty(self.epoch_len, idx_dtype)
        ordinal[order] = np.arange(self.epoch_len, dtype=np.int64) - np.repeat(starts, self.counts)
        perms = []
        for i, (n, c) in enumerate(zip(self.sizes, self.counts)):
            cycles = -(-c // n) if c else 0
            chain = [
                np.random.default_rng([*self._key, epoch, i, cyc]).permutation(n).astype(idx_dtype)
                for cyc in range(cycles)
            ]
            perms.append(np.concatenate(chain)[:c] if chain else np.empty(0, idx_dtype))
        self._epoch, self._src, self._ordinal, self._perms = epoch, src, ordinal, perms

    def lookup(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (dataset ids, sample indices within each dataset)."""
        ds = np.empty(len(samples), np.int64)
        idx = np.empty(len(samples), np.int64)
        epochs = samples // self.epoch_len
        for e in np.unique(epochs):
            sel = epochs == e
            self._plan(int(e))
            pos = samples[sel] % self.epoch_len
            d = self._src[pos].astype(np.int64)
            o = self._ordinal[pos]
            out = np.empty(len(pos), np.int64)
            for i in np.unique(d):
                m = d == i
                out[m] = self._perms[int(i)][o[m]]
            ds[sel], idx[sel] = d, out
        return ds, idx


class _PhasedOrder:
    """A curriculum: consecutive phases of the global sample axis, each with its own ``_Order``."""

    def __init__(self, orders: list[_Order], starts: list[int]):
        self.orders = orders
        self.starts = np.asarray(starts, np.int64)  # global sample where each phase begins; starts[0] = 0

    def phase_of(self, sample: int) -> int:
        return int(np.searchsorted(self.starts, sample, side="right") - 1)

    def lookup(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ds = np.empty(len(samples), np.int64)
        idx = np.empty(len(samples), np.int64)
        phase = np.searchsorted(self.starts, samples, side="right") - 1
        for k in np.unique(phase):
            sel = phase == k
            ds[sel], idx[sel] = self.orders[int(k)].lookup(samples[sel] - self.starts[k])
        return ds, idx


@dataclass
class StreamPhase:
    """One curriculum phase for ``TokenStream``: where it ends and its mix (name → proportion or None)."""

    end_sample: int | None  # global sample where the next phase starts; None for the last phase
    mix: dict[str, float | None]


# ----------------------------------------------------------------------------- micro-batches


class _MicroBatches(IterableDataset):
    """Infinite micro-batches of one rank, starting at a given point; split across workers."""

    def __init__(self, readers: list[MDSReader], names: list[str], order: _Order, *, seq_len: int, layout: Layout,
                 replica: int, base: int, first: int, pieces: list[int], document_eos: int | None = None):
        self.readers = readers
        self.pieces = pieces  # pieces of seq_len tokens per stored sample, per dataset
        self.document_eos = document_eos
        self.names = names
        self.order = order
        self.seq_len = seq_len
        self.mb = layout.micro_batch
        self.gb = layout.global_batch
        self.replica = replica
        self.per_replica = layout.per_replica
        self.accum = layout.grad_accum
        self.base = base  # global sample where micro-batch 0 begins
        self.first = first  # first micro-batch number to produce

    def samples_of(self, m: int) -> np.ndarray:
        """Global sample indices of this rank's micro-batch number ``m``."""
        t, a = divmod(m, self.accum)
        start = self.base + t * self.gb + self.replica * self.per_replica + a * self.mb
        return np.arange(start, start + self.mb, dtype=np.int64)

    def build(self, m: int) -> Batch:
        ds, idx = self.order.lookup(self.samples_of(m))
        out = np.empty((self.mb, self.seq_len), np.int64)
        for row, (d, q) in enumerate(zip(ds.tolist(), idx.tolist())):
            k = self.pieces[d]
            i, start = q // k, (q % k) * self.seq_len  # piece q % k of stored sample q // k
            tokens = self.readers[d].get_tokens(i)
            if len(tokens) < k * self.seq_len:
                raise UserError(
                    f"dataset {self.names[d]!r}: sample {i} has {len(tokens)} tokens, shorter than "
                    + (f"seq_len {self.seq_len}" if k == 1 else
                       f"the {k} × {self.seq_len} of its dataset's first sample (samples must all have one length)")
                )
            out[row] = tokens[start: start + self.seq_len]
        return Batch.from_tokens(torch.from_numpy(out), eos_id=self.document_eos)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        m = self.first + k
        while True:
            yield self.build(m)
            m += n


def _worker_init(parent: int, _worker_id: int) -> None:
    remote.keep_inherited_clients()
    # A worker dies with its rank (even a SIGKILLed one) and leaves stop signals to it: SIGTERM /
    # Ctrl-C reach the whole process group, and the rank stops its workers itself after checkpointing.
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ----------------------------------------------------------------------------- the stream


def _normalize(datasets: list[DatasetSpec] | str | DatasetSpec) -> list[DatasetSpec]:
    if isinstance(datasets, (str, Path)):
        return [DatasetSpec(name=str(datasets), path=str(datasets))]
    if isinstance(datasets, DatasetSpec):
        return [datasets]
    specs = list(datasets)
    if not specs:
        raise UserError("train_data: no datasets given")
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UserError(f"train_data: dataset names must be unique (repeated: {', '.join(sorted(dup))})")
    given = [s.proportion is not None for s in specs]
    if any(given) and not all(given):
        missing = [s.name for s in specs if s.proportion is None]
        raise UserError(f"train_data: give a proportion for every dataset of the mix or none (missing: {', '.join(missing)})")
    for s in specs:
        if s.proportion is not None and not (s.proportion >= 0 and np.isfinite(s.proportion)):
            raise UserError(f"train_data.{s.name}.proportion: expected a number >= 0, got {s.proportion}")
    if all(given) and sum(s.proportion for s in specs) <= 0:
        raise UserError("train_data: proportions must not all be zero")
    return specs


def _check_phases(phases: list[StreamPhase], names: list[str]) -> list[StreamPhase]:
    phases = [p if isinstance(p, StreamPhase) else StreamPhase(**p) for p in phases]
    prev = 0
    for k, p in enumerate(phases):
        unknown = sorted(set(p.mix) - set(names))
        if unknown:
            raise UserError(f"curriculum[{k}].mix: unknown dataset {', '.join(unknown)} (datasets: {', '.join(names)})")
        last = k == len(phases) - 1
        if last != (p.end_sample is None):
            raise UserError(f"curriculum[{k}]: every phase but the last needs an end point (and the last has none)")
        if not last and p.end_sample <= prev:
            raise UserError(f"curriculum[{k}]: end points must increase (sample {p.end_sample} after {prev})")
        prev = p.end_sample or prev
    return phases


def _counts(specs: list[DatasetSpec], sizes: list[int], mix: dict[str, float | None]) -> tuple[list[int], list[float]]:
    """Samples per epoch of each dataset for one mix (datasets outside it get 0), and the proportions."""
    inside = [sp.name in mix for sp in specs]
    total = sum(n for n, i in zip(sizes, inside) if i)
    given = [mix[sp.name] for sp, i in zip(specs, inside) if i]
    if any(v is None for v in given):
        props = [n / total if i else 0.0 for n, i in zip(sizes, inside)]
        return [n if i else 0 for n, i in zip(sizes, inside)], props
    z = sum(given)
    if not z > 0:
        raise UserError("train_data: proportions must not all be zero")
    props = [mix[sp.name] / z if i else 0.0 for sp, i in zip(specs, inside)]
    return [int(round(p * total)) for p in props], props


def _unsplit(fingerprint: dict) -> dict:
    """A fingerprint as lmforge wrote it before samples longer than seq_len were split (heads only)."""
    return fingerprint | {"datasets": [{k: v for k, v in d.items() if k != "pieces_per_sample"}
                                       for d in fingerprint["datasets"]]}


class TokenStream:
    """Infinite iterable of `Batch` es (token ids ``[micro_batch, seq_len]``) for one rank of
    ``layout`` (the rows of its data-parallel replica); a `BatchStream`."""

    def __init__(
        self,
        datasets: list[DatasetSpec] | str,
        *,
        seq_len: int,
        layout: Layout,
        rank: int = 0,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
        split: str = "train",
        pin_memory: bool = False,
        phases: list[StreamPhase] | None = None,
        document_eos: int | None = None,
    ):
        for name, v, lo in (("seq_len", seq_len, 1), ("num_workers", num_workers, 0)):
            if not isinstance(v, int) or v < lo:
                raise UserError(f"{name}: expected an integer >= {lo}, got {v!r}")
        if not 0 <= rank < layout.ranks:
            raise UserError(f"rank: expected 0 <= rank < {layout.ranks} (the layout's ranks), got {rank}")
        self.specs = _normalize(datasets)
        self.seq_len, self.layout = seq_len, layout
        self.replica, self.seed, self.num_workers = layout.replica(rank), seed, num_workers
        self.pin_memory = pin_memory  # CUDA: page-locked batches, so host→device copies overlap compute
        self.document_eos = document_eos  # document masking: batches carry doc_ids split after this token
        self.readers = []
        for i, s in enumerate(self.specs):
            sub = None if cache_dir is None else str(Path(cache_dir) / f"{i}-{hashlib.sha256(s.path.encode()).hexdigest()[:12]}")
            self.readers.append(open_dataset(s.path, split=split, cache_dir=sub))
        self.sizes = [len(r) for r in self.readers]  # stored samples
        self.pieces = []  # training samples (pieces of seq_len tokens) per stored sample
        for s, n, r in zip(self.specs, self.sizes, self.readers):
            if n == 0:
                raise UserError(f"dataset {s.name!r} ({s.path}): has no samples")
            have = r.sample_length(0)
            if have < seq_len:
                raise UserError(
                    f"dataset {s.name!r} ({s.path}): samples have {have} tokens, shorter than seq_len {seq_len}"
                )
            self.pieces.append(pieces_per_sample(have, seq_len))
        piece_sizes = [n * k for n, k in zip(self.sizes, self.pieces)]
        if phases:
            self.phases = _check_phases(phases, [sp.name for sp in self.specs])
            mixes = [p.mix for p in self.phases]
        else:
            self.phases = None
            mixes = [{sp.name: sp.proportion for sp in self.specs}]
        orders, self.phase_proportions = [], []
        for k, mix in enumerate(mixes):
            counts, props = _counts(self.specs, piece_sizes, mix)
            if sum(counts) == 0:
                raise UserError(f"train_data: the mix{f' of phase {k}' if self.phases else ''} selects no samples")
            orders.append(_Order(piece_sizes, counts, seed, phase=k))
            self.phase_proportions.append(props)
        self.proportions = self.phase_proportions[0]
        self.counts = orders[0].counts
        if self.phases:
            starts = [0] + [p.end_sample for p in self.phases[:-1]]
            self._order = _PhasedOrder(orders, starts)
        else:
            self._order = orders[0]
        self._orders = orders
        self.samples_per_epoch = orders[0].epoch_len
        self._base = 0  # global sample where this rank's micro-batch 0 begins (whole global batches)
        self._yielded = 0  # micro-batches handed out since _base
        self._loader_iter = None

    # -- bookkeeping

    @property
    def samples_seen(self) -> int:
        """Global samples consumed (all ranks assumed in step), including a partial global batch."""
        whole, part = divmod(self._yielded, self.layout.grad_accum)
        return self._base + whole * self.layout.global_batch + part * self.layout.micro_batch * self.layout.replicas

    def _split(self) -> list[int]:
        """What a saved position's partial global batch depends on: replicas, global batch, micro-batch."""
        return [self.layout.replicas, self.layout.global_batch, self.layout.micro_batch]

    @property
    def epoch(self) -> int:
        """Epoch of the current phase's order (of the whole stream without a curriculum)."""
        k = self.current_phase()
        start = 0 if k == 0 else self.phases[k - 1].end_sample
        return (self.samples_seen - start) // self._orders[k].epoch_len

    def current_phase(self) -> int:
        """Index of the curriculum phase the next sample belongs to (0 without a curriculum)."""
        return self._order.phase_of(self.samples_seen) if self.phases else 0

    def metrics(self) -> dict:
        """What the trainer logs about the data: the phase and its mix (curricula only)."""
        if not self.phases:
            return {}
        k = self.current_phase()
        return {"data/phase": k} | {f"data/mix/{sp.name}": round(p, 6)
                                    for sp, p in zip(self.specs, self.phase_proportions[k])}

    def phase(self) -> str | None:
        """'phase 2/3: web 30%, hq 70%': the phase the next sample belongs to (None without a curriculum)."""
        if not self.phases:
            return None
        k = self.current_phase()
        mix = ", ".join(f"{sp.name} {p:.0%}" for sp, p in zip(self.specs, self.phase_proportions[k]) if p > 0)
        return f"phase {k + 1}/{len(self.phases)}: {mix}"

    def fingerprint(self) -> dict:
        fp = {
            "seed": self.seed,
            # "pieces_per_sample" only where a stored sample is split: fingerprints of data trained
            # at its prepared length stay what they were, so their checkpoints resume as before.
            "datasets": [
                {"name": s.name, "samples": n, "proportion": round(p, 12)} | ({"pieces_per_sample": k} if k > 1 else {})
                for s, n, k, p in zip(self.specs, self.sizes, self.pieces, self.proportions)
            ],
        }
        if self.phases:
            fp["phases"] = [{"end_sample": p.end_sample, "proportions": [round(x, 12) for x in props]}
                            for p, props in zip(self.phases, self.phase_proportions)]
        return fp

    def state_dict(self) -> dict:
        whole, part = divmod(self._yielded, self.layout.grad_accum)
        return {
            "version": STATE_VERSION,
            "samples_seen": self._base + whole * self.layout.global_batch,  # whole global batches
            "partial_micro_batches": part,
            "layout": self._split(),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "samples_seen" not in state:
            raise UserError(f"data stream state: expected a state dict of version {STATE_VERSION}")
        fp, mine = state.get("fingerprint"), self.fingerprint()
        if fp != mine and fp == _unsplit(mine):
            raise UserError(
                f"data stream state: saved when samples longer than seq_len {self.seq_len} were cut to their head; "
                "they are now split into pieces that are all trained, so this position in the data cannot be resumed "
                "exactly; train on from these weights in a new run (custom_weights_path: this checkpoint)")
        if fp != mine:
            raise UserError(f"data stream state does not match the data: saved {fp}, now {mine}")
        self.close()
        self._base = int(state["samples_seen"])
        same_layout = list(state.get("layout", [])) == self._split()
        self._yielded = int(state.get("partial_micro_batches", 0)) if same_layout else 0

    # -- iteration

    def _dataset(self) -> _MicroBatches:
        return _MicroBatches(
            self.readers, [s.name for s in self.specs], self._order, seq_len=self.seq_len, layout=self.layout,
            replica=self.replica, base=self._base, first=self._yielded,
            pieces=self.pieces, document_eos=self.document_eos,
        )

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        ds = self._dataset()
        if self.num_workers == 0:
            source = iter(ds)
        else:
            loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                                persistent_workers=False, prefetch_factor=4,
                                worker_init_fn=partial(_worker_init, os.getpid()))
            gc.collect()  # finalize our own garbage here, not in the forked workers
            source = self._loader_iter = iter(loader)
        pin = self.pin_memory and self.num_workers == 0  # the DataLoader pins in its own thread otherwise
        for batch in source:
            self._yielded += 1
            yield batch.pin_memory() if pin else batch

    def close(self) -> None:
        """Stop DataLoader workers, if any."""
        it, self._loader_iter = self._loader_iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
