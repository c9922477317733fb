"""Whether a plan fits in memory, and when it does not, the one line that says so and what makes it fit.

The verdict is the memory model's (`plan.memory.memory_plan`) for the run's own micro-batch,
checkpointing, context parallelism and sharding. The remedy is searched in the order of least
change: another context-parallel degree or checkpointing mode on the same GPUs (`plan.context`),
micro-batch 1, sharding the model states (fsdp), more GPUs, a shorter context. It is named in the
words of whoever reads it: config keys for `train` (and preflight, `--dry-run`), flags for
`lmforge estimate` — the same change either way.

On a CPU only a sure failure is refused: the trained model states of every rank in this machine's
memory (activations and the rest come on top, and a CPU run is no fit check for a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lmforge.config.counts import gb
from lmforge.config.model import ModelConfig
from lmforge.frozen import freeze
from lmforge.plan.activations import option_words
from lmforge.plan.context import checkpointing_mode, context_plan, min_gpus
from lmforge.plan.layout import Sharding
from lmforge.plan.memory import TRAINED_BYTES_PER_PARAM, usable_bytes

# How each setting is named: in a run config, or on `lmforge estimate`'s command line.
KEYS = {"context_parallel": "compute.context_parallel: {}", "checkpointing": "compute.activation_checkpointing: {}",
        "micro_batch": "parameters.micro_batch_size: {}", "data_parallel": "compute.data_parallel: {}"}
FLAGS = {"context_parallel": "--context-parallel {}", "checkpointing": "--activation-checkpointing {}",
         "micro_batch": "--micro-batch {}", "data_parallel": "--data-parallel {}"}
LORA_BYTES_PER_PARAM = 4  # a LoRA run's frozen fp32 base weights (the adapters are small)


@dataclass(frozen=True)
class Remedy:
    """What to change so that the run fits: settings (by name, see KEYS), or ``gpus``, or a shorter context."""

    settings: dict = field(default_factory=dict)
    gpus: int | None = None
    bytes_per_gpu: float | None = None
    shorter_context: bool = False

    def __post_init__(self):
        object.__setattr__(self, "settings", freeze(self.settings))

    def text(self, names: dict = KEYS) -> str:
        said = [names[k].format(_value(k, v)) for k, v in self.settings.items()]
        joined = (" " if names is FLAGS else ", ").join(said)
        if self.gpus:
            where = f"at least {self.gpus} GPUs" + (" (--gpus × --nodes)" if names is FLAGS else "")
            return f"use {where}" + (f" with {joined}" if said else "")
        if self.shorter_context:
            return "use a shorter " + ("--seq-len" if names is FLAGS else "parameters.context_length")
        verb = "use" if names is FLAGS else "set"
        return f"{verb} {joined}" + (f" ({gb(self.bytes_per_gpu)} per GPU)" if self.bytes_per_gpu else "")


def _value(key: str, v) -> str:
    if key == "checkpointing":
        return {"none": "false"}.get(v, str(v).lower())
    return str(v)


def remedy(model: ModelConfig, ctx: int, sharding: Sharding, gpu_memory: float, *, context_parallel: int,
           checkpointing, micro_batch: int, auto_checkpointing: bool = False) -> Remedy:
    """The least change that makes ``model`` fit (see the module docstring). ``auto_checkpointing``:
    the run chooses its checkpointing itself, so a change of mode is not named."""
    mode = checkpointing_mode(checkpointing)

    def changes(choice: dict, **more) -> dict:
        out = dict(more)
        if choice["context_parallel"] != context_parallel:
            out["context_parallel"] = choice["context_parallel"]
        if choice["checkpointing"] != mode and not auto_checkpointing:
            out["checkpointing"] = choice["checkpointing"]
        return out

    def first(plan: dict, cps=None) -> dict | None:
        """The first pair that fits (`plan.context`'s order), keeping the run's own mode where it can."""
        fit = [o for o in plan["options"] if o["fits"] and (cps is None or o["context_parallel"] in cps)]
        same = [o for o in fit if o["checkpointing"] == mode and not auto_checkpointing]
        return (same or fit or [None])[0]

    here = context_plan(model, ctx, sharding, gpu_memory, micro_batch=micro_batch)
    for mb in [micro_batch] + list(range(micro_batch - 1, 0, -1)):  # this degree: another mode, then fewer rows
        at_mb = here if mb == micro_batch else context_plan(model, ctx, sharding, gpu_memory, micro_batch=mb)
        if (choice := first(at_mb, (context_parallel,))) is not None:
            return Remedy(changes(choice, **({"micro_batch": mb} if mb != micro_batch else {})),
                          bytes_per_gpu=choice["bytes_per_gpu"])
    one = {"micro_batch": 1} if micro_batch > 1 else {}
    for plan, more in ((here, {}), (context_plan(model, ctx, sharding, gpu_memory), one)):  # another degree
        if (choice := first(plan)) is not None:
            return Remedy(changes(choice, **more), bytes_per_gpu=choice["bytes_per_gpu"])
    if sharding.data_parallel != "fsdp":
        sharded = replace(sharding, data_parallel="fsdp", shard_size=None)
        if (choice := first(context_plan(model, ctx, sharded, gpu_memory))) is not None:
            return Remedy(changes(choice, data_parallel="fsdp", **one), bytes_per_gpu=choice["bytes_per_gpu"])
    more = min_gpus(model, ctx, sharding, usable_bytes(gpu_memory))
    if more is None:
        return Remedy(shorter_context=True)
    gpus, cp = more
    settings = dict(one) | ({"data_parallel": "fsdp"} if sharding.data_parallel != "fsdp" else {})
    settings |= changes({"context_parallel": cp, "checkpointing": "full"})
    return Remedy(settings, gpus=gpus)


def does_not_fit_line(model: ModelConfig, memory: dict, where: str, fix: Remedy, names: dict = KEYS) -> str:
    """The one line of a GPU plan that does not fit: what it needs, of what, and the remedy."""
    act = memory["activation_bytes_per_sample"]
    mb = memory["micro_batch"] or 1
    chosen = act["chosen"]
    cp = memory["context_parallel"]
    row = f"{memory['seq_len']} tokens per row" + (f" ({memory['seq_len'] // cp} per GPU)" if cp > 1 else "")
    label = option_words(memory["activation_checkpointing"], memory["activation_compression"],
                         memory["activation_offload"])
    return (f"{model.label()} does not fit on {where} under {memory['data_parallel']} at micro-batch {mb}, {row}, "
            f"with {label}: {gb(memory['total_bytes_per_gpu'])} per GPU (model states "
            f"{gb(memory['states_bytes_per_gpu'])}, activations {gb(mb * chosen)}), "
            f"{gb(memory['usable_bytes'])} usable; {fix.text(names)}")


def host_verdict(total_params: float, ranks: int, sharded: bool, host_memory: float, lora: bool) -> dict:
    """A CPU plan's verdict: the trained states every rank keeps, in this machine's memory."""
    per_param = LORA_BYTES_PER_PARAM if lora else TRAINED_BYTES_PER_PARAM
    need = total_params * per_param * (1 if sharded else ranks)  # ranks share this machine's memory
    return {"need_bytes": need, "host_bytes": host_memory, "fits": need <= host_memory,
            "what": "frozen weights (lora)" if lora else "weights, gradients and AdamW states"}


def host_line(total_params: float, verdict: dict, sharded: bool) -> str:
    """The one line of a CPU plan whose model states alone exceed the machine's memory."""
    return (f"model does not fit: {total_params:,.0f} parameters need {gb(verdict['need_bytes'])} for "
            f"{verdict['what']} alone, more than this machine's memory ({gb(verdict['host_bytes'])}); use a smaller "
            "model" + ("" if sharded else " or compute.data_parallel: fsdp") +
            " (`lmforge train --dry-run` shows the full estimate)")

