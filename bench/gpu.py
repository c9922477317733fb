"""GPU training speed of dense models, in one table (run through bench/gpu.sh on a CUDA machine).

    python bench/gpu.py part 1|2|3 [--results FILE] [--budget S]   # a part: each config in its own process
    python bench/gpu.py only NAME[,NAME...]                        # chosen configs (e.g. ones a part skipped)
    python bench/gpu.py config NAME                                # one config, in this process
    python bench/gpu.py table [FILE]                               # the table of the results so far
    python bench/gpu.py list                                       # the configs and their parts

Part 1: which kernel scaled_dot_product_attention picks for grouped-query attention, and the
time of each; llama-1b at seq 2048, micro-batch 8, vocab 32k and 128k, eager vs compiled bf16
(and the two loss kernels at 128k). Part 2: FP8 tensorwise and rowwise vs bf16 on llama-1b and
llama-3b (micro-batch 2: what fits an 80 GB GPU without activation checkpointing). Part 3: the
real `lmforge train` loop for 60 steps against the same step run by this script (their gap is
the trainer's own overhead: data loading, bookkeeping, logging), and FSDP2 on one rank vs none.
Part 4: Muon's step-time overhead against AdamW on llama-1b (`run_muon`; ≈1 min with compilation).

Every config runs the trainer's pieces: `parallelize` (activation checkpointing → FP8 →
compile → FSDP2, as in training), `build_optimizer` (fused AdamW), the model's training loss,
bf16 autocast, gradient clipping, and `after_optimizer_step`. Data are random tokens resident
on the GPU (never zeros). Each step is timed with CUDA events after warm-up steps (compilation
happens there); the table shows the median step. MFU is on the standard basis (6·N_active +
12·L·H·Dh·T per token, `estimate.flops.mfu_flops_per_token`) against the bf16 dense peak (FP8
rows too, so that their speed-up reads directly); "MFU 6N" counts 6·N_active alone.

Each part appends its rows to a JSON-lines file (--results, default .bench/gpu.jsonl, and a copy
in $OUT when that is set) and prints the table of everything in it, so three calls on the device
machine that carry the file from one to the next end with one table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_RESULTS = os.path.join(REPO, ".bench", "gpu.jsonl")


def _model(preset, vocab, mb, *, compile_=True, precision="bf16", recipe="tensorwise", loss="auto", fsdp=False,
           accum=1, part, note=""):
    return {"kind": "model", "preset": preset, "vocab": vocab, "seq": 2048, "mb": mb, "accum": accum,
            "compile": compile_, "precision": precision, "recipe": recipe, "loss": loss, "fsdp": fsdp,
            "part": part, "note": note}


M1 = "llama-1b"
M3 = "llama-3b"
CONFIGS = {
    "sdpa-gqa": {"kind": "sdpa", "part": 1},
    "1b-32k-eager": _model(M1, 32000, 8, compile_=False, part=1),
    "1b-32k-compiled": _model(M1, 32000, 8, part=1),
    "1b-128k-compiled": _model(M1, 128256, 8, part=1),
    "1b-128k-eager": _model(M1, 128256, 8, compile_=False, part=1),
    "1b-128k-compiled-chunked-loss": _model(M1, 128256, 8, loss="chunked", part=1,
                                            note="lmforge's chunked loss instead of liger's"),
    "1b-bf16": _model(M1, 32000, 8, part=2),
    "1b-fp8-tensorwise": _model(M1, 32000, 8, precision="fp8", recipe="tensorwise", part=2),
    "3b-bf16": _model(M3, 32000, 2, part=2),
    "3b-fp8-tensorwise": _model(M3, 32000, 2, precision="fp8", recipe="tensorwise", part=2),
    "3b-fp8-rowwise": _model(M3, 32000, 2, precision="fp8", recipe="rowwise", part=2),
    "1b-fp8-rowwise": _model(M1, 32000, 8, precision="fp8", recipe="rowwise", part=2),
    "trainer-60-steps": {"kind": "trainer", "part": 3, "steps": 60},
    "1b-no-fsdp": _model(M1, 32000, 8, part=3),
    "1b-fsdp2-1-rank": _model(M1, 32000, 8, fsdp=True, part=3),
}
# What each row is compared with (the "vs" column): FP8 with bf16, compiled with eager, FSDP with none.
BASELINES = {"1b-32k-compiled": "1b-32k-eager", "1b-128k-compiled": "1b-128k-eager",
             "1b-128k-compiled-chunked-loss": "1b-128k-compiled",
             "1b-fp8-tensorwise": "1b-bf16", "1b-fp8-rowwise": "1b-bf16",
             "3b-fp8-tensorwise": "3b-bf16", "3b-fp8-rowwise": "3b-bf16",
             "1b-fsdp2-1-rank": "1b-no-fsdp", "trainer-60-steps": "trainer-60-steps/bench-loop"}
WARMUP, STEPS = 3, 10

# --- Muon's step-time overhead (issue 38; `run_muon`): llama-1b, compiled bf16, one model whose
# steps alternate between AdamW and Muon (same shape, same forward/backward), CUDA events around
# the whole step and around the optimizer step alone.
CONFIGS["1b-muon-overhead"] = _model(M1, 32000, 8, part=4) | {"kind": "muon", "steps": 6}
BASELINES["1b-muon-overhead/muon"] = "1b-muon-overhead/adamw"


# --------------------------------------------------------------------------- one config, in-process

def run_model(c: dict) -> dict:
    import torch

    from lmforge.config.model import get_preset
    from lmforge.config.schema import ComputeConfig
    from lmforge.data.batch import Batch
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.float8 import after_optimizer_step
    from lmforge.distributed.parallelize import materialize, parallelize
    from lmforge.estimate.flops import flops_per_token, mfu_flops_per_token
    from lmforge.estimate.hardware import detect_device_spec, mfu, peak_flops
    from lmforge.models import build_model
    from lmforge.models.transformer import Transformer
    from lmforge.train.optim import build_optimizer

    device = torch.device(c.get("device", "cuda"))
    cuda = device.type == "cuda"
    shape = get_preset(c["preset"]).model_copy(update={"vocab_size": c["vocab"], "max_seq_len": c["seq"]})
    compute = ComputeConfig(data_parallel="fsdp" if c["fsdp"] else "none", compile=c["compile"],
                            loss_kernel=c["loss"], activation_checkpointing=c.get("ac", False))
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    options = dict(precision=c["precision"], fp8_recipe=c["recipe"])
    torch.manual_seed(0)
    if c["fsdp"]:  # as the trainer does it: a meta-device model, sharded, then filled from a full copy
        full = build_model(shape, device="cpu").state_dict()
        with torch.device("meta"):
            model = Transformer(shape)
        step_forward = parallelize(model, compute, dist, **options)
        materialize(model, device, full)
        del full
    else:
        model = build_model(shape, device=device)
        step_forward = parallelize(model, compute, dist, **options)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    bf16 = c["precision"] in ("bf16", "fp8")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    gen = torch.Generator().manual_seed(1)
    batches = [Batch.from_tokens(torch.randint(0, shape.vocab_size, (c["mb"], c["seq"]), generator=gen)).to(device)
               for _ in range(c["accum"])]
    n_targets = float(sum(int(b.num_targets()) for b in batches))
    last = {}

    def step():
        for b in batches:
            with autocast:
                out = step_forward(b.input_ids, b.targets)
            (out.ce_sum / n_targets).backward()
            last["loss"] = out.ce_sum.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_optimizer_step(model)

    warmup, steps = c.get("warmup", WARMUP), c.get("steps", STEPS)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    times = _timed(step, steps, cuda)
    warm_s = time.perf_counter() - t0 - sum(times)
    dt = statistics.median(times)
    tokens = c["mb"] * c["seq"] * c["accum"]
    tps = tokens / dt
    spec = detect_device_spec(device)
    peak = peak_flops(spec, "bf16" if (cuda or bf16) else "fp32")
    return {"tokens_per_s": tps, "step_ms": dt * 1e3, "step_ms_spread": (max(times) - min(times)) * 1e3,
            "mfu": mfu(tps, mfu_flops_per_token(shape, c["seq"]), 1, peak),
            "mfu_6n": mfu(tps, flops_per_token(shape, c["seq"])["dense"], 1, peak),
            "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "warmup_s": warm_s, "loss": float(last["loss"]) / (c["mb"] * c["seq"]), "device": spec.description}


def run_muon(c: dict) -> list[dict]:
    """Muon against AdamW on the same model (`CONFIGS["1b-muon-overhead"]`): both optimizers hold
    the model's parameters and take turns (AdamW, Muon, Muon, AdamW, ...), so compilation happens
    once and the forward and backward are the same work in both rows. Muon's Newton–Schulz runs in
    bf16 (what the trainer uses for a bf16 run). Rows: one per optimizer, the optimizer step's own
    time and share in the note; the "vs" column is Muon's throughput over AdamW's."""
    import torch

    from lmforge.config.model import get_preset
    from lmforge.config.schema import ComputeConfig
    from lmforge.data.batch import Batch
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import parallelize
    from lmforge.estimate.flops import flops_per_token, mfu_flops_per_token
    from lmforge.estimate.hardware import detect_device_spec, mfu, peak_flops
    from lmforge.models import build_model
    from lmforge.train.optim import build_optimizer

    device = torch.device(c.get("device", "cuda"))
    cuda = device.type == "cuda"
    shape = get_preset(c["preset"]).model_copy(update={"vocab_size": c["vocab"], "max_seq_len": c["seq"]})
    compute = ComputeConfig(data_parallel="none", compile=c["compile"], loss_kernel=c["loss"])
    torch.manual_seed(0)
    model = build_model(shape, device=device)
    step_forward = parallelize(model, compute, DistInfo(rank=0, world_size=1, local_rank=0, device=device),
                               precision=c["precision"])
    bf16 = c["precision"] == "bf16"
    ns_dtype = torch.bfloat16 if bf16 else torch.float32
    opts = {kind: build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                  device_type=device.type, kind=kind, ns_dtype=ns_dtype) for kind in ("adamw", "muon")}
    gen = torch.Generator().manual_seed(1)
    batch = Batch.from_tokens(torch.randint(0, shape.vocab_size, (c["mb"], c["seq"]), generator=gen)).to(device)
    n_targets = float(batch.num_targets())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None

    def step(kind: str) -> tuple[float, float]:
        """(step s, optimizer step s)."""
        t = [time.perf_counter()]
        if cuda:
            marks[0].record()
        with autocast:
            out = step_forward(batch.input_ids, batch.targets)
        (out.ce_sum / n_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if cuda:
            marks[1].record()
        t.append(time.perf_counter())
        opts[kind].step()
        opts[kind].zero_grad(set_to_none=True)
        if cuda:
            marks[2].record()
            torch.cuda.synchronize()
            return marks[0].elapsed_time(marks[2]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3
        t.append(time.perf_counter())
        return t[2] - t[0], t[2] - t[1]

    t0 = time.perf_counter()
    for kind in ("adamw", "muon") * c.get("warmup", WARMUP):
        step(kind)
    warm_s = time.perf_counter() - t0
    times: dict[str, list[tuple[float, float]]] = {"adamw": [], "muon": []}
    for i in range(c.get("steps", STEPS)):
        for kind in (("adamw", "muon") if i % 2 == 0 else ("muon", "adamw")):
            times[kind].append(step(kind))
    spec = detect_device_spec(device)
    peak = peak_flops(spec, "bf16" if (cuda or bf16) else "fp32")
    tokens = c["mb"] * c["seq"]
    rows = []
    for kind, ts in times.items():
        dt = statistics.median(s for s, _ in ts)
        opt_s = statistics.median(o for _, o in ts)
        tps = tokens / dt
        rows.append({"name": f"1b-muon-overhead/{kind}", "tokens_per_s": tps, "step_ms": dt * 1e3,
                     "opt_ms": opt_s * 1e3, "opt_share": opt_s / dt,
                     "mfu": mfu(tps, mfu_flops_per_token(shape, c["seq"]), 1, peak),
                     "mfu_6n": mfu(tps, flops_per_token(shape, c["seq"])["dense"], 1, peak),
                     "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                     "warmup_s": warm_s, "device": spec.description,
                     "note": f"optimizer step {opt_s * 1e3:.0f} ms = {opt_s / dt:.0%} of the step; "
                             f"{c['mb']}×{c['seq']} tokens/step"})
    return rows


def _timed(fn, n: int, cuda: bool) -> list[float]:
    """Seconds of each of n calls: CUDA events around each (the host never waits in between)."""
    import torch

    if not cuda:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for i in range(n):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]


def run_sdpa(c: dict) -> list[dict]:
    """Which SDPA kernel runs grouped-query causal attention (llama-1b's heads: 16 query, 8 key/value,
    head dim 128, 8 × 2048 tokens, bf16), and forward + backward time of each backend and of
    FlexAttention with a causal block mask (the packed-documents path)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, KV, T, D = 8, 16, 8, 2048, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 3.5 * 4 * B * H * T * T * D / 2  # fwd 2 matmuls + bwd 5, causal half (what the kernels do)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for name, backend in backends.items():
        try:
            with sdpa_kernel(backend):
                times = _warm_and_time(sdpa)
            rows.append({"name": f"sdpa-gqa/{name}", "step_ms": statistics.median(times) * 1e3,
                         "tflops": flops / statistics.median(times) / 1e12})
        except RuntimeError as e:
            rows.append({"name": f"sdpa-gqa/{name}", "error": str(e).splitlines()[0][:90]})
    times = _warm_and_time(sdpa)
    rows.append({"name": "sdpa-gqa/default", "step_ms": statistics.median(times) * 1e3,
                 "tflops": flops / statistics.median(times) / 1e12, "note": "kernels: " + _kernels(sdpa)})
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_step():
        flex(q, k, v, block_mask=mask, enable_gqa=True).backward(grad)

    try:
        times = _warm_and_time(flex_step)
        rows.append({"name": "sdpa-gqa/flex-compiled", "step_ms": statistics.median(times) * 1e3,
                     "tflops": flops / statistics.median(times) / 1e12})
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        rows.append({"name": "sdpa-gqa/flex-compiled", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
    return rows


def _warm_and_time(fn, warmup: int = 3, n: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    return _timed(fn, n, True)


def _kernels(fn) -> str:
    """The attention kernels one call launches (from the profiler), to name the default backend."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if any(s in e.key.lower() for s in ("flash", "fmha", "cudnn", "attention",
                                                                                      "efficient", "sdpa"))}
    return ", ".join(sorted(n[:48] for n in names)[:3]) or "none matched (math?)"


def run_trainer(c: dict) -> Iterator[dict]:
    """`lmforge train` for 60 steps on llama-1b (tokenizer with a 32k vocabulary trained on the
    built-in corpus, micro-batch 8 × 2048, 2 micro-batches per step, compiled, bf16), its
    tokens/s read from metrics.jsonl (the median of the log windows after the first, which holds
    the compilation), then the same step in this script's loop."""
    steps = c.get("steps", 60)
    preset = c.get("preset", M1)
    mb, accum, seq = c.get("mb", 8), c.get("accum", 2), c.get("seq", 2048)
    compile_ = c.get("compile", True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 60e9 else None
    root = tempfile.mkdtemp(prefix="lmforge-bench-", dir=shm)
    try:
        folder = os.path.join(root, "run")
        cfg = {"name": "gpu-bench-trainer", "model": preset, "train_data": "builtin:python-stdlib",
               "tokenizer": {"train": {"vocab_size": c.get("vocab", 32000)}},
               "training_duration": f"{steps}ba", "save_folder": folder, "save_interval": "100000ba",
               "parameters": {"global_batch_size": mb * accum, "micro_batch_size": mb, "context_length": seq},
               "eval": {"interval": "100000ba", "max_batches": 1, "prompts": []},
               "experiment_tracker": {"mlflow": None, "console": True}, "log_interval": 10,
               "compute": {"device": c.get("device", "cuda"), "compile": compile_}}
        path = os.path.join(root, "run.yaml")
        with open(path, "w") as f:
            json.dump(cfg, f)  # JSON is YAML
        env = os.environ | {"LMFORGE_HOME": os.path.join(root, "home"), "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", path], env=env, capture_output=True,
                              text=True, timeout=c.get("timeout", 420))
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["?"]
            return [{"name": "trainer-60-steps", "error": f"exit {proc.returncode}: {tail[0][:100]}"}]
        rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        windows = [r for r in rows if "throughput/tokens_per_s" in r and r["step"] > 10]
        with open(os.path.join(folder, "run.json")) as f:
            vocab = json.load(f)["config"]["model"]["vocab_size"]
        trainer = {"name": "trainer-60-steps", "tokens_per_s": statistics.median(r["throughput/tokens_per_s"]
                                                                                 for r in windows),
                   "mfu": statistics.median(r["throughput/mfu"] for r in windows),
                   "mfu_6n": statistics.median(r["throughput/mfu_6n"] for r in windows),
                   "peak_gb": max((r.get("memory/max_allocated_gb") or 0) for r in windows) or None,
                   "note": f"vocab {vocab}, mb {mb}×{accum}, {len(windows)} windows; run wall {wall:.0f}s"}
        trainer["step_ms"] = mb * accum * seq / trainer["tokens_per_s"] * 1e3
    finally:
        shutil.rmtree(root, ignore_errors=True)
    yield trainer  # printed now: kept if the loop below runs out of the call's budget
    loop = run_model(_model(preset, vocab, mb, accum=accum, compile_=compile_, part=3)
                     | {"device": c.get("device", "cuda"), "seq": seq} | {k: c[k] for k in ("warmup", "steps") if k in c})
    yield loop | {"name": "trainer-60-steps/bench-loop", "note": "the same step in this script's loop"}


def smoke(c: dict) -> dict:
    """The same config at toy size on the CPU: checks the script itself (tests/test_bench_gpu.py)."""
    if c["kind"] in ("model", "muon"):
        return c | {"device": "cpu", "preset": "llama-tiny", "vocab": 512, "seq": 64, "mb": 2, "compile": False,
                    "precision": "fp32" if c["precision"] == "bf16" else c["precision"], "warmup": 1, "steps": 2}
    if c["kind"] == "trainer":
        return c | {"device": "cpu", "preset": "llama-tiny", "vocab": 512, "seq": 64, "mb": 2, "compile": False,
                    "steps": 12, "warmup": 1}
    return c | {"device": "cpu"}


def run_config(name: str, c: dict) -> Iterator[dict]:
    """The config's rows, each as soon as it is measured."""
    if c.get("device") == "cpu" and (c["kind"] == "sdpa" or c.get("precision") == "fp8"):
        yield {"name": name, "config": name, "part": c["part"], "error": "needs CUDA"}
        return
    if c["kind"] == "sdpa":
        rows = run_sdpa(c)
    elif c["kind"] == "trainer":
        rows = run_trainer(c)
    elif c["kind"] == "muon":
        rows = run_muon(c)
    else:
        rows = [run_model(c) | {"name": name}]
    for r in rows:
        # The bench's own import path must not need the tracker back-ends or the object-store client.
        heavy = sorted(m for m in ("mlflow", "wandb", "s3fs") if m in sys.modules)
        r.setdefault("name", name)
        yield r | {"config": name, "part": c["part"], "heavy_imports": heavy}


# --------------------------------------------------------------------------- parts, table

def _result_rows(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def run_part(names: list[str], results: str, budget: float, smoke_: bool = False) -> None:
    start = time.monotonic()
    meta = _meta()
    for name in names:
        left = budget - (time.monotonic() - start)
        if left < 60:
            _append(results, {"name": name, "config": name, "part": CONFIGS[name]["part"],
                              "error": "skipped: out of this call's time budget (run it with `only`)"} | meta)
            continue
        t0 = time.monotonic()
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "config", name] + (["--smoke"] if smoke_ else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left - 15)
            rows = _result_rows(proc.stdout)
            if proc.returncode != 0 or not rows:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["?"]
                rows = [{"name": name, "error": f"exit {proc.returncode}: {tail[0][:120]}"}]
                sys.stderr.write(proc.stderr[-4000:])
        except subprocess.TimeoutExpired as e:
            # Rows the config printed before the budget ran out are measurements: keep them.
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rows = _result_rows(out) + [{"name": name, "error": "timed out (budget)"}]
        for r in rows:
            r.setdefault("config", name)
            r.setdefault("part", CONFIGS[name]["part"])
            _append(results, r | meta | {"wall_s": round(time.monotonic() - t0, 1)})
        print(f"# {name}: {time.monotonic() - t0:.0f}s", flush=True)
    print(table(results))


def _meta() -> dict:
    import torch

    commit = os.environ.get("LMFORGE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "commit": commit or "unknown", "date": time.strftime("%Y-%m-%d")}


def _append(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(path, os.path.join(os.environ["OUT"], os.path.basename(path)))


def table(path: str) -> str:
    """All rows of the results file (the latest row per name), as a markdown table."""
    if not os.path.exists(path):
        return f"(no results in {path})"
    rows: dict[str, dict] = {}
    for line in open(path):
        r = json.loads(line)
        rows[r["name"]] = r
    lines = ["| part | config | tokens/s | MFU | MFU 6N | step ms | peak GiB | vs | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: (kv[1].get("part", 9), list(rows).index(kv[0]))):
        if "error" in r:
            lines.append(f"| {r.get('part', '')} | {name} | — | | | | | | {r['error']} |")
            continue
        if "tflops" in r:
            lines.append(f"| {r['part']} | {name} | | | | {r['step_ms']:.2f} | | {r['tflops']:.0f} TFLOP/s | "
                         f"{r.get('note', '')} |")
            continue
        base = rows.get(BASELINES.get(name, ""), {})
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}× {BASELINES[name].split('/')[-1]}" \
            if base.get("tokens_per_s") else ""
        heavy = f" imported {','.join(r['heavy_imports'])}!" if r.get("heavy_imports") else ""
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else ""
        lines.append(f"| {r['part']} | {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['mfu_6n']:.1%} | "
                     f"{r['step_ms']:.0f} | {peak} | {vs} | {r.get('note', '')}{heavy} |")
    first = next(iter(rows.values()))
    return "\n".join([f"# {first.get('gpu')}, torch {first.get('torch')}, commit {first.get('commit')}, "
                      f"{first.get('date')}"] + lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["part", "only", "config", "table", "list"])
    p.add_argument("arg", nargs="?")
    p.add_argument("--results", default=DEFAULT_RESULTS)
    p.add_argument("--budget", type=float, default=540.0, help="seconds this call may take (a device call has 600)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script, measures nothing)")
    args = p.parse_args()
    if args.what == "list":
        for name, c in CONFIGS.items():
            print(c["part"], name)
    elif args.what == "table":
        print(table(args.arg or args.results))
    elif args.what == "config":
        config = smoke(CONFIGS[args.arg]) if args.smoke else CONFIGS[args.arg]
        for row in run_config(args.arg, config):
            print("RESULT " + json.dumps(row), flush=True)
    else:
        names = [n for n, c in CONFIGS.items() if str(c["part"]) == args.arg] if args.what == "part" \
            else args.arg.split(",")
        unknown = [n for n in names if n not in CONFIGS]
        if unknown or not names:
            sys.exit(f"error: unknown config(s) {unknown or args.arg}; see `python bench/gpu.py list`")
        run_part(names, args.results, args.budget, args.smoke)


if __name__ == "__main__":
    main()
