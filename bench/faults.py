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

from lmforge.process import descendants, process_alive, process_start

REPO = Path(__file__).resolve().parent.parent
VICTIMS = ("trainer", "supervisor")
POINTS = ("step", "checkpoint write")


def env(home: Path) -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LMFORGE_HOME": str(home),
                         "LMFORGE_RETRY_DELAY": "0"}


def tiny_data(root: Path) -> tuple[Path, Path]:
    """~400 KB of the standard library's own source: a tokenizer and a prepared dataset."""
    from lmforge.data.prepare import prepare
    from lmforge.data.tokenizer import train_tokenizer

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
    kids = [p for p in descendants(sup) if _parent(p) == sup]
    if not kids:
        return None
    child = kids[0]  # the trainer, or torchrun
    if ranks == 1:
        return child
    workers = [p for p in descendants(child) if _parent(p) == child]
    return rng.choice([child, *workers])


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


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


GOODPUT_FAULTS = {  # name → (LMFORGE_FAULT, config overrides)
    "slow rank (half speed)": ("slow:node=node1:local_rank=0:factor=2:from=4", {}),
    "killed rank": ("kill:node=node1:local_rank=1:step=7", {}),
    "stopped rank": ("stop:node=node1:local_rank=1:step=7", {"compute": {"hang_timeout": 15}}),
    "fatal XID on node1": ("xid:node=node1:step=7:code=79", {}),
    "node1 fails its diagnostic": ("slow:node=node1:factor=3:from=4,diag:node=node1",
                                   {"goodput": {"straggler": {"action": "diagnose"}}}),
    "NaN": ("nan:rank=0:step=7", {}),
}


def node_config(work: Path, name: str, data: Path, tok: Path, steps: int, extra: dict, nodes: int = 2) -> Path:
    """A 2 × 2 DDP run on localhost (or 1 × 2: a reference on the layout a cordon leaves)."""
    cfg = config(work / f"{name}.yaml", name, work / name, data, tok, 2, steps, 3)
    doc = yaml.safe_load(cfg.read_text())
    doc["parameters"]["micro_batch_size"] = 1
    doc["compute"] |= {"nodes": nodes, "data_parallel": "ddp", "async_checkpoint": False}
    if nodes > 1:
        doc["compute"] |= {"rdzv_endpoint": f"127.0.0.1:{_free_port()}", "rdzv_timeout_s": 120}
    for key, value in extra.items():
        doc[key] = (doc.get(key) or {}) | value
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(cfg: Path, work: Path, home: Path, fault: str, nodes: int = 2) -> list[int]:
    e = env(home) | {"LMFORGE_FAULT": fault}
    with open(work / f"{cfg.stem}.out", "ab") as logs:
        procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--node-rank", str(r)],
                                  env=e | {"LMFORGE_NODE": f"node{r}"}, cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
                 for r in range(nodes)]
        return [p.wait(timeout=900) for p in procs]


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def goodput_row(name: str, folder: Path) -> dict:
    """What happened to one faulted run, from its ledger, events and fault records."""
    from lmforge.goodput.ledger import account, read_ledger

    ledger, events, fired = read_ledger(str(folder)), _jsonl(folder / "events.jsonl"), _jsonl(folder / "faults.jsonl")
    acc = account(ledger) or {"goodput": 0.0, "resumptions": [], "wall_s": 0.0}
    starts = [r for r in ledger if r["kind"] == "start"]
    flagged = [e for e in events if e.get("event") in ("straggler", "health", "goodput_action")]
    detected = [r["time"] for r in ledger if r["kind"] == "detected"]
    if fired:
        t_fault = fired[0]["time"]
    else:  # slow: from the first step it applies to (the tick before it)
        t_fault = next((r["time"] for r in ledger if r["kind"] == "tick" and r["step"] >= 3), None)
    if detected:
        t_detect = detected[0]
    elif flagged and name.startswith("slow"):
        t_detect = flagged[0]["time"]
    else:
        t_detect = starts[1]["process_start"] if len(starts) > 1 else None
    nxt = next((r for r in ledger if r["kind"] == "tick" and len(starts) > 1 and r["attempt"] == starts[1]["attempt"]),
               None)
    action = next((f"{e['action']} ({', '.join(e['cordoned']) or 'no node cordoned'})" for e in events
                   if e.get("event") == "goodput_action"), None)
    if action is None:
        action = "restart (torchrun)" if any(e.get("event") == "elastic_restart" for e in events) else \
            "flagged (action log)" if flagged else "stop (diverged, exit 3)" if name == "NaN" else "restart"
    flag_steps = [e["step"] for e in events if e.get("event") == "straggler"]
    return {"fault": name, "detected_s": None if t_detect is None or t_fault is None else round(t_detect - t_fault, 1),
            "flagged_at_step": flag_steps[0] if flag_steps else None, "action": action,
            "recovered_s": round(nxt["time"] - t_detect, 1) if nxt and t_detect else None,
            "steps_lost": sum(r["steps_redone"] for r in acc["resumptions"]), "goodput": round(acc["goodput"], 3),
            "wall_s": round(acc["wall_s"], 1), "completed": (folder / "final" / "model.safetensors").exists()}


def same_weights(a: Path, b: Path) -> str:
    if not (a / "final" / "model.safetensors").exists() or not (b / "final" / "model.safetensors").exists():
        return "-"
    x, y = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    if x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x):
        return "bitwise equal"
    diff = max(float((x[k] - y[k]).abs().max()) for k in x)
    return f"DIFFERENT (max |Δ| {diff:.2g})"


def goodput_faults(work: Path, data: Path, tok: Path, steps: int, only: list[str] | None) -> list[dict]:
    import shutil

    from lmforge.goodput.cordon import read_cordon

    home = work / "home"
    run_nodes(node_config(work, "gp-reference", data, tok, steps, {}), work, home, "")
    ref = work / "gp-reference"
    clean = goodput_row("none", ref)
    clean_flags = sum(1 for e in _jsonl(ref / "events.jsonl") if e.get("event") == "straggler")
    rows = [clean | {"fault": "none (reference)", "false_flags": clean_flags, "weights": "-"}]
    for i, (name, (fault, extra)) in enumerate(GOODPUT_FAULTS.items()):
        if only and not any(o in name for o in only):
            continue
        cfg = node_config(work, f"gp-{i}", data, tok, steps, extra)
        codes = run_nodes(cfg, work, home, fault)
        folder = work / f"gp-{i}"
        row = goodput_row(name, folder) | {"exit": codes}
        cordon = read_cordon(str(folder))
        if cordon:  # resumed on 1 × 2: the reference is an uninterrupted run from that checkpoint, on that layout
            step = min(v["step"] for v in cordon.values())
            twin = work / f"gp-{i}-twin"
            ckpt = folder / "checkpoints" / f"step_{step:08d}"
            twin_cfg = node_config(work, f"gp-{i}-twin", data, tok, steps, extra, nodes=1)
            (twin / "checkpoints").mkdir(parents=True, exist_ok=True)
            if ckpt.exists():
                shutil.copytree(ckpt, twin / "checkpoints" / ckpt.name)
            run_nodes(twin_cfg, work, home, "", nodes=1)
            row["weights"] = same_weights(folder, twin) + " (vs 1 × 2 from the cordon checkpoint)"
        else:
            row["weights"] = same_weights(folder, ref)
        rows.append(row)
    return rows


def telemetry_overhead(pairs: int, work: Path, data: Path, tok: Path, steps: int) -> dict:
    """Step time with goodput.telemetry on and off, alternating, on one node × 2 ranks."""
    from lmforge.goodput.ledger import read_ledger

    home, out = work / "home", {True: [], False: []}
    for i in range(pairs):
        for on in (True, False):
            name = f"overhead-{i}-{'on' if on else 'off'}"
            cfg = node_config(work, name, data, tok, steps, {"goodput": {"telemetry": on}}, nodes=1)
            run_nodes(cfg, work, home, "", nodes=1)
            end = [r for r in read_ledger(str(work / name)) if r["kind"] == "end"][-1]
            out[on].append(end["steps_s"] / end["step"])
    on, off = sorted(out[True])[pairs // 2], sorted(out[False])[pairs // 2]
    return {"pairs": pairs, "step_ms_on": round(1000 * on, 2), "step_ms_off": round(1000 * off, 2),
            "overhead": round(on / off - 1, 4)}


def print_goodput(rows: list[dict], overhead: dict | None) -> None:
    if rows:
        print("\n| fault | detected after (s) | action | recovered after (s) | steps lost | goodput | wall (s) | "
              "final weights |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            flag = f" (flagged at step {r['flagged_at_step']})" if r.get("flagged_at_step") and \
                r["fault"].startswith("slow") else ""
            extra = f"; false flags: {r['false_flags']}" if "false_flags" in r else ""
            print(f"| {r['fault']}{extra} | {r['detected_s'] if r['detected_s'] is not None else '-'}{flag} | "
                  f"{r['action'] if not r['fault'].startswith('none') else '-'} | "
                  f"{r['recovered_s'] if r['recovered_s'] is not None else '-'} | {r['steps_lost']} | "
                  f"{100 * r['goodput']:.1f}% | {r['wall_s']} | {r['weights']} |")
    if overhead:
        print(f"\ntelemetry on/off ({overhead['pairs']} interleaved pairs, medians): step {overhead['step_ms_on']} ms "
              f"vs {overhead['step_ms_off']} ms: {100 * overhead['overhead']:+.2f}%")


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
        gp = goodput_faults(work, data, tok, args.goodput_steps, args.goodput) if args.goodput is not None else []
        overhead = telemetry_overhead(args.overhead, work, data, tok, 40) if args.overhead else None
    if args.json:
        print(json.dumps({"seed": seed, "results": results, "stop": stops, "goodput": gp, "overhead": overhead},
                         indent=1))
        return
    print_goodput(gp, overhead)
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
