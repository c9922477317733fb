"""`lmforge tokenizer train`: a byte-level BPE from raw text."""

from __future__ import annotations

import json
import os
import shutil
import time

from lmforge.cli.common import OneLineParser, add_command, bounded
from lmforge.config.limits import MAX_VOCAB
from lmforge.data.text.tokenizer import train_tokenizer
from lmforge.guard import check_output, replace_folder
from lmforge.run_files import TOKENIZER_MARKER


def register(subparsers) -> None:
    group = add_command(subparsers, "tokenizer", "train tokenizers")
    sub = group.add_subparsers(dest="tokenizer_command", metavar="COMMAND", parser_class=OneLineParser)
    p = add_command(sub, "train", "train a byte-level BPE tokenizer on raw text",
                    "Train a byte-level BPE (HF tokenizers) with <|endoftext|> and <|pad|> special tokens.\n"
                    "The folder loads with lmforge and with transformers.AutoTokenizer.")
    p.add_argument("--input", nargs="+", required=True, metavar="SRC",
                   help="files, folders, globs, URIs, hf://NAME[/CONFIG][:SPLIT] or builtin:python-stdlib")
    p.add_argument("--vocab-size", type=bounded(int, 1, MAX_VOCAB), required=True, metavar="N", help="vocabulary size incl. special tokens")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--text-field", default="text", help="text field/column of .jsonl/.json/.parquet inputs")
    p.add_argument("--bos", action="store_true", help="add a <|bos|> token, prepended to every encoded text")
    p.add_argument("--min-frequency", type=bounded(int, 0), default=2, help="minimum pair count for a merge")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer folder lmforge made at --out (nothing else: not another kind of folder)")
    p.set_defaults(func=_train)
    group.set_defaults(func=lambda args: (group.print_help(), 2)[1])


def _train(args) -> int:

    start = time.perf_counter()
    out = os.path.abspath(args.out)
    check_output(args.out, "--out", "tokenizer", overwrite=args.overwrite,
                 reads=[("the input", i) for i in args.input], command="tokenizer train")
    # Trained into a sibling folder, then moved into place: a failed run leaves --out as it was,
    # and --overwrite leaves no file of the old tokenizer behind.
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = train_tokenizer(args.input, args.vocab_size, tmp, text_field=args.text_field, add_bos=args.bos,
                              min_frequency=args.min_frequency)
        with open(os.path.join(tmp, TOKENIZER_MARKER), "w") as f:  # what --overwrite may replace (`guard`)
            json.dump({"format": "lmforge-tokenizer", "vocab_size": tok.vocab_size}, f)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {tok.vocab_size} tokens (eos {tok.eos_id}, pad {tok.pad_id}"
          f"{f', bos {tok.bos_id}' if tok.bos_id is not None else ''}) -> {args.out} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0
