"""Fitting a scaling law to a ladder's held-out losses: Chinchilla's parametric form, its
uncertainty, and the IsoFLOP parabolas that cross-check it. numpy only.

The law (Hoffmann et al. 2022, "approach 3"): L(N, D) = E + A / N^α + B / D^β with N the
parameters and D the training tokens. Fitted as they did: on log-loss, the model written as
log L = LSE(e, a − α·log N, b − β·log D) (E = eᵉ, A = eᵃ, B = eᵇ), a Huber objective on the
residuals (plus a weak prior on the exponents, `EXPONENT_PRIOR`), from a grid of starts, keeping
the best. Their δ = 10⁻³ treats almost every residual
of a small ladder as an outlier (an L1 fit that interpolates five of the points); ours is
``HUBER_DELTA`` = 1%, about one run's seed-to-seed scatter, so points are averaged and only a
clearly broken run is discounted. The optimizer is Levenberg–Marquardt on the iteratively
reweighted problem (a five-parameter problem does not need scipy).

Uncertainty (`bootstrap`): a residual bootstrap — the design (which N and D were run) is kept,
the residuals are resampled (inflated by √(n / (n − 5)) for the parameters fitted) and the law
refitted — gives the spread of a prediction from the runs' noise. Resampling whole runs
instead would often leave too few sizes in a small ladder to fit anything. That spread does not
know whether the form itself extrapolates; `backtest` measures that: the ladder without its
largest size predicts the largest size's runs.

IsoFLOP (Hoffmann's "approach 2"): at each compute level, a parabola of loss over log N gives
the size of least loss; a line through those minima over log C gives N_opt(C).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

HUBER_DELTA = 0.01  # on log-loss: 1% of the loss (see the module docstring)
FLOPS_PER_PARAM_TOKEN = 6.0  # C = 6·N·D, the standard training-compute basis
EXPONENT_BOUNDS = (0.02, 2.5)  # α, β stay here: outside, the form is describing noise
# A weak prior on each exponent: log-normal around 0.35 (Hoffmann et al. 0.34 and 0.28; Besiroglu et
# al.'s refit of their data 0.35 and 0.37), a factor 2 wide at one σ. It decides only what the runs
# cannot: a small ladder's α and E trade off almost freely, and without it the same runs less one
# size gave predictions 4% apart (BENCHMARKS.md, scaling ladder).
EXPONENT_PRIOR = (0.35, math.log(2.0))
N_PARAMS = 5


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta (loss in nats per token)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, params, tokens):
        n, d = np.asarray(params, dtype=float), np.asarray(tokens, dtype=float)
        out = self.E + self.A * n ** -self.alpha + self.B * d ** -self.beta
        return float(out) if out.ndim == 0 else out

    def optimum(self, flops: float) -> tuple[float, float]:
        """The (N, D) of least loss for a budget of ``flops`` = 6·N·D (Hoffmann et al.'s eq. 4)."""
        a, b = self.alpha, self.beta
        if not (0 < self.A < math.inf and 0 < self.B < math.inf):
            return math.nan, math.nan  # a degenerate law (a bootstrap sample's): one term vanished
        c6 = math.log(flops / FLOPS_PER_PARAM_TOKEN)
        log_n = (math.log(a * self.A / (b * self.B)) + b * c6) / (a + b)  # in logs: A and B may be huge
        log_d = c6 - log_n
        return math.exp(min(log_n, 700.0)), math.exp(min(log_d, 700.0))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Fit:
    law: Law
    objective: float  # the Huber objective at the solution
    residuals: np.ndarray  # log(observed) − log(predicted), per point
    at_bound: bool  # an exponent ended on EXPONENT_BOUNDS

    @property
    def rms(self) -> float:
        """Root-mean-square relative misfit of the points (log-loss residuals)."""
        return float(np.sqrt(np.mean(self.residuals ** 2)))


def _theta_law(theta: np.ndarray) -> Law:
    e, a, alpha, b, beta = (float(x) for x in theta)
    return Law(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)


def _law_theta(law: Law) -> np.ndarray:
    return np.array([math.log(max(law.E, 1e-300)), math.log(law.A), law.alpha, math.log(law.B), law.beta])


def _predict_log(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log L̂ per point and its Jacobian in (e, a, α, b, β), for a batch of parameter vectors:
    ``theta`` (B, 5) → (B, n) and (B, n, 5)."""
    e, a, alpha, b, beta = (theta[:, i:i + 1] for i in range(N_PARAMS))
    terms = np.stack(np.broadcast_arrays(e, a - alpha * log_n, b - beta * log_d), axis=2)
    top = terms.max(axis=2, keepdims=True)
    w = np.exp(terms - top)
    total = w.sum(axis=2, keepdims=True)
    pred = (top + np.log(total))[:, :, 0]
    p = w / total  # each term's share of the loss
    jac = np.stack([p[..., 0], p[..., 1], -p[..., 1] * log_n, p[..., 2], -p[..., 2] * log_d], axis=2)
    return pred, jac


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    """The Huber objective of each row of residuals."""
    a = np.abs(r)
    return np.sum(np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta)), axis=-1)


def _clip(theta: np.ndarray) -> np.ndarray:
    lo, hi = EXPONENT_BOUNDS
    theta = theta.copy()
    theta[:, 2] = np.clip(theta[:, 2], lo, hi)
    theta[:, 4] = np.clip(theta[:, 4], lo, hi)
    theta[:, 0] = np.maximum(theta[:, 0], -30.0)  # E → 0 is allowed, as a finite number
    return theta


def _prior(theta: np.ndarray, prior, delta: float):
    """The exponents' prior as a penalty: its value, gradient and (Gauss–Newton) Hessian per row."""
    value = np.zeros(len(theta))
    grad = np.zeros((len(theta), N_PARAMS))
    hess = np.zeros((len(theta), N_PARAMS, N_PARAMS))
    if prior is None:
        return value, grad, hess
    center, width = prior
    weight = delta * delta / (width * width)  # as a Gaussian prior against residuals of scale δ
    for i in (2, 4):
        z = np.log(theta[:, i] / center)
        value += 0.5 * weight * z * z
        grad[:, i] = weight * z / theta[:, i]
        hess[:, i, i] = weight / theta[:, i] ** 2
    return value, grad, hess


def _refine(theta: np.ndarray, log_n, log_d, log_l, delta: float, iters: int = 400,
            prior=None) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg–Marquardt on the Huber objective (IRLS weights) plus the exponents' prior, for a
    batch: ``theta`` (B, 5) from its starts, ``log_l`` (B, n) (a batch of starts shares one row of
    losses, a bootstrap has one per sample). Each row stops once an accepted step gains less than
    a part in 10⁹."""
    theta = _clip(np.atleast_2d(theta).astype(float))
    log_l = np.broadcast_to(log_l, (len(theta), len(log_n)))
    pred, jac = _predict_log(theta, log_n, log_d)
    obj = _huber(pred - log_l, delta) + _prior(theta, prior, delta)[0]
    lam = np.full(len(theta), 1e-3)
    active = np.ones(len(theta), bool)
    eye = 1e-12 * np.eye(N_PARAMS)
    for _ in range(iters):
        if not active.any():
            break
        r = pred - log_l
        psi = np.clip(r, -delta, delta)  # the Huber loss's derivative
        w = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-300))
        _, p_grad, p_hess = _prior(theta, prior, delta)
        grad = np.einsum("bnk,bn->bk", jac, psi) + p_grad
        hess = np.einsum("bnk,bn,bnm->bkm", jac, w, jac) + p_hess
        damp = lam[:, None, None] * (hess.diagonal(axis1=1, axis2=2)[:, :, None] * np.eye(N_PARAMS) + eye)
        cand = _clip(theta + np.linalg.solve(hess + damp, -grad[:, :, None])[:, :, 0])
        cpred, cjac = _predict_log(cand, log_n, log_d)
        cobj = _huber(cpred - log_l, delta) + _prior(cand, prior, delta)[0]
        better = active & (cobj < obj)
        gain = np.where(better, obj - cobj, 0.0)
        theta[better], pred[better], jac[better] = cand[better], cpred[better], cjac[better]
        obj = np.where(better, cobj, obj)
        lam = np.where(better, np.maximum(lam / 3.0, 1e-12), lam * 4.0)
        active &= ~(better & (gain < 1e-9 * np.maximum(obj, 1e-12))) & (lam < 1e10)
    return theta, obj


def _starts(log_n, log_d, loss) -> np.ndarray:
    """A grid over (E, α, β); A and B from linear least squares given those (L − E is linear in
    them), the negative ones dropped."""
    out = []
    n, d = np.exp(log_n), np.exp(log_d)
    for e_frac in (0.1, 0.4, 0.7, 0.9):
        e = e_frac * loss.min()
        for alpha in (0.15, 0.35, 0.7):
            for beta in (0.15, 0.35, 0.7):
                x = np.stack([n ** -alpha, d ** -beta], axis=1)
                coef, *_ = np.linalg.lstsq(x, loss - e, rcond=None)
                coef = np.maximum(coef, 1e-6 * (loss - e).mean() / x.mean(axis=0))
                out.append([math.log(e), math.log(coef[0]), alpha, math.log(coef[1]), beta])
    return np.array(out)


def fit_law(params, tokens, losses, *, delta: float = HUBER_DELTA, start: Law | None = None,
            prior=EXPONENT_PRIOR) -> Fit:
    """The law of least Huber objective on log-loss; ``start`` (e.g. the full ladder's fit, when
    refitting a bootstrap sample) replaces the grid of starts."""
    log_n, log_d = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    loss = np.asarray(losses, float)
    if len(loss) < 2 or not np.all(np.isfinite(loss)) or np.any(loss <= 0):
        raise ValueError("fit_law needs at least two finite, positive losses")
    log_l = np.log(loss)
    if start is not None:
        thetas, objs = _refine(np.array([_law_theta(start)]), log_n, log_d, log_l, delta, prior=prior)
    else:  # every start a little way, then the best few to the end
        thetas, objs = _refine(_starts(log_n, log_d, loss), log_n, log_d, log_l, delta, iters=30, prior=prior)
        keep = np.argsort(objs)[:4]
        thetas, objs = _refine(thetas[keep], log_n, log_d, log_l, delta, prior=prior)
    return _result(thetas[int(np.argmin(objs))], float(objs.min()), log_n, log_d, log_l)


def _result(theta: np.ndarray, obj: float, log_n, log_d, log_l) -> Fit:
    pred, _ = _predict_log(theta[None], log_n, log_d)
    lo, hi = EXPONENT_BOUNDS
    at_bound = any(math.isclose(float(theta[i]), bound, rel_tol=1e-6) for i in (2, 4) for bound in (lo, hi))
    return Fit(_theta_law(theta), obj, log_l - pred[0], at_bound)


def bootstrap(fit: Fit, params, tokens, *, samples: int = 300, seed: int = 0,
              delta: float = HUBER_DELTA, prior=EXPONENT_PRIOR) -> list[Law]:
    """Laws refitted to the fitted losses with resampled residuals (see the module docstring)."""
    n = len(fit.residuals)
    rng = np.random.default_rng(seed)
    base = np.asarray(fit.law.loss(params, tokens), float)
    inflate = math.sqrt(n / (n - N_PARAMS)) if n > N_PARAMS else 1.0
    resid = (fit.residuals - fit.residuals.mean()) * inflate
    fake = np.log(base) + rng.choice(resid, size=(samples, n), replace=True)
    log_n, log_d = np.log(np.asarray(params, float)), np.log(np.asarray(tokens, float))
    thetas, _ = _refine(np.repeat(_law_theta(fit.law)[None], samples, axis=0), log_n, log_d, fake, delta, iters=100,
                         prior=prior)
    return [_theta_law(t) for t in thetas]


@dataclass(frozen=True)
class Backtest:
    """The ladder without its largest size, predicting that size's runs."""

    held_out_params: float
    next_params: float  # the largest size it was fitted on
    error: float  # the median |log(observed / predicted)| of the held-out runs
    errors: list[float]

    def scaled(self, target_params: float) -> float:
        """The error expected at ``target_params``, growing linearly with the distance in log N
        past the ladder (an error in α costs Δα · Δlog N)."""
        step = math.log(self.held_out_params / self.next_params)
        reach = math.log(max(target_params, self.held_out_params) / self.held_out_params)
        return self.error * max(1.0, reach / step) if step > 0 else self.error


def backtest(params, tokens, losses, *, delta: float = HUBER_DELTA, min_points: int = N_PARAMS,
             prior=EXPONENT_PRIOR) -> Backtest | None:
    """None when the ladder without its largest size has fewer than ``min_points`` runs or one size."""
    n, d, loss = (np.asarray(x, float) for x in (params, tokens, losses))
    top = n.max()
    keep = n < top
    if keep.sum() < min_points or len(np.unique(n[keep])) < 2:
        return None
    fit = fit_law(n[keep], d[keep], loss[keep], delta=delta, prior=prior)
    errors = np.log(loss[~keep]) - np.log(fit.law.loss(n[~keep], d[~keep]))
    # The median, not the largest: one short, noisy run of the held-out size should not decide it.
    return Backtest(float(top), float(n[keep].max()), float(np.median(np.abs(errors))), [float(x) for x in errors])


@dataclass(frozen=True)
class IsoFlopLevel:
    flops: float
    n_opt: float | None  # None: the parabola has no minimum inside the sizes run
    loss_min: float | None
    sizes: int
    note: str = ""


def isoflop_levels(params, tokens, losses, levels) -> list[IsoFlopLevel]:
    """One parabola in log N per compute level (``levels[i]`` names run i's level) with ≥ 3 sizes."""
    n, d, loss = (np.asarray(x, float) for x in (params, tokens, losses))
    lv = np.asarray(levels)
    out = []
    for level in sorted(set(levels)):
        mask = lv == level
        sizes = len(np.unique(n[mask]))
        flops = float(np.median(FLOPS_PER_PARAM_TOKEN * n[mask] * d[mask]))
        if sizes < 3:
            out.append(IsoFlopLevel(flops, None, None, sizes, "fewer than 3 sizes"))
            continue
        x = np.log(n[mask])
        c2, c1, c0 = np.polyfit(x, loss[mask], 2)
        if c2 <= 0:
            out.append(IsoFlopLevel(flops, None, None, sizes, "no minimum (the losses do not curve up)"))
            continue
        xm = -c1 / (2 * c2)
        if not (x.min() <= xm <= x.max()):
            side = "below the smallest" if xm < x.min() else "above the largest"
            out.append(IsoFlopLevel(flops, None, None, sizes, f"the minimum is {side} size run"))
            continue
        out.append(IsoFlopLevel(flops, float(math.exp(xm)), float(c0 + c1 * xm + c2 * xm * xm), sizes))
    return out


def isoflop_trend(levels: list[IsoFlopLevel]) -> tuple[float, float] | None:
    """(exponent a, coefficient k) of N_opt = k·C^a through the levels' minima; None under two."""
    pts = [(math.log(lv.flops), math.log(lv.n_opt)) for lv in levels if lv.n_opt]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    x, y = np.array(pts).T
    a, c = np.polyfit(x, y, 1)
    return float(a), float(math.exp(c))
