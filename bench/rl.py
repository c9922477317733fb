"""Reinforcement learning's targets, measured: the sampler's KV cache, generation's share of a step, and
the shipped example's held-out exact match before and after.

    python bench/rl.py sampler                       # (a) KV cache vs recomputing: tokens/s, same model and prompts
    python bench/rl.py example                       # (b) examples/rl.yaml from runs/rl-base/sft: held-out
                                                     #     greedy exact match before/after, minutes, generation share
    python bench/rl.py example --base-too            # the base first (examples/rl_base.yaml: pretrain → SFT)

(a) One model (the example's shape, or ``--model`` a checkpoint), the same prompts, greedy (every
completion as long in both): ``models.generate.sample`` with its KV cache against the same sampler
recomputing every position at each new token. Tokens/s in wall time and in the process's CPU time
(on a loaded machine the CPU time is the fairer: another process's work is not this one's), and the
ratio (target ≥ 3×).

(b) ``lmforge finetune -f examples/rl.yaml`` as a user runs it (a subprocess, one thread per
process: ``OMP_NUM_THREADS=1``), ``taskset`` to 2 cores where it exists: the held-out greedy exact
match of the starting weights (the same scoring as the run's evaluations, `train.rl.greedy_rewards`)
and of the run's last evaluation (its metrics.jsonl), the run's wall time, and the median
``time/generation_share`` of its steps (target: +20 points in ≤ 10 minutes on 2 cores). The
machine's load average is printed with each table: other processes on the same cores slow every
number here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..")
sys.path.insert(0, REPO)


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


# --------------------------------------------------------------------------- (a) the sampler

def bench_sampler(args) -> None:
    import torch

    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model
    from lmforge.models.generate import sample

    torch.set_num_threads(args.threads)
    if args.model:
        from lmforge.train.locate import load_model

        model = load_model(args.model)[0]
    else:
        torch.manual_seed(0)
        model = build_model(ModelConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256, vocab_size=320))
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    rows = [("sampler", "new tokens", "wall s", "CPU s", "tokens/s (wall)", "tokens/s (CPU)")]
    results = {}
    for cache in (True, False):
        sample(model, prompts[:2], 4, temperature=0, cache=cache)  # warm up
        w0, c0 = time.perf_counter(), time.process_time()
        out = sample(model, prompts, args.new_tokens, temperature=0, cache=cache)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        n = sum(len(t) for t in out.tokens)
        results[cache] = (n / wall, n / cpu, out.tokens)
        rows.append(("KV cache" if cache else "no cache (recompute)", n, f"{wall:.2f}", f"{cpu:.2f}",
                     f"{n / wall:,.0f}", f"{n / cpu:,.0f}"))
    assert results[True][2] == results[False][2], "greedy completions differ with and without the cache"
    rows.append(("KV cache / no cache", "", "", "", f"{results[True][0] / results[False][0]:.1f}×",
                 f"{results[True][1] / results[False][1]:.1f}×"))
    print(f"sampler: {args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy, "
          f"{args.threads} thread(s), {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; load {load()}")
    table(rows)


# --------------------------------------------------------------------------- (b) the example

def _env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(REPO)}


def _cores(cmd: list[str], cores: str | None) -> list[str]:
    return (["taskset", "-c", cores] + cmd) if cores and shutil.which("taskset") else cmd


def held_out_exact_match(weights: str, config: dict) -> float:
    """The starting weights' held-out reward, scored as the run's evaluations score it."""
    import torch

    from lmforge.config.load import build_config
    from lmforge.data.batch import StreamLayout
    from lmforge.data.rows.rl import load_rl_data
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.distributed.dist import DistInfo
    from lmforge.plan.layout import Layout
    from lmforge.rewards.functions import load_rewards
    from lmforge.train.locate import load_model
    from lmforge.train.rl import Sampler, greedy_rewards
    from contextlib import nullcontext

    torch.set_num_threads(1)
    cfg = build_config(config | {"model": "llama-tiny", "tokenizer": weights})
    rl = cfg.rl.resolved()
    from lmforge.resolve.weights import locate

    model = load_model(weights)[0]
    tok = load_tokenizer(locate(weights).tokenizer_dir)  # (a run folder's: its final/ one)
    data = load_rl_data([cfg.eval.data_path], cfg.eval.data_path, tok,
                        cfg.parameters.context_length - rl.max_new_tokens, log=lambda *_: None)
    sampler = Sampler(model, tok, rl, sharded=False, compiled=False, autocast=nullcontext)
    layout = StreamLayout(seq_len=cfg.parameters.context_length, layout=Layout())
    (es,) = data.eval_sets(layout, 1 << 20)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return greedy_rewards(sampler, load_rewards(rl.reward, rl.reward_weights, rl.format_regex), es.batches(), one)[
        "reward"]


def bench_example(args) -> None:
    from lmforge.config.load import read_yaml

    os.chdir(REPO)
    if args.base_too:
        t0 = time.perf_counter()
        subprocess.run(_cores([sys.executable, "-m", "lmforge", "pipeline", "-f", "examples/rl_base.yaml"], args.cores),
                       env=_env(), check=True, stdout=subprocess.DEVNULL)
        print(f"base (examples/rl_base.yaml: pretrain → SFT): {time.perf_counter() - t0:.0f} s; load {load()}")
    config = read_yaml("examples/rl.yaml")
    base = args.base or config["custom_weights_path"]
    folder = args.save_folder
    shutil.rmtree(folder, ignore_errors=True)
    before = held_out_exact_match(base, config)
    cmd = [sys.executable, "-m", "lmforge", "finetune", "-f", "examples/rl.yaml", "--weights", base,
           "--save-folder", folder, "--name", f"bench-rl-{os.getpid()}", "--no-supervisor"]
    if args.steps:
        cmd += ["--training-duration", f"{args.steps}ba"]
    load_before, t0 = load(), time.perf_counter()
    subprocess.run(_cores(cmd, args.cores), env=_env(), check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    evals = [(m["step"], m["eval/reward"]) for m in rows if "eval/reward" in m]
    shares = [m["time/generation_share"] for m in rows if "time/generation_share" in m]
    step_s = [m["time/generation_s"] + m["time/update_s"] for m in rows if "time/update_s" in m]
    print(f"example: examples/rl.yaml from {base}, {args.cores or 'all'} core(s), one thread per process; "
          f"load {load_before} before, {load()} after")
    table([("held-out greedy exact match", "value"),
           ("before (the starting weights)", f"{100 * before:.1f}%"),
           *[(f"  step {s}", f"{100 * r:.1f}%") for s, r in evals],
           ("after (the last evaluation)", f"{100 * evals[-1][1]:.1f}%"),
           ("gain", f"{100 * (evals[-1][1] - before):+.1f} points"),
           ("run wall time (start-up, evaluations, export included)", f"{wall / 60:.1f} min"),
           ("median step (generation + update)", f"{statistics.median(step_s):.2f} s"),
           ("generation's share of a step (median)", f"{100 * statistics.median(shares):.0f}%")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sampler", help="(a) the KV cache against recomputing every position")
    s.add_argument("--model", help="a checkpoint or final/ folder (default: the example's shape, random weights)")
    s.add_argument("--prompts", type=int, default=64)
    s.add_argument("--prompt-len", type=int, default=16)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=1)
    e = sub.add_parser("example", help="(b) examples/rl.yaml: held-out exact match before/after")
    e.add_argument("--base", help="starting weights (default: the example's custom_weights_path)")
    e.add_argument("--base-too", action="store_true", help="train the base first (examples/rl_base.yaml)")
    e.add_argument("--steps", type=int, help="override the example's training_duration (steps)")
    e.add_argument("--cores", default="0,1", help="taskset cores (default 0,1: two cores; '' for all)")
    e.add_argument("--save-folder", default="runs/bench-rl")
    args = p.parse_args()
    (bench_sampler if args.what == "sampler" else bench_example)(args)


if __name__ == "__main__":
    main()
