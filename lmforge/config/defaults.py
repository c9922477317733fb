"""Size-aware defaults: everything left unset in `parameters` is derived here.

| default | rule | where it comes from |
|---|---|---|
| learning_rate | log-linear in non-embedding params between the anchors below | MPT/LLM Foundry recipes (125M 6e-4, 350M 3e-4, 760M 2.5e-4, 1B 2e-4, 3B 1.6e-4, 7B 1.2e-4, 13B 1e-4, 30B 1e-4, 70B 8e-5, as published by MosaicML and Meta); ≤5M 2e-3 from bench/sweep.py; Muon: ≤5M 4e-3 (bench/sweep.py), AdamW's from 30M |
| global batch | tokens per step by size (≤30M: 8K; ≤200M: 0.5M; ≤2B: 1M; ≤20B: 2M; else 4M), at most run tokens / 1000 (a power of two, at least 2,048) for a run of known length, converted to samples | MPT recipes (256–512 × 2048) and Llama 2 (4M tokens); the short-run cap from quickstart runs and bench/sweep.py (BENCHMARKS.md) |
| warmup | 5% of the run in its own unit (steps, or seconds of a wall-clock run), at most 2000 steps | common practice (torchtitan, nanoGPT use fixed ~2k for long runs) |
| schedule | wsd: warmup, constant, linear decay to 0 over the last 20% | MiniCPM (Hu et al. 2024), Hägele et al. 2024; bench/sweep.py (beat cosine at 60 s) |
| optimizer | auto: Muon from scratch up to 5M non-embedding params, else AdamW | bench/sweep.py's optimizer stage (BENCHMARKS.md) |
| AdamW | β (0.9, 0.95), ε 1e-8, weight decay 0.1 on matrices only | GPT-3, Llama |
| Muon | momentum 0.95 (Nesterov), 5 Newton–Schulz steps, update scaled 0.2·√max(A, B), AdamW's weight decay | Jordan et al. 2024; Liu et al. 2025 |
| grad clip | 1.0 | GPT-3, Llama |
| precision | bf16 autocast if the device runs bf16 matmuls fast (CUDA with bf16; CPUs with AMX), else fp32 | |
| tokens | compute-optimal ≈ 20 × params (shown by `--dry-run` / `estimate`) | Chinchilla (Hoffmann et al. 2022) |
"""

from __future__ import annotations

import math

# (non-embedding params, peak LR)
LR_ANCHORS = [(5e6, 2e-3), (30e6, 1e-3), (125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4),
              (3e9, 1.6e-4), (7e9, 1.2e-4), (13e9, 1e-4), (30e9, 1e-4), (70e9, 8e-5)]
# The optimizer (`parameters.optimizer: auto`): Muon where bench/sweep.py's optimizer stage measured
# it to win — training from scratch, models up to MUON_MAX_PARAMS non-embedding parameters (the
# sweep's ~0.8M-parameter shape, which `model: auto` picks on CPUs: tinyshakespeare 70 s and 5 min,
# the built-in corpus 3 min, each optimizer at its own tuned LR and at the tokens it gets in the
# budget; BENCHMARKS.md). Above that, and for fine-tuning weights trained with AdamW, AdamW until
# measured.
MUON_MAX_PARAMS = 5e6
# Muon's peak LR: at the small end the sweep's choice over its three budgets (2× AdamW's there: the
# best at 3 min, within 0.03 bits per byte of the best, 8e-3, at the others); AdamW's anchors from
# 30M up, which Moonshot's RMS-matched update is made to reuse (Liu et al. 2025); log-linear between.
MUON_LR_ANCHORS = [(5e6, 4e-3)] + LR_ANCHORS[1:]
# (upper bound of non-embedding params, tokens per optimizer step)
BATCH_TOKENS = [(30e6, 8192), (200e6, 524288), (2e9, 1048576), (20e9, 2097152), (math.inf, 4194304)]


# Fine-tuning's learning rate, as a share of the size-based pretraining default:
# - SFT, all weights: one tenth (e.g. 1.2e-5 for 7B), the usual SFT range;
# - preference tuning: one hundredth (7B: 1.2e-6; TRL's DPO default is 1e-6, Zephyr's and Tulu 3's
#   DPO 5e-7);
# - reinforcement learning (task_type rl): one hundredth too (7B: 1.2e-6; TRL's GRPO default is 1e-6).
# LoRA takes ten times that (adapters take ~10× the full fine-tuning rate): SFT with LoRA keeps the
# pretraining default itself.
TASK_LR_FACTOR = {"instruction_finetune": 0.1, "chat_completion": 0.1, "preference": 0.01, "rl": 0.01}
LORA_LR_MULTIPLIER = 10
# Reinforcement learning's default batch: prompts per step, each sampled rl.group_size times (TRL's
# GRPO defaults come to one prompt per device; DAPO and the GSPO paper take 256-512 on clusters):
# enough groups that one step's advantage is not a handful of prompts' luck.
RL_PROMPTS_PER_STEP = 16


def task_learning_rate(non_embedding_params: float, task_type: str, lora: bool, optimizer: str = "adamw") -> float:
    """The default peak LR of a run of this task (see TASK_LR_FACTOR) with this optimizer."""
    lr = default_learning_rate(non_embedding_params, optimizer)
    factor = TASK_LR_FACTOR.get(task_type)
    if factor is None:  # pretraining and continued pretraining
        return lr
    return float(f"{lr * min(1.0, factor * (LORA_LR_MULTIPLIER if lora else 1)):.3g}")


def run_optimizer(optimizer: str, non_embedding_params: float, from_scratch: bool) -> str:
    """``parameters.optimizer`` made concrete: ``auto`` is muon for a model trained from scratch
    (no ``custom_weights_path``) with at most MUON_MAX_PARAMS non-embedding parameters, else adamw."""
    if optimizer != "auto":
        return optimizer
    return "muon" if from_scratch and non_embedding_params <= MUON_MAX_PARAMS else "adamw"


def default_learning_rate(non_embedding_params: float, optimizer: str = "adamw") -> float:
    anchors = MUON_LR_ANCHORS if optimizer == "muon" else LR_ANCHORS
    x = math.log(max(non_embedding_params, 1.0))
    pts = [(math.log(n), math.log(lr)) for n, lr in anchors]
    if x <= pts[0][0]:
        return anchors[0][1]
    if x >= pts[-1][0]:
        return anchors[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return float(f"{math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0)):.3g}")
    raise AssertionError("unreachable")


# A short run learns more from many small steps than from a few large ones: for a run of known
# length the default batch is at most the largest power of two that still gives it MIN_STEPS
# steps, and at least MIN_BATCH_TOKENS. Measured on 2 CPU cores with a ~1M-parameter model:
# - the quickstart (3 min, ≈2.1M tokens trained, real command, one run each): 2,048 tokens/step
#   (~1,000 steps) reached 1.780 held-out bits per byte, 4,096 (~510) 1.828, 8,192 (~260) 1.881;
# - bench/sweep.py at a 60 s budget (≈0.65M tokens): 2,048 (~330 steps) against 1,024 (~650):
#   0.09 better on the built-in corpus, 0.05 worse on tinyshakespeare (hence the floor).
# (The cap was 250 steps while `model: auto` under-measured its shape's speed, mean of 3 steps
# instead of the fastest: the planned tokens came out ~2.5× low, which kept the quickstart at
# 2,048 tokens/step by accident; BENCHMARKS.md, session 8.)
MIN_STEPS = 1000
MIN_BATCH_TOKENS = 2048


def default_batch_tokens(non_embedding_params: float, run_tokens: float | None = None) -> int:
    """Tokens per optimizer step: by model size, made smaller for a short run (``run_tokens``)."""
    tokens = next(t for bound, t in BATCH_TOKENS if non_embedding_params <= bound)
    if run_tokens:
        cap = 2 ** int(math.log2(max(1.0, run_tokens / MIN_STEPS)))
        tokens = min(tokens, max(MIN_BATCH_TOKENS, cap))
    return tokens


def default_batch_rule(non_embedding_params: float, run_tokens: float | None = None) -> str:
    """Which part of the rule gave `default_batch_tokens` its value, in words."""
    from lmforge.config.counts import human

    i, (bound, tokens) = next((i, b) for i, b in enumerate(BATCH_TOKENS) if non_embedding_params <= b[0])
    size = f"up to {human(bound)}" if bound != math.inf else f"above {human(BATCH_TOKENS[i - 1][0])}"
    rule = f"{human(tokens)} tokens per step for models of {size} non-embedding parameters"
    chosen = default_batch_tokens(non_embedding_params, run_tokens)
    if chosen != tokens:
        rule += (f", at most a {MIN_STEPS:,}th of a run of {human(run_tokens)} tokens (a power of two)"
                 + (f", at least {MIN_BATCH_TOKENS:,}" if chosen == MIN_BATCH_TOKENS else ""))
    return rule


# The default warmup: this share of the run, in the run's own unit (steps, or seconds of a
# wall-clock budget), and never more than MAX_WARMUP_STEPS steps' worth.
WARMUP_FRACTION = 0.05
MAX_WARMUP_STEPS = 2000


def auto_precision(bf16_native: bool) -> str:
    """What `precision: auto` trains in: bf16 where the device runs bf16 matmuls natively (CUDA
    with bf16; CPUs with AMX — with AVX512-BF16 alone a step under bf16 autocast ran 1.5× slower
    than in fp32, BENCHMARKS.md 2026-11-23 session 6), else fp32."""
    return "bf16" if bf16_native else "fp32"


def micro_batch_for(per_rank: int, cap: int = 8) -> int:
    """The largest divisor of the per-rank batch that is at most `cap` (8 on CPU; memory-based on GPUs)."""
    return max(d for d in range(1, min(per_rank, cap) + 1) if per_rank % d == 0)


def auto_vocab(d_model: int, data_bytes: float | None = None) -> int:
    """The BPE vocabulary to train when `tokenizer.train.vocab_size` is auto (see VOCAB in the table)."""
    v = 1024 if d_model <= 192 else 4096 if d_model <= 512 else 32768
    if data_bytes:
        v = min(v, max(512, 2 ** int(math.log2(data_bytes / 256))))
    return v


def estimated_bytes_per_token(vocab: int) -> float:
    """Typical bytes per token of a byte-level BPE of this size on English text or code."""
    return 2.3 + 0.35 * max(0.0, math.log2(vocab / 1024))
