"""`lmforge data prepare` and `lmforge data inspect`."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from lmforge.cli.common import OneLineParser, add_command
from lmforge.data import remote
from lmforge.data.mds import MDSReader
from lmforge.data.prepare import prepare, read_summary
from lmforge.data.tokenizer import load_tokenizer
from lmforge.errors import UserError


def register(subparsers) -> None:
    group = add_command(subparsers, "data", "prepare and inspect datasets")
    sub = group.add_subparsers(dest="data_command", metavar="COMMAND", parser_class=OneLineParser)

    p = add_command(sub, "prepare", "tokenize raw text into packed MDS shards",
                    "Tokenize documents, join them with EOS, pack into --seq-len samples and write MDS\n"
                    "shards to DEST/train (and DEST/val with --eval-fraction). Re-running with the same\n"
                    "inputs and arguments does nothing.")
    p.add_argument("--input", nargs="+", required=True, metavar="SRC",
                   help="files, folders, globs, URIs, hf://NAME[/CONFIG][:SPLIT] or builtin:python-stdlib")
    p.add_argument("--tokenizer", required=True, metavar="TOK", help="tokenizer folder (tokenizer.json) or HF name")
    p.add_argument("--out", required=True, metavar="DEST", help="output folder or object-store URI")
    p.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per sample")
    p.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                   help="fraction of documents held out in DEST/val (chosen by a hash of their content)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="tokenizer processes")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd, zstd:LEVEL or none")
    p.add_argument("--text-field", default="text", help="text field/column of .jsonl/.json/.parquet inputs")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset already in DEST")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_prepare)

    p = add_command(sub, "inspect", "show a prepared dataset's summary and its first sample")
    p.add_argument("dest", metavar="DEST", help="prepared dataset folder or URI")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.add_argument("--chars", type=int, default=600, help="characters of the first sample to show (0: all)")
    p.set_defaults(func=_inspect)
    group.set_defaults(func=lambda args: (group.print_help(), 2)[1])


def _prepare(args) -> int:
    summary = prepare(args.input, args.tokenizer, args.out, args.seq_len, eval_fraction=args.eval_fraction,
                      workers=args.workers, compression=args.compression, text_field=args.text_field,
                      overwrite=args.overwrite, progress=None if not args.json else False)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if summary.get("already_prepared"):
        print(f"already prepared: {args.out} (same inputs, arguments and tokenizer; nothing to do)")
    _print_summary(summary, args.out)
    return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "-" if v is None else str(v)


def _print_summary(summary: dict, dest: str) -> None:
    console = Console()
    table = Table(title=f"dataset {dest}", title_justify="left")
    cols = ("documents", "tokens", "bytes", "bytes_per_token", "samples", "shards", "dropped_tokens")
    headers = ("docs", "tokens", "bytes", "B/token", "samples", "shards", "dropped")
    table.add_column("split", no_wrap=True, min_width=5)
    for h in headers:
        table.add_column(h, justify="right", no_wrap=True)
    for name, s in (summary.get("splits") or {}).items():
        table.add_row(name, *(_fmt(s.get(c)) for c in cols))
    console.print(table)
    tok = summary.get("tokenizer") or {}
    args = summary.get("args") or {}
    console.print(f"seq_len {args.get('seq_len')}, dtype {summary.get('dtype')}, tokenizer {tok.get('path')} "
                  f"(vocab {tok.get('vocab_size')}, eos {tok.get('eos_id')})", highlight=False)
    if summary.get("tokens_per_second"):
        console.print(f"{summary.get('seconds')}s, {summary['tokens_per_second']:,.0f} tokens/s "
                      f"with {summary.get('workers')} workers", highlight=False)
    for s in summary.get("skipped_inputs") or []:
        console.print(f"skipped {s['input']}: {s['reason']}", highlight=False)
    if summary.get("skipped_lines"):
        console.print(f"skipped {summary['skipped_lines']} records, e.g. {summary['skipped_line_examples'][0]}",
                      highlight=False)
    if summary.get("invalid_utf8_replacements"):
        console.print(f"{summary['invalid_utf8_replacements']} invalid UTF-8 sequences replaced, in "
                      f"{', '.join(summary.get('invalid_utf8_files') or [])}", highlight=False)


def first_sample(dest: str) -> list[int]:
    """Token ids of the first train sample of a prepared dataset (local or remote)."""
    split_uri = remote.join(dest, "train")
    if not remote.is_remote(dest):
        with tempfile.TemporaryDirectory() as cache:
            return MDSReader(remote.local_path(split_uri), cache_dir=cache).get_tokens(0).tolist()
    with tempfile.TemporaryDirectory() as local:
        remote.download(remote.join(split_uri, "index.json"), os.path.join(local, "index.json"))
        reader = MDSReader(local, cache_dir=os.path.join(local, "cache"), name=split_uri,
                           fetch=lambda base: remote.download(remote.join(split_uri, base), os.path.join(local, base)))
        return reader.get_tokens(0).tolist()


def _inspect(args) -> int:
    summary = read_summary(args.dest)
    ids = first_sample(args.dest)
    text = None
    tok_path = (summary.get("tokenizer") or {}).get("path")
    try:
        text = load_tokenizer(tok_path).decode(ids) if tok_path else None
    except UserError as e:
        sys.stderr.write(f"warning: cannot decode the sample: {e}\n")
    if args.json:
        print(json.dumps({"summary": summary, "first_sample": {"ids": ids, "text": text}}, indent=2))
        return 0
    _print_summary(summary, args.dest)
    shown = text if text is not None else " ".join(map(str, ids))
    if args.chars and len(shown) > args.chars:
        shown = shown[: args.chars] + f"... [{len(shown) - args.chars} more characters]"
    print(f"\nfirst sample ({len(ids)} tokens):\n{shown}")
    return 0
