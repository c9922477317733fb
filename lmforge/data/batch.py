"""What the data layer hands the trainer: a `Batch`, from a `BatchStream`.

Targets are already shifted: ``targets[b, t]`` is the token that position ``t`` must predict
(``input_ids[b, t + 1]`` for plain text), or ``IGNORE`` where nothing is trained (the last
position of a row, prompts and padding in fine-tuning). The loss is then a plain cross-entropy
over every position, with no slicing of the logits (a slice of [B, T, V] logits is a copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Protocol, runtime_checkable

import torch

from lmforge.plan.layout import Layout

IGNORE = -100  # cross_entropy's default ignore_index


@dataclass
class Batch:
    """One micro-batch: token ids [B, T], shifted targets [B, T], optional document ids [B, T];
    under context parallelism one rank's part of it, with the global positions [T] of its tokens."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    # Packed rows (fine-tuning, document masking): a token attends only to earlier tokens
    # with the same id. None: plain causal attention over the whole row.
    doc_ids: torch.Tensor | None = None
    # Context parallelism (`part`): where this part's tokens sit in the rows. None: whole rows.
    positions: torch.Tensor | None = None

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eos_id: int | None = None) -> "Batch":
        """Plain language modelling: every position predicts the next token of its row.

        With ``eos_id`` (document masking) the rows are split into their documents: a position's
        document id is the number of end-of-text tokens before it, so each document ends with
        its own EOS and attention stays inside it."""
        targets = torch.empty_like(tokens)
        targets[:, :-1] = tokens[:, 1:]
        targets[:, -1] = IGNORE
        doc_ids = None
        if eos_id is not None:
            ends = (tokens == eos_id).to(torch.int32)
            doc_ids = ends.cumsum(1, dtype=torch.int32) - ends
        return cls(tokens, targets, doc_ids)

    @classmethod
    def from_masked(cls, tokens: torch.Tensor, trained: torch.Tensor, doc_ids: torch.Tensor | None) -> "Batch":
        """Fine-tuning: only tokens flagged in ``trained`` are predicted (their previous position
        carries them as its target)."""
        shifted = tokens.masked_fill(~trained, IGNORE)
        targets = torch.full_like(tokens, IGNORE)
        targets[:, :-1] = shifted[:, 1:]
        return cls(tokens, targets, doc_ids)

    def part(self, positions: torch.Tensor) -> "Batch":
        """The tokens at ``positions`` of every row (one rank's share under context parallelism):
        ids, targets and document ids taken together, so a target stays with its position."""
        def take(t):
            return None if t is None else t.index_select(1, positions)

        return Batch(take(self.input_ids), take(self.targets), take(self.doc_ids), positions)

    def to(self, device: torch.device, non_blocking: bool = True) -> "Batch":
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(move(self.input_ids), move(self.targets), move(self.doc_ids), move(self.positions))

    def pin_memory(self) -> "Batch":
        """Page-locked host memory, so that `.to(cuda, non_blocking=True)` really overlaps
        (the DataLoader calls this for custom batch types when pin_memory=True)."""
        def pin(t):
            return None if t is None else t.pin_memory()

        return Batch(pin(self.input_ids), pin(self.targets), pin(self.doc_ids))

    def unscored(self) -> "Batch":
        """The same rows with nothing to predict: a stand-in that runs a forward and counts for
        nothing (a rank whose held-out rows ran out, as its peers' still run)."""
        return Batch(self.input_ids, torch.full_like(self.targets, IGNORE), self.doc_ids)

    def num_targets(self) -> torch.Tensor:
        """Positions that contribute to the loss (a tensor: no host sync)."""
        return (self.targets != IGNORE).sum()


@runtime_checkable
class BatchStream(Protocol):
    """An endless, deterministic, resumable sequence of one rank's micro-batches.

    Both the pretraining stream (`data.stream.TokenStream`) and the fine-tuning stream
    (`data.sft.SFTStream`) implement it; the trainer knows nothing else about its data.
    """

    def __iter__(self) -> Iterator[Batch]: ...

    @property
    def epoch(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...

    def phase(self) -> str | None:
        """The curriculum phase the next batch comes from, for a log line ("phase 2/3: web 30%,
        hq 70%"); None when the data has no phases."""
        ...

    def metrics(self) -> dict:
        """What the trainer logs about the data at each log step (e.g. the phase and its mix);
        may be empty."""
        ...


@dataclass(frozen=True)
class StreamLayout:
    """How one rank reads its data: the run's layout (the planner's batch split over the data-parallel
    replicas, `plan.layout.Layout`), which rank this is, and the rows' shape. The streams read the
    split from here and never work it out again."""

    seq_len: int
    layout: Layout  # the run's ranks and batch split, as planned
    rank: int = 0  # this process's rank (a row's context-parallel ranks read the same rows)
    seed: int = 0
    num_workers: int = 0  # DataLoader worker processes (training stream only)
    pin_memory: bool = False
    document_eos: int | None = None  # pretraining document masking: the end-of-text id that ends a document

    @property
    def micro_batch(self) -> int:
        """Samples per forward pass on this rank."""
        return self.layout.micro_batch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, all replicas together."""
        return self.layout.global_batch

    @property
    def replica(self) -> int:
        """Which data-parallel replica this rank reads for."""
        return self.layout.replica(self.rank)

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    def one_pass(self) -> "StreamLayout":
        """The layout of a held-out pass: one micro-batch per replica per 'step', no workers."""
        split = replace(self.layout, global_batch=self.layout.micro_batch * self.layout.replicas)
        return replace(self, layout=split, num_workers=0)


class EpochOrder:
    """Global sample k of a run over ``n`` rows is row ``perm_e[k mod n]`` of epoch ``e = k // n``: a
    permutation seeded by (seed, epoch), the same on every rank and on a resumed run. The fine-tuning
    rows and RL's prompts read their rows through it; the current epoch's permutation is kept."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def __call__(self, k: int) -> int:
        e = k // self.n
        if e != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000003 + e)
            self._epoch, self._perm = e, torch.randperm(self.n, generator=gen)
        return int(self._perm[k % self.n])


@dataclass
class EvalSet:
    """One held-out set: a name for its metrics and a way to make a fresh pass over it."""

    name: str  # metric prefix, e.g. "eval" or "eval/<dataset>"
    batches: Callable[[], Iterator[Batch]]  # a new iterator of at most eval.max_batches micro-batches
    bytes_per_token: float | None = None  # of the held-out text, for bits per byte (None: unknown)


@runtime_checkable
class TrainingData(Protocol):
    """Training data as the trainer sees it, whatever it came from.

    ``kind`` is ``"pretrain"`` (packed token streams, `data.stream.run_data.ResolvedData`), ``"sft"``
    (prompt/response rows, `data.sft.SFTData`) or ``"preference"`` (pairs,
    `data.preference.PreferenceData`): the trainer picks its objective by this declared kind
    (`train.objective`), never by what attributes an object happens to have.
    """

    kind: str
    tokenizer_path: str
    chat_template: str | None  # written with the exported tokenizer (fine-tuning), else None

    def train_stream(self, layout: StreamLayout) -> BatchStream: ...

    def eval_sets(self, layout: StreamLayout, max_batches: int) -> list[EvalSet]: ...
