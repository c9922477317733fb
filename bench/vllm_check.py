"""vLLM serves lmforge's Hugging Face export: for a dense model (LlamaForCausalLM) and a MoE
(MixtralForCausalLM), vLLM's prompt token ids and greedy output equal lmforge's (`generate` at
temperature 0, what `lmforge generate --temperature 0` prints), on a CUDA machine with vLLM.

    python bench/vllm_check.py [--dtype float32] [--out DIR]   # both models, each in its own process
    bash bench/gpu.sh vllm                                       # the same, as bench/gpu.sh's part

The models are random (init std 0.1: logits far from ties, so greedy equality is a fair test of
the same function rather than of luck), 4 layers × d 256, with a byte-level BPE tokenizer trained
here on a few files of the Python standard library; the export is `lmforge export` (in-process).
Both sides run in fp32 by default (--dtype): vLLM in bf16 against fp32 would compare rounding.
One JSON row per model goes to stdout and DIR/vllm.jsonl ($OUT or .bench by default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPTS = ["def main(argv):\n    parser = ", "class Fraction(", "The quick brown fox", "    return self._"]
NEW_TOKENS = 32
SHAPE = dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=512, max_seq_len=512, init_std=0.1)
KINDS = {"dense": {}, "moe": dict(n_experts=4, top_k=2, expansion_ratio=2.0)}


def build(kind: str, root: Path) -> tuple[Path, object]:
    """(the HF export of a random ``kind`` model, its tokenizer)."""
    import torch

    from lmforge.config.model import ModelConfig, padded_vocab
    from lmforge.data.text.tokenizer import train_tokenizer
    from lmforge.models import build_model, save_pretrained
    from lmforge.train.export import export

    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "fractions.py", "textwrap.py"):
        (raw / f"{name}.txt").write_text((stdlib / name).read_text())
    tok = train_tokenizer([str(raw)], 2048, str(root / "tok"))
    cfg = ModelConfig(**SHAPE, **KINDS[kind], vocab_size=padded_vocab(tok.vocab_size))
    torch.manual_seed(0)
    save_pretrained(build_model(cfg).eval(), cfg, root / "ckpt", tokenizer_dir=str(root / "tok"))
    export(str(root / "ckpt"), str(root / "hf"))
    return root / "hf", tok


def check(kind: str, dtype: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    from lmforge.models.generate import generate
    from lmforge.train.locate import load_model

    with tempfile.TemporaryDirectory(prefix="lmforge-vllm-") as tmp:
        hf, tok = build(kind, Path(tmp))
        ours, _, _ = load_model(str(hf), device="cuda", dtype=getattr(torch, dtype))
        want = [tok.encode_prompt(p) for p in PROMPTS]
        greedy = [generate(ours, ids, NEW_TOKENS, temperature=0) for ids in want]
        del ours
        torch.cuda.empty_cache()
        llm = LLM(model=str(hf), dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512,
                  seed=0)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got = [list(o.outputs[0].token_ids) for o in outs]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, greedy)]
    return {"model": kind, "architecture": "MixtralForCausalLM" if kind == "moe" else "LlamaForCausalLM",
            "dtype": dtype, "prompts": len(PROMPTS),
            "same_prompt_ids": sum(list(o.prompt_token_ids) == w for o, w in zip(outs, want)),
            "same_greedy": sum(g == w for g, w in zip(got, greedy)), "first_diff": first_diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", ".bench"))
    p.add_argument("--one", choices=list(KINDS), help=argparse.SUPPRESS)  # a child: one model, one JSON line
    args = p.parse_args()
    if args.one:
        print(json.dumps(check(args.one, args.dtype)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    ok = True
    for kind in KINDS:  # a process each: one vLLM engine per process frees its GPU memory at exit
        proc = subprocess.run([sys.executable, __file__, "--one", kind, "--dtype", args.dtype], capture_output=True,
                              text=True, timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "model": kind, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        ok &= row.get("same_greedy") == row.get("prompts") == row.get("same_prompt_ids")
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "vllm.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    print("vLLM: greedy output equals lmforge's for every model" if ok else "vLLM: MISMATCH or error (rows above)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
