"""`lmforge generate --checkpoint PATH (--prompt TEXT | --file F) [sampling options]`."""

from __future__ import annotations

import sys

from lmforge.cli.common import add_command, add_device_argument, bounded, torch_device
from lmforge.config.limits import MAX_NEW_TOKENS, MAX_SEED
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError


def register(sub) -> None:
    p = add_command(sub, "generate", "sample text from a checkpoint, streaming it to the terminal",
                    description="PATH may be a run's save folder, its final/, a checkpoints/step_N folder or a "
                    "Hugging Face folder (e.g. one written by `lmforge export`).")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="the model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--file", metavar="F", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS), default=100, help="tokens to generate at most")
    p.add_argument("--temperature", type=bounded(float, 0, 100), default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=bounded(int, 0), default=50, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=bounded(float, 0, 1, above=True), default=0.95, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=bounded(int, 0, MAX_SEED), default=None, help="sampling seed (default: random)")
    p.add_argument("--tokenizer", metavar="DIR", help="default: the tokenizer stored with the checkpoint")
    add_device_argument(p)
    p.set_defaults(func=run)


def _check(args) -> None:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens: must be positive (got {args.max_new_tokens})")
    if args.temperature < 0:
        raise UserError(f"--temperature: must be >= 0 (got {args.temperature})")
    if args.top_k < 0:
        raise UserError(f"--top-k: must be >= 0 (got {args.top_k})")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1] (got {args.top_p})")


def _prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--file {args.file}: cannot read ({e.strerror if isinstance(e, OSError) else e})") from None
    if not text:
        raise UserError("prompt: empty (give --prompt TEXT or a non-empty --file)")
    return text


def run(args) -> int:
    _check(args)
    text = _prompt(args)
    from lmforge.models.generate import generate
    from lmforge.resolve.weights import check_tokenizer_fits
    from lmforge.train.locate import load_model

    device = torch_device(args.device)  # torch, as the imports above (lazy: `lmforge --help`)
    model, cfg, loc = load_model(args.checkpoint, device=device)
    tok_dir = args.tokenizer or loc.tokenizer_dir
    if not tok_dir:
        raise UserError(f"checkpoint {args.checkpoint}: no tokenizer stored with it; pass --tokenizer DIR")
    tok = load_tokenizer(tok_dir)
    check_tokenizer_fits(tok, cfg, f"checkpoint {args.checkpoint}")
    if args.chat:  # the tokenizer's own chat template if it has one, else lmforge's plain one
        from lmforge.data.chat import load_chat_template
        from lmforge.data.chat import chat_prompt

        template = load_chat_template(tok.path)
        text = template.generation_prompt(text, tok) if template else chat_prompt(text)
    ids = tok.encode_prompt(text)
    sys.stdout.write(text)
    sys.stdout.flush()
    new: list[int] = []
    shown = 0

    def on_token(t: int) -> None:
        nonlocal shown
        if t == tok.eos_id:
            return
        new.append(t)
        out = tok.decode(new)
        if out.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return
        sys.stdout.write(out[shown:])
        sys.stdout.flush()
        shown = len(out)

    generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
             top_p=args.top_p, eos_id=tok.eos_id, seed=args.seed, on_token=on_token)
    rest = tok.decode(new)[shown:]
    sys.stdout.write(rest + "\n")
    return 0
