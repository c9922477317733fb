"""`model: auto`: the dense shape expected to reach the lowest loss for a run's budget.

The rule, and where it comes from:

- **Compute-optimal allocation.** For a budget of C FLOPs the loss-minimizing model trains on
  about ``TOKENS_PER_PARAM`` tokens per parameter (Hoffmann et al. 2022, "Chinchilla": ≈20,
  roughly constant over four orders of magnitude of compute). So each candidate shape gets the
  tokens the budget buys *for it* (D), and the candidate whose D/N is closest (in log) to the
  target wins: a bigger model would see too few tokens, a smaller one would waste them.
- **Count every parameter, embeddings included.** Kaplan et al. (2020) counted non-embedding
  parameters and found far larger optimal models; Pearce & Song (2024, "Reconciling Kaplan and
  Chinchilla scaling laws") show the gap comes mostly from that counting at small scale, where
  the embedding is a large share of the model. Our candidates are small enough for this to
  matter, so N is the total (tied embeddings counted once).
- **Repeated data counts less.** When the budget buys more tokens than the data holds, the
  repeated epochs are worth less than fresh tokens: D_eff = U + U·R*·(1 − e^(−R/R*)) with U the
  unique tokens, R the repetitions beyond the first and R* ≈ 15.4 (Muennighoff et al. 2023,
  "Scaling data-constrained language models").
- **The budget's unit.** Tokens fix D; steps fix it with one batch for every shape (the
  ``global_batch_size`` given, else the smallest shape's default); FLOPs give D = C / FLOPs per token of the
  candidate (6·N_active, the standard basis); wall-clock time gives D = seconds × the
  candidate's training tokens/s *measured on this machine* (`train.throughput`, cached), so
  whatever runs efficiently here is preferred.
- **This machine's sweep.** ``TOKENS_PER_PARAM`` and the vocabulary rule below were checked
  against bench/sweep.py's shape and vocabulary sweeps on 2 CPU cores (see BENCHMARKS.md).

Everything here is pure: the throughput of a candidate comes in as a function, or through the
machine's probe (`choose_for_run`, which sizes each candidate's batch as its plan would:
`plan.batch`). `resolve.auto_model` gathers the facts only a run has (its data's size, a
resumed run's recorded shape) and calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from lmforge.config.defaults import auto_vocab, estimated_bytes_per_token
from lmforge.config.counts import human
from lmforge.config.durations import Duration
from lmforge.config.model import PRESETS, ModelConfig, padded_vocab
from lmforge.config.schema import RunConfig
from lmforge.errors import UserError
from lmforge.plan.batch import assumed_tokens_per_s, global_batch, plan_optimizer, probe_micro_batch, run_tokens
from lmforge.plan.checks import replicas
from lmforge.plan.flops import mfu_flops_per_token, param_counts
from lmforge.plan.hardware import mfu_basis, peak_flops
from lmforge.plan.machine import Machine

TOKENS_PER_PARAM = 20.0  # Chinchilla; all parameters counted (see the module docstring)
REPEAT_HALF_LIFE = 15.4  # R* of Muennighoff et al. 2023
SMALL_CONTEXT = 256  # context of the small (CPU-sized) candidates
# Small shapes (d_model, n_layers, n_heads): depth grows with width, heads of 32–64 dims.
SMALL_SHAPES = [(128, 4, 4), (192, 4, 4), (256, 4, 4), (256, 6, 4), (384, 6, 6), (512, 8, 8), (640, 10, 10)]
LARGE_PRESETS = ["llama-125m", "llama-350m", "llama-760m", "llama-1b", "llama-3b", "llama-7b", "llama-13b",
                 "llama-30b", "llama-70b"]


@dataclass
class Budget:
    """What a run may spend: ``tok`` / ``ba`` (× batch tokens) / ``flop`` / ``s``."""

    kind: str  # "tok" | "ba" | "flop" | "s"
    value: float

    @classmethod
    def from_duration(cls, d: Duration, *, data_tokens: int | None, key: str = "training_duration") -> "Budget":
        if d.unit in ("tok", "ba", "flop", "s"):
            return cls(d.unit, d.value)
        if d.unit in ("ep", "sp") and data_tokens:
            if d.unit == "ep":
                return cls("tok", d.value * data_tokens)
        raise UserError(f"{key}: model: auto needs a budget it can size a model from: tokens ('5M tok'), steps "
                        f"('500ba'), FLOPs ('1e15flop') or time ('5min'); got {d}"
                        + (" on data whose size is not known before it is prepared" if d.unit == "ep" else ""))

    def __str__(self) -> str:
        return {"tok": f"{self.value:,.0f} tokens", "ba": f"{self.value:,.0f} steps",
                "flop": f"{self.value:.3g} FLOPs", "s": f"{self.value:g}s"}[self.kind]


@dataclass
class Candidate:
    model: ModelConfig  # vocab_size set
    context_length: int
    batch_tokens: int
    params: int = 0  # all parameters
    tokens: float = 0.0  # what the budget buys for this shape
    effective_tokens: float = 0.0  # after the repeated-data discount
    tokens_per_s: float | None = None

    @property
    def label(self) -> str:
        m = self.model
        return m.preset or f"{m.n_layers}×{m.d_model}"


def candidates(vocab: int | None, data_bytes: float | None, context_length: int | None,
               batch_tokens: Callable[[ModelConfig, int], int]) -> list[Candidate]:
    """The family `model: auto` chooses from. ``vocab`` None: the vocabulary is chosen per shape."""
    out = []
    for d, layers, heads in SMALL_SHAPES:
        v = vocab or auto_vocab(d, data_bytes)
        ctx = context_length or SMALL_CONTEXT
        m = ModelConfig(d_model=d, n_layers=layers, n_heads=heads, vocab_size=padded_vocab(v), max_seq_len=ctx,
                        tie_embeddings=True)
        out.append(Candidate(m, ctx, batch_tokens(m, ctx)))
    for name in LARGE_PRESETS:
        base = dict(PRESETS[name])
        v = vocab or base.get("vocab_size") or 32000
        m = ModelConfig(preset=name, **(base | {"vocab_size": padded_vocab(v)}))
        ctx = context_length or m.max_seq_len
        m = m.model_copy(update={"max_seq_len": max(ctx, m.max_seq_len)})
        out.append(Candidate(m, ctx, batch_tokens(m, ctx)))
    return out


def effective_tokens(tokens: float, unique: float | None) -> float:
    """Muennighoff et al.'s worth of ``tokens`` drawn from ``unique`` tokens of data."""
    if not unique or tokens <= unique:
        return tokens
    repeats = tokens / unique - 1.0
    return unique + unique * REPEAT_HALF_LIFE * (1.0 - math.exp(-repeats / REPEAT_HALF_LIFE))


def choose(budget: Budget, cands: list[Candidate], *, unique_tokens: float | None = None,
           tokens_per_s: Callable[[Candidate], float] | None = None,
           flops_per_s_guess: float = 5e10, rate_note: str = "measured here") -> tuple[Candidate, str]:
    """The candidate whose (effective) tokens per parameter is closest to TOKENS_PER_PARAM, and
    a one-line reason. ``tokens_per_s`` (wall-clock budgets) times a candidate on this machine."""
    for c in cands:
        c.params = param_counts(c.model)["total"]
    if budget.kind == "s":
        if tokens_per_s is None:
            raise ValueError("a wall-clock budget needs tokens_per_s")
        # Time only the few shapes around the FLOPs-based guess: measuring is not free.
        cands = _near_flops_optimum(budget, cands, flops_per_s_guess)
    step_batch = min(c.batch_tokens for c in cands)
    for c in cands:
        if budget.kind == "tok":
            c.tokens = budget.value
        elif budget.kind == "ba":
            # One batch for every shape: the default batch grows with the model, and costing each
            # shape at its own would let a few huge steps "buy" a big model more tokens than a
            # small one gets (3 steps × 0.5M tokens). The smallest is the one a small pick uses.
            c.batch_tokens = step_batch
            c.tokens = budget.value * c.batch_tokens
        elif budget.kind == "flop":
            c.tokens = budget.value / mfu_flops_per_token(c.model, c.context_length)
        else:
            c.tokens_per_s = tokens_per_s(c)
            c.tokens = budget.value * c.tokens_per_s
        c.effective_tokens = effective_tokens(c.tokens, unique_tokens)

    def distance(c: Candidate) -> float:
        return abs(math.log(c.effective_tokens / (TOKENS_PER_PARAM * c.params)))

    best = min(cands, key=distance)
    m = best.model
    if budget.kind == "tok":
        bought = f"{human(best.tokens)} tokens"
    elif budget.kind == "ba":
        bought = f"{budget} × {human(best.batch_tokens)} tokens = {human(best.tokens)} tokens"
    elif budget.kind == "flop":
        bought = f"{budget} buy {human(best.tokens)} tokens of it"
    else:
        bought = f"{budget} × {human(best.tokens_per_s)} tokens/s ({rate_note}) = {human(best.tokens)} tokens"
    if unique_tokens and best.tokens > unique_tokens:
        bought += f" ({best.tokens / unique_tokens:.1f} epochs of {human(unique_tokens)}, worth {human(best.effective_tokens)})"
    reason = (f"model: auto → {best.label} ({m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab "
              f"{m.vocab_size}, {best.params / 1e6:.2f}M params, context {best.context_length}): {bought}, "
              f"{best.effective_tokens / best.params:.2g} per parameter — of {len(cands)} shapes the closest to "
              f"{TOKENS_PER_PARAM:g} tokens per parameter (Chinchilla, embeddings counted)")
    return best, reason


def _near_flops_optimum(budget: Budget, cands: list[Candidate], flops_per_s: float,
                        keep: int = 4) -> list[Candidate]:
    """The ``keep`` candidates nearest the choice a FLOPs estimate (``flops_per_s`` sustained) would
    make: only those are timed."""
    guess = Budget("flop", budget.value * flops_per_s)
    ranked = []
    for c in cands:
        tokens = guess.value / mfu_flops_per_token(c.model, c.context_length)
        ranked.append((abs(math.log(tokens / (TOKENS_PER_PARAM * c.params))), c))
    ranked.sort(key=lambda x: x[0])
    return [c for _, c in ranked[:keep]]


def choose_for_run(cfg: RunConfig, machine: Machine, *, ctx: int | None, vocab: int | None, data_bytes: float | None,
                   data_tokens: int | None, unique_tokens: float | None, log) -> tuple[Candidate, str]:
    """`model: auto` for a run on ``machine``: the candidates, each with the global batch its plan
    would take (`plan.batch.global_batch`), timed by the machine's probe where it measures (cached
    for next time), else modelled at the machine's assumed MFU; the choice and its line."""
    budget = Budget.from_duration(cfg.training_duration, data_tokens=data_tokens)
    p = cfg.parameters
    precision = "bf16" if (p.precision == "bf16" or (p.precision == "auto" and machine.bf16)) else "fp32"
    reps = replicas(machine.world_size, cfg.compute.context_parallel)

    def batch_tokens(m: ModelConfig, c: int) -> int:
        tokens = run_tokens(Duration(budget.value, budget.kind), m, c,
                            tokens_per_s=lambda: assumed_tokens_per_s(m, c, machine, precision))
        return global_batch(cfg, m, c, reps, tokens) * c

    def tokens_per_s(cand: Candidate) -> float:
        m, c = cand.model, cand.context_length
        micro = probe_micro_batch(cand.batch_tokens // c, reps, machine.device)
        kw = dict(precision=precision, optimizer=plan_optimizer(cfg, m))  # timed with the optimizer it would get
        hit = machine.probe.tokens_per_s(m, c, micro, measure=False, **kw)
        if hit:
            return hit * machine.compute_devices
        if param_counts(m)["total"] > 2e9 or not machine.probe.measures:  # too big to time casually, or described
            return assumed_tokens_per_s(m, c, machine, precision)
        log(f"model: auto: timing {m.n_layers}×{m.d_model} (vocab {m.vocab_size}) on {machine.device} "
            "(cached for next time)")
        return machine.probe.tokens_per_s(m, c, micro, measure=True, **kw) * machine.compute_devices

    cands = candidates(vocab, data_bytes, ctx, batch_tokens)
    if unique_tokens is None and data_bytes:
        unique_tokens = data_bytes / estimated_bytes_per_token(vocab or cands[0].model.vocab_size)
    note = "measured here" if machine.probe.measures else \
        f"{machine.assumed_mfu:.0%} of the peak of {machine.spec.name}"
    if machine.compute_devices > 1:
        note += f", × {machine.compute_devices} GPUs"
    flops_per_s = machine.assumed_mfu * peak_flops(machine.spec, mfu_basis(precision)) * machine.compute_devices
    return choose(budget, cands, unique_tokens=unique_tokens, tokens_per_s=tokens_per_s,
                  flops_per_s_guess=flops_per_s, rate_note=note)
