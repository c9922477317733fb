"""Scaling-law ladders: the fit recovers a known law and its intervals cover; the planner keeps
its rules; bad ladder files are one line; and one small real ladder end to end (`lmforge
scaling run` trains registered runs, fits, writes the prediction, target.yaml and the report, and a
re-run resumes instead of starting over)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from browser import Browser, browser_setup_note, find_chromium
from train_helpers import assert_one_line_error, cli, lmforge, metrics

from lmforge.errors import UserError
from lmforge.scaling.config import LadderConfig, load_ladder
from lmforge.scaling.fit import Law, backtest, fit_law, isoflop_levels, isoflop_trend
from lmforge.scaling.ladder_plan import plan_ladder
from lmforge.scaling.predict import predict

CHINCHILLA = Law(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)  # Hoffmann et al.'s fit


def isoflop_design(law: Law, flops=(1e17, 4e17, 1.6e18), spread=(0.25, 0.5, 1, 2, 4)):
    """Runs on IsoFLOP lines around the law's optimum: (N, D, level) arrays."""
    n, d, lv = [], [], []
    for i, c in enumerate(flops):
        n_opt, _ = law.optimum(c)
        for f in spread:
            n.append(n_opt * f)
            d.append(c / (6 * n_opt * f))
            lv.append(i)
    return np.array(n), np.array(d), lv


def test_fit_recovers_a_known_law_and_its_optimum():
    n, d, _ = isoflop_design(CHINCHILLA)
    exact = fit_law(n, d, CHINCHILLA.loss(n, d), prior=None)
    for key in ("E", "A", "alpha", "B", "beta"):
        assert getattr(exact.law, key) == pytest.approx(getattr(CHINCHILLA, key), rel=1e-4), key
    assert exact.rms < 1e-6
    # The exponents' weak prior moves a law the runs pin down by next to nothing.
    held = fit_law(n, d, CHINCHILLA.loss(n, d))
    assert held.law.alpha == pytest.approx(CHINCHILLA.alpha, rel=0.02) and held.rms < 1e-3
    assert exact.law.optimum(1e21)[0] == pytest.approx(CHINCHILLA.optimum(1e21)[0], rel=1e-3)
    # With 0.5% noise the far prediction (4× the largest size, 10× the compute) stays within 3%.
    noisy = CHINCHILLA.loss(n, d) * np.exp(np.random.default_rng(0).normal(0, 0.005, len(n)))
    fit = fit_law(n, d, noisy)
    big_n, big_d = 4 * n.max(), 10 * 1.6e18 / (6 * 4 * n.max())
    assert fit.law.loss(big_n, big_d) == pytest.approx(CHINCHILLA.loss(big_n, big_d), rel=0.03)
    assert 0.2 < fit.law.alpha < 0.5 and 0.15 < fit.law.beta < 0.45


def test_the_prediction_is_the_known_laws_value():
    """Runs that lie on a known law predict a target 4× the largest run at that law's loss: within
    1% (the exponents' weak prior moves it by ~0.6%), so a prediction biased by 3% fails here —
    the interval checks alone do not see a bias their width covers."""
    n, d, levels = isoflop_design(CHINCHILLA, flops=(1e17, 4e17, 1.6e18), spread=(0.5, 1, 2))
    runs = [{"label": str(i), "params": float(a), "tokens": float(b), "level": lv, "loss": float(c)}
            for i, (a, b, lv, c) in enumerate(zip(n, d, levels, CHINCHILLA.loss(n, d)))]
    target_n, target_d = 4 * n.max(), 2 * d.max()
    out = predict(runs, target_params=target_n, target_tokens=target_d, target_flops=None, unique_tokens=1e30,
                  samples=8)
    t = out["target"]
    assert t["loss"] == pytest.approx(CHINCHILLA.loss(target_n, target_d), rel=0.01)
    assert t["loss_low"] < t["loss"] < t["loss_high"]
    optimum = CHINCHILLA.optimum(out["compute_optimal"]["flops"])[0]
    assert out["compute_optimal"]["params"] == pytest.approx(optimum, rel=0.05)


@pytest.mark.e2e  # a few seconds of fitting
def test_intervals_cover_the_true_loss():
    """Over independent noisy ladders, the 90% interval of predict() holds the true loss of a
    target 4× the largest run in about 90% of them (here: at least 10 of 12)."""
    n, d, levels = isoflop_design(CHINCHILLA, flops=(1e17, 4e17), spread=(0.5, 1, 2, 4))
    target_n = 4 * n.max()
    target_d = 2 * d.max()
    truth = CHINCHILLA.loss(target_n, target_d)
    rng = np.random.default_rng(7)
    covered = 0
    for _ in range(12):
        losses = CHINCHILLA.loss(n, d) * np.exp(rng.normal(0, 0.01, len(n)))
        runs = [{"label": str(i), "params": float(a), "tokens": float(b), "level": lv, "loss": float(c)}
                for i, (a, b, lv, c) in enumerate(zip(n, d, levels, losses))]
        t = predict(runs, target_params=target_n, target_tokens=target_d, target_flops=None,
                    unique_tokens=1e30, samples=40)["target"]
        covered += t["loss_low"] <= truth <= t["loss_high"]
    assert covered >= 10, covered


def test_isoflop_parabolas_find_the_laws_optimum():
    n, d, levels = isoflop_design(CHINCHILLA)
    found = isoflop_levels(n, d, CHINCHILLA.loss(n, d), levels)
    assert [lv.sizes for lv in found] == [5, 5, 5]
    for lv in found:  # a parabola in log N is close to the law's minimum along the line
        assert lv.n_opt == pytest.approx(CHINCHILLA.optimum(lv.flops)[0], rel=0.25)
    a, _ = isoflop_trend(found)
    assert a == pytest.approx(CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta), abs=0.05)
    # A level whose sizes all sit on one side of the minimum says so instead of extrapolating.
    side = isoflop_levels(n[:3], d[:3], CHINCHILLA.loss(n[:3], d[:3]) - np.array([0.0, 0.05, 0.2]), [0, 0, 0])
    assert side[0].n_opt is None and "size run" in side[0].note


def test_honesty_few_runs_widen_the_interval_and_say_why():
    n, d, levels = isoflop_design(CHINCHILLA, flops=(1e17,), spread=(0.5, 2))
    runs = [{"label": str(i), "params": float(a), "tokens": float(b), "level": 0, "loss": float(c)}
            for i, (a, b, c) in enumerate(zip(n, d, CHINCHILLA.loss(n, d)))]
    out = predict(runs, target_params=8 * n.max(), target_tokens=d.max(), target_flops=None, unique_tokens=1e30,
                  samples=20)
    text = " | ".join(out["warnings"])
    assert "only 2 runs" in text and "only 2 model sizes" in text and "two token counts" in text
    t = out["target"]
    assert t["loss_high"] / t["loss"] >= 1.05 - 1e-9 and t["loss"] / t["loss_low"] >= 1.05 - 1e-9
    assert backtest(n, d, CHINCHILLA.loss(n, d)) is None


# --------------------------------------------------------------------------- the planner

def _ladder(tmp_path, **over) -> LadderConfig:
    spec = {"name": "lad", "train_data": str(tmp_path / "train.txt"), "tokenizer": str(tmp_path / "tok"),
            "save_folder": str(tmp_path / "lad"), "target": {"model": {"d_model": 160, "n_layers": 5, "n_heads": 5},
                                                              "tokens": "1M"}, "budget": "6min"}
    for key, value in over.items():
        spec[key] = value
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_ladder(str(path))


RATES = {32: 40e3, 48: 30e3, 64: 20e3, 80: 15e3, 96: 10e3, 128: 6e3}


def _plan(cfg, **kw):
    args = dict(vocab=512, context=256, unique_tokens=500e3, val_tokens=50e3,
                tokens_per_s=lambda m: RATES[m.d_model], overhead_s=10.0)
    return plan_ladder(cfg, **(args | kw))


def test_plan_keeps_its_rules(tmp_path):
    cfg = _ladder(tmp_path, ladder={"parallel": 2})
    plan = _plan(cfg)
    target = plan.target.params
    assert plan.target.how == "given" and target == 1_906_400  # 5 × 160, SwiGLU 512, untied, vocabulary 512
    assert all(p.params * 4 <= target for p in plan.points)
    assert len({p.params for p in plan.points}) >= 3 and len(plan.points) >= 6
    assert plan.estimated_seconds <= 360
    for p in plan.points:
        assert p.tokens % p.batch_tokens == 0 and p.tokens // p.batch_tokens >= 200  # ladder.min_steps
        assert p.tokens <= 4 * 500e3  # ladder.max_epochs
    by_level = {}
    for p in plan.points:  # each level is one IsoFLOP line (up to the rounding to whole steps)
        by_level.setdefault(p.level, []).append(p.flops)
    for flops in by_level.values():
        assert max(flops) / min(flops) < 1.1
    tops = sorted(max(f) for f in by_level.values())
    assert all(b / a == pytest.approx(2.0, rel=0.1) for a, b in zip(tops, tops[1:]))
    assert plan.eval_batches == int(50e3 // 256) // 8


def test_every_run_and_the_target_train_with_one_optimizer(tmp_path):
    """`optimizer: auto` changes optimizer at 5M parameters; a ladder pins one for all its runs and
    its target (AdamW for auto, else the file's) with that optimizer's LR rule."""
    from lmforge.config.defaults import default_learning_rate
    from lmforge.runs.ladder import run_config, target_config

    for given, expected in ((None, "adamw"), ("auto", "adamw"), ("muon", "muon")):
        cfg = _ladder(tmp_path, **({"parameters": {"optimizer": given}} if given else {}))
        plan = _plan(cfg)
        raws = [run_config(cfg, plan, p) for p in plan.points]
        raws.append(target_config(cfg, plan, plan.target.model, 1e6))
        assert {r["parameters"]["optimizer"] for r in raws} == {expected}
        small = min(plan.points, key=lambda p: p.params)  # well under 5M: the small end's anchor of each rule
        assert small.learning_rate == default_learning_rate(1.0, expected) == {"adamw": 2e-3, "muon": 4e-3}[expected]


@pytest.mark.parametrize("change, words", [
    ({"target": {"model": {"d_model": 64, "n_layers": 2, "n_heads": 2}, "tokens": "1M"}},
     ["less than 4× the ladder's second smallest model", "give a bigger target"]),
    ({"target": {"tokens": "1M"}}, ["compute-optimal model for the target", "give a bigger target"]),
    ({"budget": "20s"}, ["cannot fit two ladder runs on this machine now", "give at least"]),
    ({"budget": "1e9flop"}, ["cannot fit two ladder runs", "give a larger budget"]),
    ({"target": {"model": {"d_model": 160, "n_layers": 5, "n_heads": 5}, "tokens": "5M"}},
     ["train_data: 500K tokens is too small for the target's 5M", "ladder.max_epochs"]),
])
def test_plans_that_cannot_work_say_why(tmp_path, change, words):
    with pytest.raises(UserError) as e:
        _plan(_ladder(tmp_path, **change))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_data_too_small_for_the_ladder(tmp_path):
    with pytest.raises(UserError, match="too small for the ladder: its shortest run"):
        _plan(_ladder(tmp_path, target={"model": {"d_model": 160, "n_layers": 5, "n_heads": 5}, "tokens": 40e3}),
              unique_tokens=20e3)
    with pytest.raises(UserError, match="held-out data has 1K tokens, less than one batch"):
        _plan(_ladder(tmp_path), val_tokens=1000)


@pytest.mark.parametrize("spec, words", [
    ({"model": "llama-125m"}, ["`model` has no place in a ladder file", "target: {model"]),
    ({"budget": "500ba"}, ["budget: expected a wall-clock time"]),
    ({"target": {"tokens": "1M", "flops": 1e15}}, ["give `tokens` or `flops`, not both"]),
    ({"target": {"model": "llama-125m"}}, ["give `tokens`"]),
    ({"tokenizer": {"train": {"vocab_size": "auto"}}}, ["vocab_size: auto would give each model size"]),
    ({"ladder": {"sizez": 3}}, ["unknown config key 'ladder.sizez'", "did you mean 'sizes'"]),
    ({"parameters": {"learning_rat": 1e-3}}, ["parameters.learning_rat"]),
])
def test_bad_ladder_files_are_one_line(tmp_path, spec, words):
    base = {"train_data": "x.txt", "tokenizer": "tok", "target": {"tokens": "1M"}, "budget": "6min"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base | spec))
    proc = cli("scaling", "run", "-f", path, "--dry-run")
    assert_one_line_error(proc, *words)


@pytest.mark.parametrize("content", ['{"plan": {"points": []}}', '["a list"]', '{"plan": 3}'])
def test_a_plan_file_this_version_cannot_read_is_one_line(tmp_path, content):
    """`scaling show` of a folder whose plan.json was edited by hand or written by another version."""
    (tmp_path / "plan.json").write_text(content)
    assert_one_line_error(cli("scaling", "show", tmp_path), "plan.json: not a ladder plan this version can read",
                          "delete it to plan again")


@pytest.mark.integration  # builds and steps a tiny model
def test_a_ladder_plans_with_the_typical_step_and_caches_nothing(tmp_path, monkeypatch):
    """`typical=True` (a time budget under the present load): the mean timed step, not the fastest,
    and no cache entry (a clock whose first timed step is 10× slower than the others)."""
    from lmforge.config.model import ModelConfig
    from lmforge.train.throughput import cached_tokens_per_s, measure_tokens_per_s

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    steps = iter([1.0, 0.1, 0.1])
    now, started = [0.0], [False]

    def clock():
        if started[0]:
            now[0] += next(steps)
        started[0] = not started[0]
        return now[0]

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
    assert measure_tokens_per_s(cfg, 16, 2, steps=3, warmup=0, clock=clock, typical=True) == pytest.approx(2 * 16 / 0.4)
    assert cached_tokens_per_s(cfg, 16, 2) is None


@pytest.mark.e2e  # a fresh interpreter
def test_scaling_package_is_torch_free():
    code = ("import sys, lmforge.scaling.fit, lmforge.scaling.ladder_plan, lmforge.scaling.predict, lmforge.scaling.summary; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- a real ladder

# The shipped example, as it is, made test-sized with the command line's own overrides: the built-in
# corpus at a short context, 2 sizes × 2 compute levels of a FLOPs budget, a small target.
EXAMPLE_OVERRIDES = ["--budget", "6e10flop",
                     "--set", "target={model: {d_model: 128, n_layers: 2, n_heads: 4}, tokens: 40K}",
                     "--set", "parameters={context_length: 64, global_batch_size: 8, warmup: 2ba}",
                     "--set", "ladder={sizes: 2, levels: 2, min_steps: 10, parallel: 2, threads: 1}"]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """`lmforge scaling run -f examples/scaling.yaml` (test-sized by --budget/--set): a 4-run ladder on
    the built-in corpus, two at a time: (the command's arguments, its save folder, its output)."""
    from conftest import REPO

    root = tmp_path_factory.mktemp("ladder")
    args = ["scaling", "run", "-f", REPO / "examples" / "scaling.yaml", *EXAMPLE_OVERRIDES,
            "--set", f"save_folder={root / 'lad'}"]
    proc = lmforge(*args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return args, root / "lad", proc.stdout


@pytest.mark.e2e
def test_a_ladder_trains_registered_runs_fits_and_resumes(ladder, tmp_path):
    """The shipped example end to end (test-sized): registered runs, the fit and prediction (with its
    unit and metric), the target trained from its own folder and recorded, the report in Chromium,
    and a re-run that resumes instead of starting over."""
    from lmforge.config.load import build_config
    from lmforge.runs.registry import Registry

    args, folder, out = ladder
    assert "law: L(N, D) =" in out and "target: " in out and "next: lmforge train -f" in out
    assert re.search(r"^predicted held-out loss: \d\.\d{4} nats/token \(90% interval [\d.]+ – [\d.]+\): the final "
                     r"eval/loss of `lmforge train -f target\.yaml`$", out, re.M), out[-2000:]
    assert re.search(r"^scaling: \S+ completed in \d+s, held-out loss \d\.\d{4}; \d to go$", out, re.M), out
    pred = json.loads((folder / "prediction.json").read_text())
    t = pred["target"]
    assert t["loss_low"] < t["loss"] < t["loss_high"] and t["params"] > 4 * max(r["params"] for r in pred["runs"])
    assert t["tokens"] == 40_000 and {"E", "A", "alpha", "B", "beta", "rms"} <= set(pred["fit"])
    runs = pred["runs"]
    assert len(runs) == 4 and {r["status"] for r in runs} == {"completed"}
    assert len({r["params"] for r in runs}) == 2 and {r["level"] for r in runs} == {0, 1}
    assert any("too few" in w for w in pred["warnings"])  # 4 runs cannot judge a 5-parameter law
    for r in runs:  # each run is an ordinary registered run with its own config file
        row = Registry().saved_in(r["save_folder"])
        assert row and row[0]["status"] == "COMPLETED" and row[0]["name"] == f"stdlib-{r['label']}"
        assert r["loss"] == [m for m in metrics(Path(r["save_folder"])) if "eval/loss" in m][-1]["eval/loss"]
    # target.yaml: a valid run config with the same recipe and the same held-out samples as the runs
    target = build_config(yaml.safe_load((folder / "target.yaml").read_text()))
    one = build_config(yaml.safe_load((folder / "runs" / f"{runs[0]['label']}.yaml").read_text()))
    assert target.model.d_model == 128 and target.training_duration.value == 40_000
    assert target.eval.max_batches == one.eval.max_batches and target.parameters.context_length == 64
    assert target.parameters.micro_batch_size == one.parameters.micro_batch_size == 8
    assert target.parameters.optimizer == one.parameters.optimizer == "adamw"  # one recipe: auto would switch at 5M
    assert "lmforge-report" in (folder / "report.html").read_text()[:2000]
    # `scaling show`: the same table, any time
    shown = cli("scaling", "show", folder, check=True).stdout
    assert "4 of 4 runs completed" in shown and f"{t['loss']:.4f}" in shown and "trained target" not in shown
    # The target, trained from target.yaml's own folder: its loss reaches prediction.json and report.html
    trained = lmforge("train", "-f", "target.yaml", cwd=folder, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    actual = [m for m in metrics(folder / "target") if "eval/loss" in m][-1]["eval/loss"]
    assert f"scaling: the target's held-out loss {actual:.4f} (" in trained.stdout, trained.stdout[-1500:]
    assert json.loads((folder / "prediction.json").read_text())["target"]["actual"] == actual
    assert re.search(rf"^trained target: {actual:.4f} nats/token \([+-][\d.]+% from the prediction, (inside|OUTSIDE) "
                     r"the interval\)$", cli("scaling", "show", folder, check=True).stdout, re.M)
    _the_report_as_a_reader_sees_it(folder / "report.html", actual, tmp_path)
    # A re-run skips what is done and resumes what is not: one run's export removed, it continues
    # from its last checkpoint; the others are not trained again.
    redo = folder / "runs" / runs[-1]["label"]
    shutil.rmtree(redo / "final")
    again = lmforge(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the ladder planned" in again.stdout and "3 of 4 runs already completed" in again.stdout
    assert "resume: continuing from" in (redo / "logs" / "resumption-1.log").read_text()
    assert (redo / "final").is_dir()


def _the_report_as_a_reader_sees_it(page, actual: float, tmp_path) -> None:
    chromium = find_chromium()
    if chromium is None:
        return  # (the rest of the test stands; the report's page is checked where a browser is installed)
    with Browser(chromium) as b:
        b.open(page.as_uri())
        plots = b.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        drawn = b.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".filter(d => d.querySelector('.main-svg .scatterlayer .trace')).length")
        points = b.evaluate("document.querySelectorAll('#chart-tokens .scatterlayer .point').length")
        error_bars = b.evaluate("document.querySelectorAll('#chart-tokens .errorbar').length")
        legend = b.evaluate("Array.from(document.querySelectorAll('#chart-tokens .legendtext')).map(t => t.textContent)")
        rows = b.evaluate("Array.from(document.querySelectorAll('table')[0].rows).map(r => r.innerText)")
        text = b.evaluate("document.body.innerText")
        png = b.screenshot()
        problems = b.problems()
    (tmp_path / "ladder.png").write_bytes(png)  # for a human to look at when this fails
    assert problems == [] and plots == drawn == 2
    assert points >= 4 + 1 + 1 and error_bars >= 1  # the runs, the prediction with its interval, the trained target
    assert "target, trained" in legend and "Warnings" in text, legend
    # the prediction's rows are the terminal's lines (one wording), with the trained target's loss
    assert any(r.startswith("predicted held-out loss") and "nats/token" in r and "eval/loss" in r for r in rows), rows
    assert any(r.startswith("trained target") and f"{actual:.4f} nats/token" in r for r in rows), rows


# --------------------------------------------------------------------------- the command's words and knobs

def _chinchilla_prediction(unique_tokens: float, max_epochs: float | None = 4.0) -> dict:
    n, d, levels = isoflop_design(CHINCHILLA, flops=(1e17, 4e17), spread=(0.5, 1, 2))
    runs = [{"label": f"r{i}", "params": float(a), "tokens": float(b), "level": lv, "loss": float(c),
             "flops": 6 * float(a) * float(b)} for i, (a, b, lv, c) in enumerate(zip(n, d, levels, CHINCHILLA.loss(n, d)))]
    pred = predict(runs, target_params=4 * n.max(), target_tokens=4 * d.max(), target_flops=None,
                   unique_tokens=unique_tokens, samples=20, max_epochs=max_epochs)
    pred["ladder"] = {"name": "law", "max_epochs": max_epochs}
    return pred


def test_the_prediction_names_its_unit_and_metric_and_a_data_hungry_optimum_warns():
    """The terminal's lines and the report's rows are one wording (`prediction_facts`); the loss has
    its unit and says which number of the target it predicts; a compute-optimal size that would
    repeat the data more than ladder.max_epochs says so on its line and as a warning."""
    from lmforge.report.scaling import _prediction_rows
    from lmforge.scaling.summary import format_prediction

    enough = _chinchilla_prediction(unique_tokens=1e30)
    assert not any("max_epochs" in w for w in enough["warnings"])
    scarce = _chinchilla_prediction(unique_tokens=2e8)
    epochs = scarce["compute_optimal"]["epochs"]
    assert epochs > 4 and any(f"{epochs:.1f} epochs of the data, more than ladder.max_epochs (4)" in w
                              for w in scarce["warnings"]), scarce["warnings"]
    lines = format_prediction(scarce)
    predicted = next(ln for ln in lines if ln.startswith("predicted held-out loss: "))
    assert predicted.endswith("): the final eval/loss of `lmforge train -f target.yaml`") and " nats/token (90% " in predicted
    optimal = next(ln for ln in lines if ln.startswith("compute-optimal for "))
    assert optimal.endswith(f"{epochs:.1f} epochs of the data: more than ladder.max_epochs 4, see the warning)")
    rows = [(html.unescape(label), html.unescape(re.sub(r"</?b>", "", text))) for label, text in
            _prediction_rows(scarce, None)]
    assert [f"{label}: {text}" for label, text in rows] == [ln for ln in lines if not ln.startswith("warning: ")]


def test_a_ladder_file_takes_set_and_budget_overrides_and_gives_runs_absolute_paths(tmp_path, monkeypatch):
    """`scaling run --set … --budget …` as `train` takes them; a relative path of the file (resolved
    from where the ladder started) is absolute in every run's config and in target.yaml, so they run
    from any folder — target.yaml from its own."""
    from lmforge.runs.ladder import run_config, target_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("text")
    (tmp_path / "tok").mkdir()
    spec = {"train_data": {"web": {"path": "data/train.txt", "proportion": 1.0}}, "tokenizer": "tok",
            "eval": {"data_path": "data/train.txt"}, "target": {"tokens": "1M"}, "budget": "6min"}
    (tmp_path / "lad.yaml").write_text(yaml.safe_dump(spec))
    cfg = load_ladder("lad.yaml", ["ladder.parallel=3", "target={model: {d_model: 160, n_layers: 5, n_heads: 5}, "
                                   "tokens: 1M}", "parameters.warmup=7ba"], "2e14flop")
    assert (cfg.ladder.parallel, cfg.budget.unit, cfg.budget.value) == (3, "flop", 2e14)
    assert cfg.base["parameters"]["warmup"] == "7ba" and cfg.base["tokenizer"] == "tok"  # the file as written
    plan = _plan(cfg)
    for raw in (run_config(cfg, plan, plan.points[0]), target_config(cfg, plan, plan.target.model, 1e6)):
        assert raw["train_data"]["web"] == {"path": str(tmp_path / "data" / "train.txt"), "proportion": 1.0}
        assert raw["tokenizer"] == str(tmp_path / "tok") and raw["eval"]["data_path"] == str(tmp_path / "data/train.txt")
        assert raw["save_folder"].startswith(str(tmp_path / "ladders" / "lad"))
    hub = load_ladder("lad.yaml", ["tokenizer=gpt2", "train_data=builtin:python-stdlib"])
    assert (hub.run_base["tokenizer"], hub.run_base["train_data"]) == ("gpt2", "builtin:python-stdlib")  # not paths
    assert_one_line_error(cli("scaling", "run", "-f", "lad.yaml", "--set", "ladder.sizez=3", "--dry-run"),
                          "unknown config key 'ladder.sizez'")
    assert_one_line_error(cli("scaling", "run", "-f", "lad.yaml", "--budget", "500ba", "--dry-run"),
                          "budget: expected a wall-clock time")


def test_detach_says_so_when_another_driver_holds_the_ladder(tmp_path):
    """`scaling run --detach` of a ladder another `scaling run` is driving: the one line that driver's
    lock gives, at once (not "running in the background" from a process that then stops)."""
    from lmforge.runs.ladder import LOG_FILE, LadderLock

    spec = {"train_data": "x.txt", "tokenizer": "tok", "target": {"tokens": "1M"}, "budget": "6min",
            "save_folder": str(tmp_path / "lad")}
    (tmp_path / "lad.yaml").write_text(yaml.safe_dump(spec))
    held = LadderLock(str(tmp_path / "lad"))
    try:
        proc = cli("scaling", "run", "-f", tmp_path / "lad.yaml", "--detach")
    finally:
        held.close()
    assert_one_line_error(proc, f"the ladder in {tmp_path / 'lad'} is already running (pid ", "lmforge scaling show")
    assert "background" not in proc.stdout and not (tmp_path / "lad" / LOG_FILE).exists()


def test_progress_lines_while_rungs_train(tmp_path):
    """What the ladder prints between a run's start and its end: each running run's share and loss
    from its metrics.jsonl, and the time left here."""
    from lmforge.runs.ladder import _Started, progress_line
    from lmforge.scaling.ladder_plan import Point

    def point(label, tokens):
        return Point(label=label, model={}, params=1e5, tokens=tokens, level=0, flops=6e5 * tokens,
                     learning_rate=2e-3, batch_tokens=2048, seconds=60.0)

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "metrics.jsonl").write_text(json.dumps({"step": 50, "train/loss": 3.61234, "train/tokens": 102400,
                                                 "throughput/tokens_per_s": 2048.0, "time/elapsed_s": 50.0,
                                                 "train/progress": 0.25}) + "\n")
    running = [_Started(point("2x48-400k", 409600), None, "n", "", str(a)),
               _Started(point("2x64-200k", 204800), None, "m", "", str(b))]
    line = progress_line(running, 3, 8, waiting_s=90.0)
    assert line == "scaling: 3 of 8 runs done; 2x48-400k 25% (loss 3.6123), 2x64-200k starting; about 4.0 min left here"
    assert progress_line(running, 3, 8, waiting_s=None).endswith("2x64-200k starting")
    # runs skipped for the budget have ended, but not as runs done
    assert progress_line(running, 5, 8, None, skipped=2).startswith("scaling: 3 of 8 runs done (2 skipped); 2x48")
