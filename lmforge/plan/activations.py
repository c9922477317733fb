"""Activation memory, the torch-free part: the one reading of `compute.activation_checkpointing`,
`compute.activation_compression` and `compute.activation_offload` — what each block does with the
tensors it saves for backward. `distributed.parallelize` applies this reading and `plan.memory`
counts it; neither reads the settings on its own.

Per block (its index from 0), one of:

- **checkpointing** by granularity: ``block`` (the whole block recomputed in backward; its input
  kept), ``attention`` or ``mlp`` (that sublayer with its norms: its input kept, the other sublayer
  as without checkpointing), ``experts`` (an MoE block's expert MLPs: the rows sent to the experts
  kept, routing and attention as without), ``selective`` (matmul and attention outputs kept,
  element-wise ops recomputed), or none;
- **compression** ``fp8`` (e4m3) or ``int8``: every saved floating tensor of at least
  `MIN_ELEMENTS` elements whose last dimension is at least `MIN_ROW` wide and that is not a weight
  (a parameter, or a view or cast of one) is stored in one byte per element, with an fp32 scale per
  `SCALE_BLOCK` consecutive elements (``scale: block``) or per tensor (``scale: tensor``), and
  restored to its dtype when backward needs it. Smaller tensors (a norm's 1/rms, attention's
  log-sum-exp: per-token statistics), integer tensors (routing indices) and weights stay as they are.

``activation_offload`` (CUDA) moves what the blocks keep (compressed or not, the same tensors) to
pinned host memory as each block's forward ends, and brings a block's back during backward one block
ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.activations import CheckpointingSpec, CompressionSpec, Layers, parse_layers
from lmforge.errors import UserError

GRANULARITIES = ("block", "attention", "mlp", "experts", "selective")
COMPRESSIONS = ("fp8", "int8")
MIN_ELEMENTS = 4096  # a saved tensor with fewer elements is kept as it is (compression, offload)
MIN_ROW = 16  # nor one whose last dimension is narrower: per-token statistics
SCALE_BLOCK = 128  # consecutive elements that share one fp32 scale (scale: block)
SCALE_BYTES = 4
OFFLOAD_IN_FLIGHT = 2  # blocks whose saved tensors an offloading GPU holds: the one sent, the one fetched back

KEY = "compute.activation_checkpointing"
COMPRESSION_KEY = "compute.activation_compression"
OFFLOAD_KEY = "compute.activation_offload"


@dataclass(frozen=True)
class BlockPolicy:
    """What one block does with the tensors it saves for backward."""

    checkpointing: str | None = None  # a granularity, or None
    compression: str | None = None  # fp8 | int8, or None


@dataclass(frozen=True)
class ActivationPolicy:
    """Every block's `BlockPolicy`, the compression's scales and whether the saved tensors go to the host."""

    blocks: tuple[BlockPolicy, ...]
    scale: str = "block"
    offload: bool = False

    def checkpointed(self) -> dict[int, str]:
        """Block index → granularity, for the checkpointed blocks."""
        return {i: b.checkpointing for i, b in enumerate(self.blocks) if b.checkpointing}

    @property
    def saves_differently(self) -> bool:
        """Whether any saved tensor is stored otherwise than autograd keeps it (compressed or offloaded)."""
        return self.offload or any(b.compression for b in self.blocks)


def _spec(value) -> tuple[str | None, Layers | None]:
    """A `compute.activation_checkpointing` value → (granularity, layers); (None, None) for none.
    ``auto`` left unresolved (a model built outside a run) means none."""
    if value is False or value is None or value == "auto":
        return None, None
    if value is True or value == "full":
        return "block", Layers("all")
    if value == "selective":
        return "selective", Layers("all")
    if isinstance(value, (dict, CheckpointingSpec)):
        spec = value if isinstance(value, CheckpointingSpec) else CheckpointingSpec.model_validate(value)
        return spec.granularity, parse_layers(spec.layers)
    return "block", Layers("every", int(value))


def _compression(value) -> tuple[str | None, str, Layers | None]:
    """A `compute.activation_compression` value → (kind, scale, layers); kind None for off (or an
    unresolved auto)."""
    if value in (None, False, "off", "auto"):
        return None, "block", None
    if isinstance(value, str):
        return value, "block", Layers("all")
    spec = value if isinstance(value, CompressionSpec) else CompressionSpec.model_validate(value)
    return spec.kind, spec.scale, parse_layers(spec.layers)


def _blocks(layers: Layers, n_layers: int, key: str, integer_form: bool = False) -> list[int]:
    if integer_form:  # `activation_checkpointing: N` keeps its old reading: every N-th block, none past the depth
        return [i for i in range(n_layers) if (i + 1) % layers.a == 0]
    try:
        return layers.blocks(n_layers)
    except ValueError as e:
        raise UserError(f"{key}.layers: {e}") from None


def activation_policy(checkpointing=False, compression="off", offload=False, *, n_layers: int,
                      moe: bool = False) -> ActivationPolicy:
    """The one reading of the three settings for a model of ``n_layers`` blocks (``moe``: its blocks
    are mixture-of-experts). UserError, naming the key, for a ``layers`` form past the model's depth
    or experts checkpointing of a dense model."""
    granularity, layers = _spec(checkpointing)
    if granularity == "experts" and not moe:
        raise UserError(f"{KEY}.granularity: experts checkpoints the expert MLPs of mixture-of-experts blocks; "
                        "this model is dense (model.n_experts 0): use mlp")
    kind, scale, clayers = _compression(compression)
    every = isinstance(checkpointing, int) and not isinstance(checkpointing, bool)
    ckpt = set(_blocks(layers, n_layers, KEY, every)) if granularity else set()
    comp = set(_blocks(clayers, n_layers, COMPRESSION_KEY)) if kind else set()
    blocks = tuple(BlockPolicy(granularity if i in ckpt else None, kind if i in comp else None)
                   for i in range(n_layers))
    return ActivationPolicy(blocks, scale, bool(offload) and offload != "auto")


def checkpointing_setting(granularity: str | None, layers: str = "all"):
    """The simplest `compute.activation_checkpointing` value for ``granularity`` on ``layers``:
    false, full, selective, N (every N-th block) or {granularity, layers}."""
    if granularity is None:
        return False
    if layers == "all" and granularity in ("block", "selective"):
        return "full" if granularity == "block" else "selective"
    return {"granularity": granularity, "layers": layers}


def canonical_checkpointing(value):
    """A `compute.activation_checkpointing` value (any form) in its simplest JSON form (what a plan keeps)."""
    if isinstance(value, (dict, CheckpointingSpec)):
        granularity, layers = _spec(value)
        return checkpointing_setting(granularity, str(layers))
    return value


def canonical_compression(value):
    """A `compute.activation_compression` value in its simplest JSON form: off | fp8 | int8 | {kind, scale, layers}."""
    kind, scale, layers = _compression(value)
    if kind is None:
        return "off"
    if scale == "block" and str(layers) == "all":
        return kind
    return {"kind": kind, "scale": scale, "layers": str(layers)}


def checkpointing_words(value) -> str:
    """A `compute.activation_checkpointing` value in words: "full checkpointing", "mlp checkpointing
    of blocks range(2,6)", "no checkpointing"."""
    granularity, layers = _spec(value)
    if granularity is None:
        return "no checkpointing"
    if isinstance(value, int) and not isinstance(value, bool):
        n = int(value)
        return f"checkpointing every {n}{'nd' if n == 2 else 'rd' if n == 3 else 'th'} block"
    name = "full" if granularity == "block" else granularity
    return f"{name} checkpointing" + ("" if layers.kind == "all" else f" of {layers.words()}")


def compression_words(value) -> str | None:
    """A `compute.activation_compression` value in words, or None when off."""
    kind, scale, layers = _compression(value)
    if kind is None:
        return None
    return f"{kind} activations" + ("" if scale == "block" else " (one scale per tensor)") + \
        ("" if str(layers) == "all" else f" in {layers.words()}")


def activation_options(cfg, offload: bool = True) -> list[tuple]:
    """The ways of keeping a model's activations that `lmforge estimate` shows side by side, as
    (checkpointing, compression, offload) settings, least recompute first: none, each granularity
    over every block, then fp8 compression without and with full checkpointing, and (``offload``:
    CUDA) full checkpointing with fp8 compression offloaded."""
    grains = ["attention", "mlp"] + (["experts"] if cfg.is_moe else [])
    out = [(False, "off", False), ("selective", "off", False)]
    out += [(checkpointing_setting(g), "off", False) for g in grains]
    out += [("full", "off", False), (False, "fp8", False), ("full", "fp8", False)]
    return out + ([("full", "fp8", True)] if offload else [])


def option_words(checkpointing, compression, offload) -> str:
    """One way of keeping activations in words: "full checkpointing, fp8 activations, offloaded"."""
    parts = [checkpointing_words(checkpointing), compression_words(compression)]
    return ", ".join(p for p in parts if p) + (", offloaded to the host" if offload else "")


def for_slice(value, n_layers: int, slice_layers: int, key: str = "layers"):
    """A checkpointing or compression setting of a ``n_layers``-block model, for a slice of its first
    ``slice_layers`` blocks (the GPU probe's, `train.micro_batch`) with the same share of blocks: a
    ``layers`` form of N blocks of the model names round(N × slice / model) of the slice's (none: off)."""
    if not isinstance(value, (dict, CheckpointingSpec, CompressionSpec)) or slice_layers >= n_layers:
        return value
    spec = value.model_dump() if not isinstance(value, dict) else dict(value)
    layers = parse_layers(spec.get("layers", "all"))
    if layers.kind in ("all", "every"):
        return value
    named = len(layers.blocks(n_layers))
    share = round(named * slice_layers / n_layers)
    if share == 0:
        return False if "granularity" in spec or "kind" not in spec else "off"
    return spec | {key: f"first-{share}"}
