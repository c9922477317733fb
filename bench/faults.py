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
    if args.json:
        print(json.dumps({"seed": seed, "results": results, "stop": stops}, indent=1))
        return
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
