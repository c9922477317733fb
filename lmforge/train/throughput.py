"""Measured training throughput of a model shape on this machine, cached.

`model: auto` with a wall-clock budget turns seconds into tokens with these numbers, and a
wall-clock run's schedule and "too short for one step" check use them when they exist. A
measurement times a few full optimizer steps (forward, backward, clip, optimizer) on random
tokens exactly as the trainer runs them; the result is kept under
``$LMFORGE_HOME/cache/throughput/`` keyed by the machine (CPU/GPU model, threads, torch
version) and the shape, so each shape is timed once per machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from contextlib import nullcontext

from lmforge.config.model import ModelConfig
from lmforge.home import cache_dir


def machine_key(device) -> dict:
    """What makes two throughput measurements comparable."""
    import torch

    info = {"torch": torch.__version__.split("+")[0], "device": str(device).split(":")[0]}
    if info["device"] == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info |= {"cpu": _cpu_model(), "threads": torch.get_num_threads(), "machine": platform.machine()}
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _key(cfg: ModelConfig, context_length: int, micro_batch: int, precision: str, optimizer: str, device) -> str:
    shape = cfg.model_dump(mode="json", exclude={"preset", "max_seq_len", "init_std"})
    # "timing": how the figure was taken; a cache written by the old mean-of-3 timing (which
    # under-measured) is not reused.
    obj = {"machine": machine_key(device), "shape": shape, "ctx": context_length, "micro": micro_batch,
           "precision": precision, "optimizer": optimizer, "timing": "fastest step"}
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _path(key: str) -> str:
    return os.path.join(cache_dir("throughput"), key + ".json")


def cached_tokens_per_s(cfg: ModelConfig, context_length: int, micro_batch: int, *, precision: str = "fp32",
                        optimizer: str = "adamw", device="cpu") -> float | None:
    """The cached measurement for this shape on this machine, or None. A CPU measurement taken
    while the machine was busier than it has cores, and busier than it is now, does not count
    (it would make `model: auto` choose for a slower machine than this one is)."""
    try:
        with open(_path(_key(cfg, context_length, micro_batch, precision, optimizer, device))) as f:
            record = json.load(f)
        tps = float(record["tokens_per_s"])
    except (OSError, ValueError, KeyError):
        return None
    then = record.get("load_avg")
    now = _load_avg()
    if str(device).startswith("cpu") and then is not None and now is not None:
        cores = os.cpu_count() or 1
        if then > cores and then > now + 1:
            return None
    return tps


def measure_tokens_per_s(cfg: ModelConfig, context_length: int, micro_batch: int, *, precision: str = "fp32",
                         optimizer: str = "adamw", device="cpu", steps: int = 3, warmup: int = 1,
                         use_cache: bool = True, clock=time.perf_counter, typical: bool = False) -> float:
    """Training tokens/s of one process on ``device``: the fastest of ``steps`` timed steps after
    ``warmup`` untimed ones (cached per machine and shape).

    ``clock`` is wall time; bench/sweep.py passes `time.process_time` (CPU time of a one-thread
    process) to compare shapes on a busy shared machine without using the cache. ``typical``: the
    mean step instead of the fastest, never cached — what a wall-clock budget buys under the
    machine's present load (`lmforge scaling` plans its ladder with it)."""
    import torch

    from lmforge.data.batch import Batch
    from lmforge.models import build_model
    from lmforge.train.optim import build_optimizer

    use_cache = use_cache and not typical
    if use_cache:
        hit = cached_tokens_per_s(cfg, context_length, micro_batch, precision=precision, optimizer=optimizer,
                                  device=device)
        if hit is not None:
            return hit
    device = torch.device(device)
    cfg = cfg.model_copy(update={"max_seq_len": max(cfg.max_seq_len, context_length)})
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                          device_type=device.type, kind=optimizer)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    batch = Batch.from_tokens(torch.randint(0, cfg.vocab_size, (micro_batch, context_length))).to(device)
    torch.set_rng_state(rng)
    n = float(batch.num_targets())

    def step():
        with autocast():
            out = model.training_loss(batch.input_ids, batch.targets)
        loss = out.ce_sum / n + (out.aux_loss if out.aux_loss is not None else 0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    # The fastest step, not the mean: a moment of competition (another process, the supervisor
    # or the trackers starting beside a run's first seconds) slows some steps, never speeds one
    # up. With the mean of 3, the quickstart once timed its shape at 5.0K tokens/s and then
    # trained it at 11–13K (BENCHMARKS.md, session 7).
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        sync()
        times.append(clock() - t0)
    seconds = sum(times) / len(times) if typical else min(times)
    tps = micro_batch * context_length / seconds
    if use_cache:
        record = {"tokens_per_s": tps, "step_s": seconds, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "load_avg": _load_avg(),
                  "machine": machine_key(device), "ctx": context_length, "micro_batch": micro_batch}
        path = _path(_key(cfg, context_length, micro_batch, precision, optimizer, device))
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    return tps


def _load_avg() -> float | None:
    """The 1-minute load average, where the OS has one (not on Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
