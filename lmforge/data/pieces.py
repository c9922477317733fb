"""Prepared samples longer than the training context: how they are cut into pieces, and counted.

A dataset prepared at ``L`` tokens per sample and trained at a context of ``C`` tokens (``C ≤ L``)
holds ``⌊L / C⌋`` pieces per stored sample: piece ``j`` is tokens ``[j·C, (j+1)·C)``. Each piece
is one training sample (one row of a batch), so every token of the data is trained once per
epoch — not only each sample's head. The ``L mod C`` tokens after the last whole piece are not
trained, as `data prepare` drops its final partial sample: padding them would spend compute
on padding, and joining them with the next sample's tokens would make a piece depend on two
samples. `split_lines` says so, with the share, at the start of the run.

Everything downstream counts pieces: an epoch is every piece once (`epoch_pieces`), a
``sp`` duration or ``global_batch_size`` counts rows of ``C`` tokens, mix proportions are
shares of pieces (that is, of trained tokens), and `model: auto` sizes for `epoch_tokens`.
Torch-free: the plan, `model: auto` and the stream (`data.stream`) all use these rules.
"""

from __future__ import annotations

from typing import Iterable


def pieces_per_sample(sample_len: int, ctx: int) -> int:
    """Training samples of ``ctx`` tokens one stored sample of ``sample_len`` tokens gives
    (0 when the sample is shorter than the context: that is an error the plan reports)."""
    if ctx < 1:
        raise ValueError(f"context must be at least 1 token, got {ctx}")
    return sample_len // ctx


def epoch_pieces(datasets: Iterable[tuple[int, int]], ctx: int) -> int:
    """Training samples in one epoch of ``(stored samples, sample length)`` datasets: each piece once."""
    return sum(n * pieces_per_sample(length, ctx) for n, length in datasets)


def epoch_tokens(datasets: Iterable[tuple[int, int]], ctx: int) -> int:
    """Tokens one epoch trains: `epoch_pieces` × the context (what `1ep` of the data is)."""
    return epoch_pieces(datasets, ctx) * ctx


def split_lines(lengths: Iterable[tuple[str, int]], ctx: int) -> list[str]:
    """What the run says at its start about ``(dataset name, sample length)`` pairs longer than the
    context: one line per sample length, naming the datasets when there are several."""
    lengths = list(lengths)
    by_length: dict[int, list[str]] = {}
    for name, length in lengths:
        if length > ctx:
            by_length.setdefault(length, []).append(name)
    lines = []
    for length, names in sorted(by_length.items()):
        k, rest = pieces_per_sample(length, ctx), length % ctx
        which = f" ({', '.join(names)})" if len(lengths) > 1 else ""
        if k == 1:
            line = (f"data: samples of {length:,} tokens{which} are longer than the context: trained as their "
                    f"first {ctx:,}")
        else:
            line = f"data: samples of {length:,} tokens{which} split into {k} pieces of {ctx:,}"
        if rest:
            line += (f"; the last {rest:,} tokens of each ({rest / length:.0%}) are not trained (a context that "
                     f"divides {length:,}, or data prepared at a multiple of {ctx:,}, trains them)")
        lines.append(line)
    return lines
