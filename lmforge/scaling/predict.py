"""From a ladder's finished runs to the prediction: the target's held-out loss with an
interval, the compute-optimal size and tokens for its budget, and what to distrust.

The interval (at ``confidence``, 90% by default) adds three parts in quadrature, on log-loss:

- the fit's own uncertainty: percentiles of the target's prediction over a residual bootstrap
  of the law (`fit.bootstrap`);
- one run's scatter around the law: the target is one run too (the residuals' RMS, corrected for
  the five fitted parameters, and never less than ``SEED_SCATTER``, times the normal quantile);
- the form's extrapolation error: the ladder without its largest size mispredicts that size by
  some amount (`fit.backtest`); the target is further out, and that error is scaled by the
  distance in log N (`Backtest.scaled`).

Honesty: a ladder too small to judge (fewer runs than the law's parameters + 2, fewer than three
sizes, no size at two token counts, no backtest) gets a warning naming why and an interval of
at least ±5%; a poor fit, exponents at their bounds, a long extrapolation or an IsoFLOP
cross-check that disagrees get a warning each.

Repeated data counts less (Muennighoff et al. 2023): every D here, the ladder's and the target's,
is the *effective* token count of `plan.auto.effective_tokens` — equal to the tokens trained
while they fit in one epoch.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable

import numpy as np

from lmforge.errors import UserError

from lmforge.plan.auto import effective_tokens
from lmforge.scaling.fit import (EXPONENT_PRIOR, FLOPS_PER_PARAM_TOKEN, HUBER_DELTA, N_PARAMS, Backtest, Law,
                                 backtest, bootstrap, fit_law, isoflop_levels, isoflop_trend)
from lmforge.config.counts import human

WEAK_FLOOR = 0.05  # the interval's least half-width (relative) when the ladder cannot judge its own fit
NOISE_FLOOR = 0.003  # ... and otherwise
# One run's held-out loss moves with its seed by about this much (1σ, relative) at a few hundred
# steps: on tinyshakespeare two seeds of the 870K target differed by 1.9%, of a 200K model by 0.5%
# (BENCHMARKS.md, scaling ladder). A fit's residuals understate it (five parameters absorb some).
SEED_SCATTER = 0.01
POOR_FIT = 0.02  # RMS misfit of the runs above which the fit is called poor
FAR = 16.0  # extrapolating further than this many times the ladder's largest size earns a warning
ISOFLOP_DISAGREES = 2.0  # factor between the law's and the IsoFLOP parabolas' compute-optimal size


def predict(runs: list[dict], *, target_params: float | None, target_tokens: float | None,
            target_flops: float | None, unique_tokens: float, confidence: float = 0.9,
            choose_model: Callable[[float], tuple[dict, float]] | None = None, samples: int = 300,
            prior=EXPONENT_PRIOR, max_epochs: float | None = None) -> dict:
    """``runs``: finished ladder runs, each {label, params, tokens, level, loss}. The target is
    (params, tokens), or tokens / FLOPs alone with ``choose_model`` mapping a parameter count to
    the nearest real shape (its config, its parameters). ``max_epochs``: the most a run may repeat
    its data (`ladder.max_epochs`); a compute-optimal size that would repeat it more is a warning."""
    if len(runs) < 2:
        raise ValueError("predict needs at least two finished runs")
    n = np.array([r["params"] for r in runs], float)
    d = np.array([effective_tokens(r["tokens"], unique_tokens) for r in runs], float)
    loss = np.array([r["loss"] for r in runs], float)
    fit = fit_law(n, d, loss, prior=prior)
    law = fit.law
    warnings: list[str] = []

    model, target_params, target_tokens = _place_target(law, target_params, target_tokens, target_flops,
                                                        unique_tokens, choose_model)
    flops = FLOPS_PER_PARAM_TOKEN * target_params * target_tokens
    d_target = effective_tokens(target_tokens, unique_tokens)
    center = math.log(law.loss(target_params, d_target))

    laws = bootstrap(fit, n, d, samples=samples, prior=prior)
    boot = np.log([b.loss(target_params, d_target) for b in laws])
    tail = (1 - confidence) / 2
    q_lo, q_hi = np.quantile(boot, [tail, 1 - tail])
    z = NormalDist().inv_cdf(1 - tail)
    dof = len(runs) - N_PARAMS
    scatter = max(fit.rms * math.sqrt(len(runs) / dof) if dof > 0 else 0.0, SEED_SCATTER)
    bt = backtest(n, d, loss, prior=prior)
    misfit = bt.scaled(target_params) if bt else 0.0
    lo_w = math.sqrt(max(center - q_lo, 0.0) ** 2 + (z * scatter) ** 2 + misfit ** 2)
    hi_w = math.sqrt(max(q_hi - center, 0.0) ** 2 + (z * scatter) ** 2 + misfit ** 2)

    sizes = sorted(set(n.tolist()))
    weak = _weaknesses(runs, n, sizes, bt)
    warnings += weak
    floor = math.log1p(WEAK_FLOOR) if weak else math.log1p(NOISE_FLOOR)
    if weak:
        warnings.append(f"the interval is widened to at least ±{WEAK_FLOOR:.0%} for the reasons above")
    lo_w, hi_w = max(lo_w, floor), max(hi_w, floor)

    warnings += _fit_warnings(fit, bt, misfit, target_params / max(sizes), d / n, d_target / target_params,
                              target_tokens, unique_tokens, d_target)
    n_opt, d_opt = law.optimum(flops)
    warnings += _epochs_warning(n_opt, d_opt / unique_tokens, max_epochs)
    opt_boot = np.array([b.optimum(flops)[0] for b in laws])
    iso = isoflop_levels(n, [r["tokens"] for r in runs], loss, [r["level"] for r in runs])
    trend = isoflop_trend(iso)
    iso_n = trend[1] * flops ** trend[0] if trend else None
    if iso_n is not None and not (1 / ISOFLOP_DISAGREES <= iso_n / n_opt <= ISOFLOP_DISAGREES):
        warnings.append(f"the IsoFLOP parabolas put the compute-optimal size at {human(iso_n)} parameters, the law at "
                        f"{human(n_opt)}: the two methods disagree by more than {ISOFLOP_DISAGREES:g}×")

    fitted = law.loss(n, d)
    return {
        "target": {"loss": math.exp(center), "loss_low": math.exp(center - lo_w), "loss_high": math.exp(center + hi_w),
                   "confidence": confidence, "params": int(target_params), "tokens": int(target_tokens),
                   "effective_tokens": d_target, "flops": flops, "model": model},
        "compute_optimal": {"flops": flops, "params": n_opt, "tokens": d_opt,
                            "params_low": float(np.nanquantile(opt_boot, tail)),
                            "params_high": float(np.nanquantile(opt_boot, 1 - tail)),
                            "tokens_per_param": d_opt / n_opt, "epochs": d_opt / unique_tokens},
        "fit": {"law": "L(N, D) = E + A/N^alpha + B/D^beta", **law.to_dict(), "rms": fit.rms,
                "huber_delta": HUBER_DELTA,
                "exponent_prior": list(prior) if prior else None, "runs": len(runs), "sizes": len(sizes),
                "bootstrap_samples": samples, "interval_parts": {
                    "bootstrap": [center - float(q_lo), float(q_hi) - center], "scatter": z * scatter,
                    "extrapolation": misfit},
                "backtest": _backtest_dict(bt)},
        "isoflop": {"levels": [vars(lv) for lv in iso],
                    "exponent": trend[0] if trend else None, "params_at_target": iso_n},
        "runs": [dict(r, effective_tokens=float(de), fitted=float(f), residual=float(math.log(r["loss"] / f)))
                 for r, de, f in zip(runs, d, fitted)],
        "warnings": warnings,
    }


def _place_target(law: Law, params: float | None, tokens: float | None, flops: float | None,
                  unique_tokens: float, choose_model) -> tuple[dict | None, float, float]:
    """(model config or None, parameters, tokens) of the target: as given, or — tokens or FLOPs
    alone — the size the fitted law finds compute-optimal, rounded to a real shape."""
    if params is not None:
        return None, params, tokens
    if flops is not None:
        n_opt, _ = law.optimum(flops)
    else:
        n_opt = _optimal_params_for_tokens(law, effective_tokens(tokens, unique_tokens))
    model, params = choose_model(n_opt)
    return model, params, (flops / (FLOPS_PER_PARAM_TOKEN * params) if flops is not None else tokens)


def _fit_warnings(fit, bt: Backtest | None, misfit: float, reach: float, ratios, target_ratio: float,
                  target_tokens: float, unique_tokens: float, d_target: float) -> list[str]:
    """What makes a prediction less trustworthy than its interval says: a poor fit, an exponent on
    its bound, a long extrapolation (``reach``: the target's size over the largest run's), a bad
    backtest, a target far more over-sized for its data than any run (``ratios``: the runs' tokens
    per parameter), repeated data."""
    warnings: list[str] = []
    law = fit.law
    if fit.rms > POOR_FIT:
        warnings.append(f"the law fits the runs poorly: RMS misfit {fit.rms:.1%} (a broken run, or a recipe that is "
                        "not right for every size)")
    if fit.at_bound:
        warnings.append(f"an exponent of the fit ended on its bound (α {law.alpha:.3g}, β {law.beta:.3g}): the runs "
                        "do not pin the law down")
    if reach > FAR:
        warnings.append(f"the target has {reach:.0f}× the parameters of the ladder's largest run: a long "
                        "extrapolation, the law's form is trusted far beyond what was measured")
    if bt and bt.error > POOR_FIT:
        warnings.append(f"without its largest size the ladder mispredicts that size by {bt.error:.1%} (median) "
                        f"(backtest): the interval carries {misfit:.1%} for the target's distance")
    if target_ratio < ratios.min() / 2:
        warnings.append(f"the target trains on {target_ratio:.2g} tokens per parameter, fewer than half "
                        f"the fewest of any ladder run ({ratios.min():.2g}): the law has not seen a model this "
                        "over-sized for its data (with repeated data, the extra parameters are worth less too)")
    if target_tokens > unique_tokens:
        warnings.append(f"the target repeats its data {target_tokens / unique_tokens:.1f} times; repeated tokens "
                        f"count as {d_target / target_tokens:.0%} of new ones (Muennighoff et al.)")

    return warnings


def _epochs_warning(n_opt: float, epochs: float, max_epochs: float | None) -> list[str]:
    """The compute-optimal size repeating its data more often than a ladder run may."""
    if max_epochs is None or epochs <= max_epochs:
        return []
    return [f"the compute-optimal size for the target's compute trains {human(n_opt)} parameters on {epochs:.1f} "
            f"epochs of the data, more than ladder.max_epochs ({max_epochs:g}): repeated tokens are worth less than "
            "new ones (Muennighoff et al.), so that optimum is not to be trusted; more data, or a smaller budget, is "
            "what it asks for"]


def _weaknesses(runs, n, sizes, bt: Backtest | None) -> list[str]:
    out = []
    if len(runs) < N_PARAMS + 2:
        out.append(f"only {len(runs)} runs for a law of {N_PARAMS} parameters: too few to judge the fit")
    if len(sizes) < 3:
        out.append(f"only {len(sizes)} model sizes: the exponent in N rests on them alone")
    if not any(np.sum(n == s) >= 2 for s in sizes):
        out.append("no size was trained at two token counts: the N and D terms cannot be told apart")
    if bt is None:
        out.append("too few runs below the largest size to backtest the law's extrapolation")
    return out


def _backtest_dict(bt: Backtest | None) -> dict | None:
    if bt is None:
        return None
    return {"held_out_params": bt.held_out_params, "fitted_up_to": bt.next_params, "error": bt.error,
            "errors": bt.errors}


def _optimal_params_for_tokens(law: Law, tokens: float) -> float:
    """N such that ``tokens`` is the compute-optimal D for the budget 6·N·D."""
    a, b = law.alpha, law.beta
    if not (0 < law.A < math.inf and 0 < law.B < math.inf):
        raise UserError("the fitted law has no compute-optimal size (one of its terms vanished): give the target's "
                        "model in the ladder file (target: {model: …, tokens: …})")
    log_g = math.log(a * law.A / (b * law.B)) / (a + b)
    log_c6 = (math.log(tokens) + log_g) * (a + b) / a  # C/6, from D_opt = (C/6)^(a/(a+b)) / G
    return math.exp(min(log_c6 - math.log(tokens), 700.0))
