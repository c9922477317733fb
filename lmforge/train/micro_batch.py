"""The GPU timing probe of `parameters.micro_batch_size: auto` (the choice itself is
`plan.micro_batch`, made during resolution: `plan.run.micro_batch_and_checkpointing`).

On a GPU the candidates that fit in memory are timed by `probe_tokens_per_s`: a few forward +
backward passes of a slice of the model (`PROBE_LAYERS` blocks of its shape, its embedding and
head), built and compiled exactly as the run will be (`parallelize`: checkpointing → FP8 →
compile). Candidates differ in how each block runs — micro-batch, recompute — so a slice ranks
them as the whole model would, at a fraction of its memory and compile time (compilation is per
block shape, not per block). The slice's tokens/s are scaled to the whole model by FLOPs per
token (the same MFU). Each figure is cached under ``$LMFORGE_HOME/cache/micro-batch/``, keyed by
the machine (GPU model, torch version), the shape, the context, the micro-batch, the
checkpointing mode, the precision and whether it compiled; a later run of the same shape reads
it instead of timing again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from contextlib import nullcontext

from lmforge.config.model import ModelConfig
from lmforge.distributed.float8 import FP8Options
from lmforge.plan.activations import for_slice
from lmforge.plan.flops import mfu_flops_per_token
from lmforge.home import cache_dir
from lmforge.train.throughput import machine_key

PROBE_LAYERS = 4  # blocks in the probe's slice (every-2nd-block checkpointing needs a few)


def _key(cfg: ModelConfig, ctx: int, micro_batch: int, checkpointing, precision: str, fp8: FP8Options,
         compile_: bool, layers: int, device, compression="off", offload: bool = False) -> str:
    shape = cfg.model_dump(mode="json", exclude={"preset", "max_seq_len", "init_std"})
    obj = {"machine": machine_key(device), "shape": shape, "ctx": ctx, "micro": micro_batch,
           "checkpointing": checkpointing, "precision": precision,
           **({"compression": compression, "offload": offload} if compression != "off" or offload else {}),
           "fp8": dataclasses.asdict(fp8) if precision == "fp8" else None, "compile": compile_, "layers": layers,
           "timing": "fastest forward+backward"}
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def probe_tokens_per_s(cfg: ModelConfig, ctx: int, micro_batch: int, checkpointing, *, precision: str,
                       fp8: FP8Options = FP8Options(), compile_=True, device="cuda", layers: int = PROBE_LAYERS,
                       steps: int = 3, warmup: int = 2, use_cache: bool = True, compression="off",
                       offload: bool = False) -> float | None:
    """The whole model's expected training tokens/s at this micro-batch and way of keeping
    activations (checkpointing mode, ``compression``, ``offload``: `plan.activations`),
    from the fastest of ``steps`` forward + backward passes of a ``layers``-block slice after
    ``warmup`` untimed ones (compilation happens there); None when the slice runs out of memory.
    The optimizer is left out: its cost per step does not depend on the micro-batch."""
    import torch

    from lmforge.config.schema import ComputeConfig
    from lmforge.data.batch import Batch
    from lmforge.distributed.dist import DistInfo
    from lmforge.distributed.parallelize import compile_enabled, parallelize
    from lmforge.models import build_model
    from lmforge.plan.layout import Layout

    device = torch.device(device)
    compile_ = compile_enabled(compile_, device)
    path = os.path.join(cache_dir("micro-batch"),
                        _key(cfg, ctx, micro_batch, checkpointing, precision, fp8, compile_, layers, device,
                             compression, offload)
                        + ".json")
    if use_cache:
        try:
            with open(path) as f:
                return float(json.load(f)["tokens_per_s"])
        except (OSError, ValueError, KeyError):
            pass
    part = cfg.model_copy(update={"n_layers": min(cfg.n_layers, layers), "max_seq_len": max(cfg.max_seq_len, ctx)})
    # A setting on some of the model's blocks takes the same share of the slice's.
    checkpointing = for_slice(checkpointing, cfg.n_layers, part.n_layers)
    compression = for_slice(compression, cfg.n_layers, part.n_layers)
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    model = train_forward = None
    try:
        model = build_model(part, device=device)
        train_forward = parallelize(model, Layout(device=device.type), DistInfo(rank=0, world_size=1, local_rank=0,
                                                                                 device=device),
                                    compute=ComputeConfig(compile=compile_), checkpointing=checkpointing,
                                    compression=compression, offload=offload, precision=precision, fp8=fp8)
        batch = Batch.from_tokens(torch.randint(0, part.vocab_size, (micro_batch, ctx))).to(device)
        n = float(batch.num_targets())
        autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision in ("bf16", "fp8") \
            else nullcontext

        def step() -> None:
            with autocast():
                out = train_forward(batch.input_ids, batch.targets)
            loss = out.ce_sum / n + (out.aux_loss if out.aux_loss is not None else 0.0)
            loss.backward()
            model.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        seconds = min(_timed(step, cuda) for _ in range(steps))
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del model, train_forward
        torch.set_rng_state(rng)
        if compile_:
            torch._dynamo.reset()  # the run compiles its own blocks; drop the slice's graphs
        if cuda:
            torch.cuda.empty_cache()
    slice_tps = micro_batch * ctx / seconds
    tps = slice_tps * mfu_flops_per_token(part, ctx) / mfu_flops_per_token(cfg, ctx)
    if use_cache:
        record = {"tokens_per_s": tps, "slice_tokens_per_s": slice_tps, "layers": part.n_layers,
                  "step_s": seconds, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_key(device),
                  "ctx": ctx, "micro_batch": micro_batch, "checkpointing": checkpointing, "precision": precision}
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    return tps


def _timed(step, cuda: bool) -> float:
    """Seconds ``step()`` takes: by CUDA events on a GPU (no host sync inside the step), else by the clock."""
    import torch

    if not cuda:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
