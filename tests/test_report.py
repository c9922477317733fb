"""The HTML report, `lmforge runs compare` and live cost, from real tiny runs; the page is opened
in a real headless Chromium (skipped, with the reason, where none is installed)."""

from __future__ import annotations

import io
import json
import math
import re

import pytest
import torch

from browser import Browser, browser_setup_note, find_chromium
from conftest import RUN_PRICE as PRICE
from lmforge.goodput.conditions import CONDITIONS
from train_helpers import assert_one_line_error, cli, metrics


@pytest.fixture(scope="module")
def runs(finished_runs):
    """The save folders of the session's two finished runs (conftest: lr 3e-3 and 1e-3, priced)."""
    return [r.folder for r in finished_runs]


@pytest.fixture(scope="module")
def both_page(runs, tmp_path_factory):
    """`lmforge report` of both runs, one page."""
    out = tmp_path_factory.mktemp("report-page") / "both.html"
    proc = cli("report", *runs, "--out", out)
    assert proc.returncode == 0 and "2 run(s)" in proc.stdout, proc
    return out


@pytest.mark.e2e
def test_each_run_leaves_its_report_plan_events_and_cost(runs):
    folder = runs[0]
    page = (folder / "report.html").read_text()
    assert "report-fast" in page and "COMPLETED" in page
    assert "<summary>step 8</summary>" in page and "<summary>step 4</summary>" in page  # generations of both evals
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["total_steps"] == 8 and plan["total_tokens"] == 8 * 8 * 64 and plan["devices"] == 1
    assert plan["device"] == "cpu" and plan["price_per_gpu_hour"] == PRICE
    # the run's own plan as it saved it: its speed measured here where it was, else the assumed MFU
    assert plan["estimate"]["seconds"] > 0 and plan["view"]["batch"]["micro_batch"] == 4
    assert plan["estimate"]["rate_source"] == "measured on this machine" or plan["estimate"]["mfu"] == pytest.approx(0.4)
    assert plan["estimate"]["cost"] == pytest.approx(PRICE * plan["estimate"]["seconds"] / 3600)
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    # The run's lifecycle; a goodput condition may also be recorded (on a shared CPU another process's
    # load can hold a few steps below the run's median MFU), never anything else.
    lifecycle = [(e["event"], e.get("status")) for e in events if e["event"] not in CONDITIONS]
    assert lifecycle == [("started", None), ("finished", "completed")], events
    # Live cost: every logged step carries the training time and what it cost at the price.
    train_rows = [r for r in metrics(folder) if "train/loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 9))
    elapsed = [r["time/elapsed_s"] for r in train_rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    for r in train_rows:
        assert r["cost/per_hour"] == PRICE  # one device
        assert r["cost/so_far"] == pytest.approx(PRICE * r["time/elapsed_s"] / 3600, rel=1e-9)


@pytest.mark.e2e
def test_report_is_refreshed_at_each_eval_and_at_the_end(runs, tmp_path):
    from lmforge.config.tracking import TrackerConfig
    from lmforge.report import write_run_report
    from lmforge.tracking import build_trackers

    run_file = json.loads((runs[0] / "run.json").read_text())
    t = build_trackers(TrackerConfig(mlflow=None, console=False), run_name="live", run_dir=str(tmp_path),
                       render_report=write_run_report)
    assert [x.name for x in t] == ["jsonl", "report"]
    t.log_params(run_file["config"] | {"plan": {"world_size": 1, "total_steps": 4}})
    report = tmp_path / "report.html"
    for step in (1, 2):
        t.log_metrics({"train/loss": 6.0 - step, "train/tokens": 512 * step, "time/elapsed_s": step}, step)
    assert not report.exists()  # training steps alone do not rewrite the page
    t.log_text("generation_0", "def first_sample(", 2)
    t.log_metrics({"eval/loss": 5.5, "eval/bits_per_byte": 3.0}, 2)
    first = report.read_text()
    assert "def first_sample(" in first and "RUNNING" in first
    t.log_text("generation_0", "def second_sample(", 4)
    t.log_metrics({"eval/loss": 5.0, "eval/bits_per_byte": 2.9}, 4)
    second = report.read_text()
    assert "def second_sample(" in second and second != first
    t.finish("stopped")
    final = report.read_text()
    assert "STOPPED" in final
    assert json.loads((tmp_path / "plan.json").read_text())["total_tokens"] == 4 * 8 * 64


@pytest.mark.e2e
def test_report_of_two_runs_overlays_them_and_lists_config_differences(runs, both_page):
    from lmforge.report import load_run
    from lmforge.report.compare import config_differences
    from lmforge.report.html import CHARTS, metric_chart

    page = both_page.read_text()
    # Self-contained: plotly.js is inline (in the head) and nothing in the page refers to the network.
    head, body = page.split("</head>", 1)
    assert head.count("<script") == 1 and "<script type='text/javascript'>" in head and len(head) > 3e6
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", body)
    assert "Plotly.newPlot" in body and len(page) < 8e6
    meta = json.loads(re.search(r"name='lmforge-report' content=\"([^\"]+)\"", page).group(1).replace("&quot;", '"'))
    assert meta["runs"] == ["report-fast", "report-slow"] and meta["charts"] >= 7

    fast, slow = load_run(str(runs[0])), load_run(str(runs[1]))
    title, ytitle, pick, scale = CHARTS[0]
    fig = metric_chart([fast, slow], title, ytitle, pick, scale)
    assert [tr["name"] for tr in fig["data"]] == ["report-fast", "report-slow"]
    for trace, folder in zip(fig["data"], runs):
        losses = {r["step"]: r["train/loss"] for r in metrics(folder) if "train/loss" in r}
        assert trace["x"] == sorted(losses) and trace["y"] == [losses[s] for s in sorted(losses)]
    # The runs differ in their learning rate, and the second also logs to W&B (conftest).
    assert dict(config_differences([fast, slow])) == {
        "parameters.learning_rate": [3e-3, 1e-3], "experiment_tracker.wandb.project": [None, "lmforge-test"],
        "experiment_tracker.wandb.mode": [None, "offline"]}
    assert "parameters.learning_rate" in page


@pytest.mark.e2e
def test_runs_compare_prints_metric_and_config_differences(runs):
    proc = cli("runs", "compare", *runs)
    assert proc.returncode == 0, proc
    out = proc.stdout
    fast = [r for r in metrics(runs[0]) if "train/loss" in r][-1]
    slow = [r for r in metrics(runs[1]) if "train/loss" in r][-1]
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("train loss (last)"))
    assert f"{fast['train/loss']:.4g}" in row and f"{slow['train/loss']:.4g}" in row
    diff = next(ln for ln in out.splitlines() if "parameters.learning_rate" in ln)
    assert "0.003" in diff and "0.001" in diff
    assert re.search(r"^\s*cost so far\s", out, re.M)


@pytest.mark.e2e
def test_bad_input_is_one_line(runs, tmp_path):
    assert_one_line_error(cli("report", "no-such-run"), "'no-such-run'", "neither a run")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(cli("report", empty), str(empty), "no metrics.jsonl")
    assert_one_line_error(cli("runs", "compare", runs[0], "no-such-run"), "no-such-run")
    assert_one_line_error(cli("report", runs[0], "--out", tmp_path), "--out", "is a folder")
    assert list(tmp_path.iterdir()) == [empty]  # nothing written


def test_progress_line_shows_cost_so_far_and_to_finish():
    from lmforge.tracking import ConsoleTracker

    out = io.StringIO()
    c = ConsoleTracker(total_steps=10, stream=out, log_every=5)
    for step in range(1, 11):
        c.log_metrics({"train/loss": 3.0, "time/elapsed_s": 36.0 * step, "cost/per_hour": 10.0,
                       "cost/so_far": 0.1 * step, "train/progress": step / 10}, step)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("step ")]
    # the one ETA (training time × what is left of the run): 324 s after step 1, 180 s after step 5
    assert "cost 0.10 (+0.90 to finish) |" in lines[0] and "ETA 0:05:24" in lines[0], lines[0]
    assert "cost 0.50 (+0.50 to finish) |" in lines[1] and "ETA 0:03:00" in lines[1], lines[1]
    assert "cost 1.00" in lines[-1] and "to finish" not in lines[-1]


def test_cost_is_derived_for_all_devices_before_the_trackers(tmp_path):
    """The trainer logs only its training time; TrackingCallback prices it for every device of the run."""
    from lmforge.config.tracking import TrackerConfig
    from lmforge.tracking import TrackingCallback
    from lmforge.train.callbacks import RunInfo

    cb = TrackingCallback(TrackerConfig(mlflow=None, console=False, report=False))
    cb.on_start(RunInfo(name="priced", save_folder=str(tmp_path), resumed=False,
                        config={"compute": {"price_per_gpu_hour": 3.0}}, plan={"world_size": 4},
                        total_steps=2, total_tokens=None))
    cb.on_metrics({"train/loss": 2.0, "time/elapsed_s": 1800.0}, 1)
    cb.on_metrics({"eval/loss": 2.5}, 1)  # no training time: nothing to price
    cb.on_end("stopped", None)
    (train, evaluation) = metrics(tmp_path)
    assert train["cost/per_hour"] == 12.0 and train["cost/so_far"] == 6.0
    assert not any(k.startswith("cost/") for k in evaluation)


@pytest.mark.e2e
def test_describe_summary_has_cost_to_finish(runs):
    from lmforge.runs.progress import summarize

    config = json.loads((runs[0] / "run.json").read_text())["config"]
    mid = next(r for r in metrics(runs[0]) if r.get("step") == 4 and "train/loss" in r)
    s = summarize(mid, config)
    assert s["cost"] == mid["cost/so_far"] and s["eta_s"] > 0
    assert math.isclose(s["cost_to_finish"], PRICE * s["eta_s"] / 3600)


@pytest.mark.e2e
def test_report_renders_in_headless_chromium(both_page, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (scripts/test.sh installs Debian's `chromium` when it runs as "
                    f"root with apt-get; or set LMFORGE_CHROMIUM) {browser_setup_note()}".strip())
    Image = pytest.importorskip("PIL.Image")
    charts = json.loads(re.search(r"name='lmforge-report' content=\"([^\"]+)\"",
                                  both_page.read_text()).group(1).replace("&quot;", '"'))["charts"]
    with Browser(chromium) as b:
        b.open(both_page.as_uri())
        plots = b.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        drawn = b.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".filter(d => d.querySelector('.main-svg .scatterlayer .trace')).length")
        lines = b.evaluate("document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line').length")
        generations = b.evaluate("document.querySelectorAll('details pre').length")
        png = b.screenshot()
        problems = b.problems()
    (tmp_path / "report.png").write_bytes(png)  # for a human to look at when this fails
    assert problems == []
    assert plots == drawn == charts + 1  # every metric chart and the timeline drew their traces
    assert lines >= 2 * charts  # both runs on every chart
    assert generations >= 2
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.width >= 1000 and img.height > 2000  # the full page, not an empty viewport
    small = img.resize((img.width // 4, img.height // 4))
    pixels = list(small.get_flattened_data() if hasattr(small, "get_flattened_data") else small.getdata())
    not_white = sum(1 for p in pixels if sum(p) < 720) / len(pixels)
    assert not_white > 0.03 and len(set(pixels)) > 200, (not_white, len(set(pixels)))


# --------------------------------------------------------------------------- runs that ended early


def _train_tracked(tiny_data, folder, stop_at=None, **overrides):
    """A tiny run in this process with the trackers a CLI run has (metrics.jsonl, report.html);
    ``stop_at``: a SIGTERM (what `runs stop` sends) arrives while step ``stop_at`` is logged."""
    import signal

    import torch

    from conftest import tiny_run_config
    from lmforge.config.load import build_config
    from lmforge.config.tracking import TrackerConfig
    from lmforge.distributed.dist import DistInfo
    from lmforge.tracking import TrackingCallback
    from lmforge.train.callbacks import Callback
    from lmforge.report import write_run_report
    from lmforge.resolve import resolve
    from lmforge.train.machine import process_machine
    from lmforge.train.build import build_trainer

    class StopAt(Callback):
        def on_metrics(self, metrics, step):
            if step == stop_at and "train/loss" in metrics:
                signal.raise_signal(signal.SIGTERM)

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cfg = build_config(tiny_run_config(tiny_data, folder, **({"compute.async_checkpoint": False} | overrides)))
    callbacks = [TrackingCallback(TrackerConfig(mlflow=None, console=False), render_report=write_run_report), StopAt()]
    return build_trainer(resolve(cfg, process_machine(one), log=lambda *_: None), one, callbacks=callbacks,
                   log=lambda *_: None)


@pytest.mark.integration
def test_report_of_a_failed_run_says_why_in_its_summary(tiny_data, tmp_path):
    """A run that diverges before its first eval: the error line is in the report's summary (not
    only in a tooltip), the page does not blame empty eval.prompts (two are set), and the plan table
    has no time "to finish" for a run that has ended."""
    from lmforge.train.trainer import TrainingDiverged

    trainer = _train_tracked(tiny_data, tmp_path / "run", training_duration="30ba", save_interval="10ba",
                             **{"parameters.grad_clip": None, "parameters.warmup": "1ba", "eval.interval": "20ba",
                                "eval.prompts": ["def a(", "def b("], "compute.price_per_gpu_hour": 1.0})
    step = trainer.train_step

    def diverging_step(batches):  # the weights blow up after step 1 (the schema bounds the learning rate)
        if trainer.state.step == 1:
            with torch.no_grad():
                trainer.model.output_weight.fill_(float("inf"))
        return step(batches)

    trainer.train_step = diverging_step
    with pytest.raises(TrainingDiverged) as err:
        trainer.fit()
    page = (tmp_path / "run" / "report.html").read_text()
    summary = page.split("<h2>Summary</h2>", 1)[1].split("<h2>", 1)[0]
    assert "FAILED" in summary and html_escape(str(err.value)) in summary, summary
    assert "eval.prompts is empty" not in page and "before its first eval" in page
    plan = page.split("<h2>Plan against what happened</h2>", 1)[1].split("<h2>", 1)[0]
    assert "to finish" not in plan, plan
    chromium = find_chromium(wait_s=0)
    if chromium is not None:  # as a reader sees it: the reason is a row of the summary table
        with Browser(chromium) as b:
            b.open((tmp_path / "run" / "report.html").as_uri())
            rows = b.evaluate("Array.from(document.querySelectorAll('table')[0].rows).map(r => r.innerText)")
        assert any(r.startswith("reason") and str(err.value) in r for r in rows), rows


@pytest.mark.integration
def test_a_stopped_run_reports_the_step_it_stopped_at(tiny_data, tmp_path):
    """Stopped between two log steps (log_interval 5, the stop at step 5 takes effect after step 6):
    the last logged step, the report's steps and the checkpoint all say 6."""
    from lmforge.report import load_run
    from lmforge.report.compare import summary

    trainer = _train_tracked(tiny_data, tmp_path / "run", stop_at=5, training_duration="30ba", save_interval="20ba",
                             log_interval=5, **{"eval.interval": "20ba"})
    result = trainer.fit()
    assert result.status == "stopped" and result.step == 6
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_00000006"]
    assert max(r["step"] for r in metrics(tmp_path / "run") if "train/loss" in r) == 6
    run = load_run(str(tmp_path / "run"))
    assert summary(run)["steps"] == 6
    page = (tmp_path / "run" / "report.html").read_text()
    assert "STOPPED" in page and "to finish" not in page


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_compare_deltas_carry_their_units():
    """B − A of a duration is a duration, of MFU percentage points that do not round to -0.0."""
    from lmforge.report.compare import format_compare
    from lmforge.report.load import RunData

    def run(name, elapsed, mfu):
        records = [{"step": s, "train/loss": 3.0, "throughput/mfu": mfu, "time/elapsed_s": elapsed * s / 2}
                   for s in (1, 2)]
        return RunData(name=name, folder=name, records=records, status="COMPLETED")

    out = format_compare(run("a", 526.0, 0.1234), run("b", 510.73, 0.1230))
    time_row = next(ln for ln in out.splitlines() if ln.strip().startswith("training time"))
    assert time_row.split()[-2:] == ["-0:00:15", "(-2.9%)"], time_row
    mfu_row = next(ln for ln in out.splitlines() if ln.strip().startswith("MFU"))
    assert mfu_row.split()[-2:] == ["-0.04", "pts"], mfu_row


def test_compare_prints_count_deltas_with_every_digit_and_preference_rows():
    """Token and step deltas read as the counts beside them (+761,856, not +7.619e+05); a
    preference run's accuracy and margin have rows of their own."""
    from lmforge.report.compare import format_compare
    from lmforge.report.load import RunData

    def run(name, tokens, acc):
        records = [{"step": 4, "train/loss": 0.6, "train/tokens": tokens, "train/rewards/accuracy": acc},
                   {"step": 4, "eval/loss": 0.5, "eval/rewards/accuracy": acc, "eval/rewards/margin": 2 * acc}]
        return RunData(name=name, folder=name, records=records, status="COMPLETED")

    out = format_compare(run("a", 1_048_576, 0.5), run("b", 1_810_432, 0.75))
    tokens = next(ln for ln in out.splitlines() if ln.strip().startswith("tokens "))
    assert tokens.split()[1:] == ["1,048,576", "1,810,432", "+761,856", "(+72.7%)"], tokens
    rows = {ln.strip().split("  ")[0]: ln.split() for ln in out.splitlines() if "preference" in ln}
    assert rows["eval preference accuracy (last)"][-4:] == ["0.5", "0.75", "+0.25", "(+50.0%)"], rows
    assert "eval preference margin (last)" in rows and "train preference accuracy (last)" in rows


def _preference_run(tmp_path):
    """A DPO run's files as the trainer writes them: training and held-out preference metrics."""
    folder = tmp_path / "dpo"
    folder.mkdir()
    rows = []
    for step in range(1, 21):
        acc = min(1.0, 0.5 + step / 40)
        rows.append({"step": step, "train/loss": 0.69 - step / 100, "train/lr": 1e-3, "train/tokens": 512 * step,
                     "train/rewards/chosen": step / 50, "train/rewards/rejected": -step / 50,
                     "train/rewards/margin": step / 25, "train/rewards/accuracy": acc, "time/elapsed_s": step})
        if step % 10 == 0:
            rows.append({"step": step, "eval/loss": 0.7 - step / 100, "eval/pairs": 20,
                         "eval/rewards/chosen": step / 60, "eval/rewards/rejected": -step / 60,
                         "eval/rewards/margin": step / 30, "eval/rewards/accuracy": acc - 0.05})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.e2e  # headless Chromium
def test_a_preference_report_names_train_and_eval_and_has_an_accuracy_row(tmp_path):
    """The report of a DPO run: its curves tell train from eval (not two "rewards/accuracy"), its
    summary has the accuracy, and — in Chromium, as a reader sees it — no axis title runs into its
    chart's title."""
    from lmforge.report import load_run
    from lmforge.report.html import write_report

    page = tmp_path / "dpo.html"
    write_report([load_run(str(_preference_run(tmp_path)))], str(page))
    chromium = find_chromium(wait_s=0)
    if chromium is None:
        pytest.skip(f"Chromium is not installed {browser_setup_note()}".strip())
    with Browser(chromium) as b:
        b.open(page.as_uri())
        charts = b.evaluate("""Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({
            title: (d.querySelector('.gtitle') || {}).textContent,
            names: Array.from(d.querySelectorAll('.legendtext')).map(t => t.textContent),
            clash: (() => {
                const t = d.querySelector('.gtitle'), y = d.querySelector('.ytitle');
                if (!t || !y) return false;
                const a = t.getBoundingClientRect(), c = y.getBoundingClientRect();
                return !(a.right < c.left || c.right < a.left || a.bottom < c.top || c.bottom < a.top);
            })()}))""")
        rows = b.evaluate("Array.from(document.querySelectorAll('table')[0].rows).map(r => r.innerText)")
        (tmp_path / "dpo.png").write_bytes(b.screenshot())  # for a human to look at when this fails
        problems = b.problems()
    assert problems == []
    by_title = {c["title"]: c for c in charts}
    assert by_title["Preference accuracy"]["names"] == ["dpo · eval", "dpo · train"], by_title
    rewards = by_title["Preference rewards"]["names"]
    assert len(set(rewards)) == len(rewards) == 6 and "dpo · eval/rewards/margin" in rewards, rewards
    assert [c["title"] for c in charts if c["clash"]] == [], charts
    assert any(r.startswith("eval preference accuracy (last)") and r.endswith("0.95") for r in rows), rows
    assert any(r.startswith("train preference accuracy (last)") and r.endswith("1") for r in rows), rows
