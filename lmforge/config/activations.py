"""The forms of the activation settings of `compute` (the mapping forms of
``activation_checkpointing`` and ``activation_compression``), and the one grammar of the blocks
they apply to (``layers``).

``layers`` names blocks by their 0-based index in the model:

- ``all``: every block;
- ``first-N`` / ``last-N``: the first / last N blocks;
- ``range(M,K)``: blocks M … K-1 (as Python's ``range``: ``range(2,6)`` is blocks 2, 3, 4 and 5);
- ``every-N``: every N-th block (blocks N-1, 2N-1, …; the integer form N of
  ``activation_checkpointing`` means the same).

The form is checked here, where a config is read; whether it fits the model's depth is checked
when the run is planned (`plan.activations`), where the depth is known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from lmforge.config.checked import Strict

LAYER_FORMS = "all, first-N, last-N, range(M,K) or every-N"
_FORM = re.compile(r"^(?:(all)|(first|last|every)-(\d+)|range\((\d+),(\d+)\))$")


@dataclass(frozen=True)
class Layers:
    """A parsed ``layers`` form: ``kind`` all | first | last | range | every, with its numbers."""

    kind: str
    a: int = 0
    b: int = 0

    def blocks(self, n_layers: int) -> list[int]:
        """The indices of the blocks this form names in a model of ``n_layers`` blocks; ValueError
        (one clause, no key) where it reaches past the model's depth."""
        if self.kind == "all":
            return list(range(n_layers))
        if self.kind == "every":
            if self.a > n_layers:
                raise ValueError(f"every-{self.a} names no block of a model of {n_layers} blocks")
            return [i for i in range(n_layers) if (i + 1) % self.a == 0]
        if self.kind == "range":
            if self.b > n_layers:
                raise ValueError(f"range({self.a},{self.b}) reaches block {self.b - 1}, past the model's "
                                 f"{n_layers} blocks (0 … {n_layers - 1})")
            return list(range(self.a, self.b))
        if self.a > n_layers:
            raise ValueError(f"{self.kind}-{self.a} asks for more blocks than the model's {n_layers}")
        return list(range(self.a)) if self.kind == "first" else list(range(n_layers - self.a, n_layers))

    def words(self) -> str:
        """The blocks in words: "the first 4 blocks", "blocks 2 to 5"."""
        if self.kind == "all":
            return "every block"
        if self.kind == "range":
            return f"blocks {self.a} to {self.b - 1}"
        if self.kind == "every":
            return f"every {self.a}{'nd' if self.a == 2 else 'rd' if self.a == 3 else 'th'} block"
        return f"the {self.kind} {self.a} block" + ("s" if self.a > 1 else "")

    def __str__(self) -> str:
        if self.kind == "all":
            return "all"
        return f"range({self.a},{self.b})" if self.kind == "range" else f"{self.kind}-{self.a}"


def parse_layers(text) -> Layers:
    """``layers`` → `Layers`; ValueError naming the forms for anything else."""
    m = _FORM.match(str(text).replace(" ", "")) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"expected {LAYER_FORMS}, got {text!r}")
    if m.group(1):
        return Layers("all")
    if m.group(2):
        n = int(m.group(3))
        if n < 1:
            raise ValueError(f"{m.group(2)}-{n}: N is a whole number above 0")
        return Layers(m.group(2), n)
    start, stop = int(m.group(4)), int(m.group(5))
    if start >= stop:
        raise ValueError(f"range({start},{stop}) is empty: M must be below K (blocks M … K-1)")
    return Layers("range", start, stop)


class CheckpointingSpec(Strict):
    """``compute.activation_checkpointing`` as a mapping: what is recomputed, in which blocks."""

    granularity: Literal["block", "attention", "mlp", "experts", "selective"] = Field(
        "block", description="block: the whole block; attention / mlp: that sublayer (with its norm); experts: "
        "an MoE block's expert MLPs; selective: the element-wise ops (matmul and attention outputs kept)")
    layers: str = Field("all", description=f"the blocks: {LAYER_FORMS} (0-based; range(M,K) is M … K-1)")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        return str(parse_layers(v))


class CompressionSpec(Strict):
    """``compute.activation_compression`` as a mapping: the format, its scales and the blocks."""

    kind: Literal["fp8", "int8"] = Field("fp8", description="fp8 (e4m3) or int8, one byte per element")
    scale: Literal["block", "tensor"] = Field(
        "block", description="block: one fp32 scale per 128 consecutive elements; tensor: one per tensor")
    layers: str = Field("all", description=f"the blocks: {LAYER_FORMS}")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        return str(parse_layers(v))
