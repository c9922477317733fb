"""Work units: the input of `data prepare` / `data dedup` cut into pieces that do not depend on
how many tasks run them.

A unit is a list of slices of the input files, in input order. Consecutive whole files are
grouped until the next one would take the unit past ``unit_bytes``; a file larger than that is
cut into fixed byte ranges of ``unit_bytes`` when its documents are lines (uncompressed JSONL: a
line belongs to the range its first byte is in, so the ranges need no scan to find document
boundaries); any other large file, a ``builtin:`` corpus and an ``hf://`` dataset are a unit of
their own. The cut depends only on the inputs (paths and sizes) and ``unit_bytes``: the same
units, in the same order, for one process or for a thousand tasks.

Each unit is tokenized and packed on its own, so a dataset with U units drops U partial samples
per split (less than ``seq_len`` tokens each) where one stream would drop one: 0.01% of the
tokens at the default unit size and ``seq_len`` 2048.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from lmforge.data.text.sources import Source, SourceStats, UnreadableInput, read_source, splittable
from lmforge.errors import UserError

# 256 MiB of input per unit: ~60M tokens, so the partial samples lost at unit ends are a few in a
# million tokens; 1T tokens (~4 TB of text) make ~16K units, enough to keep thousands of tasks busy.
DEFAULT_UNIT_BYTES = 256 << 20


@dataclass(frozen=True)
class Slice:
    """A whole source (``start`` None) or the lines starting in bytes [start, end) of one."""

    uri: str
    start: int | None = None
    end: int | None = None

    def to_json(self) -> list:
        return [self.uri] if self.start is None else [self.uri, self.start, self.end]


@dataclass(frozen=True)
class Unit:
    index: int
    slices: tuple[Slice, ...]
    bytes: int | None  # input bytes (compressed size for compressed files); None: not known (builtin, hf)

    def to_json(self) -> dict:
        return {"slices": [s.to_json() for s in self.slices], "bytes": self.bytes}



def plan_units(sources: list[Source], unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
    """The work units of ``sources`` (already in input order)."""
    units: list[Unit] = []
    group: list[Slice] = []
    size = 0

    def close() -> None:
        nonlocal group, size
        if group:
            units.append(Unit(len(units), tuple(group), size))
        group, size = [], 0

    for src in sources:
        if src.size is None:  # builtin:, hf://: one unit, size unknown
            close()
            units.append(Unit(len(units), (Slice(src.uri),), None))
        elif src.size > unit_bytes and splittable(src):
            close()
            for start in range(0, src.size, unit_bytes):
                end = min(start + unit_bytes, src.size)
                units.append(Unit(len(units), (Slice(src.uri, start, end),), end - start))
        else:
            if group and size + src.size > unit_bytes:
                close()
            group.append(Slice(src.uri))
            size += src.size
    close()
    return units


ON_BAD_INPUT = ("skip", "fail")


def check_on_bad_input(value: str) -> None:
    if value not in ON_BAD_INPUT:
        raise UserError(f"--on-bad-input {value}: expected skip or fail")


def unit_documents(unit: Unit, text_field: str, stats: SourceStats, on_bad_input: str = "skip") -> Iterator[str]:
    """The documents of a unit, in input order (counted in ``stats``).

    An input that cannot be read (``UnreadableInput``: corrupt, truncated, ...) is skipped from
    the point where reading it failed, named in ``stats.skipped_inputs`` with the documents read
    before (they stay), or with ``on_bad_input="fail"`` raised. The point depends only on the
    file's bytes, so every stage that reads the unit sees the same documents."""
    for s in unit.slices:
        if s.start is None or s.start == 0:
            stats.files += 1  # a file is counted once, by the unit that reads its start
        read = 0
        try:
            for text in read_source(Source(s.uri), text_field, stats,
                                    byte_range=None if s.start is None else (s.start, s.end)):
                stats.documents += 1
                read += 1
                yield text
        except UnreadableInput as e:
            if on_bad_input != "skip":
                raise
            where = s.uri if s.start is None else f"{s.uri} (bytes {s.start}-{s.end})"
            reason = str(e).removeprefix(f"{s.uri}: ")
            stats.skip_input(where, f"{reason}; skipped{f' after its first {read} documents' if read else ''}")
