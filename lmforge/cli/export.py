"""`lmforge export --checkpoint PATH --format hf --out DIR`."""

from __future__ import annotations

from lmforge.cli.common import add_command


def register(sub) -> None:
    p = add_command(sub, "export", "export a checkpoint as a Hugging Face (or lmforge) model folder",
                    description="PATH may be a run's save folder, its final/, a checkpoints/step_N folder or a "
                    "Hugging Face folder. The HF folder loads with transformers.AutoModelForCausalLM and "
                    "AutoTokenizer, as the model's family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                    "Qwen3ForCausalLM, Olmo2ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM; "
                    "MixtralForCausalLM for MoE). --format peft writes a LoRA "
                    "run's adapter as a PEFT folder.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="what to export")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (must be new or empty)")
    p.add_argument("--format", default="hf", choices=["hf", "lmforge", "peft"],
                   help="output layout (peft: the LoRA adapter of a run trained with lora:)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer to include; default: the checkpoint's own")
    p.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16 or float16")
    p.add_argument("--max-shard-size", default="5GB", help="split weights into shards of at most this size")
    p.add_argument("--allow-clip-qkv", action="store_true",
                   help="export a clip_qkv model anyway (HF has no clip; outputs match only under the clip)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from lmforge.train.export import export  # torch (lazy: `lmforge --help` stays light)

    out = export(args.checkpoint, args.out, fmt=args.format, tokenizer=args.tokenizer, dtype=args.dtype,
                 max_shard_size=args.max_shard_size, allow_clip_qkv=args.allow_clip_qkv, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} → {out} ({args.format})")
    return 0
