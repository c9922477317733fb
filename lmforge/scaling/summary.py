"""The ladder's table for a terminal: `lmforge scaling run` prints it at the end and
`lmforge scaling show DIR` at any time (runs still going show their status)."""

from __future__ import annotations

from lmforge.config.counts import human


def format_runs(runs: list[dict]) -> list[str]:
    lines = [f"  {'run':<16}{'params':>8}{'tokens':>8}{'FLOPs':>10}  {'status':<11}{'loss':>8}{'law':>8}"
             f"{'resid.':>8}{'s':>6}"]
    for r in sorted(runs, key=lambda r: (r["params"], r["tokens"])):
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        fitted = f"{r['fitted']:.4f}" if r.get("fitted") is not None else "-"
        resid = f"{r['residual']:+.2%}" if r.get("residual") is not None else "-"
        secs = f"{r['seconds']:.0f}" if r.get("seconds") else "-"
        lines.append(f"  {r['label']:<16}{human(r['params']):>8}{human(r['tokens']):>8}{r['flops']:>10.2e}  "
                     f"{r.get('status', 'completed'):<11}{loss:>8}{fitted:>8}{resid:>8}{secs:>6}")
    return lines


def format_prediction(pred: dict, actual: float | None = None) -> list[str]:
    t, opt, f = pred["target"], pred["compute_optimal"], pred["fit"]
    lines = [f"law: L(N, D) = {f['E']:.3f} + {f['A']:.4g}/N^{f['alpha']:.3f} + {f['B']:.4g}/D^{f['beta']:.3f}   "
             f"({f['runs']} runs, {f['sizes']} sizes, RMS misfit {f['rms']:.2%})"]
    bt = f.get("backtest")
    if bt:
        lines.append(f"backtest: fitted without the {human(bt['held_out_params'])}-param runs, the law misses them by "
                     f"{bt['error']:.2%} (median)")
    lines.append(isoflop_line(pred))
    lines.append(f"target: {human(t['params'])} params × {human(t['tokens'])} tokens → held-out loss "
                 f"{t['loss']:.4f} ({t['confidence']:.0%} interval {t['loss_low']:.4f} – {t['loss_high']:.4f})")
    if actual is not None:
        inside = t["loss_low"] <= actual <= t["loss_high"]
        lines.append(f"  trained: {actual:.4f} ({actual / t['loss'] - 1:+.2%} from the prediction, "
                     f"{'inside' if inside else 'OUTSIDE'} the interval)")
    lines.append(f"compute-optimal for {t['flops']:.3g} FLOPs: {human(opt['params'])} params "
                 f"({human(opt['params_low'])} – {human(opt['params_high'])}) × {human(opt['tokens'])} tokens "
                 f"({opt['tokens_per_param']:.1f} tokens/param, {opt['epochs']:.1f} epochs of the data)")
    lines += [f"warning: {w}" for w in pred.get("warnings", [])]
    return lines


def isoflop_line(pred: dict) -> str:
    """The IsoFLOP cross-check in one line: the trend through the levels' minima, or why there is none."""
    iso = pred.get("isoflop") or {}
    opt = pred["compute_optimal"]
    if iso.get("params_at_target"):
        return (f"IsoFLOP cross-check: N_opt ∝ C^{iso['exponent']:.2f}, {human(iso['params_at_target'])} params at "
                f"the target's compute (law: {human(opt['params'])})")
    found = [lv for lv in iso.get("levels", []) if lv.get("n_opt")]
    notes = "; ".join(f"{lv['flops']:.2g} FLOPs: " + (f"minimum at {human(lv['n_opt'])} params" if lv.get("n_opt")
                                                       else lv["note"]) for lv in iso.get("levels", []))
    return (f"IsoFLOP cross-check: {'one level' if found else 'no level'} has its minimum inside the sizes run, "
            f"no trend to compare ({notes})")
