"""Fault injection: SIGKILL a supervised run again and again; it must still end bitwise right.

For each rank count, a tiny model is trained once without interruption (the reference), then
again under `lmforge train` (the supervisor) while this script SIGKILLs, in turn, the training
process (the trainer; with 2 ranks: torchrun or one of the ranks) and the supervisor itself,
alternately at a random step and in the middle of a checkpoint write (a ``.step_N.tmp`` folder
exists). A killed trainer is restarted by the supervisor or torchrun; a killed supervisor takes
the whole run down and the same command is run again, which resumes. After each kill it checks:

- orphans: every process of the run seen so far that should be dead is dead (waited for);
- half-written checkpoints: every visible ``checkpoints/step_N`` has its state file, DCP metadata
  and one shard per rank;

and at the end: the final weights equal the reference bit for bit, and the registry holds one
resumption per kill (restarts counted once, whoever restarted), except for a kill that lands
after training ended (the final weights written: the supervisor was finishing up), which is
counted apart.

    python bench/faults.py --kills 20 --stops 5           # 1 and 2 ranks, 10 kills each; 5 timed stops
    python bench/faults.py --kills 2 --ranks 1 --json     # what the CI test runs
    python bench/faults.py --kills 0 --goodput            # goodput faults on 2 nodes × 2 ranks (below)
    python bench/faults.py --kills 0 --overhead 3         # telemetry on/off, interleaved, 3 pairs

``--goodput`` runs a 2-node × 2-rank gloo job on this machine (two `lmforge train --node-rank R`
processes, ``LMFORGE_NODE=node0|node1``) once without faults (the reference, and its false flags),
then once through each fault of ``LMFORGE_FAULT`` (docs/goodput.md), and prints: detected after
(from the fault to the condition's record; for a crash, to the restarted attempt's start), the
action, recovered after (detection to the first step of the next attempt), steps lost, goodput,
and whether the final weights equal the reference's — or, where the run resumed on fewer ranks,
an uninterrupted run from the same checkpoint on that layout (bitwise where the resume is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

from lmforge.process import descendants, parent_of, process_alive, process_start

REPO = Path(__file__).resolve().parent.parent
VICTIMS = ("trainer", "supervisor")
POINTS = ("step", "checkpoint write")


def env(home: Path) -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LMFORGE_HOME": str(home),
                         "LMFORGE_RETRY_DELAY": "0"}


def tiny_data(root: Path) -> tuple[Path, Path]:
    """~400 KB of the standard library's own source: a tokenizer and a prepared dataset."""
    from lmforge.data.prepare.prepare import prepare
    from lmforge.data.text.tokenizer import train_tokenizer

    raw, tok, data = root / "raw", root / "tok", root / "data"
    if not data.exists():
        raw.mkdir(parents=True, exist_ok=True)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in ("argparse.py", "textwrap.py", "dataclasses.py", "fractions.py", "statistics.py"):
            (raw / (name + ".txt")).write_text((stdlib / name).read_text())
        train_tokenizer([str(raw)], 512, str(tok))
        prepare([str(raw)], str(tok), str(data), 64, eval_fraction=0.2)
    return data, tok


def config(path: Path, name: str, folder: Path, data: Path, tok: Path, ranks: int, steps: int, retries: int) -> Path:
    cfg = {"name": name, "tokenizer": str(tok), "train_data": str(data), "save_folder": str(folder),
           "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                     "max_seq_len": 64},
           "training_duration": f"{steps}ba", "save_interval": "3ba", "log_interval": 1, "max_retries": retries,
           "parameters": {"global_batch_size": 8, "micro_batch_size": 2, "learning_rate": 3e-3,
                          "context_length": 64, "warmup": "2ba"},
           "eval": {"interval": "1000ba", "max_batches": 1, "prompts": []},
           "experiment_tracker": {"mlflow": None, "console": True},
           "compute": {"ranks": ranks} if ranks > 1 else {}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def steps_logged(folder: Path) -> int:
    try:
        return sum(1 for line in (folder / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line)
    except OSError:
        return 0


def writes(folder: Path) -> set[tuple[str, int]]:
    """Checkpoint writes in progress (or interrupted): the ``.step_N.tmp`` folders, by name and inode."""
    root = folder / "checkpoints"
    out = set()
    for name in os.listdir(root) if root.is_dir() else ():
        if name.endswith(".tmp"):
            try:
                out.add((name, os.stat(root / name).st_ino))
            except OSError:
                pass
    return out


def half_written(folder: Path, ranks: int) -> list[str]:
    """Visible checkpoints that are not complete."""
    bad = []
    root = folder / "checkpoints"
    for d in sorted(root.glob("step_*")) if root.is_dir() else []:
        ok = (d / "lmforge-state.json").is_file() and (d / ".metadata").is_file()
        try:
            json.loads((d / "lmforge-state.json").read_text())
        except (OSError, ValueError):
            ok = False
        shards = list(d.glob("*.distcp"))
        if not ok or len(shards) < ranks or not all((d / f"rng_rank{r}.pt").is_file() for r in range(ranks)):
            if d.exists():  # (pruned meanwhile by the run: not a visible half-written one)
                bad.append(d.name)
    return bad


def wait_for(pred, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.001)


def pick_victim(kind: str, sup: int, ranks: int, rng: random.Random) -> int | None:
    if kind == "supervisor":
        return sup
    kids = [p for p in descendants(sup) if parent_of(p) == sup]
    if not kids:
        return None
    child = kids[0]  # the trainer, or torchrun
    if ranks == 1:
        return child
    workers = [p for p in descendants(child) if _leads_session(p)]  # the ranks (forked: below the fork server)
    return rng.choice([child, *workers])


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def faults(ranks: int, kills: int, steps: int, work: Path, data: Path, tok: Path, rng: random.Random) -> dict:
    home = work / "home"
    e = env(home)
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "lmforge", *map(str, a)], env=e, cwd=REPO,  # noqa: E731
                                          capture_output=True, text=True, **kw)
    ref = work / f"ref{ranks}"
    p = run("train", "-f", config(work / f"ref{ranks}.yaml", f"ref{ranks}", ref, data, tok, ranks, steps, 0),
            "--no-supervisor")
    assert p.returncode == 0, p.stderr[-3000:]

    name = f"faults{ranks}"
    folder = work / name
    cfg = config(work / f"{name}.yaml", name, folder, data, tok, ranks, steps, kills + 2)
    t0 = time.monotonic()
    logs = open(work / f"{name}.out", "ab")

    def start():
        return subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], env=e, cwd=REPO,
                                stdout=logs, stderr=subprocess.STDOUT)

    sup = start()
    seen: dict[int, str | None] = {}  # every process of the run seen so far → its start identity
    orphans = inside_write = done = after_end = 0
    half = set()
    for i in range(kills):
        kind, point = VICTIMS[i % 2], POINTS[(i + i // 2) % 2]  # each victim at each kind of point
        n0 = steps_logged(folder)
        wait_for(lambda: steps_logged(folder) >= n0 + rng.randint(1, 3), 300, "training to go on", sup)
        old = writes(folder)  # leftovers of earlier kills are not writes in progress
        if point == "checkpoint write":
            try:
                wait_for(lambda: writes(folder) - old, 60, "a checkpoint write", sup)
            except RuntimeError:
                if sup.poll() is not None:
                    raise
        before = writes(folder)
        tree = [sup.pid, *descendants(sup.pid)]
        victim = pick_victim(kind, sup.pid, ranks, rng)
        if victim is None:
            continue
        doomed = [victim, *descendants(victim)] if kind == "trainer" else tree
        for pid in tree:
            seen.setdefault(pid, process_start(pid))
        ended = (folder / "final" / "model.safetensors").exists()  # training is over: nothing to restart
        os.kill(victim, signal.SIGKILL)
        inside_write += bool((before & writes(folder)) - old)
        after_end += ended
        try:
            wait_for(lambda: not any(process_alive(p, seen.get(p)) for p in doomed), 30, "the killed processes")
        except RuntimeError:
            orphans += sum(process_alive(p, seen.get(p)) for p in doomed)
        half |= set(half_written(folder, ranks))
        if kind == "supervisor":
            sup.wait()
            sup = start()  # the same command again: it resumes
        done += 1
    rc = sup.wait(timeout=600)
    wall = time.monotonic() - t0
    orphans += sum(process_alive(pid, start) for pid, start in seen.items())  # all must be gone by now
    a, b = load_file(str(ref / "final" / "model.safetensors")), load_file(str(folder / "final" / "model.safetensors"))
    equal = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    desc = run("runs", "describe", name, "--json")
    resumptions = [{"status": r["status"], "reason": r["reason"]} for r in json.loads(desc.stdout)["resumptions"]]
    return {"ranks": ranks, "kills": done, "inside_checkpoint_write": inside_write, "after_the_end": after_end,
            "exit": rc,
            "restarts_recorded": len(resumptions) - 1, "bitwise_equal": equal, "orphans": orphans,
            "half_written_visible": len(half), "wall_s": round(wall, 1), "resumptions": resumptions}


def stop_latency(n: int, work: Path, data: Path, tok: Path) -> dict:
    """SIGTERM to a supervised 2-rank run (as Ctrl-C or `lmforge runs stop` do), ``n`` times: seconds
    until every process of the run is gone, and whether each rank wrote its part of one checkpoint
    at the step where training stopped."""
    e = env(work / "home")
    folder = work / "stopper"
    cfg = config(work / "stopper.yaml", "stopper", folder, data, tok, 2, 100_000, 0)
    times, ok = [], 0
    with open(work / "stopper.out", "ab") as logs:
        for _ in range(n):
            sup = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], env=e, cwd=REPO,
                                   stdout=logs, stderr=subprocess.STDOUT)
            n0 = steps_logged(folder)
            wait_for(lambda: steps_logged(folder) >= n0 + 5, 300, "training steps", sup)
            tree = {p: process_start(p) for p in [sup.pid, *descendants(sup.pid)]}
            t0 = time.monotonic()
            sup.send_signal(signal.SIGTERM)
            wait_for(lambda: not any(process_alive(p, s) for p, s in tree.items()), 120, "the run to exit")
            times.append(time.monotonic() - t0)
            sup.wait()
            last = max(json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                       if '"train/loss"' in line)
            ckpt = folder / "checkpoints" / f"step_{last:08d}"
            ok += sup.returncode == 0 and len(list(ckpt.glob("*.distcp"))) == 2 and not half_written(folder, 2)
    times.sort()
    return {"stops": n, "checkpoint_at_stop_step": ok, "seconds_min": round(times[0], 2),
            "seconds_median": round(times[len(times) // 2], 2), "seconds_max": round(times[-1], 2)}


SLOW_FROM = 4  # the slow fault's first step
GOODPUT_FAULTS = {  # name → (LMFORGE_FAULT, config overrides)
    "slow rank (half speed)": (f"slow:node=node1:local_rank=0:factor=2:from={SLOW_FROM}", {}),
    "stopped rank": ("stop:node=node1:local_rank=1:step=7", {"compute": {"hang_timeout": 15}}),
    "killed rank": ("kill:node=node1:local_rank=1:step=7", {}),
    "fatal XID on node1": ("xid:node=node1:step=7:code=79", {}),
    "node1 fails its diagnostic": (f"slow:node=node1:factor=3:from={SLOW_FROM},diag:node=node1",
                                   {"goodput": {"straggler": {"action": "diagnose"}}}),
    "NaN": ("nan:rank=0:step=7", {}),
}


def node_config(work: Path, name: str, data: Path, tok: Path, steps: int | str, extra: dict, nodes: int = 2,
                save_every: int = 3) -> Path:
    """A 2 × 2 DDP run on localhost (or 1 × 2: a twin on the layout a cordon leaves); every checkpoint
    kept (the twin starts from the cordon's). ``steps``: a count, or a duration such as "10min"."""
    cfg = config(work / f"{name}.yaml", name, work / name, data, tok, 2, 1, 3)
    doc = yaml.safe_load(cfg.read_text())
    doc["training_duration"] = f"{steps}ba" if isinstance(steps, int) else steps
    doc["save_interval"] = f"{save_every}ba"
    doc["save_num_checkpoints_to_keep"] = 1000
    doc["parameters"]["micro_batch_size"] = 1
    doc["compute"] |= {"nodes": nodes, "data_parallel": "ddp", "async_checkpoint": False}
    if nodes > 1:
        doc["compute"] |= {"rdzv_endpoint": f"127.0.0.1:{_free_port()}", "rdzv_timeout_s": 120}
    for key, value in extra.items():
        doc[key] = (doc.get(key) or {}) | value if isinstance(value, dict) else value
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(cfg: Path, work: Path, home: Path, fault: str, nodes: int = 2, timeout: float = 900) -> list[int]:
    e = env(home) | {"LMFORGE_FAULT": fault}
    with open(work / f"{cfg.stem}.out", "ab") as logs:
        procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--node-rank", str(r)],
                                  env=e | {"LMFORGE_NODE": f"node{r}"}, cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
                 for r in range(nodes)]
        return [p.wait(timeout=timeout) for p in procs]


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def goodput_row(name: str, folder: Path, log_interval: int = 1) -> dict:
    """What happened to one faulted run, from its ledger, events and fault records."""
    from lmforge.goodput.ledger import account, read_ledger

    ledger, events, fired = read_ledger(str(folder)), _jsonl(folder / "events.jsonl"), _jsonl(folder / "faults.jsonl")
    acc = account(ledger) or {"goodput": 0.0, "resumptions": [], "wall_s": 0.0, "parts": {}}
    starts = [r for r in ledger if r["kind"] == "start"]
    flags = [e for e in events if e.get("event") == "straggler"]
    detected = [r["time"] for r in ledger if r["kind"] == "detected"]
    if fired:
        t_fault = fired[0]["time"]
    else:  # slow: from the first step it applies to (the tick of the step before it)
        t_fault = next((r["time"] for r in ledger if r["kind"] == "tick" and r["step"] >= SLOW_FROM - 1), None)
    if detected:
        t_detect = detected[0]
    elif flags and name.startswith("slow"):
        t_detect = flags[0]["time"]
    else:  # a crash or a hang: the restarted attempt's start
        t_detect = starts[1]["process_start"] if len(starts) > 1 else None
    nxt = next((r for r in ledger if r["kind"] == "tick" and len(starts) > 1 and r["attempt"] == starts[1]["attempt"]),
               None)
    action = next((f"{e['action']} ({', '.join(e['cordoned']) or 'no node cordoned'})" for e in events
                   if e.get("event") == "goodput_action"), None)
    if action is None:
        action = "restart (torchrun)" if any(e.get("event") == "elastic_restart" for e in events) else \
            "flagged (action log)" if flags else "stop (diverged, exit 3)" if name == "NaN" else "-"
    flagged_after = None
    if flags and name.startswith("slow"):  # log intervals from the first slow step
        flagged_after = -(-(flags[0]["step"] - SLOW_FROM + 1) // log_interval)
    plan = (json.loads((folder / "plan.json").read_text()).get("view") or {}).get("goodput") \
        if (folder / "plan.json").exists() else None
    return {"fault": name, "detected_s": None if t_detect is None or t_fault is None else round(t_detect - t_fault, 1),
            "planned": plan["goodput"] if plan else None, "per_fault": per_fault(ledger, events, fired),
            "flagged_after_intervals": flagged_after, "action": action,
            "recovered_s": round(nxt["time"] - t_detect, 1) if nxt and t_detect else None,
            "steps_lost": sum(r["steps_redone"] for r in acc["resumptions"]), "goodput": round(acc["goodput"], 3),
            "wall_s": round(acc["wall_s"], 1), "parts": acc["parts"],
            "false_flags": len([f for f in flags if f["node"] != "node1"]),
            "completed": (folder / "final" / "model.safetensors").exists()}


def per_fault(ledger: list[dict], events: list[dict], fired: list[dict]) -> list[dict]:
    """Each fault that fired: when it was detected (a node's torchrun saw a rank fail, or a condition's
    record) and the seconds from there to the next attempt's first step (its loop's start)."""
    starts = [r for r in ledger if r["kind"] == "start"]
    detections = [r["time"] for r in ledger if r["kind"] == "detected"] + \
        [e["time"] for e in events if e.get("event") == "rank_failed"]
    out, seen = [], set()
    for f in sorted(fired, key=lambda f: f["time"]):
        if f["kind"] in seen or f["kind"] not in ("kill", "stop", "xid"):
            continue
        seen.add(f["kind"])  # (each of a node's ranks records a node-wide fault)
        nxt = next((r for r in starts if r["process_start"] > f["time"]), None)
        found = [t for t in detections if t >= f["time"] and (nxt is None or t <= nxt["time"])]
        detect = min(found) if found else None
        out.append({"fault": f["kind"], "step": f["step"], "detected_s": round(detect - f["time"], 1) if detect else None,
                    "recovered_s": round(nxt["time"] - detect, 1) if nxt and detect else None})
    return out


def same_weights(a: Path, b: Path) -> str:
    if not (a / "final" / "model.safetensors").exists() or not (b / "final" / "model.safetensors").exists():
        return "-"
    x, y = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    if x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x):
        return "bitwise equal"
    diff = max(float((x[k] - y[k]).abs().max()) for k in x)
    return f"max abs diff {diff:.2g}"


def goodput_faults(work: Path, data: Path, tok: Path, steps: int, only: list[str] | None,
                   log_interval: int = 1) -> list[dict]:
    """The reference (no fault), then each fault of GOODPUT_FAULTS on 2 nodes × 2 ranks. A run that
    resumed on fewer nodes is compared with its twin: an uninterrupted run on the same schedule of
    layouts — a copy of the cordon's checkpoint (2 × 2 up to it) continued on 1 × 2 — and with the
    2 × 2 reference."""
    import shutil

    from lmforge.goodput.cordon import read_cordon

    home = work / "home"
    every = {"log_interval": log_interval}
    run_nodes(node_config(work, "gp-reference", data, tok, steps, every), work, home, "")
    ref = work / "gp-reference"
    clean = goodput_row("none", ref, log_interval)
    rows = [clean | {"fault": "none (reference)", "weights": "-"}]
    for i, (name, (fault, extra)) in enumerate(GOODPUT_FAULTS.items()):
        if only and not any(o in name for o in only):
            continue
        cfg = node_config(work, f"gp-{i}", data, tok, steps, extra | every)
        codes = run_nodes(cfg, work, home, fault)
        folder = work / f"gp-{i}"
        row = goodput_row(name, folder, log_interval) | {"exit": codes}
        cordon = read_cordon(str(folder))
        row["weights"] = same_weights(folder, ref) + " vs the 2 × 2 reference"
        if cordon:
            step = min(v["step"] for v in cordon.values())
            twin = work / f"gp-{i}-twin"
            ckpt = folder / "checkpoints" / f"step_{step:08d}"
            (twin / "checkpoints").mkdir(parents=True, exist_ok=True)
            shutil.copytree(ckpt, twin / "checkpoints" / ckpt.name)
            run_nodes(node_config(work, f"gp-{i}-twin", data, tok, steps, extra | every, nodes=1), work, home, "",
                      nodes=1)
            row["weights"] = (same_weights(folder, twin) + " vs 2 × 2 → 1 × 2 uninterrupted from the cordon's "
                              "checkpoint; " + row["weights"])
        rows.append(row)
    return rows


def clean_run(minutes: float, work: Path, data: Path, tok: Path, log_interval: int = 1) -> dict:
    """A fault-free 2 × 2 run of ``minutes`` (training time) with the default straggler rule at
    ``log_interval`` (1: every step is an interval, the noisiest): its straggler flags are false ones."""
    name = "gp-clean"
    run_nodes(node_config(work, name, data, tok, f"{minutes:g}min", {"log_interval": log_interval}, save_every=1000),
              work, work / "home", "",
              timeout=minutes * 60 + 900)
    folder = work / name
    flags = [e for e in _jsonl(folder / "events.jsonl") if e.get("event") == "straggler"]
    scores = [m["straggler/max_score"] for m in _jsonl(folder / "metrics.jsonl") if "straggler/max_score" in m]
    scores.sort()
    steps = max((m["step"] for m in _jsonl(folder / "metrics.jsonl")), default=0)
    return {"minutes": minutes, "steps": steps, "log_interval": log_interval, "false_flags": len(flags), "flags": flags,
            "max_score_median": scores[len(scores) // 2] if scores else None,
            "max_score_p99": scores[int(0.99 * (len(scores) - 1))] if scores else None,
            "max_score_max": scores[-1] if scores else None}


def three_faults(minutes: float, work: Path, data: Path, tok: Path, step_s: float, start: dict, *,
                 save_every: int | None = None, local: bool = True, hang_timeout: float = 15.0) -> dict:
    """A 2 × 2 run of ``minutes`` of training, through three faults at 20%, 45% and 70% of the steps it is
    expected to take at ``step_s`` per step (the reference's) — a killed rank (torchrun restarts the ranks), a
    stopped rank (the hang watchdog, then a restart) and a fatal XID on node1 (cordoned: node 0 goes on
    alone). Checkpoints: ``save_interval: auto`` (or every ``save_every`` steps) and, with ``local``, a
    local tier in /dev/shm at its own auto interval. The run is planned with the scenario's inputs, from
    the reference run's start (``start``: its whole start-up, and the part after the imports, which a
    rank forked from a warm fork server still pays): its first start; a restart, the mean of a killed
    rank's (~0.5 s to notice, then a forked start), the hang's (its timeout, then a forked start) and the
    XID's (a cordon: the whole chain starts again); three failures of 4 ranks over the wall that makes.
    Its planned goodput is reported beside the measured one, and beside the model evaluated with the
    run's own measured inputs."""
    steps = max(40, int(minutes * 60 / step_s))  # expected: the run trains `minutes` of wall-clock time
    at = [int(f * steps) for f in (0.2, 0.45, 0.7)]  # (a margin before the end: a slower box takes fewer steps)
    fault = (f"kill:node=node1:local_rank=1:step={at[0]},stop:node=node0:local_rank=1:step={at[1]},"
             f"xid:node=node1:step={at[2]}:code=79")
    name = "gp-three"
    restart = (2 * start["forked_s"] + start["full_s"] + 0.5 + hang_timeout + 0.1) / 3
    wall = minutes * 60 + start["full_s"] + 3 * restart
    rate = 3 / (4 * wall / 3600)  # per rank and hour
    extra = {"compute": {"hang_timeout": hang_timeout},
             "goodput": {"failures_per_gpu_hour": round(rate, 4), "restart_s": round(restart, 2),
                         "start_s": round(start["full_s"], 2)}}
    cfg = node_config(work, name, data, tok, f"{minutes:g}min", extra, save_every=save_every or 1)
    doc = yaml.safe_load(cfg.read_text())
    doc["save_interval"] = f"{save_every}ba" if save_every else "auto"
    shm = Path("/dev/shm") / f"lmforge-bench-{os.getpid()}-{name}"
    if local:
        doc["local_checkpoints"] = {"folder": str(shm), "interval": "auto", "keep": 2}
    cfg.write_text(yaml.safe_dump(doc))
    dry = subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--dry-run", "--json"],
                         env=env(work / "home"), cwd=REPO, capture_output=True, text=True, check=True)
    planned = json.loads(dry.stdout)["plan"]["goodput"]  # before the run (its plan.json is each attempt's)
    try:
        run_nodes(cfg, work, work / "home", fault, timeout=minutes * 60 * 3 + 900)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    row = goodput_row("three faults", work / name)
    fired = list(dict.fromkeys(f["kind"] for f in _jsonl(work / name / "faults.jsonl")))  # (a node's ranks each)
    return row | {"steps": steps, "save_every": doc["save_interval"], "local": local, "faults": fault,
                  "fired": fired, "hang_timeout": hang_timeout, "model": model_check(work / name, planned)}


def model_check(folder: Path, plan: dict | None = None) -> dict:
    """The goodput model (`plan.goodput`) against what the run measured: the plan's projection, made
    before the run (``plan``: its dry run's), and the model evaluated with the run's own inputs — its failures over its wall, its
    restarts (recovery + start-up), its checkpoints' median blocking time per tier, the intervals it
    used and its step time — beside the measured goodput."""
    import statistics

    from lmforge.goodput.ledger import account, read_ledger
    from lmforge.plan.goodput import Tier, goodput_at

    ledger = read_ledger(str(folder))
    acc = account(ledger)
    if plan is None and (folder / "plan.json").exists():  # (the last attempt's: after a cordon, fewer ranks')
        plan = (json.loads((folder / "plan.json").read_text()).get("view") or {}).get("goodput")
    ends = [r for r in ledger if r["kind"] in ("end", "last", "tick")]
    steps_s = sum(a.get("steps_s", 0) for a in _last_per_attempt(ledger))
    steps = sum(max(0, a.get("step", 0) - s) for a, s in _span_per_attempt(ledger))
    step_s = steps_s / steps if steps else 0.0
    failures = [r for r in acc["resumptions"] if not str(r["cause"]).startswith("ended ")]
    restart = statistics.mean(r["recovery_s"] + r["startup_s"] for r in failures) if failures else 0.0
    first = next((r for r in ledger if r["kind"] == "start"), None)
    startup = first["time"] - first["process_start"] if first else 0.0
    mtbf = (acc["wall_s"] - startup) / len(failures) if failures else float("inf")  # (failures strike after it)
    tiers = []
    for tier in ("durable", "local"):
        blocking = [r["blocking_s"] for r in ledger if r["kind"] == "checkpoint" and r.get("tier") == tier]
        if any(r["kind"] == "interval" and r.get("tier") == tier for r in ledger):
            covers = next((t["covers"] for t in (plan or {}).get("tiers", []) if t["tier"] == tier), 1.0)
            period = steps_s / len(blocking) if blocking else steps_s  # the seconds of steps per checkpoint
            tiers.append(Tier(tier, statistics.median(blocking) if blocking else 0.0, 0.0, period, covers))
    model = goodput_at(tiers, mtbf, restart, run_s=steps_s, startup_s=startup) if tiers and ends else None
    return {"planned": plan["goodput"] if plan else None, "planned_parts": plan["parts"] if plan else None,
            "with_measured_inputs": model["goodput"] if model else None, "model_parts": model,
            "measured": acc["goodput"], "inputs": {"mtbf_s": mtbf, "restart_s": restart, "step_s": step_s,
                                                   "first_start_s": startup, "tiers": [t.__dict__ for t in tiers]}}


def _last_per_attempt(ledger: list[dict]) -> list[dict]:
    from lmforge.goodput.ledger import LAST_KINDS

    last: dict[str, dict] = {}
    for r in ledger:
        if r["kind"] in LAST_KINDS and (r["attempt"] not in last or r["time"] >= last[r["attempt"]]["time"]):
            last[r["attempt"]] = r
    return list(last.values())


def _span_per_attempt(ledger: list[dict]) -> list[tuple[dict, int]]:
    starts = {r["attempt"]: r.get("step", 0) for r in ledger if r["kind"] == "start"}
    return [(r, starts.get(r["attempt"], 0)) for r in _last_per_attempt(ledger)]


def hook_cost(sections_per_step: int, folder: Path) -> dict:
    """What telemetry adds to one step at log_interval 1, measured in this process: its section hooks and
    one log interval's conditions, on minus off (the all-gather and the ledger's record run with telemetry
    off too: health, accounting)."""
    import torch

    from lmforge.config.goodput import GoodputConfig
    from lmforge.distributed.dist import DistInfo
    from lmforge.train.telemetry import Telemetry

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    out, interval = {}, {}
    for on in (True, False):
        tel = Telemetry(GoodputConfig(telemetry=on), one, folder=str(folder), log=lambda *_: None, environ={})
        tel.start(0)
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            with tel.section("forward"):
                pass
        out[on] = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(2000):
            tel.interval()
        interval[on] = (time.perf_counter() - t0) / 2000
        if tel.health is not None:
            tel.health.close()
    section, conditions = out[True] - out[False], interval[True] - interval[False]
    return {"section_us": round(1e6 * section, 2), "interval_us": round(1e6 * conditions, 1),
            "per_step_us": round(1e6 * (section * sections_per_step + conditions), 1)}


def telemetry_overhead(pairs: int, work: Path, data: Path, tok: Path, steps: int) -> dict:
    """Step time with goodput.telemetry on and off, alternating, on one node × 2 ranks (log_interval 1:
    every step pays the conditions), and the hooks' cost per step measured in-process."""
    from lmforge.goodput.ledger import read_ledger

    home, out = work / "home", {True: [], False: []}
    for i in range(pairs):
        for on in (True, False):
            name = f"overhead-{i}-{'on' if on else 'off'}"
            cfg = node_config(work, name, data, tok, steps, {"goodput": {"telemetry": on}}, nodes=1, save_every=10**6)
            run_nodes(cfg, work, home, "", nodes=1)
            end = [r for r in read_ledger(str(work / name)) if r["kind"] == "end"][-1]
            out[on].append(end["steps_s"] / end["step"])
    on, off = sorted(out[True])[pairs // 2], sorted(out[False])[pairs // 2]
    # a step: data, then forward and backward per micro-batch (global 8 = 2 ranks × 1 × 4), optimizer
    cost = hook_cost(2 + 2 * 4, work / "hooks")
    return {"pairs": pairs, "step_ms_on": round(1000 * on, 2), "step_ms_off": round(1000 * off, 2),
            "overhead": round(on / off - 1, 4), "on_ms": [round(1000 * x, 2) for x in out[True]],
            "off_ms": [round(1000 * x, 2) for x in out[False]], "hooks": cost,
            "hooks_share": round(cost["per_step_us"] / (1e6 * off), 5)}


def _step_s(work: Path, data: Path, tok: Path) -> tuple[float, dict]:
    """Seconds per step of the 2 × 2 reference, the median over its log steps (the first ones, slower,
    aside), and its start-up (``full_s``; ``forked_s``: after the imports); run now when the goodput rows
    did not."""
    import statistics

    from lmforge.goodput.ledger import read_ledger

    ref = work / "gp-reference"
    if not (ref / "final").exists():
        run_nodes(node_config(work, "gp-reference", data, tok, 60, {}), work, work / "home", "")
    ledger = read_ledger(str(ref))
    ticks = [r for r in ledger if r["kind"] == "tick"]
    start = next(r for r in ledger if r["kind"] == "start")
    step_s = statistics.median(b["steps_s"] - a["steps_s"] for a, b in zip(ticks[3:], ticks[4:]) if b["step"] > a["step"])
    full = start["time"] - start["process_start"]
    return step_s, {"full_s": full, "forked_s": full - (start.get("phases") or {}).get("imported", 0.0)}


def print_goodput(rows: list[dict], overhead: dict | None, clean: dict | None, three: dict | None) -> None:
    if rows:
        print("\n| fault | detected after (s) | action | recovered after (s) | steps lost | goodput (planned) | wall (s) | "
              "final weights |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            after = r.get("flagged_after_intervals")
            flag = f" (flagged after {after} log intervals)" if after else ""
            extra = f"; false flags: {r['false_flags']}" if r["fault"].startswith("none") else ""
            print(f"| {r['fault']}{extra} | {r['detected_s'] if r['detected_s'] is not None else '-'}{flag} | "
                  f"{r['action'] if not r['fault'].startswith('none') else '-'} | "
                  f"{r['recovered_s'] if r['recovered_s'] is not None else '-'} | {r['steps_lost']} | "
                  f"{100 * r['goodput']:.1f}% ({100 * r['planned']:.1f}%) | {r['wall_s']} | {r['weights']} |"
                  if r.get("planned") is not None else
                  f"{r['recovered_s'] if r['recovered_s'] is not None else '-'} | {r['steps_lost']} | "
                  f"{100 * r['goodput']:.1f}% | {r['wall_s']} | {r['weights']} |")
    if clean:
        print(f"\nclean 2 × 2 run, {clean['minutes']:g} min of training ({clean['steps']} steps, log_interval "
              f"{clean['log_interval']}): "
              f"{clean['false_flags']} false straggler flag(s); max score per interval: median "
              f"{clean['max_score_median']}, p99 {clean['max_score_p99']}, max {clean['max_score_max']}")
    if three:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in three["parts"].items())
        m = three["model"]
        pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"  # noqa: E731
        print(f"\nthree faults ({', '.join(three['fired'])}) in {three['steps']} steps (save_interval "
              f"{three['save_every']}{', local tier in /dev/shm' if three['local'] else ''}, hang_timeout "
              f"{three['hang_timeout']:g}s): goodput {100 * three['goodput']:.1f}% of {three['wall_s']}s wall "
              f"({parts}); steps lost {three['steps_lost']}; recovery per fault (detection → first step): "
              f"{three['per_fault']}")
        print(f"  goodput planned {pct(m['planned'])} (before the run), the model with the run's measured inputs "
              f"{pct(m['with_measured_inputs'])}, measured {pct(m['measured'])}; inputs measured: "
              f"{json.dumps(m['inputs'], default=str)}")
    if overhead:
        h = overhead["hooks"]
        print(f"\ntelemetry on/off ({overhead['pairs']} interleaved pairs, medians): step {overhead['step_ms_on']} ms "
              f"vs {overhead['step_ms_off']} ms: {100 * overhead['overhead']:+.2f}% (on {overhead['on_ms']}, off "
              f"{overhead['off_ms']}); the hooks measured alone: {h['section_us']} µs per section, "
              f"{h['interval_us']} µs per interval's conditions, {h['per_step_us']} µs per step = "
              f"{100 * overhead['hooks_share']:.3f}% of the step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in all (split over the rank counts)")
    ap.add_argument("--ranks", default="1,2", help="rank counts to run, e.g. 1 or 1,2")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 12 + 6 × kills per run)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the kill points (default: random)")
    ap.add_argument("--workdir", help="folder for data and runs (default: a temporary one)")
    ap.add_argument("--data", help="a prepared dataset (default: built from the standard library)")
    ap.add_argument("--tokenizer", help="its tokenizer folder (with --data)")
    ap.add_argument("--stops", type=int, default=0, help="also time N stops (SIGTERM) of a 2-rank run")
    ap.add_argument("--goodput", nargs="*", metavar="FAULT",
                    help="run the goodput faults on 2 nodes × 2 ranks (optionally only those whose name has FAULT)")
    ap.add_argument("--goodput-steps", type=int, default=14, help="steps of each goodput run")
    ap.add_argument("--log-interval", type=int, default=1, help="the goodput rows' and the clean run's log_interval")
    ap.add_argument("--clean-minutes", type=float, default=0, help="a fault-free 2 × 2 run this long: its false flags")
    ap.add_argument("--three-faults", type=float, default=0, metavar="MINUTES",
                    help="a 2 × 2 run about this long through three faults: its goodput")
    ap.add_argument("--save-every", type=int, default=None, metavar="STEPS",
                    help="--three-faults: checkpoint every STEPS steps (default: save_interval: auto)")
    ap.add_argument("--no-local", action="store_true", help="--three-faults: no local checkpoint tier")
    ap.add_argument("--hang-timeout", type=float, default=15.0, help="--three-faults: compute.hang_timeout (s)")
    ap.add_argument("--overhead", type=int, default=0, metavar="PAIRS", help="telemetry on/off, interleaved")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    ranks = [int(r) for r in args.ranks.split(",")]
    per_run = [args.kills // len(ranks) + (i < args.kills % len(ranks)) for i in range(len(ranks))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, tok = (Path(args.data), Path(args.tokenizer)) if args.data else tiny_data(work / "tiny")
        results = [faults(r, k, args.steps or 12 + 6 * k, work, data, tok, rng)
                   for r, k in zip(ranks, per_run) if k]
        stops = stop_latency(args.stops, work, data, tok) if args.stops else None
        gp = goodput_faults(work, data, tok, args.goodput_steps, args.goodput, args.log_interval) \
            if args.goodput is not None else []
        clean = clean_run(args.clean_minutes, work, data, tok, args.log_interval) if args.clean_minutes else None
        three = None
        if args.three_faults:
            step_s, start = _step_s(work, data, tok)
            three = three_faults(args.three_faults, work, data, tok, step_s, start, save_every=args.save_every,
                                 local=not args.no_local, hang_timeout=args.hang_timeout)
        overhead = telemetry_overhead(args.overhead, work, data, tok, 600) if args.overhead else None
    if args.json:
        print(json.dumps({"seed": seed, "results": results, "stop": stops, "goodput": gp, "clean": clean,
                          "three_faults": three, "overhead": overhead}, indent=1))
        return
    print_goodput(gp, overhead, clean, three)
    print(f"seed {seed}")
    print("| ranks | SIGKILLs | in a checkpoint write | after training ended | restarts recorded | final weights | "
          "orphans | half-written visible | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['ranks']} | {r['kills']} | {r['inside_checkpoint_write']} | {r['after_the_end']} | "
              f"{r['restarts_recorded']} | "
              f"{'bitwise equal' if r['bitwise_equal'] else 'DIFFERENT'} | {r['orphans']} | "
              f"{r['half_written_visible']} | {r['wall_s']} |")
    if stops:
        print(f"\nstop of a 2-rank run (SIGTERM → every process gone), {stops['stops']} times: median "
              f"{stops['seconds_median']} s (min {stops['seconds_min']}, max {stops['seconds_max']}); "
              f"checkpoint at the stop step on both ranks: {stops['checkpoint_at_stop_step']}/{stops['stops']}")


if __name__ == "__main__":
    main()
