"""Write the example preference pairs: the SFT example's task with the right operator chosen over a wrong one.

    python examples/preference_pairs.py            # → examples/data/preference/{train,val}.jsonl

Each row is a prompt of `examples/data/sft` ("# Python: return the sum of a and b"), the correct
function as ``chosen`` and the same function with a wrong operator as ``rejected``, so the only
thing a pair teaches is which operator the words ask for. Held-out pairs use argument names
never paired in training. Deterministic (seeded): the committed files are this script's output.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = {"sum": "+", "difference": "-", "product": "*", "quotient": "/", "power": "**", "remainder": "%"}
NAMES = ["a", "b", "x", "y", "n", "m", "value", "count", "left", "right", "total", "item"]


def pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    combos = [(a, b) for a in NAMES for b in NAMES if a != b]
    rng.shuffle(combos)
    held_out = set(combos[:16])
    train, val = [], []
    for op, sym in OPS.items():
        for a, b in combos:
            wrong = rng.choice([s for s in OPS.values() if s != sym])
            head = f"def {op}_of_{a}_{b}({a}, {b}):\n    return {a} "
            row = {"prompt": f"# Python: return the {op} of {a} and {b}\n",
                   "chosen": f"{head}{sym} {b}\n", "rejected": f"{head}{wrong} {b}\n"}
            (val if (a, b) in held_out else train).append(row)
    rng.shuffle(train)
    rng.shuffle(val)
    return train[:240], val[:48]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "data" / "preference"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = pairs(args.seed)
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(train)} training and {len(val)} held-out pairs in {out}")


if __name__ == "__main__":
    main()
