"""Evaluation the trainer runs while it trains: prompt generations and ICL benchmarks.

Both run on rank 0 when every rank holds the whole model (single process, DDP). Under FSDP
each forward gathers weights from every rank, so every rank runs the same prompts and examples
in step (same seeds → same tokens) and only rank 0 keeps the results.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from lmforge.config.schema import RunConfig
from lmforge.distributed.dist import DistInfo
from lmforge.eval.gauntlet import gauntlet_scores, load_gauntlet
from lmforge.eval.icl import evaluate_icl, load_tasks
from lmforge.models.generate import generate


def generations(model, tokenizer, cfg: RunConfig, compiled: bool) -> list[str]:
    """Sample from each eval prompt with a fixed seed (never touches the training RNG)."""
    out = []
    # Compiled blocks were specialized for training shapes; decoding one token at a time in
    # them would recompile for every length.
    stance = torch.compiler.set_stance("force_eager") if compiled else nullcontext()
    with stance, _one_thread_on_cpu(model):
        for i, prompt in enumerate(cfg.eval.prompts):
            new = generate(model, tokenizer.encode_prompt(prompt), cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
                           top_k=cfg.eval.top_k, top_p=cfg.eval.top_p, eos_id=tokenizer.eos_id,
                           seed=cfg.parameters.seed + i)
            if new and new[-1] == tokenizer.eos_id:
                new = new[:-1]
            out.append(prompt + tokenizer.decode(new))
    return out


@contextmanager
def _one_thread_on_cpu(model):
    """Decoding on a CPU runs one thread: a token's tiny matmuls gain nothing from more, and on a busy
    machine every op's thread barrier waits for a descheduled peer (the quickstart's 4×128 model,
    2 cores under a load of 12: 146 ms a token with 2 threads, 11 ms with 1)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_icl(cfg: RunConfig):
    """Read ICL tasks and the gauntlet once, before training, so bad files fail early."""
    if not cfg.eval.icl_tasks:
        return None
    tasks = load_tasks(cfg.eval.icl_tasks, data_root=cfg.eval.data_root)
    return tasks, (load_gauntlet(cfg.eval.gauntlet, tasks=tasks) if cfg.eval.gauntlet else None)


def run_icl(model, tokenizer, icl, cfg: RunConfig, dist: DistInfo, sharded: bool, autocast) -> dict:
    """In-context-learning accuracies (and gauntlet scores) as flat metrics, on rank 0."""
    if not icl or not (dist.is_main or sharded):
        return {}
    tasks, gauntlet = icl
    with autocast() if sharded else nullcontext():
        results = evaluate_icl(model, tokenizer, tasks, limit=cfg.eval.icl_limit, max_seq_len=model.cfg.max_seq_len)
    if not dist.is_main:
        return {}
    metrics = {f"icl/{k}": v["accuracy"] for k, v in results.items() if isinstance(v, dict) and "accuracy" in v}
    for k, v in results.items():  # lm-evaluation-harness's rules beside Foundry's (`eval.icl`)
        metrics |= {f"icl/{k}/{rule}": v[rule] for rule in ("acc", "acc_norm") if rule in v}
    if gauntlet is not None:
        scores = gauntlet_scores(results, gauntlet)
        for group in ("categories", "averages"):
            for k, v in (scores.get(group) or {}).items():
                if v is not None:
                    metrics[f"gauntlet/{k}"] = v
    return metrics
