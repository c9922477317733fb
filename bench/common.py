"""What bench/sweep.py and bench/recipe.py share: the two corpora, one in-process training run,
and the held-out bits per byte over a whole held-out split.

Corpora:
- ``shakespeare``: ``../shared/corpora/tinyshakespeare.txt``, the first 90% of its characters to
  train on and the last 10% held out (nanoGPT's split), written once under
  ``$LMFORGE_HOME/cache/bench``;
- ``python``: the built-in corpus ``builtin:python-stdlib`` with the quickstart's 1% held out.

Bits per byte here is the mean loss over *every* sample of the held-out split (not the
trainer's first ``eval.max_batches``), divided by ln 2 and by the split's bytes per token.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAKESPEARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "corpora",
                           "tinyshakespeare.txt")
CORPORA = ("shakespeare", "python")


def corpus_paths(name: str) -> dict:
    """{train_data, eval: {...}} config entries for a corpus."""
    if name == "python":
        return {"train_data": "builtin:python-stdlib", "eval": {"holdout_fraction": 0.01}}
    if name != "shakespeare":
        raise SystemExit(f"unknown corpus {name!r}; expected one of {', '.join(CORPORA)}")
    from lmforge.home import cache_dir

    src = os.path.abspath(SHAKESPEARE)
    if not os.path.exists(src):
        raise SystemExit(f"{src} not found (the shared corpora folder)")
    out = cache_dir("bench")
    train, val = os.path.join(out, "shakespeare-train.txt"), os.path.join(out, "shakespeare-val.txt")
    if not (os.path.exists(train) and os.path.exists(val)):
        text = open(src, encoding="utf-8").read()
        n = int(0.9 * len(text))
        for path, part in ((train, text[:n]), (val, text[n:])):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(part)
            os.replace(path + ".tmp", path)
    return {"train_data": train, "eval": {"data_path": val, "holdout_fraction": 0.0}}


def heldout_bpb(trainer, batch_size: int = 16) -> dict:
    """Mean loss and bits per byte over the whole held-out split of the trainer's data."""
    import torch

    from lmforge.data.batch import Batch
    from lmforge.data.stream.tokens import open_dataset

    (ds, split), = trainer.data.eval
    reader = open_dataset(ds.path, split)
    model = trainer.model
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(reader), batch_size):
            rows = [torch.from_numpy(reader.get_tokens(i).astype("int64"))
                    for i in range(start, min(len(reader), start + batch_size))]
            batch = Batch.from_tokens(torch.stack(rows))
            out = model.training_loss(batch.input_ids, batch.targets)
            total += float(out.ce_sum)
            count += int(batch.num_targets())
    model.train()
    loss = total / count
    bpt = ds.split_stats(split)["bytes_per_token"]
    return {"loss": loss, "bpb": loss / math.log(2) / bpt, "eval_tokens": count, "bytes_per_token": bpt}


QUICKSTART_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    \"\"\""]


def python_share(samples: list[str]) -> float:
    """Share of non-empty generated lines that Python's `tokenize` accepts, each line on its own
    (so multi-line brackets and strings count against it)."""
    import io
    import tokenize

    ok = total = 0
    for text in samples:
        for line in text.splitlines():
            if not line.strip():
                continue
            total += 1
            try:
                list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
                ok += 1
            except (tokenize.TokenError, IndentationError, SyntaxError):
                pass
    return ok / max(1, total)


def python_lines(model, tok, n: int = 12, new_tokens: int = 128) -> float:
    """python_share of ``n`` samples of ``new_tokens`` from the quickstart's prompts."""
    from lmforge.models.generate import generate

    model.eval()
    samples = []
    for i in range(n):
        prompt = QUICKSTART_PROMPTS[i % len(QUICKSTART_PROMPTS)]
        new = generate(model, tok.encode(prompt), new_tokens, temperature=0.8, top_k=50, top_p=0.95,
                       eos_id=tok.eos_id, seed=100 + i)
        samples.append(prompt + tok.decode([t for t in new if t != tok.eos_id]))
    model.train()
    return python_share(samples)


def train_config(corpus: str, knobs: dict, duration: str, save_folder: str) -> dict:
    """A run config from recipe knobs (see sweep.BASE); knobs left out take lmforge's defaults."""
    k = dict(knobs)
    model = k.pop("model", None)
    if model is None:
        model = {key: k.pop(key) for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
                 if key in k}
        for key in ("tie_embeddings", "qk_norm"):
            if key in k:
                model[key] = k.pop(key)
        if "context_length" in k:
            model["max_seq_len"] = k["context_length"]
    tokenizer = {"train": {"vocab_size": k.pop("vocab")}} if "vocab" in k else {"train": {}}
    params = {}
    warmup = k.get("warmup")
    if isinstance(warmup, str) and warmup.endswith("%"):  # a share of a token budget
        k["warmup"] = f"{int(float(warmup[:-1]) / 100 * float(duration.removesuffix('tok')))}tok"
    if "batch_tokens" in k:
        params["global_batch_size"] = f"{k.pop('batch_tokens')}tok"
    for key in ("context_length", "micro_batch_size", "learning_rate", "warmup", "schedule", "decay_fraction",
                "min_lr_ratio", "weight_decay", "optimizer", "grad_clip", "seed", "betas"):
        if key in k:
            params[key] = k.pop(key)
    if k:
        raise SystemExit(f"unknown knobs: {', '.join(k)}")
    paths = corpus_paths(corpus)
    return {
        "name": "bench", "model": model, "tokenizer": tokenizer, "train_data": paths["train_data"],
        "eval": paths["eval"] | {"prompts": [], "max_batches": 1}, "training_duration": duration,
        "save_folder": save_folder, "parameters": params, "autoresume": False,
        "experiment_tracker": {"mlflow": None, "console": False, "jsonl": False},
        "compute": {"async_checkpoint": False},
    }


def train_and_measure(corpus: str, knobs: dict, duration: str, log=lambda *_: None) -> dict:
    """Train in this process for ``duration`` (steps taken one by one, no checkpoints or
    evaluations on the way) and measure held-out bits per byte at the end."""
    import torch

    from lmforge.config.load import build_config
    from lmforge.distributed.dist import DistInfo
    from lmforge.resolve import resolve
    from lmforge.train.machine import process_machine
    from lmforge.train.build import build_trainer

    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
        cfg = build_config(train_config(corpus, knobs, duration, os.path.join(tmp, "run")))
        t_setup = time.perf_counter()
        setup = resolve(cfg, process_machine(dist), log=log)
        trainer = build_trainer(setup, dist, log=log)
        setup_s = time.perf_counter() - t_setup
        plan = trainer.plan
        batches = iter(trainer.stream)
        trainer._start_clock()
        t0 = time.perf_counter()
        losses = []
        while not trainer._done():
            out = trainer.train_step([next(batches) for _ in range(plan.grad_accum)])
            losses.append(out.loss)
        train_s = time.perf_counter() - t0
        trainer.stream.close()
        result = heldout_bpb(trainer)
        if corpus == "python":
            result["python_lines"] = python_lines(trainer.model, setup.tokenizer)
        counts = plan.params
    return result | {
        "steps": trainer.state.step, "tokens": trainer.state.tokens, "train_s": round(train_s, 2),
        "setup_s": round(setup_s, 2), "final_train_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "params": counts["total"], "non_embedding": counts["non_embedding"], "model": cfg.model if
        isinstance(cfg.model, str) else setup.cfg.model.model_dump(mode="json", exclude_none=True),
        "vocab": setup.cfg.model.vocab_size, "lr": plan.learning_rate, "batch": plan.global_batch,
        "context": plan.context_length, "threads": torch.get_num_threads()}
