"""The ladder's table for a terminal: `lmforge scaling run` prints it at the end and
`lmforge scaling show DIR` at any time (runs still going show their status)."""

from __future__ import annotations

from lmforge.config.counts import human


def run_cells(r: dict) -> list[str]:
    """One ladder run as the table's cells: run, params, tokens, FLOPs, status, held-out loss, the
    law's value, the residual, seconds (the terminal's table and the report's alike)."""
    return [r["label"], human(r["params"]), human(r["tokens"]), f"{r['flops']:.2e}", r.get("status", "completed"),
            f"{r['loss']:.4f}" if r.get("loss") is not None else "-",
            f"{r['fitted']:.4f}" if r.get("fitted") is not None else "-",
            f"{r['residual']:+.2%}" if r.get("residual") is not None else "-",
            f"{r['seconds']:.0f}" if r.get("seconds") else "-"]


def ordered(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: (r["params"], r["tokens"]))


def format_runs(runs: list[dict]) -> list[str]:
    def line(c: list[str]) -> str:
        return (f"  {c[0]:<16}{c[1]:>8}{c[2]:>8}{c[3]:>10}  {c[4]:<11}{c[5]:>8}{c[6]:>8}{c[7]:>8}{c[8]:>6}")
    return [line(["run", "params", "tokens", "FLOPs", "status", "loss", "law", "resid.", "s"])] + \
        [line(run_cells(r)) for r in ordered(runs)]


# What the prediction is of: the final held-out loss of the target's run, in its unit.
METRIC = "the final eval/loss of `lmforge train -f target.yaml`"
UNIT = "nats/token"


def prediction_facts(pred: dict, actual: float | None = None) -> list[tuple[str, str]]:
    """(label, text) of what a ladder found: the law, its checks, the prediction (with its unit and
    the metric it predicts) and the trained target's loss, the compute-optimal size. The terminal
    prints them as lines (`format_prediction`), the ladder's report as a table — one wording."""
    t, opt, f = pred["target"], pred["compute_optimal"], pred["fit"]
    facts = [("law", f"L(N, D) = {f['E']:.3f} + {f['A']:.4g}/N^{f['alpha']:.3f} + {f['B']:.4g}/D^{f['beta']:.3f}   "
                     f"({f['runs']} runs, {f['sizes']} sizes, RMS misfit {f['rms']:.2%})")]
    bt = f.get("backtest")
    if bt:
        facts.append(("backtest", f"fitted without the {human(bt['held_out_params'])}-param runs, the law misses them "
                                  f"by {bt['error']:.2%} (median)"))
    facts.append(("IsoFLOP cross-check", isoflop_line(pred).split(": ", 1)[1]))
    facts.append(("target", f"{human(t['params'])} params × {human(t['tokens'])} tokens ({t['flops']:.3g} FLOPs)"))
    facts.append(("predicted held-out loss", f"{t['loss']:.4f} {UNIT} ({t['confidence']:.0%} interval "
                                             f"{t['loss_low']:.4f} – {t['loss_high']:.4f}): {METRIC}"))
    if actual is not None:
        inside = t["loss_low"] <= actual <= t["loss_high"]
        facts.append(("trained target", f"{actual:.4f} {UNIT} ({actual / t['loss'] - 1:+.2%} from the prediction, "
                                        f"{'inside' if inside else 'OUTSIDE'} the interval)"))
    max_epochs = (pred.get("ladder") or {}).get("max_epochs")
    over = max_epochs is not None and opt["epochs"] > max_epochs
    facts.append((f"compute-optimal for {t['flops']:.3g} FLOPs",
                  f"{human(opt['params'])} params ({human(opt['params_low'])} – {human(opt['params_high'])}) × "
                  f"{human(opt['tokens'])} tokens ({opt['tokens_per_param']:.1f} tokens/param, {opt['epochs']:.1f} "
                  "epochs of the data" + (f": more than ladder.max_epochs {max_epochs:g}, see the warning)" if over
                                          else ")")))
    return facts


def format_prediction(pred: dict, actual: float | None = None) -> list[str]:
    return [f"{label}: {text}" for label, text in prediction_facts(pred, actual)] + \
        [f"warning: {w}" for w in pred.get("warnings", [])]


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
