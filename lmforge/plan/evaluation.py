"""Evaluation sized to the run: how often a run evaluates and on how many held-out batches.

An evaluation (held-out loss over ``eval.max_batches`` micro-batches per rank, then a generation
from each ``eval.prompts``) stops the training while it runs, so on a short run it can take more
time than the steps: a 60-second quickstart that evaluated at every step spent 57 s in evaluation
and trained 3 of its 15 steps. So where the user leaves them unset, ``eval.interval`` and
``eval.max_batches`` are sized for the run: evaluation may take at most ``EVAL_SHARE`` of the run's
planned time (its steps × the plan's step time, or its wall-clock budget), the final evaluation
included — a run always gets that one.

The rule, with the plan's own speed (measured, or assumed: the plan says which):

- an evaluation's time is its held-out tokens at a forward pass's cost (``FORWARD_SHARE`` of a
  training token's: 2·N of the 6·N FLOPs), all ranks in parallel, plus its generated tokens at
  ``DECODE_S_PER_LAYER`` per layer each (sampling one token at a time is bound by the per-layer
  overhead of a tiny batch, not by FLOPs);
- with the batches the user gave (else ``DEFAULT_EVAL_BATCHES``) as many evaluations as the budget
  pays for, at most ``DEFAULT_EVALS`` per run; where not even one fits, fewer batches (at least
  one) and the final evaluation alone;
- an interval the user gave keeps its evaluations; the batches (if unset) are then what the
  budget pays for each.

Values the user set are kept as they are; the line the plan prints says what evaluation will cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EVAL_SHARE = 0.10  # of a run's planned time, at most, where eval.interval / eval.max_batches are unset
DEFAULT_EVALS = 10  # evaluations per run (the final one included) where the budget pays for them
DEFAULT_EVAL_BATCHES = 20  # held-out micro-batches per rank and evaluation, where the budget pays for them
FORWARD_SHARE = 1 / 3  # a held-out token's cost against a training token's: the forward pass (2·N of 6·N)
# One generated token: a forward of one position through every layer, bound by per-layer overhead
# (lmforge's sampling loop with a KV cache on 2 CPU cores: 4 layers × 128, 2–3 ms a token unloaded).
DECODE_S_PER_LAYER = 0.0005


@dataclass(frozen=True)
class EvalPlan:
    interval: int  # optimizer steps between evaluations
    batches: int  # held-out micro-batches per rank and evaluation (eval.max_batches)
    evals: int  # evaluations the run is expected to make, the final one included
    seconds: float  # one evaluation, expected
    share: float  # of the run's planned time, all evaluations together
    line: str  # what the plan says about it


def eval_seconds(batches: int, *, eval_sets: int, micro_batch: int, context: int, replicas: int,
                 tokens_per_s: float, generated_tokens: int, n_layers: int) -> float:
    """Expected seconds of one evaluation: the held-out forward passes of every set (each rank
    reads ``batches`` micro-batches, in parallel) and the generations."""
    heldout = eval_sets * batches * micro_batch * context * replicas * FORWARD_SHARE / tokens_per_s
    return heldout + generated_tokens * n_layers * DECODE_S_PER_LAYER


def plan_evaluation(*, interval: int | None, batches: int | None, nominal_steps: int, run_seconds: float,
                    eval_sets: int, micro_batch: int, context: int, replicas: int, tokens_per_s: float,
                    generated_tokens: int, n_layers: int, rate_source: str = "", timed: bool = False) -> EvalPlan:
    """Interval and batches for a run of ``nominal_steps`` steps lasting ``run_seconds`` (planned);
    ``interval`` / ``batches`` as the user set them (None: sized here). ``timed``: a wall-clock budget,
    whose steps are only expected — one that runs faster than planned must not meet an evaluation
    meant for its end in its middle."""
    nominal = max(1, nominal_steps)

    def cost(n: int) -> float:
        return eval_seconds(n, eval_sets=eval_sets, micro_batch=micro_batch, context=context, replicas=replicas,
                            tokens_per_s=tokens_per_s, generated_tokens=generated_tokens, n_layers=n_layers)

    budget = EVAL_SHARE * run_seconds
    if interval is not None:
        evals = _evals(nominal, interval)
        if batches is None:
            batches = _batches_for(budget / evals, cost)
    else:
        if batches is None:
            batches = DEFAULT_EVAL_BATCHES if cost(DEFAULT_EVAL_BATCHES) <= budget else _batches_for(budget, cost)
        evals = max(1, min(DEFAULT_EVALS, int(budget // cost(batches)) if cost(batches) > 0 else DEFAULT_EVALS,
                           nominal))
        # `evals` evaluations, the final one included: every interval steps before the end.
        interval = nominal if evals == 1 else math.ceil(nominal / evals)
        evals = _evals(nominal, interval)
        if evals == 1 and timed:
            interval = 2 * nominal  # the end only, also at twice the planned speed
    seconds = cost(batches)
    share = evals * seconds / run_seconds if run_seconds > 0 else 0.0
    speed = f" at the plan's speed ({rate_source})" if rate_source else ""
    every = "at the end only" if interval >= nominal else f"every {interval:,} steps and at the end"
    line = (f"evaluation: {every} ({evals} × {batches} held-out batch(es) of {micro_batch} × {context} tokens per "
            f"rank{f' and {generated_tokens} generated tokens' if generated_tokens else ''}): ≈{seconds:.3g}s each, "
            f"{share:.0%} of the run's ≈{run_seconds:.3g}s{speed}")
    return EvalPlan(interval, batches, evals, seconds, share, line)


def _evals(nominal: int, interval: int) -> int:
    """Evaluations a run of ``nominal`` steps makes: every ``interval`` steps before its end, and the final one."""
    return (nominal - 1) // interval + 1


def _batches_for(seconds: float, cost) -> int:
    """The most held-out batches (1 to DEFAULT_EVAL_BATCHES) one evaluation of ``seconds`` pays for."""
    fixed, per = cost(0), cost(1) - cost(0)
    if per <= 0:
        return DEFAULT_EVAL_BATCHES
    return max(1, min(DEFAULT_EVAL_BATCHES, int((seconds - fixed) // per)))
