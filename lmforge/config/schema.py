"""The run config: one pydantic schema, the single source of defaults.

Top-level keys follow the managed pretraining API (``model``, ``train_data``,
``save_folder``, ``training_duration``) plus what training-stack users expect
(``parameters``, ``compute``, ``eval``, ``experiment_tracker``). Values left as ``None``
or ``"auto"`` are filled from the model size and the machine by ``lmforge.config.defaults``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, field_validator, model_validator

from lmforge.config.activations import CheckpointingSpec, CompressionSpec
from lmforge.config.checked import Strict
from lmforge.config.curation import CurateConfig
from lmforge.config.limits import (MAX_BATCH_TOKENS, MAX_GRAD_CLIP, MAX_GROUP_SIZE, MAX_LEARNING_RATE, MAX_NAME,
                                    MAX_NEW_TOKENS, MAX_NODES, MAX_PRICE_PER_HOUR, MAX_RANKS, MAX_RETRIES, MAX_SEED,
                                    MAX_SEQ_LEN, MAX_UPDATES_PER_BATCH, MAX_VOCAB, MAX_WEIGHT_DECAY)
from lmforge.config.durations import Duration, parse_duration
from lmforge.config.goodput import GoodputConfig
from lmforge.config.model import ModelConfig, resolve_model
from lmforge.config.storage import ObjectStoreConfig, SecretsConfig
from lmforge.config.tracking import TrackerConfig
from lmforge.errors import UserError

HANG_TIMEOUT_MIN_S = 5.0  # shorter timeouts fire on ordinary pauses (GC, a slow read)
HANG_TIMEOUT_MAX_S = 7 * 86400.0


_Strict = Strict  # unknown keys, booleans as numbers and inf/nan refused (`config.checked`)


# Durations are written and shown as strings ("500ba"), parsed into Duration objects.
DurationField = Annotated[Duration, BeforeValidator(parse_duration), PlainSerializer(str, return_type=str)]
# A warmup may be none at all ('0ba'): the LR starts at its peak.
WarmupField = Annotated[Duration, BeforeValidator(lambda v: parse_duration(v, "warmup", allow_zero=True)),
                        PlainSerializer(str, return_type=str)]


class DatasetEntry(_Strict):
    name: str | None = Field(None, description="name in a mix; default: the mapping key, or d0, d1, ...")
    path: str = Field(..., description="prepared MDS dataset, or raw text (files, globs, URIs, builtin:python-stdlib)")
    proportion: float | None = Field(None, gt=0, description="share of this dataset in the mix; default: by size")
    text_field: str = Field("text", description="JSON field / parquet column holding the text (raw inputs)")
    curate: CurateConfig | None = Field(
        None, description="raw inputs: dedup / filters / decontaminate on the way in (see docs/curation.md)")


class Phase(_Strict):
    """One phase of a curriculum: a mix that holds until a point of the run."""

    until: str | None = Field(None, description="end of the phase: a duration ('20B tok', '500ba', '1M sp') or "
                              "a fraction of the run ('0.8', '80%'); the last phase runs to the end")
    mix: dict[str, float | None] = Field(..., description="dataset name → proportion (none given: by size)")

    @field_validator("until", mode="before")
    @classmethod
    def _until(cls, v):
        if v is None:
            return None
        if isinstance(v, bool):
            raise ValueError("expected a duration like '20B tok' or a fraction of the run like 0.8 or '80%'")
        if isinstance(v, (int, float)):
            v = str(v)
        phase_end(v)  # raises ValueError with the expected forms
        return str(v).strip()

    @field_validator("mix")
    @classmethod
    def _mix(cls, v):
        if not v:
            raise ValueError("a phase needs at least one dataset")
        given = [p is not None for p in v.values()]
        if any(given) and not all(given):
            raise ValueError("give a proportion for every dataset of the phase or none")
        for name, p in v.items():
            if p is not None and not p > 0:
                raise ValueError(f"proportion of {name!r} must be > 0, got {p}")
        return v


_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?):([0-9]{1,5})$")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (a name, an IPv4 address or a bracketed IPv6 one) → (host, port). Raises ValueError."""
    m = _ENDPOINT.match(str(text).strip())
    if not m or not 0 < int(m.group(3)) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. node0.cluster:29500, 10.0.0.1:29500 or [fd00::1]:29500)")
    return m.group(1).strip("[]"), int(m.group(3))


def check_run_name(name: str) -> None:
    """A run name becomes a folder (runs/<name>), a registry key and a rendezvous id: it must name one
    thing, not a path. Raises ValueError."""
    if not name.strip():
        raise ValueError("a run name cannot be empty; leave `name` out for the config file's name")
    bad = next((c for c in name if c in "/\\" or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"{name!r} holds {bad!r}; a run name is one word of letters, digits, '.', '_' or '-' "
                         "(save_folder sets where it is written)")
    if len(name) > MAX_NAME:
        raise ValueError(f"a run name of {len(name)} characters is too long (at most {MAX_NAME}): it names a "
                         "folder, a registry entry and a rendezvous")
    if name in (".", "..") or name != name.strip():
        raise ValueError(f"{name!r} is not a usable run name (a path, or spaces at its ends)")


def phase_end(text: str) -> tuple[str, float]:
    """A phase end point: ('frac', f) with 0 < f <= 1, or (unit, value) of a step-countable duration."""
    t = str(text).strip()
    try:
        f = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        f = None
    if f is not None:
        if not 0 < f <= 1:
            raise ValueError(f"a fraction of the run must be in (0, 1], got {text!r}")
        return "frac", f
    d = parse_duration(t, "phase end")
    if d.unit not in ("tok", "ba", "sp"):
        raise ValueError(f"a phase ends after tokens, steps or samples ('20B tok', '500ba', '1M sp') "
                         f"or at a fraction of the run, not {text!r}")
    return d.unit, d.value


class TokenizerTrain(_Strict):
    vocab_size: int | Literal["auto"] = Field(
        "auto", description="vocabulary size of the BPE to train; auto: from the model width and the data size "
        "(chosen with the shape under model: auto)")

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v):
        if isinstance(v, int) and not 64 <= v <= MAX_VOCAB:
            raise ValueError(f"must be at least 64 (and at most {MAX_VOCAB}) or 'auto'")
        return v
    bos: bool = Field(False, description="also add a beginning-of-text token")


class TokenizerExtend(_Strict):
    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="vocabulary size after extension (more than the base tokenizer's)")
    base: str | None = Field(None, description="tokenizer folder to extend; default: the one with custom_weights_path")


class TokenizerSpec(_Strict):
    train: TokenizerTrain | None = Field(None, description="train a byte-level BPE on the training data")
    extend: TokenizerExtend | None = Field(
        None, description="continued pretraining: add BPE merges learned on the training data to the model's "
        "tokenizer; new embedding rows start as the mean of their old pieces")

    @model_validator(mode="after")
    def _one(self):
        if (self.train is None) == (self.extend is None):
            raise ValueError("give exactly one of train: {vocab_size: N} or extend: {vocab_size: N}")
        return self


class EvalConfig(_Strict):
    data_path: str | None = Field(None, description="held-out data; default: the val split of the training data")
    holdout_fraction: float = Field(
        0.01, ge=0, lt=1, description="share of raw-text documents held out for eval when lmforge prepares the data; "
        "too few documents for one held-out sample (one .txt file): that share of the packed tokens, from the end")
    interval: DurationField | None = Field(None, description="how often to evaluate, e.g. '500ba' or '1M tok'; default: up to "
                                           "10 evals per run, as many as fit in 10% of its planned time (the final one always)")
    max_batches: int | None = Field(None, gt=0, le=1 << 30, description="held-out micro-batches per rank and evaluation; "
                                    "default: 20, fewer where one evaluation would take more than 10% of the run's time")
    prompts: tuple[str, ...] = Field((), description="prompts to generate from at each evaluation")
    max_new_tokens: int = Field(64, gt=0, le=MAX_NEW_TOKENS, description="tokens generated per prompt")
    temperature: float = Field(0.8, ge=0, le=100, description="sampling temperature for prompts (0 = greedy)")
    top_k: int | None = Field(50, gt=0, le=MAX_VOCAB, description="sample from the k most likely tokens")
    top_p: float | None = Field(0.95, gt=0, le=1, description="nucleus sampling threshold")
    icl_tasks: str | tuple[dict, ...] | None = Field(None, description="ICL task YAML (or a list of tasks)")
    gauntlet: str | None = Field(None, description="gauntlet YAML grouping the ICL tasks")
    icl_interval: DurationField | None = Field(None, description="how often to run ICL tasks; default: at the end only")
    icl_limit: int | None = Field(None, gt=0, description="examples per ICL task (None = all)")
    data_root: str | None = Field(None, description="folder that relative ICL dataset paths resolve against")



class Parameters(_Strict):
    learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE, description="peak LR; default from model size")
    context_length: int | None = Field(None, gt=1, le=MAX_SEQ_LEN, description="tokens per training sample; prepared samples "
                                       "longer than this are split into pieces of it, all trained; default: model "
                                       "max_seq_len, at most the prepared samples' length")
    global_batch_size: int | str | None = Field(
        None, description="samples per optimizer step across all ranks, or tokens ('1M tok'); default from model size, smaller "
        "for a short run (at least 1000 steps)")
    micro_batch_size: int | Literal["auto"] = Field("auto", description="samples per forward pass per rank")
    # [recipe] schedule and optimizer (lmforge/train/optim.py; defaults from bench/sweep.py)
    warmup: WarmupField | None = Field(
        None, description="LR warmup, e.g. '100ba', '10M tok' or '5s' ('0ba': none); default: 5% of the run in its "
        "own unit (seconds for a wall-clock run)")
    schedule: Literal["wsd", "cosine", "linear", "constant"] = Field(
        "wsd", description="LR shape after warmup: wsd (stable, then decay over the last decay_fraction), "
        "cosine, linear, constant")
    decay_fraction: float = Field(0.2, gt=0, lt=1, description="wsd: share of the run spent decaying the LR")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final LR as a fraction of the peak (wsd/cosine/linear)")
    optimizer: Literal["auto", "adamw", "muon"] = Field(
        "auto", description="adamw, or muon for the blocks' weight matrices (each expert's separately; AdamW "
        "for embeddings, head, norms, biases, MoE routers; update RMS matched to AdamW's: 0.2·√max(rows, cols), "
        "Liu et al. 2025); auto: muon for a model trained from scratch with ≤5M non-embedding parameters "
        "(where the sweep measured it to win), else adamw")
    weight_decay: float = Field(0.1, ge=0, le=MAX_WEIGHT_DECAY, description="decoupled weight decay (matrices only)")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon: Nesterov momentum of the matrices' updates")
    muon_weight_decay: float | None = Field(
        None, ge=0, le=MAX_WEIGHT_DECAY, description="muon: decoupled weight decay of the Muon matrices; default: weight_decay")
    # [/recipe]
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon")
    grad_clip: float | None = Field(1.0, gt=0, le=MAX_GRAD_CLIP, description="max global grad norm; null to turn off")
    precision: Literal["auto", "bf16", "fp32", "fp8"] = Field(
        "auto", description="bf16 autocast where the hardware runs it fast (GPUs with bf16, CPUs with AMX), else "
        "fp32; fp8: FP8 matmuls in the linear layers (torchao, lmforge[gpu]; GPUs of compute capability 8.9+), "
        "bf16 elsewhere")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="precision fp8: one scale per tensor (fastest; FP8 all-gather under FSDP) or "
        "per row (more accurate)")
    fp8_skip_small: bool = Field(
        True, description="precision fp8: keep linear layers too small to gain from FP8 in bf16 (torchao's H100 "
        "thresholds on in/out features); false: every layer FP8 can take")
    fp8_experts: bool = Field(
        False, description="precision fp8, MoE models on H100-class GPUs (sm90): the experts' grouped GEMMs in FP8 "
        "too (rowwise scales, torchao's prototype; each expert's rows padded to 16)")
    document_masking: bool = Field(
        False, description="pretraining: a token attends only to earlier tokens of its own document (documents "
        "end at the tokenizer's end-of-text token in the packed samples); fine-tuning rows always are")
    seed: int = Field(17, ge=0, le=MAX_SEED, description="seed for init, data order and sampling")


    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        for i, b in enumerate(v):
            if not 0 <= b < 1:  # torch's rule, checked before the run starts
                raise ValueError(f"betas[{i}] is {b:g}; each AdamW beta is in [0, 1), e.g. [0.9, 0.95]")
        return v

    @field_validator("global_batch_size")
    @classmethod
    def _gbs(cls, v):
        if isinstance(v, str):
            d = parse_duration(v, "global_batch_size")
            if d.unit not in ("tok", "sp"):
                raise ValueError("expected samples (an integer) or tokens like '1M tok'")
            if d.value > MAX_BATCH_TOKENS:  # as samples or tokens: no step of it would ever be taken
                raise ValueError(f"{v!r} is too large for one optimizer step (at most {MAX_BATCH_TOKENS:.0e})")
            return str(d)
        if v is not None and not 0 < v <= MAX_BATCH_TOKENS:
            raise ValueError(f"must be positive and at most {MAX_BATCH_TOKENS:.0e} samples")
        return v

    @field_validator("micro_batch_size")
    @classmethod
    def _mbs(cls, v):
        if isinstance(v, int) and not 0 < v <= MAX_BATCH_TOKENS:
            raise ValueError("must be a positive integer or 'auto'")
        return v

    @model_validator(mode="after")
    def _fp8_options(self):
        if self.fp8_experts and self.precision != "fp8":
            raise ValueError(f"fp8_experts: true needs precision: fp8 (got {self.precision})")
        return self


class ComputeConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where to train")
    gpus: int | Literal["auto"] = Field("auto", description="GPUs per node to use (at least 1)")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    ranks: int | None = Field(None, ge=1, le=1024, description="CPU only: run N gloo ranks (for tests / no-GPU users)")
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp", "none"] = Field(
        "auto", description="how ranks share the model: ddp (a whole copy on each), fsdp (states sharded over every "
        "rank), hsdp (over a node's ranks, copies across nodes), none; auto: none on one device, ddp on CPU ranks or "
        "where a whole copy fits each GPU, else hsdp on several nodes where a node holds a copy, else fsdp")
    # --- scale-out (lmforge.distributed; see docs/scale-out.md)
    shard_size: int | None = Field(None, ge=1, le=MAX_RANKS, description="hsdp: ranks per shard group (default: ranks per node)")
    expert_parallel: int = Field(
        1, ge=1, le=MAX_RANKS, description="MoE, fsdp/hsdp: split each layer's experts over N ranks (E/N each), tokens sent to "
        "them by all-to-all; N divides n_experts and the ranks of a shard group")
    context_parallel: int = Field(
        1, ge=1, le=MAX_RANKS, description="split every row's tokens over N ranks (long context; causal load balancing: rank r "
        "holds chunks r and 2N-1-r of 2N); N divides the ranks (of a shard group, hsdp) and the context length in "
        "2N chunks; CUDA: torch's ring attention, plain causal rows only (docs/long-context.md)")
    reshard_after_forward: bool = Field(
        True, description="fsdp/hsdp: free gathered weights after forward (less memory, one more all-gather)")
    node_rank: int = Field(0, ge=0, lt=MAX_NODES, description="multi-node: this node's index (0 … nodes-1)")
    rdzv_endpoint: str | None = Field(None, description="multi-node: HOST:PORT of the torchrun c10d rendezvous")
    rdzv_timeout_s: int = Field(300, gt=0, le=7 * 86400, description="multi-node: seconds to wait for every node to join")
    activation_checkpointing: bool | Literal["auto", "full", "selective"] | int | CheckpointingSpec = Field(
        "auto", description="recompute activations in backward: true/full (every block), selective (keep matmul "
        "outputs, recompute the rest), N (every N-th block), false, or {granularity, layers}; auto: on GPUs chosen "
        "with micro_batch_size auto for the most tokens/s that fit (`lmforge estimate --micro-batch auto` shows "
        "it), else false")
    activation_compression: Literal["off", "auto", "fp8", "int8"] | CompressionSpec = Field(
        "off", description="store the activations blocks save for backward in one byte per element (fp8 or int8 "
        "with fp32 scales per 128 elements; {kind, scale, layers} to choose); auto: on GPUs the planner may choose "
        "it with activation_checkpointing auto (docs/activation-memory.md)")
    activation_offload: bool | Literal["auto"] = Field(
        False, description="CUDA: move the activations blocks save for backward to pinned host memory, fetched "
        "back for backward (unmeasured); auto: on GPUs the planner may choose it")
    async_checkpoint: bool = Field(True, description="write checkpoints in the background while training continues")
    # --- end scale-out
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each transformer block and the norm + head + loss; auto: on CUDA")
    loss_kernel: Literal["auto", "chunked", "liger"] = Field(
        "auto", description="output head + cross-entropy without whole logits: liger-kernel's fused kernel (CUDA, "
        "lmforge[gpu]) or lmforge's chunked one; auto: liger where installed on CUDA, else chunked")
    num_workers: int = Field(0, ge=0, le=1024, description="DataLoader worker processes per rank")
    hang_timeout: float | None = Field(
        None, description="seconds (or '10min') without a completed training step before every rank dumps its "
        "stacks and the run restarts; default: 20× the median step time, at least 5 minutes")

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _hang_timeout(cls, v):
        if isinstance(v, str):
            d = parse_duration(v, "hang_timeout")
            if d.unit != "s":
                raise ValueError(f"expected seconds or a wall-clock duration like '90s' or '10min', got {v!r}")
            v = d.value
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < HANG_TIMEOUT_MIN_S:
            raise ValueError(f"{v:g}s is below the floor of {HANG_TIMEOUT_MIN_S:g}s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > HANG_TIMEOUT_MAX_S:
            raise ValueError(f"{v:g}s is above {HANG_TIMEOUT_MAX_S:g}s (a week); leave it out for the default")
        return v
    price_per_gpu_hour: float | None = Field(
        None, ge=0, le=MAX_PRICE_PER_HOUR, description="price of one device (GPU, or CPU rank) per hour: the progress line, `runs describe` "
        "and the report show the cost so far and the estimated cost to finish")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v):
        if v is not None:
            parse_endpoint(v)
        return v

    def check_nodes(self) -> None:
        """Several nodes need the rendezvous of node 0 and a node rank below their count. Not a
        validator: `lmforge launch` checks a config for N nodes whose endpoint the job sets later.
        Raises UserError."""
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise UserError(f"compute.nodes: {self.nodes} nodes need compute.rdzv_endpoint (HOST:PORT of node 0), "
                            "e.g. --rdzv-endpoint node0:29500")
        if self.node_rank >= self.nodes:
            raise UserError(f"compute.node_rank: {self.node_rank} is not below compute.nodes ({self.nodes})")

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v):
        if isinstance(v, int) and not 1 <= v <= MAX_RANKS:
            raise ValueError("expected auto or a whole number of GPUs, at least 1 (on a CPU: compute.ranks)")
        return v

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _ac_word(cls, v):
        word = isinstance(v, str) and (v in ("auto", "full", "selective", "true", "false") or v.isdigit())
        if not (word or isinstance(v, (int, dict, CheckpointingSpec))):
            raise ValueError(f"expected auto, false, true, full, selective, a positive integer N (every N-th block) "
                             f"or {{granularity, layers}}, got {v!r}")
        return v

    @field_validator("activation_compression", mode="before")
    @classmethod
    def _compression_word(cls, v):
        if not (v in ("off", "auto", "fp8", "int8") if isinstance(v, str) else isinstance(v, (dict, CompressionSpec))):
            raise ValueError(f"expected off, auto, fp8, int8 or {{kind, scale, layers}}, got {v!r}")
        return v

    @field_validator("activation_checkpointing")
    @classmethod
    def _ac(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError("expected auto, false, true, full, selective, a positive integer N (every N-th block) "
                             "or {granularity, layers}")
        return v


# The projections LoRA can target, by their Hugging Face / PEFT names (attention, then MLP).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(_Strict):
    """Low-rank adapters on a frozen base model (lmforge/models/lora.py). Defaults: README,
    "Where the defaults come from" (all seven projections at rank 4: < 2% of llama-tiny)."""
    rank: int = Field(4, gt=0, le=1 << 16, description="rank r of each adapter")
    alpha: float = Field(16.0, gt=0, le=1e6, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter's input")
    targets: tuple[str, ...] = Field(tuple(LORA_TARGETS),
                               description="projections to adapt: " + ", ".join(LORA_TARGETS))

    @field_validator("targets")
    @classmethod
    def _targets(cls, v):
        if not v:
            raise ValueError("at least one target is needed")
        for t in v:
            if t not in LORA_TARGETS:
                raise ValueError(f"unknown target {t!r}; expected some of {', '.join(LORA_TARGETS)}")
        return list(dict.fromkeys(v))


class SFTOptions(_Strict):
    """Supervised fine-tuning data handling (task_type instruction_finetune / chat_completion)."""
    packing: bool = Field(True, description="pack several examples per row (attention kept within each); "
                          "false: one example per row, padded")


# Task types `lmforge finetune` runs on JSONL rows (the others pretrain on text or prepared data).
PREFERENCE_TASK = "preference"  # pairs of a chosen and a rejected response (lmforge/data/rows/preference.py)
RL_TASK = "rl"  # prompts whose sampled completions are scored by rewards (lmforge/data/rows/rl.py, lmforge/train/rl.py)
FINETUNE_TASKS = ("instruction_finetune", "chat_completion", PREFERENCE_TASK, RL_TASK)

# [preference] preference tuning after SFT (lmforge/data/rows/preference.py, lmforge/models/preference_loss.py)
PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # losses without a reference model
# β by loss: DPO and IPO 0.1 (the DPO paper's and TRL's; IPO's τ), SimPO 2.0 with a margin γ of 1.0
# (the SimPO paper's β 2–2.5 with γ/β ≈ 0.5), ORPO's λ 0.1 (the ORPO paper's, for Llama 2 and Phi-2).
PREFERENCE_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
SIMPO_GAMMA = 1.0


class PreferenceOptions(_Strict):
    """Preference tuning (task_type preference): which loss, its strength and its reference model."""
    loss: Literal["dpo", "ipo", "simpo", "orpo"] = Field(
        "dpo", description="dpo (Rafailov et al. 2023), ipo (Azar et al. 2023, on per-token mean log-ratios), "
        "simpo (Meng et al. 2024: reference-free, length-normalized, with a margin), orpo (Hong et al. 2024: "
        "reference-free, the chosen answer's NLL plus an odds-ratio term)")
    beta: float | None = Field(
        None, gt=0, le=1e3, description="dpo: β, the strength of the pull toward the reference (0.1); ipo: τ (0.1); "
        "simpo: β (2.0); orpo: λ, the weight of the odds-ratio term (0.1)")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="dpo: the probability that a pair's label is flipped (conservative DPO); "
        "0 = plain DPO")
    gamma: float | None = Field(None, ge=0, le=1e3, description="simpo: the target reward margin γ (1.0)")
    reference: Literal["precomputed", "live"] | None = Field(
        None, description="dpo/ipo: the reference model's log-probs: precomputed (once, before the first step, "
        "from the starting weights; stored in save_folder as reference-logps.safetensors) or live (the base "
        "with its LoRA adapters off, at every step; needs lora:); default: live with lora:, else precomputed. "
        "simpo/orpo have no reference")

    @model_validator(mode="after")
    def _fits_loss(self):
        if self.loss in REFERENCE_FREE and self.reference is not None:
            raise ValueError(f"reference: {self.loss} is reference-free; leave preference.reference out "
                             "(or use loss dpo or ipo)")
        if self.label_smoothing and self.loss != "dpo":
            raise ValueError(f"label_smoothing: applies to loss dpo only, not {self.loss}")
        if self.gamma is not None and self.loss != "simpo":
            raise ValueError(f"gamma: applies to loss simpo only, not {self.loss}")
        return self

    def resolved(self, lora: bool) -> "PreferenceOptions":
        """Every default written in: β by loss, SimPO's γ, and the reference of DPO/IPO — with LoRA
        the base with its adapters off (no precomputation, nothing stored), else precomputed."""
        update = {"beta": PREFERENCE_BETA[self.loss] if self.beta is None else self.beta}
        if self.loss == "simpo":
            update["gamma"] = SIMPO_GAMMA if self.gamma is None else self.gamma
        if self.loss not in REFERENCE_FREE:
            update["reference"] = self.reference or ("live" if lora else "precomputed")
        return self.model_copy(update=update)
# [/preference]


class LocalCheckpoints(_Strict):
    """A fast checkpoint tier on node-local storage beside the durable ``save_folder`` (docs/goodput.md):
    frequent checkpoints there, fewer in the save folder; a resume takes the newest intact checkpoint
    of either that every rank can read."""

    folder: str = Field(..., description="this run's folder on fast local storage (an NVMe drive, /dev/shm); "
                        "every rank must read it at a resume (one node, or a shared fast tier), else the "
                        "run resumes from save_folder")
    interval: DurationField | Literal["auto"] = Field(
        "auto", description="checkpoint here every …; auto: the interval that maximises goodput for this "
        "tier's cost (plan.goodput), re-estimated from the run's own checkpoint times")
    keep: int = Field(2, ge=1, le=1 << 20, description="local checkpoints kept (older ones are deleted)")

    @field_validator("folder")
    @classmethod
    def _folder(cls, v):
        if not v.strip() or "://" in v:
            raise ValueError(f"expected a local folder (a path on this machine), got {v!r}")
        return v

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, v):
        return v if v == "auto" else parse_duration(v, "local_checkpoints.interval")


# [rl] reinforcement learning from rewards (lmforge/train/rl.py, lmforge/models/policy_loss.py, lmforge/rewards/)
RL_LOSSES = ("dapo", "grpo", "dr_grpo", "gspo")
BUILTIN_REWARDS = ("exact_match", "math", "format")
# A user's reward: a Python file and a function in it, TRL's signature (lmforge/rewards/functions.py).
USER_REWARD = re.compile(r"^(?P<path>.+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
# rl.clip by loss: DAPO's "clip-higher" [0.2, 0.28] (Yu et al. 2025) for the token-level ratios; GSPO's
# sequence-level ratio (a geometric mean of token ratios) moves far less: [3e-4, 4e-4] (Zheng et al. 2025).
RL_CLIP = {"dapo": (0.2, 0.28), "grpo": (0.2, 0.28), "dr_grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


class RLOptions(_Strict):
    """Reinforcement learning from rewards (task_type rl): rewards, rollouts and the policy loss (docs/rl.md)."""
    reward: tuple[str, ...] = Field(
        (), description="reward functions, summed (weighted): exact_match (the completion equals "
        "the row's `answer`), math (the final answer — \\boxed{}, '#### n' or the last number — equals the row's "
        "`answer` as a number), format (rl.format_regex found in the completion), or path/to/file.py:function "
        "(TRL's signature: prompts, completions, the row's columns as keyword arguments → a list of floats, "
        "None for not applicable)")
    reward_weights: tuple[float, ...] | None = Field(None, description="one weight per reward; default: 1 each")
    format_regex: str | None = Field(None, description="the regular expression the format reward searches the "
                                     "completion for (re.search, dot matches newlines)")
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE, description="completions sampled per prompt (the group "
                            "whose rewards are compared)")
    max_new_tokens: int = Field(256, gt=0, le=MAX_NEW_TOKENS, description="tokens a completion may have; one cut "
                                "there is counted as truncated")
    temperature: float = Field(1.0, gt=0, le=100, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold of the rollouts (1: off)")
    stop: tuple[str, ...] = Field((), description="strings that end a completion (kept in its tokens, "
                            "left out of the text the rewards see), besides the end-of-text token")
    engine: Literal["native", "vllm"] = Field(
        "native", description="who samples: native (lmforge's batched sampler with a KV cache, every device) or "
        "vllm (CUDA and the vllm extra; not available in this version: refused with a line)")
    loss: Literal["dapo", "grpo", "dr_grpo", "gspo"] = Field(
        "dapo", description="dapo (token-level mean over the batch; Yu et al. 2025), grpo (each completion's token "
        "mean, then the mean; Shao et al. 2024), dr_grpo (token sum over group_size·max_new_tokens per prompt; "
        "Liu et al. 2025), gspo (sequence-level ratio: the geometric mean of the token ratios; Zheng et al. 2025)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages are rewards minus their group's mean, divided by the group's standard "
        "deviation (group), the whole batch's (batch) or nothing (none: Dr. GRPO)")
    clip: tuple[float, float] | None = Field(
        None, description="[low, high]: the ratio is clipped to [1 − low, 1 + high]; default [0.2, 0.28] "
        "(DAPO's clip-higher), gspo [3e-4, 4e-4]")
    updates_per_batch: int = Field(1, ge=1, le=MAX_UPDATES_PER_BATCH, description="optimizer updates on each batch "
                                   "of completions (GRPO's μ); with 1 the ratio is 1 and clipping never acts")
    kl: float = Field(0.0, ge=0, le=1e3, description="β of a KL penalty to the starting weights (the k3 "
                      "estimator); 0: none, no reference model")
    resample_flat_groups: int = Field(0, ge=0, le=16, description="groups whose rewards are all equal (no "
                                      "learning signal) are sampled again up to N times; 0: only counted")
    mask_truncated: bool = Field(False, description="completions cut at max_new_tokens are left out of the loss "
                                 "(DAPO's overlong filtering); else only counted")

    @field_validator("reward")
    @classmethod
    def _reward(cls, v):
        for name in v:
            if name not in BUILTIN_REWARDS and not USER_REWARD.match(name):
                raise ValueError(f"{name!r} is not a reward; expected {', '.join(BUILTIN_REWARDS)} or "
                                 "path/to/file.py:function")
        if len(set(v)) != len(v):
            raise ValueError("a reward is listed twice; each is scored and logged once")
        return v

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, v):
        if v is not None and any(abs(w) > 1e6 for w in v):
            raise ValueError("a weight is beyond ±1e6")
        return v

    @field_validator("format_regex")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"{v!r} is not a regular expression ({e})") from None
        return v

    @field_validator("clip")
    @classmethod
    def _clip(cls, v):
        if v is not None and not (0 <= v[0] < 1 and 0 <= v[1] <= 10):
            raise ValueError(f"expected [low, high] with 0 ≤ low < 1 and 0 ≤ high ≤ 10 (the ratio is kept in "
                             f"[1 − low, 1 + high]), got {list(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if any(not s for s in v):
            raise ValueError("a stop string is empty")
        if len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"{len(self.reward_weights)} rl.reward_weights for {len(self.reward)} reward(s) in "
                             "rl.reward; give one weight per reward")
        if "format" in self.reward and self.format_regex is None:
            raise ValueError("the format reward needs rl.format_regex (the pattern the completion must contain)")
        if self.format_regex is not None and "format" not in self.reward:
            raise ValueError("rl.format_regex is set, but `format` is not among rl.reward")
        return self

    def resolved(self) -> "RLOptions":
        """Every default written in: the clip range by loss, a weight of 1 per reward."""
        return self.model_copy(update={"clip": tuple(self.clip or RL_CLIP[self.loss]),
                                       "reward_weights": tuple(self.reward_weights or (1.0,) * len(self.reward))})
# [/rl]


class RunConfig(_Strict):
    name: str | None = Field(None, description="run name (a folder name and registry key: no '/'); default: the config file's "
                                      "name, else model + timestamp")
    model: ModelConfig | Literal["auto"] = Field(
        ..., description="preset name, {preset: ..., overrides}, a full shape, or auto (the shape expected to "
        "reach the lowest loss for training_duration on this machine)")
    tokenizer: str | TokenizerSpec | None = Field(
        None, description="tokenizer folder, {train: {vocab_size: N}} to train one, or {extend: {vocab_size: N}} to grow "
        "the custom_weights_path model's; default: the one the data was prepared with")
    train_data: tuple[DatasetEntry, ...] = Field(
        ..., description="path/URI, list, {name: {path, proportion}} mix, or a curriculum: a list of phases "
        "[{until, mix}, ...] (stored as the datasets here plus `curriculum`)")
    curriculum: tuple[Phase, ...] | None = Field(
        None, description="phases that change the mix (normally written as train_data: [{until, mix}, ...])")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation while training")
    save_folder: str | None = Field(None, description="checkpoints, metrics, exports; default runs/<name>")
    save_interval: DurationField | Literal["auto"] | None = Field(
        None, description="checkpoint every …; auto: the interval that maximises goodput (Young/Daly, from the "
        "failure rate and the checkpoint's cost: `lmforge estimate` shows it), re-estimated from the run's own "
        "checkpoint times and failures; default: ~5 per run")
    local_checkpoints: LocalCheckpoints | None = Field(
        None, description="a fast tier of frequent checkpoints on local storage ({folder, interval, keep}); "
        "save_folder keeps the durable ones")
    save_num_checkpoints_to_keep: int = Field(2, ge=1, le=1 << 20, description="older checkpoints are deleted")
    training_duration: DurationField = Field(..., description="e.g. '10000tok', '200B tok', '500ba', '2ep', '30min'")
    parameters: Parameters = Field(default_factory=Parameters, description="optimization hyperparameters")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="devices and parallelism")
    experiment_tracker: TrackerConfig = Field(default_factory=TrackerConfig, description="MLflow / W&B / JSONL")
    custom_weights_path: str | None = Field(
        None, description="weights to start from: a run folder, its final/, a checkpoints/step_N folder or a "
        "Hugging Face folder (hf:/path); fresh optimizer and schedule")
    task_type: Literal["pretrain", "continued_pretrain", "instruction_finetune", "chat_completion",
                       "preference", "rl"] = Field(
        "pretrain", description="instruction_finetune / chat_completion: train_data and eval.data_path are "
        "JSONL prompt/response or messages rows, loss on responses only; preference: JSONL prompt/chosen/rejected "
        "rows, DPO and its kin; rl: JSONL prompt (or messages) rows whose other columns reach the rewards, "
        "GRPO and its kin (lmforge finetune)")
    sft: SFTOptions = Field(default_factory=SFTOptions, description="fine-tuning data options (sft.packing: "
                            "preference pairs too)")
    preference: PreferenceOptions = Field(default_factory=PreferenceOptions,
                                          description="task_type preference: the loss and its reference")
    rl: RLOptions = Field(default_factory=RLOptions, description="task_type rl: rewards, rollouts and the "
                          "policy loss (docs/rl.md)")
    lora: LoRAConfig | None = Field(
        None, description="train low-rank adapters on the frozen custom_weights_path model instead of all weights "
        "({rank, alpha, dropout, targets}); the final model is merged, final/adapter is a PEFT adapter")
    autoresume: bool = Field(True, description="continue from the latest checkpoint in save_folder")
    goodput: GoodputConfig = Field(
        default_factory=GoodputConfig, description="stragglers, GPU health, the conditions that checkpoint, "
        "diagnose, cordon and resume (docs/goodput.md)")
    max_retries: int = Field(2, ge=0, le=MAX_RETRIES, description="restarts after a crash or a hang, in all (by the supervisor or "
                             "torchrun); each resumes from the latest checkpoint")
    log_interval: int = Field(10, ge=1, le=1 << 30, description="steps between logged metrics (trackers, the progress bar); "
                              "plain console lines thin them to ~20 a run, one at least every 100 steps")
    # [object-store] remote save_folder / train_data settings (lmforge/config/storage.py)
    object_store: ObjectStoreConfig = Field(default_factory=ObjectStoreConfig, description="endpoint, retries")
    secrets: SecretsConfig | None = Field(None, description="credentials file or env var names (never values)")


    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if v is not None:
            check_run_name(v)
        return v

    @field_validator("save_interval", mode="before")
    @classmethod
    def _save_interval(cls, v):
        return v if v in ("auto", None) else parse_duration(v, "save_interval")

    @field_validator("save_folder")
    @classmethod
    def _save_folder(cls, v):
        if v is not None and not v.strip():
            raise ValueError("empty; leave save_folder out for the default runs/<name>")
        return v

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v):
        return "auto" if v == "auto" else resolve_model(v)

    @model_validator(mode="before")
    @classmethod
    def _phases(cls, data):
        """`train_data: [{until, mix: {name: {path, proportion}}}, ...]` → datasets + `curriculum`."""
        td = data.get("train_data") if isinstance(data, dict) else None
        if not (isinstance(td, list) and any(isinstance(e, dict) and "mix" in e for e in td)):
            return data
        if data.get("curriculum") is not None:
            raise ValueError("train_data: phases are given in train_data; do not also set curriculum")
        datasets: dict[str, dict] = {}
        phases = []
        for i, phase in enumerate(td):
            if not isinstance(phase, dict) or not isinstance(phase.get("mix"), dict):
                raise ValueError(f"train_data[{i}]: every phase of a curriculum is a mapping with "
                                 "`mix: {name: {path, proportion}}` (and `until:`)")
            mix = {}
            for name, entry in phase["mix"].items():
                if isinstance(entry, (int, float)) and not isinstance(entry, bool):
                    entry = {"proportion": entry}  # a dataset defined (with its path) in another phase
                elif isinstance(entry, str):
                    entry = {"path": entry}
                elif not isinstance(entry, dict):
                    raise ValueError(f"train_data[{i}].mix.{name}: expected a path, a proportion or "
                                     "{path, proportion}")
                entry = dict(entry)
                mix[name] = entry.pop("proportion", None)
                if entry:
                    seen = datasets.setdefault(name, {"name": name, **entry})
                    if {"name": name, **entry} != seen:
                        raise ValueError(f"train_data[{i}].mix.{name}: defined differently in an earlier phase "
                                         f"({seen}); a dataset keeps one path and settings in every phase")
            phases.append({k: v for k, v in phase.items() if k != "mix"} | {"mix": mix})
        for i, phase in enumerate(phases):
            for name in phase["mix"]:
                if name not in datasets:
                    raise ValueError(f"train_data[{i}].mix.{name}: no phase gives this dataset's path")
        return dict(data, train_data=list(datasets.values()), curriculum=phases)

    @field_validator("train_data", mode="before")
    @classmethod
    def _train_data(cls, v):
        """Accept 'path', {path, text_field, …}, ['a', 'b'], or {name: path | {path, proportion}}."""
        if isinstance(v, str):
            return [{"path": v}]
        if isinstance(v, dict) and isinstance(v.get("path"), str) and set(v) <= set(DatasetEntry.model_fields):
            return [v]  # one dataset written as a mapping ({path, text_field}), not a mix of datasets
        if isinstance(v, dict):
            out = []
            for name, entry in v.items():
                if not isinstance(entry, (str, dict)) and entry is not None:
                    raise ValueError(f"train_data.{name}: expected a path or {{path, proportion}}, got {entry!r}")
                entry = {"path": entry} if isinstance(entry, str) else dict(entry or {})
                entry.setdefault("name", name)
                out.append(entry)
            return out
        if isinstance(v, list):
            return [{"path": e} if isinstance(e, str) else e for e in v]
        return v

    @model_validator(mode="after")
    def _names(self):
        if not self.train_data:
            raise ValueError("train_data: at least one dataset is required")
        if self.model != "auto" and self.model.rope_scaling is not None and not self.custom_weights_path:
            raise ValueError("model.rope_scaling: extends the context of trained weights and needs custom_weights_path; "
                             "a model trained from scratch at max_seq_len needs none (leave rope_scaling out)")
        if self.lora is not None and not self.custom_weights_path:
            raise ValueError("lora: needs custom_weights_path (the frozen model the adapters are trained on)")
        dense_only = [t for t in (self.lora.targets if self.lora else []) if t in ("gate_proj", "up_proj", "down_proj")]
        if dense_only and self.model.is_moe:
            raise ValueError(f"lora.targets: {dense_only[0]} matches no module of this model (mixture-of-experts "
                             "layers have no dense MLP projections; target q_proj, k_proj, v_proj, o_proj)")
        if self.lora is not None and self.parameters.optimizer == "muon":
            raise ValueError("parameters.optimizer: muon trains whole weight matrices, and with lora they are frozen "
                             "(the adapters are low-rank factors Muon is not defined for); use optimizer: adamw")
        if self.lora is not None and isinstance(self.tokenizer, TokenizerSpec) and self.tokenizer.extend:
            raise ValueError("lora: cannot be combined with tokenizer.extend (new embedding rows must be trained)")
        if self.preference != PreferenceOptions() and self.task_type != "preference":
            raise ValueError(f"preference: applies to task_type preference (this run's is {self.task_type})")
        if self.preference.reference == "live" and self.lora is None:
            raise ValueError("preference.reference: live is the base with its LoRA adapters off and needs lora:; "
                             "full fine-tuning uses reference: precomputed (the same log-probs, without a second "
                             "copy of the model)")
        self._check_rl()
        if isinstance(self.tokenizer, TokenizerSpec) and self.tokenizer.extend and not self.custom_weights_path:
            raise ValueError("tokenizer.extend: needs custom_weights_path (the model whose vocabulary is extended)")
        for entry in self.train_data:
            cur = entry.curate
            if cur and cur.decontaminate and not cur.decontaminate.tasks and not self.eval.icl_tasks:
                raise ValueError(f"train_data.{entry.name}.curate.decontaminate: no ICL tasks to decontaminate "
                                 "against; set eval.icl_tasks or curate.decontaminate.tasks")
        if self.curriculum:
            self._check_curriculum()
        self.goodput.check(nodes=self.compute.nodes, autoresume=self.autoresume)
        return self

    def _check_rl(self) -> None:
        if self.rl != RLOptions() and self.task_type != RL_TASK:
            raise ValueError(f"rl: applies to task_type rl (this run's is {self.task_type})")
        if self.task_type != RL_TASK:
            return
        if not self.rl.reward:
            raise ValueError("rl.reward: task_type rl needs at least one reward (exact_match, math, format or "
                             "path/to/file.py:function)")
        if isinstance(self.parameters.global_batch_size, str):
            raise ValueError(f"parameters.global_batch_size: task_type rl counts prompts per step (each sampled "
                             f"rl.group_size times); expected an integer, not {self.parameters.global_batch_size!r}")

    @field_validator("train_data")
    @classmethod
    def _dataset_names(cls, v: list[DatasetEntry]) -> list[DatasetEntry]:
        """Datasets without a name are named by position (d0, d1, …): what mixes and metrics call them."""
        return [e if e.name is not None else e.model_copy(update={"name": f"d{i}"}) for i, e in enumerate(v)]

    def _check_curriculum(self) -> None:
        """What can be checked before the plan: names, and end points increasing within a unit."""
        names = {d.name for d in self.train_data}
        last: dict[str, float] = {}
        run = self.training_duration
        for i, phase in enumerate(self.curriculum):
            unknown = sorted(set(phase.mix) - names)
            if unknown:
                raise ValueError(f"curriculum[{i}].mix: unknown dataset {', '.join(unknown)} "
                                 f"(datasets: {', '.join(sorted(names))})")
            if phase.until is None:
                if i != len(self.curriculum) - 1:
                    raise ValueError(f"train_data[{i}].until: only the last phase may leave out its end point")
                continue
            unit, value = phase_end(phase.until)
            if unit in last and value <= last[unit]:
                raise ValueError(f"train_data[{i}].until: end points must increase ({phase.until!r} is not "
                                 "after the previous phase's end)")
            last[unit] = value
            if unit == run.unit and value > run.value:
                raise ValueError(f"train_data[{i}].until: {phase.until!r} is past the end of the run "
                                 f"(training_duration {run})")
