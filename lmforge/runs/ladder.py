"""`lmforge scaling run`: plan a ladder, train its runs as ordinary registered runs, fit, predict.

The ladder's ``save_folder`` holds:

    plan.json            the plan, written before the first run starts; a re-run reuses it
    runs/<label>.yaml    each run's full config (``lmforge train -f`` runs it anywhere)
    runs/<label>/        each run's save folder: an ordinary run (`lmforge runs list` shows it)
    prediction.json      the fitted law and the prediction (`scaling.predict`)
    target.yaml          the target's full run config, the recipe the law was fitted for
    report.html          the runs, the fitted curves and the prediction with its interval
    ladder.log           the ladder's own output when it runs detached

Each run is ``lmforge train -f runs/<label>.yaml`` in a child process (its supervisor registers
it, restarts it after a crash, and a Ctrl-C checkpoints it), ``ladder.parallel`` at a time, each
with ``ladder.threads`` CPU threads. Re-running the ladder skips the runs whose ``final/`` model
exists, waits for one still running (started by an earlier, interrupted ladder) and resumes an
unfinished one from its latest checkpoint. A run that fails is left out of the fit (and named).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import subprocess
import sys
import time

import yaml

from lmforge.config.model import ModelConfig
from lmforge.errors import UserError
from lmforge.plan.batch import CPU_MICRO_BATCH
from lmforge.runs.progress import MetricsTail, metrics_path, read_history, summarize
from lmforge.runs.registry import ACTIVE, Registry
from lmforge.scaling.config import LadderConfig
from lmforge.config.counts import human
from lmforge.scaling.ladder_plan import (LadderPlan, Point, family_shape, ladder_context,
                                  learning_rate, params_of, plan_ladder, prior_target, run_batch_tokens, WIDTHS)
from lmforge.scaling.predict import predict

PLAN_FILE = "plan.json"
PREDICTION_FILE = "prediction.json"
TARGET_FILE = "target.yaml"
REPORT_FILE = "report.html"
LOG_FILE = "ladder.log"
STATE_FILE = "ladder-state.json"  # each finished run's wall-clock seconds, as this ladder saw them


# --------------------------------------------------------------------------- planning

def run_threads(cfg: LadderConfig) -> int:
    """``ladder.threads``; auto: the cores over ``parallel``, or 1 on a machine busier than its cores."""
    opts = cfg.ladder
    if opts.threads != "auto":
        return int(opts.threads)
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] > cores
    except (AttributeError, OSError):
        busy = False
    return 1 if busy else max(1, cores // opts.parallel)


def _data(cfg: LadderConfig, log) -> tuple[int, int, float, float]:
    """(tokenizer vocabulary, context, training tokens, held-out tokens), preparing the data once
    (cached, as every run of the ladder will find it)."""
    from lmforge.data.stream.run_data import resolve_data, resolve_tokenizer
    from lmforge.data.text.tokenizer import load_tokenizer

    base = cfg.base_config
    vocab = load_tokenizer(resolve_tokenizer(base, log=log)).vocab_size
    context = ladder_context(cfg, prior_target(cfg, vocab, 2048).params)
    base = base.model_copy(update={"parameters": base.parameters.model_copy(update={"context_length": context})})
    data = resolve_data(base, context, log=log)
    if not data.eval:
        raise UserError("eval: a ladder fits held-out losses; give eval.data_path (held-out text) or an "
                        "eval.holdout_fraction > 0")
    train = sum(float(d.split_stats("train").get("tokens") or 0) for d in data.train)
    held = sum(float(ds.split_stats(split).get("tokens") or 0) for ds, split in data.eval)
    return vocab, context, train, held


def measure_and_plan(cfg: LadderConfig, log=print) -> LadderPlan:
    """Measure what a time budget needs on this machine (each size's training rate now, a run's
    start-up) and plan."""
    vocab, context, train_tokens, val_tokens = _data(cfg, log)
    threads = run_threads(cfg)
    rate, overhead = None, 0.0
    if cfg.budget.unit == "s":
        rate = _rate_fn(cfg, context, threads, log)
        overhead = run_overhead(threads)
        log(f"scaling: a run's start-up, evaluation and export take about {overhead:.0f}s here now")
    return plan_ladder(cfg, vocab=vocab, context=context, unique_tokens=train_tokens, val_tokens=val_tokens,
                       tokens_per_s=rate, overhead_s=overhead, threads=threads)


def run_overhead(threads: int) -> float:
    """What a run costs besides training: two interpreters importing torch and the trainer (its
    supervisor and the trainer itself), timed as a fresh process here now, and a few seconds
    for the final evaluation, the export and the exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, lmforge.train.trainer"], check=True,
                   env=os.environ | {"OMP_NUM_THREADS": str(threads)})
    return 2 * (time.perf_counter() - t0) + 5.0


def _rate_fn(cfg: LadderConfig, context: int, threads: int, log):
    import torch

    from lmforge.config.defaults import auto_precision
    from lmforge.train.machine import bf16_supported
    from lmforge.train.throughput import measure_tokens_per_s

    base = cfg.base_config
    device = torch.device("cuda" if base.compute.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    precision = base.parameters.precision
    precision = auto_precision(bf16_supported(device)) if precision == "auto" else precision

    def rate(m: ModelConfig) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            # The mean of 8 steps: on a shared machine a few steps catch a quiet moment or a busy one.
            tps = measure_tokens_per_s(m, context, CPU_MICRO_BATCH, precision=precision,
                                       optimizer=cfg.optimizer, device=device, steps=8, typical=True)
        finally:
            torch.set_num_threads(before)
        log(f"scaling: {m.n_layers}x{m.d_model} ({human(params_of(m))} params) trains at {human(tps)} tokens/s "
            f"here now ({threads} thread{'s' if threads > 1 else ''}, mean of 8 steps)")
        return tps
    return rate


def existing_plan(cfg: LadderConfig) -> LadderPlan | None:
    """The plan in the ladder's plan.json, if any; refused when the ladder file changed since."""
    path = os.path.join(cfg.save_folder, PLAN_FILE)
    record = _read_json(path)
    if record is None:
        return None
    if not isinstance(record, dict) or record.get("spec") != _spec(cfg):
        raise UserError(f"{path} was planned from a different ladder file (or other --set/--budget overrides); "
                        f"keep the file and overrides as they were, choose another save_folder, or delete {path} to "
                        "plan again (runs of the same shape and tokens are reused)")
    return _plan_of(record, path)


def _plan_of(record, path: str) -> LadderPlan:
    """The plan a plan.json holds; one line when it is not one this version reads (edited by hand,
    or written by another version)."""
    try:
        return LadderPlan.from_dict(record["plan"])
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a ladder plan this version can read ({type(e).__name__}: {e}); delete it "
                        "to plan again (runs of the same shape and tokens are reused)") from None


def _spec(cfg: LadderConfig) -> dict:
    return cfg.model_dump(mode="json", exclude_defaults=True)  # what the file says, not this version's defaults


def load_or_make_plan(cfg: LadderConfig, log=print, *, write: bool = True) -> LadderPlan:
    """The ladder's plan: made once (measuring this machine) and kept in plan.json."""
    plan = existing_plan(cfg)
    if plan is not None:
        log(f"scaling: continuing the ladder planned in {os.path.join(cfg.save_folder, PLAN_FILE)}")
        return plan
    plan = measure_and_plan(cfg, log)
    if write:
        os.makedirs(cfg.save_folder, exist_ok=True)
        _write_json(os.path.join(cfg.save_folder, PLAN_FILE), {"spec": _spec(cfg), "plan": plan.to_dict()})
    return plan


def format_plan(plan: LadderPlan) -> str:
    t = plan.target
    lines = [f"ladder {plan.name}: {len(plan.points)} runs, budget {plan.budget}"
             + (f", about {plan.estimated_seconds / 60:.1f} min here ({plan.parallel} at a time, "
                f"{plan.threads} thread{'s' if plan.threads > 1 else ''} each)" if plan.estimated_seconds else ""),
             f"  target: {human(t.params)} params × {human(t.tokens)} tokens"
             + (" (compute-optimal size chosen after the fit; 20 tokens/param placed it for planning)"
                if t.model is None else ""),
             f"  {'run':<16}{'params':>9}{'tokens':>9}{'FLOPs':>10}{'lr':>9}{'batch':>7}{'est. s':>8}"]
    for p in plan.points:
        secs = f"{p.seconds:.0f}" if p.seconds is not None else "-"
        lines.append(f"  {p.label:<16}{human(p.params):>9}{human(p.tokens):>9}{p.flops:>10.2e}"
                     f"{p.learning_rate:>9.2g}{human(p.batch_tokens):>7}{secs:>8}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------- run configs

def run_folder(ladder_folder: str, point: Point) -> str:
    return os.path.join(os.path.abspath(ladder_folder), "runs", point.label)


def _compact_model(model: dict) -> dict:
    """The model mapping without the fields left at their defaults (a readable config)."""
    return ModelConfig(**model).model_dump(mode="json", exclude_defaults=True)


def run_config(cfg: LadderConfig, plan: LadderPlan, point: Point) -> dict:
    """The full config of one ladder run: the file's shared keys, then the ladder's choices."""
    raw = copy.deepcopy(cfg.run_base)  # local paths absolute: the config runs from any folder
    raw["name"] = f"{cfg.name}-{point.label}"
    raw["model"] = _compact_model(point.model)
    raw["training_duration"] = f"{point.tokens}tok"
    raw["save_folder"] = run_folder(cfg.save_folder, point)
    _recipe(raw, plan, point.learning_rate, point.batch_tokens, cfg.optimizer)
    ev = raw.setdefault("eval", {})
    ev["interval"] = f"{point.tokens}tok"  # one evaluation, at the end: that loss is what is fitted
    raw.setdefault("save_interval", f"{max(point.batch_tokens, point.tokens // 2)}tok")
    # The ladder has its own report; a run's trackers stay off unless the file asks for them.
    raw.setdefault("experiment_tracker", {"mlflow": None, "report": False})
    return raw


def target_config(cfg: LadderConfig, plan: LadderPlan, model: dict, tokens: float) -> dict:
    """The target's full run config: the same recipe and held-out evaluation as every ladder run."""
    m = ModelConfig(**model)
    tokens = int(tokens)
    raw = copy.deepcopy(cfg.run_base)  # local paths absolute: the config runs from any folder
    raw["name"] = f"{cfg.name}-target"
    raw["model"] = _compact_model(model)
    raw["training_duration"] = f"{tokens}tok"
    raw["save_folder"] = os.path.join(os.path.abspath(cfg.save_folder), "target")
    _recipe(raw, plan, learning_rate(m, cfg.optimizer), run_batch_tokens(cfg, m, tokens, plan.context), cfg.optimizer)
    return raw


def _recipe(raw: dict, plan: LadderPlan, lr: float, batch_tokens: int, optimizer: str) -> None:
    params = raw.setdefault("parameters", {})
    params["optimizer"] = optimizer  # one for every run and the target (LadderConfig.optimizer)
    params["context_length"] = plan.context
    if plan.warmup_steps is not None:
        params["warmup"] = f"{plan.warmup_steps}ba"
    params.setdefault("learning_rate", lr)
    params.setdefault("global_batch_size", f"{batch_tokens}tok")
    params.setdefault("micro_batch_size", plan.micro_batch)
    ev = raw.setdefault("eval", {})
    ev["max_batches"] = plan.eval_batches  # the same held-out samples for every run and the target


def choose_target_model(plan: LadderPlan):
    """For a tokens- or FLOPs-only target: the family shape nearest a parameter count (in log)."""
    import math

    shapes = [family_shape(d, plan.vocab, plan.context) for d in WIDTHS]

    def nearest(n: float) -> tuple[dict, float]:
        best = min(shapes, key=lambda m: abs(math.log(params_of(m) / n)))
        return best.model_dump(mode="json"), float(params_of(best))
    return nearest


# --------------------------------------------------------------------------- running

def _completed(folder: str) -> bool:
    from lmforge.runs.stages import is_completed

    return is_completed(folder)


def final_loss(folder: str) -> tuple[float | None, float | None]:
    """(the last held-out loss, the tokens trained) of a run's metrics.jsonl."""
    loss = tokens = None
    for rec in read_history(folder):
        if "eval/loss" in rec:
            loss = rec["eval/loss"]
        if "train/tokens" in rec:
            tokens = rec["train/tokens"]
    return loss, tokens


def _active_run(folder: str) -> dict | None:
    for row in Registry().saved_in(folder):
        row = Registry().mark_lost_if_dead(row)
        if row["status"] in ACTIVE:
            return row
    return None


class _Started:
    def __init__(self, point: Point, proc: subprocess.Popen | None, name: str | None, out: str, folder: str):
        self.point, self.proc, self.name, self.out, self.t0 = point, proc, name, out, time.time()
        self.metrics = MetricsTail(metrics_path(folder))  # its progress, for the ladder's progress lines

    def done(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        row = Registry().get(self.name)  # a run an earlier ladder started: wait for it through the registry
        row = Registry().mark_lost_if_dead(row) if row else None
        if row is None or row["status"] not in ACTIVE:
            return 0 if row and row["status"] == "COMPLETED" else 1
        return None


PROGRESS_S = 15.0  # while runs train, a line of their progress at least this often (no long silences)


def progress_line(active: list[_Started], done: int, total: int, waiting_s: float | None, skipped: int = 0) -> str:
    """What the ladder is doing: each running run's share done and loss (from its metrics.jsonl),
    and — with the plan's estimates (a time budget) — about how long the rest takes here.
    ``done``: runs ended (``skipped`` of them not started: past the budget); ``waiting_s``: the
    estimated seconds of the runs not started yet."""
    parts, left = [], []
    for s in active:
        m = summarize(s.metrics.poll(), {"training_duration": f"{s.point.tokens}tok"})
        if not m:
            parts.append(f"{s.point.label} starting")
            continue
        parts.append(f"{s.point.label} {100 * (m.get('progress') or 0):.0f}% (loss {m['loss']:.4f})")
        if m.get("eta_s") is not None:
            left.append(m["eta_s"])
    line = f"scaling: {done - skipped} of {total} runs done{f' ({skipped} skipped)' if skipped else ''}; " + \
        ", ".join(parts)
    if waiting_s is not None and (left or not active):
        line += f"; about {(max(left, default=0.0) + waiting_s) / 60:.1f} min left here"
    return line


def execute(cfg: LadderConfig, plan: LadderPlan, log=print, deadline: float | None = None) -> int:
    """Train every run not finished yet, ``parallel`` at a time; returns how many it started.

    With a ``deadline`` (a time budget's end), a run that would end after it is not started: its
    time is the plan's estimate times how much longer than estimated the runs finished so far took
    (the machine's load changes after it was measured). A re-run of the ladder trains them."""
    state = _read_json(os.path.join(cfg.save_folder, STATE_FILE)) or {}
    todo, active = [], []
    for p in plan.points:
        folder = run_folder(cfg.save_folder, p)
        if _completed(folder):
            continue
        row = _active_run(folder)
        if row is not None:
            log(f"scaling: {p.label} is still running (run {row['name']}); waiting for it")
            active.append(_Started(p, None, row["name"], "", folder))
        else:
            todo.append(p)
    total = len(plan.points)
    finished = total - len(todo) - len(active)
    if finished:
        log(f"scaling: {finished} of {total} runs already completed")
    env = os.environ | {"OMP_NUM_THREADS": str(plan.threads)}
    slower: list[float] = []  # actual / estimated seconds of the runs finished here
    started, skipped, noted = 0, 0, time.time()
    try:
        while todo or active:
            while todo and len(active) < plan.parallel:
                p = todo.pop(0)
                factor = sorted(slower)[len(slower) // 2] if slower else 1.0
                if deadline is not None and p.seconds and time.time() + factor * p.seconds > deadline:
                    finished, skipped = finished + 1, skipped + 1
                    log(f"scaling: {p.label} skipped: it would end after the budget (about "
                        f"{factor * p.seconds:.0f}s, {max(0.0, deadline - time.time()):.0f}s left); re-run the "
                        "ladder to train it")
                    continue
                active.append(_start(cfg, plan, p, env))
                started += 1
                log(f"scaling: [{finished + len(active)}/{total}] {p.label}: {human(p.params)} params × "
                    f"{human(p.tokens)} tokens (lmforge train -f {_rel(_config_path(cfg, p))})")
                noted = time.time()
            time.sleep(0.5)
            for s in [s for s in active if s.done() is not None]:
                active.remove(s)
                finished += 1
                _finished(cfg, s, state, slower, log, total - finished)
                noted = time.time()
            if active and time.time() - noted >= PROGRESS_S:  # 15 s without a line: where the runs are
                noted = time.time()
                waiting = sum(p.seconds or 0 for p in todo) * (sorted(slower)[len(slower) // 2] if slower else 1.0)
                log(progress_line(active, finished, total, waiting / plan.parallel if plan.estimated_seconds else None,
                                  skipped))
    except KeyboardInterrupt:
        # The runs share this terminal's process group: each got the Ctrl-C and checkpoints.
        log("scaling: interrupted; the runs stop at a checkpoint; re-run the same command to continue")
        for s in active:
            if s.proc is not None:
                s.proc.wait()
        raise
    return started


def _finished(cfg: LadderConfig, s: _Started, state: dict, slower: list[float], log, to_go: int) -> None:
    """A run ended: its wall time recorded (and how it compares with the plan's estimate), one line."""
    code = s.done()
    wall = time.time() - s.t0
    loss, _ = final_loss(run_folder(cfg.save_folder, s.point))
    rest = f"; {to_go} to go" if to_go else ""
    if code == 0 and _completed(run_folder(cfg.save_folder, s.point)):
        state[s.point.label] = {"wall_s": wall} if s.proc is not None else state.get(s.point.label, {})
        if s.proc is not None and s.point.seconds:
            slower.append(wall / s.point.seconds)
        _write_json(os.path.join(cfg.save_folder, STATE_FILE), state)
        held_out = f"held-out loss {loss:.4f}" if loss is not None else \
            "no held-out loss in its metrics (left out of the fit)"
        log(f"scaling: {s.point.label} completed in {wall:.0f}s, {held_out}{rest}")
    else:
        log(f"scaling: {s.point.label} did not complete (exit {code}); see {_rel(s.out) or 'its logs'}; "
            f"it is left out of the fit (re-run the ladder to resume it){rest}")


def _config_path(cfg: LadderConfig, p: Point) -> str:
    return os.path.join(cfg.save_folder, "runs", f"{p.label}.yaml")


def _start(cfg: LadderConfig, plan: LadderPlan, p: Point, env: dict) -> _Started:
    path = _config_path(cfg, p)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(run_config(cfg, plan, p), f, sort_keys=False)
    out = os.path.join(cfg.save_folder, "runs", f"{p.label}.log")
    with open(out, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", path], stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, env=env)
    return _Started(p, proc, None, out, run_folder(cfg.save_folder, p))


def results(ladder_folder: str, plan: LadderPlan) -> list[dict]:
    """Each run of the plan with its status, and its held-out loss where it completed."""
    state = _read_json(os.path.join(ladder_folder, STATE_FILE)) or {}
    out = []
    for p in plan.points:
        folder = run_folder(ladder_folder, p)
        loss, tokens = final_loss(folder)
        done = _completed(folder) and loss is not None
        row = None if done else _active_run(folder)
        status = "completed" if done else (row["status"].lower() if row else
                                           ("unfinished" if os.path.isdir(folder) else "not started"))
        out.append({"label": p.label, "params": p.params, "tokens": int(tokens or p.tokens), "level": p.level,
                    "flops": p.flops, "learning_rate": p.learning_rate, "status": status,
                    "loss": loss if done else None, "seconds": (state.get(p.label) or {}).get("wall_s"),
                    "save_folder": folder})
    return out


def finish(cfg: LadderConfig, plan: LadderPlan, runs: list[dict], log=print) -> dict:
    """Fit, predict, and write prediction.json, target.yaml and report.html."""
    done = [r for r in runs if r["status"] == "completed"]
    if len(done) < 2:
        raise UserError(f"only {len(done)} of the ladder's {len(runs)} runs completed; a law needs at least two. "
                        f"See {cfg.save_folder}/runs/*.log, then re-run the ladder to resume")
    t = plan.target
    given = t.model is not None
    pred = predict(done,
                   target_params=t.params if given else None, target_tokens=cfg.target.tokens or (
                       t.tokens if given else None),
                   target_flops=None if given or cfg.target.tokens else cfg.target.flops,
                   unique_tokens=plan.unique_tokens, confidence=cfg.ladder.confidence,
                   choose_model=None if given else choose_target_model(plan), max_epochs=cfg.ladder.max_epochs)
    model = t.model if given else pred["target"]["model"]
    pred["target"]["model"] = _compact_model(model)
    largest = max(r["params"] for r in done)
    gap = pred["target"]["params"] / largest
    if gap < cfg.ladder.target_gap:
        pred["warnings"].append(f"the chosen target has only {gap:.1f}× the parameters of the ladder's largest run "
                                f"(ladder.target_gap asks {cfg.ladder.target_gap:g}×)")
    failed = [r["label"] for r in runs if r["status"] != "completed"]
    if failed:
        pred["warnings"].insert(0, f"{len(failed)} of {len(runs)} runs did not complete and are left out: "
                                   f"{', '.join(failed)}")
    state = _read_json(os.path.join(cfg.save_folder, STATE_FILE)) or {}
    pred["budget"] = {"budget": plan.budget, "planned_s": plan.estimated_seconds, "wall_s": state.get("ladder_wall_s"),
                      "runs_s": sum(r["seconds"] or 0 for r in done), "parallel": plan.parallel,
                      "threads": plan.threads, "tokens_per_s": plan.tokens_per_s, "overhead_s": plan.overhead_s}
    pred["ladder"] = {"name": cfg.name, "save_folder": os.path.abspath(cfg.save_folder), "context": plan.context,
                      "vocab": plan.vocab, "unique_tokens": plan.unique_tokens, "max_epochs": cfg.ladder.max_epochs}
    pred["runs"] += [r for r in runs if r["status"] != "completed"]
    target_yaml = target_config(cfg, plan, model, pred["target"]["tokens"])
    pred["target"]["config"] = os.path.join(os.path.abspath(cfg.save_folder), TARGET_FILE)
    pred["target"]["save_folder"] = target_yaml["save_folder"]
    with open(os.path.join(cfg.save_folder, TARGET_FILE), "w") as f:
        f.write(f"# The target of ladder {cfg.name}: predicted held-out loss {pred['target']['loss']:.4f} "
                f"({pred['target']['loss_low']:.4f} – {pred['target']['loss_high']:.4f}, "
                f"{cfg.ladder.confidence:.0%}).\n# lmforge train -f {TARGET_FILE}\n")
        yaml.safe_dump(target_yaml, f, sort_keys=False)
    pred["target"]["actual"] = target_actual(target_yaml["save_folder"])
    _write_json(os.path.join(cfg.save_folder, PREDICTION_FILE), pred)
    from lmforge.report.scaling import write_ladder_report

    write_ladder_report(pred, os.path.join(cfg.save_folder, REPORT_FILE), pred["target"]["actual"])
    return pred


def target_actual(folder: str) -> float | None:
    """The target run's final held-out loss, once it has completed (`lmforge train -f target.yaml`)."""
    if not _completed(folder):
        return None
    return final_loss(folder)[0]


def record_target(save_folder: str) -> str | None:
    """After a run in ``save_folder`` ends: when it is a ladder's target (the folder beside it holds
    the prediction naming it) and has completed, its held-out loss goes into the ladder's
    prediction.json (``target.actual``) and report.html. Returns a line saying so, or None (not a
    target, not completed, or recorded already)."""
    ladder = os.path.dirname(os.path.abspath(save_folder))
    path = os.path.join(ladder, PREDICTION_FILE)
    pred = _read_json(path)
    if not isinstance(pred, dict) or not isinstance(pred.get("target"), dict) or \
            os.path.abspath(str(pred["target"].get("save_folder"))) != os.path.abspath(save_folder):
        return None
    actual = target_actual(save_folder)
    if actual is None or actual == pred["target"].get("actual"):
        return None
    pred["target"]["actual"] = actual
    _write_json(path, pred)
    from lmforge.report.scaling import write_ladder_report

    write_ladder_report(pred, os.path.join(ladder, REPORT_FILE), actual)
    t = pred["target"]
    return (f"scaling: the target's held-out loss {actual:.4f} ({actual / t['loss'] - 1:+.2%} from the prediction "
            f"{t['loss']:.4f}) is now in {path} and {os.path.join(ladder, REPORT_FILE)}")


def read_ladder(folder: str) -> tuple[LadderPlan, dict | None]:
    """(the plan, the prediction if the ladder has been fitted) of a ladder's save folder."""
    record = _read_json(os.path.join(folder, PLAN_FILE))
    if record is None:
        raise UserError(f"{folder}: not a ladder folder (no {PLAN_FILE}); give the save_folder of a ladder file "
                        "that `lmforge scaling run` has started")
    return _plan_of(record, os.path.join(folder, PLAN_FILE)), _read_json(os.path.join(folder, PREDICTION_FILE))


class LadderLock:
    """One ladder driver per save folder (a kernel lock, gone with its process)."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, ".ladder.lock")
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            who = self.f.read().strip()
            self.f.close()
            raise UserError(f"the ladder in {folder} is already running ({who or 'another process'}); follow it with "
                            f"`lmforge scaling show {folder}`") from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"pid {os.getpid()}")
        self.f.flush()

    @classmethod
    def probe(cls, folder: str) -> None:
        """The one line of a ladder another driver runs, raised before one is started in the background
        (`--detach` would otherwise say "running" while its process stops at the lock)."""
        cls(folder).close()

    def close(self) -> None:
        self.f.close()


def run_ladder(cfg: LadderConfig, log=print) -> dict:
    lock = LadderLock(cfg.save_folder)
    try:
        t0 = time.time()
        plan = load_or_make_plan(cfg, log)
        log(format_plan(plan))
        # A time budget counts from this command's start, planning (measuring) included.
        deadline = t0 + cfg.budget.value if cfg.budget.unit == "s" else None
        started = execute(cfg, plan, log, deadline)
        if started:  # the ladder's wall-clock time: its invocations that trained something
            state_path = os.path.join(cfg.save_folder, STATE_FILE)
            state = _read_json(state_path) or {}
            state["ladder_wall_s"] = state.get("ladder_wall_s", 0.0) + time.time() - t0
            _write_json(state_path, state)
        return finish(cfg, plan, results(cfg.save_folder, plan), log)
    finally:
        lock.close()


def detach(args_file: str, save_folder: str, overrides: list[str] = ()) -> int:
    """`scaling run --detach`: the same command (its ``--set``/``--budget`` ``overrides`` too) in its own
    session, its output in ladder.log."""
    os.makedirs(save_folder, exist_ok=True)
    path = os.path.join(save_folder, LOG_FILE)
    with open(path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmforge", "scaling", "run", "-f", args_file, *overrides],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


# --------------------------------------------------------------------------- files

def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _rel(path: str) -> str:
    if not path:
        return path
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path

