"""Write the reinforcement-learning examples' data: tasks whose answers a program checks.

    python examples/rl_tasks.py            # → examples/data/rl/*

Two tasks, each with held-out prompts never seen in training:

- **sums** (`examples/rl.yaml`): "47 + 8 = " → "55" (a number below 100 and a digit). ``sums.txt``
  is a tiny model's pretraining text (800 sums written out, one per line, 20 times over in new
  orders), ``sft.jsonl`` 100
  prompt/response rows in the task's format (the answer, its line's end, then the end of text),
  ``train.jsonl`` / ``val.jsonl`` the prompts the RL run samples from and is evaluated on, with the
  ``answer`` the ``exact_match`` reward compares to. The 200 held-out sums appear in no other file.
- **operators** (the RL rung of `examples/pipeline.yaml`): the SFT and preference examples' task —
  "# Python: return the product of x and y" — as prompts ending at ``return x``, answered by the
  operator and the second name (" * y"). Held-out prompts use argument names never paired in training.

Deterministic (seeded): the committed files are this script's output.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = {"sum": "+", "difference": "-", "product": "*", "quotient": "/", "power": "**", "remainder": "%"}
NAMES = ["a", "b", "x", "y", "n", "m", "value", "count", "left", "right", "total", "item"]


def sums(seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(100) for b in range(10)]  # a two-digit number and a digit: a carry or not
    rng.shuffle(pairs)
    held, rest = pairs[:200], pairs[200:]
    text = []
    for _ in range(20):  # each sum 20 times, in a new order each time: the model learns sums, not their order
        rng.shuffle(rest)
        text += [f"{a} + {b} = {a + b}\n" for a, b in rest]
    # the answer as the pretraining text writes it (its line ends), then the end of text (SFT adds it)
    sft = [{"prompt": f"{a} + {b} = ", "response": f"{a + b}\n"} for a, b in rest[:100]]
    train = [{"prompt": f"{a} + {b} = ", "answer": str(a + b)} for a, b in rest]
    val = [{"prompt": f"{a} + {b} = ", "answer": str(a + b)} for a, b in held]
    return {"sums.txt": text, "sft.jsonl": sft, "train.jsonl": train, "val.jsonl": val}


def operators(seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    combos = [(a, b) for a in NAMES for b in NAMES if a != b]
    rng.shuffle(combos)
    held = set(combos[:16])  # as examples/preference_pairs.py holds them out
    train, val = [], []
    for op, sym in OPS.items():
        for a, b in combos:
            row = {"prompt": f"# Python: return the {op} of {a} and {b}\ndef {op}_of_{a}_{b}({a}, {b}):\n    return {a}",
                   "answer": f"{sym} {b}"}
            (val if (a, b) in held else train).append(row)
    rng.shuffle(train)
    rng.shuffle(val)
    return {"code_train.jsonl": train[:480], "code_val.jsonl": val[:64]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "data" / "rl"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = sums(args.seed) | operators(args.seed)
    for name, rows in files.items():
        (out / name).write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    print(", ".join(f"{len(rows)} {name}" for name, rows in files.items()) + f" in {out}")


if __name__ == "__main__":
    main()
