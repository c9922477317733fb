"""`lmforge export --checkpoint PATH --format hf --out DIR`."""

from __future__ import annotations

from lmforge.cli.common import add_command


def register(sub) -> None:
    p = add_command(sub, "export", "export a checkpoint as a Hugging Face, lmforge or GGUF (llama.cpp/Ollama) model",
                    description="PATH may be a run's save folder, its final/, a checkpoints/step_N folder or a "
                    "Hugging Face folder. The HF folder loads with transformers.AutoModelForCausalLM and "
                    "AutoTokenizer, as the model's family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                    "Qwen3ForCausalLM, Olmo2ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM; "
                    "MixtralForCausalLM for MoE). --format peft writes a LoRA "
                    "run's adapter as a PEFT folder. --format gguf writes DIR/model-<dtype>.gguf for llama.cpp "
                    "(weights, tokenizer and chat template in one file) and DIR/Modelfile for `ollama create NAME -f "
                    "DIR/Modelfile`, or with --out FILE.gguf the GGUF file alone; see docs/run-your-model.md. "
                    "--overwrite replaces an earlier export only, never a folder of other files, a run or a dataset.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="what to export")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write (new, empty, or an earlier export with --overwrite); gguf: also FILE.gguf")
    p.add_argument("--format", default="hf", choices=["hf", "lmforge", "peft", "gguf"],
                   help="output layout (peft: the LoRA adapter of a run trained with lora:; gguf: llama.cpp/Ollama)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer to include; default: the checkpoint's own")
    p.add_argument("--dtype", help="weights dtype: float32 (default), bfloat16 or float16; for gguf f32, f16 "
                   "(default), bf16 or q8_0")
    p.add_argument("--max-shard-size", default="5GB", help="split weights into shards of at most this size")
    p.add_argument("--allow-clip-qkv", action="store_true",
                   help="export a clip_qkv model anyway (HF has no clip; outputs match only under the clip)")
    p.add_argument("--merge", action="store_true",
                   help="gguf: export a LoRA run with its adapters merged into the weights (required for one)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export (or GGUF file) at --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from lmforge.train.export import export  # torch (lazy: `lmforge --help` stays light)

    out = export(args.checkpoint, args.out, fmt=args.format, tokenizer=args.tokenizer, dtype=args.dtype,
                 max_shard_size=args.max_shard_size, allow_clip_qkv=args.allow_clip_qkv, overwrite=args.overwrite,
                 merge=args.merge)
    if args.format == "gguf" and out.is_file():
        print(f"exported {args.checkpoint} → {out} (llama.cpp; --out DIR also writes an Ollama Modelfile)")
    elif args.format == "gguf":
        gguf = next(out.glob("*.gguf"))
        print(f"exported {args.checkpoint} → {gguf} (llama.cpp); Ollama: ollama create NAME -f {out / 'Modelfile'}")
    else:
        print(f"exported {args.checkpoint} → {out} ({args.format})")
    return 0
