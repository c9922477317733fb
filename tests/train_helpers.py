"""Run `lmforge train` for real (in a subprocess, or in-process as its child would) and read what it wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def set_dotted(cfg: dict, changes: dict) -> dict:
    """``cfg`` with each ``"a.b.c": value`` of ``changes`` set at that path (the parents made); returns it."""
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return cfg


def stream_sizes(kw: dict) -> dict:
    """A token stream's keyword arguments with the sizes a test names (``world_size``,
    ``global_batch_size``, ``micro_batch_size``) made into the layout the planner would make."""
    from lmforge.plan.layout import Layout

    kw = dict(kw)
    layout = Layout(ranks=kw.pop("world_size", 1), global_batch=kw.pop("global_batch_size"),
                    micro_batch=kw.pop("micro_batch_size"))
    return kw | {"layout": layout}


def env(**extra) -> dict:
    # One thread per process: tiny models gain nothing from more, and test processes never
    # fight over the two cores (also makes every run's float reductions identical).
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def lmforge(*args, timeout=300, check=False, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lmforge", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(**kw.pop("env", {})), cwd=kw.pop("cwd", REPO), **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"lmforge {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`proc.communicate(timeout)`; on a timeout the whole process tree is killed first (a hung
    run's supervisor, torchrun and ranks would otherwise go on for the rest of the suite)."""
    import signal

    from lmforge.process import descendants

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.communicate()
        raise


def train_in_process(raw: dict, log=lambda *_: None):
    """One run in this process, as a CLI child runs it (`runs.job.run_job`: setup by task_type,
    Trainer, trackers), with `model` / `tokenizer` taken from custom_weights_path when left out."""
    from lmforge.config.load import build_config
    from lmforge.runs.job import run_job
    from lmforge.resolve.weights import fill_from_weights

    return run_job(build_config(fill_from_weights(raw)), log=log)


def cli(*args, check: bool = False) -> subprocess.CompletedProcess:
    """`lmforge ARGS...` in this process (no interpreter start-up), for commands that return at once:
    the exit status and what it printed, as `lmforge(...)` gives them; ``check`` fails on a non-zero exit."""
    import contextlib
    import io

    from lmforge.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse refuses an argument (`cli.common.OneLineParser`): exit 2
            code = e.code
    if check and code != 0:
        raise AssertionError(f"lmforge {' '.join(map(str, args))} failed ({code}):\n{out.getvalue()}\n{err.getvalue()}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def metrics(save_folder: Path) -> list[dict]:
    path = save_folder / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return rows


def train_losses(save_folder: Path) -> dict[int, float]:
    """step → loss; after a resume the re-run steps overwrite the earlier records."""
    return {r["step"]: r["train/loss"] for r in metrics(save_folder) if "train/loss" in r}


def final_weights(save_folder: Path) -> dict:
    return load_file(str(save_folder / "final" / "model.safetensors"))


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def train_killed_at(cfg_path: Path, save_folder: Path, step: int, timeout: float = 240) -> None:
    """Start `lmforge train`, SIGKILL it once `step` optimizer steps are logged."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    deadline = time.time() + timeout
    try:
        while max(train_losses(save_folder), default=0) < step:
            assert proc.poll() is None, "training ended before it could be killed"
            assert time.time() < deadline, "training did not reach the kill step in time"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def worker_with_rank(pid: int, rank: int) -> int | None:
    """The pid of torchrun's first-attempt worker of ``rank`` under process ``pid``, once it exists."""
    from lmforge.process import descendants

    for d in descendants(pid):
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                envs = f.read().split(b"\0")
            with open(f"/proc/{d}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        # a rank torchrun started as a program (its environment), or forked from the fork server (its name)
        if (f"RANK={rank}".encode() in envs and b"TORCHELASTIC_RESTART_COUNT=0" in envs) or name == f"lmforge-r{rank}.0":
            return d
    return None


@contextmanager
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same float reductions
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_here(cfg: dict) -> list[str]:
    """`lmforge train`'s training job, in this process (one rank); returns its log lines."""
    from lmforge.config.load import load_config
    from lmforge.runs.job import run_job

    lines: list[str] = []
    with one_thread():
        run_job(load_config(data=cfg), log=lines.append)
    return lines
