"""ICL evaluation speed: examples per second per task type, at 0 and 3 shots, on CPU.

Scores the first --limit examples of LLM Foundry's eval files (multiple choice, schema, language
modeling, generation) with a `llama-tiny`-shaped model (random weights: speed does not depend on
them, except that generation always runs its whole budget) and a BPE tokenizer trained on the
tasks' own text. Needs the eval data (LLM Foundry's local_data files; --data-root).

    python bench/eval.py [--data-root ../shared/eval-data] [--limit 100] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from lmforge.config.model import get_preset
from lmforge.data.text.tokenizer import train_tokenizer
from lmforge.eval.icl import evaluate_icl, load_tasks
from lmforge.models import build_model

REPO = Path(__file__).resolve().parent.parent
TASKS = [  # (label, file, type, extra task keys), as in lmforge/tasks/tasks.yaml
    ("copa", "commonsense_reasoning/copa.jsonl", "multiple_choice", {}),
    ("piqa", "commonsense_reasoning/piqa.jsonl", "multiple_choice", {"continuation_delimiter": "\nAnswer: "}),
    ("arc_easy", "world_knowledge/arc_easy.jsonl", "multiple_choice", {"continuation_delimiter": "\nAnswer: "}),
    ("winograd", "language_understanding/winograd_wsc.jsonl", "schema", {}),
    ("winogrande", "language_understanding/winogrande.jsonl", "schema", {}),
    ("lambada_openai", "language_understanding/lambada_openai.jsonl", "language_modeling", {}),
    ("jeopardy", "world_knowledge/jeopardy_small.jsonl", "language_modeling",
     {"continuation_delimiter": "\nAnswer: ", "has_categories": True}),
    ("triviaqa", "world_knowledge/triviaqa_small.jsonl", "generation_task_with_answers", {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "eval-data"))
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shots", default="0,3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.data_root)
    if not root.is_dir():
        raise SystemExit(f"--data-root {root}: not a folder (LLM Foundry's eval local_data files)")
    shots = [int(s) for s in args.shots.split(",")]
    tasks = load_tasks([{"label": label, "dataset_uri": path, "icl_task_type": kind, "num_fewshot": shots, **extra}
                        for label, path, kind, extra in TASKS], data_root=root)

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text("\n".join(json.dumps(ex) for t in tasks for ex in t.examples[:2000]))
        tok = train_tokenizer([str(text)], 8192, str(Path(tmp) / "tok"))
    cfg = get_preset("llama-tiny").model_copy(update={"vocab_size": tok.vocab_size})
    torch.manual_seed(0)
    model = build_model(cfg).eval()

    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"llama-tiny ({cfg.d_model}d x {cfg.n_layers}, ctx {cfg.max_seq_len}), batch {args.batch_size}")
    # CPU seconds (all threads) beside wall seconds: on a shared machine the wall clock also counts
    # waiting for a core, CPU time does not.
    print("| task | type | shots | examples | seconds | examples/s | CPU s per 100 examples |")
    print("|---|---|---|---|---|---|---|")
    rows, per_type = [], {}
    for task in tasks:
        for k in shots:
            one = [dataclasses.replace(task, num_fewshot=[k])]
            t0, c0 = time.perf_counter(), time.process_time()
            result = evaluate_icl(model, tok, one, batch_size=args.batch_size, limit=args.limit)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = result[f"{task.label}/{k}-shot"]["n"]
            rows.append({"task": task.label, "type": task.task_type, "shots": k, "n": n, "seconds": seconds,
                         "cpu_seconds": cpu})
            total = per_type.setdefault((task.task_type, k), [0, 0.0, 0.0])
            total[0] += n
            total[1] += seconds
            total[2] += cpu
            print(f"| {task.label} | {task.task_type} | {k} | {n} | {seconds:.2f} | {n / seconds:.1f} | "
                  f"{100 * cpu / n:.2f} |", flush=True)
    print("\n| type | shots | examples/s (all tasks of the type) | seconds per 100 examples | CPU s per 100 |")
    print("|---|---|---|---|---|")
    for (kind, k), (n, s, c) in sorted(per_type.items()):
        print(f"| {kind} | {k} | {n / s:.1f} | {100 * s / n:.2f} | {100 * c / n:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
