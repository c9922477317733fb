"""`lmforge data prepare`, `data dedup`, `data stats` and `data inspect`."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from lmforge.cli.common import OneLineParser, add_command, bounded
from lmforge.config.limits import MAX_SEQ_LEN
from lmforge.data import remote
from lmforge.data.prepare.executors import ExecutorSpec
from lmforge.data.mds import MDSReader
from lmforge.data.prepare.prepare import input_warnings, prepare, read_summary
from lmforge.data.prepare.units import DEFAULT_UNIT_BYTES, ON_BAD_INPUT
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError


def register(subparsers) -> None:
    group = add_command(subparsers, "data", "prepare, curate and inspect datasets")
    sub = group.add_subparsers(dest="data_command", metavar="COMMAND", parser_class=OneLineParser)

    p = add_command(sub, "prepare", "tokenize raw text into packed MDS shards",
                    "Tokenize documents, join them with EOS, pack into --seq-len samples and write MDS\n"
                    "shards to DEST/train (and DEST/val with --eval-fraction). Re-running with the same\n"
                    "inputs and arguments does nothing.")
    p.add_argument("--input", nargs="+", required=True, metavar="SRC",
                   help="files, folders, globs, URIs, hf://NAME[/CONFIG][:SPLIT] or builtin:python-stdlib")
    p.add_argument("--tokenizer", required=True, metavar="TOK", help="tokenizer folder (tokenizer.json) or HF name")
    p.add_argument("--out", required=True, metavar="DEST", help="output folder or object-store URI")
    p.add_argument("--seq-len", type=bounded(int, 2, MAX_SEQ_LEN), required=True, metavar="N", help="tokens per sample")
    p.add_argument("--eval-fraction", type=bounded(float, 0, 1, below=True), default=0.0, metavar="F",
                   help="fraction of documents held out in DEST/val (chosen by a hash of their content); "
                   "too few documents for one val sample: that fraction of the samples, from the end")
    p.add_argument("--workers", type=bounded(int, 1, 4096), default=min(4, os.cpu_count() or 1),
                   help="tokenizer processes (without --executor; with one, --tasks)")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd, zstd:LEVEL or none")
    p.add_argument("--text-field", default="text", help="text field/column of .jsonl/.json/.parquet inputs")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different prepared dataset (or an unfinished one) in DEST; nothing else")
    add_bad_input_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_curation_args(p, dedup_default=None)
    add_executor_args(p)
    p.set_defaults(func=_prepare)

    p = add_command(sub, "dedup", "deduplicate (and optionally filter) raw text into JSONL",
                    "Remove exact and near-duplicate documents (and, with --filter/--decontaminate, low-quality,\n"
                    "off-language and contaminated ones) from raw text; write the kept documents to\n"
                    "DEST/documents.jsonl (one {\"text\": ...} per line) and the summary to DEST/curation.json.\n"
                    "The same steps are options of `data prepare`. See docs/curation.md.")
    p.add_argument("--input", nargs="+", required=True, metavar="SRC",
                   help="files, folders, globs, URIs, hf://NAME[/CONFIG][:SPLIT] or builtin:python-stdlib")
    p.add_argument("--out", required=True, metavar="DEST", help="output folder")
    p.add_argument("--text-field", default="text", help="text field/column of .jsonl/.json/.parquet inputs")
    p.add_argument("--workers", type=bounded(int, 1, 4096), default=min(4, os.cpu_count() or 1),
                   help="worker processes (without --executor; with one, --tasks)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it holds another `data dedup` output (or an unfinished one); nothing else")
    add_bad_input_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_curation_args(p, dedup_default="exact,near")
    add_executor_args(p)
    p.set_defaults(func=_dedup)

    p = add_command(sub, "stats", "documents, tokens, lengths, duplicates and languages of a corpus",
                    "Statistics of raw text (SRC: anything --input takes) or of a prepared dataset (DEST):\n"
                    "documents, tokens, bytes per token, document-length histogram, duplicate rate\n"
                    "and language mix; a table here, and plots in --plot FILE (.png or .html).")
    p.add_argument("source", metavar="SRC|DEST", nargs="+", help="raw inputs, or one prepared dataset folder")
    p.add_argument("--tokenizer", metavar="TOK", help="count tokens of raw text with this tokenizer")
    p.add_argument("--text-field", default="text", help="text field/column of .jsonl/.json/.parquet inputs")
    p.add_argument("--max-docs", type=bounded(int, 1), default=None, metavar="N", help="read at most N documents")
    p.add_argument("--plot", metavar="FILE",
                   help="write the plots to FILE.png or FILE.html (replaces earlier plots there, nothing else)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the --plot FILE even if lmforge did not write it (never a file of a run or a dataset)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=_stats)

    p = add_command(sub, "inspect", "show a prepared dataset's summary and its first sample")
    p.add_argument("dest", metavar="DEST", help="prepared dataset folder or URI")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.add_argument("--chars", type=bounded(int, 0), default=600, help="characters of the first sample to show (0: all)")
    p.set_defaults(func=_inspect)
    group.set_defaults(func=lambda args: (group.print_help(), 2)[1])


FILTERS_HELP = "c4, fineweb, language, gopher_quality, gopher_repetition"


def add_bad_input_arg(p) -> None:
    p.add_argument("--on-bad-input", choices=ON_BAD_INPUT, default="skip",
                   help="an input file that cannot be read (corrupt, truncated, no text field): skip it, counted and "
                        "named in the summary (default), or stop, keeping the units done")


def add_curation_args(p, dedup_default: str | None) -> None:
    g = p.add_argument_group("curation (docs/curation.md)")
    g.add_argument("--dedup", default=dedup_default, metavar="KINDS",
                   help="exact, near, exact,near or none: remove duplicate documents")
    g.add_argument("--near-threshold", type=bounded(float, 0, 1, above=True), metavar="J", help="near-dup Jaccard threshold (default 0.8)")
    g.add_argument("--filter", action="append", default=[], metavar="NAME",
                   help=f"quality/language filter with its default thresholds (repeatable or comma-separated): "
                        f"{FILTERS_HELP}")
    g.add_argument("--language", metavar="LANGS", help="languages the language filter keeps, e.g. en,fr (default en)")
    g.add_argument("--decontaminate", metavar="TASKS",
                   help="remove documents sharing a 13-word n-gram with these ICL tasks (a tasks YAML or 'default')")
    g.add_argument("--data-root", metavar="DIR", help="folder the ICL tasks' relative dataset paths resolve against")
    g.add_argument("--curate", metavar="FILE", help="YAML with the full `curate:` settings (thresholds); "
                   "the flags above are applied on top")
    g.add_argument("--flag-only", action="store_true", help="count and sample what the steps match, remove nothing")
    g.add_argument("--removed-out", metavar="DIR", help="write a sample of the removed documents per reason here")


def add_executor_args(p) -> None:
    g = p.add_argument_group("many tasks (docs/data-at-scale.md)")
    g.add_argument("--executor", metavar="KIND",
                   help="run as --tasks tasks on datatrove's local, slurm or ray executor (default: this process "
                        "and --workers processes)")
    g.add_argument("--tasks", type=bounded(int, 1, 1_000_000), metavar="N", help="how many tasks (implies --executor local)")
    g.add_argument("--unit-mb", type=bounded(float, 0, 1 << 20, above=True), default=DEFAULT_UNIT_BYTES / (1 << 20), metavar="MB",
                   help="input per work unit (default %(default).0f): each unit is packed on its own, whatever "
                        "the number of tasks")
    g.add_argument("--partition", metavar="NAME", help="slurm: the partition the tasks run on")
    g.add_argument("--time", default="24:00:00", metavar="HH:MM:SS", help="slurm: a task's time limit")
    g.add_argument("--cpus-per-task", type=bounded(int, 1, 4096), default=1, metavar="N", help="slurm and ray: cores per task")


def executor_from_args(args) -> ExecutorSpec | None:
    if args.executor is None and args.tasks is None:
        return None
    return ExecutorSpec(kind=args.executor or "local", tasks=1 if args.tasks is None else args.tasks,
                        partition=args.partition, time=args.time, cpus_per_task=args.cpus_per_task)


def unit_bytes_from_args(args) -> int:
    if not args.unit_mb > 0:
        raise UserError(f"--unit-mb {args.unit_mb}: expected a positive number of megabytes")
    return max(1, int(args.unit_mb * (1 << 20)))


def curation_from_args(args) -> dict | None:
    """The `curate:` mapping the flags describe (None: no curation)."""
    from lmforge.config.curation import FILTER_NAMES
    from lmforge.config.load import read_yaml
    from lmforge.errors import UserError

    cur: dict = {}
    if args.curate:
        cur = read_yaml(args.curate) or {}
        if not isinstance(cur, dict):
            raise UserError(f"--curate {args.curate}: expected a mapping of curate settings")
        cur = dict(cur.get("curate", cur))
    if args.dedup is not None:
        kinds = {k.strip() for k in args.dedup.split(",") if k.strip()}
        if not kinds <= {"exact", "near", "none"} or ("none" in kinds and len(kinds) > 1):
            raise UserError(f"--dedup {args.dedup}: expected exact, near, exact,near or none")
        cur["dedup"] = None if kinds == {"none"} else dict(cur.get("dedup") or {}, exact="exact" in kinds,
                                                           near="near" in kinds)
    if args.near_threshold is not None:
        if not cur.get("dedup"):
            raise UserError("--near-threshold: only with --dedup near")
        cur["dedup"] = dict(cur["dedup"] if isinstance(cur["dedup"], dict) else {}, threshold=args.near_threshold)
    filters = dict(cur.get("filters") or {}) if not isinstance(cur.get("filters"), list) else \
        {n: True for n in cur["filters"]}
    for item in args.filter:
        for name in (n.strip() for n in item.split(",") if n.strip()):
            if name not in FILTER_NAMES:
                raise UserError(f"--filter {name}: unknown filter (expected one of {FILTERS_HELP})")
            filters.setdefault(name, True)
    if args.language:
        lang = filters.get("language")
        filters["language"] = (lang if isinstance(lang, dict) else {}) | {
            "languages": [x.strip() for x in args.language.split(",") if x.strip()]}
    if filters:
        cur["filters"] = filters
    if args.decontaminate:
        d = cur.get("decontaminate")
        cur["decontaminate"] = dict(d if isinstance(d, dict) else {}, tasks=args.decontaminate)
    if args.data_root:
        if not cur.get("decontaminate"):
            raise UserError("--data-root: only with --decontaminate")
        cur["decontaminate"]["data_root"] = args.data_root
    if args.flag_only:
        cur["action"] = "flag"
    return cur or None


def _prepare(args) -> int:
    summary = prepare(args.input, args.tokenizer, args.out, args.seq_len, eval_fraction=args.eval_fraction,
                      workers=args.workers, compression=args.compression, text_field=args.text_field,
                      overwrite=args.overwrite, progress=None if not args.json else False,
                      curate=curation_from_args(args), removed_out=args.removed_out,
                      executor=executor_from_args(args), unit_bytes=unit_bytes_from_args(args),
                      on_bad_input=args.on_bad_input)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if summary.get("submitted"):
        _print_submitted(summary, args.out, "lmforge-dataset.json")
        return 0
    if summary.get("already_prepared"):
        print(f"already prepared: {args.out} (same inputs, arguments and tokenizer; nothing to do)")
    _print_summary(summary, args.out)
    return 0


def _print_submitted(summary: dict, dest: str, marker: str) -> None:
    for j in summary["submitted"]:
        print(f"submitted {j['stage']}: Slurm job {j['job_id']} ({j['tasks']} tasks), script {j['script']}")
    print(f"{dest} is complete when {marker} appears in it; running the same command again after the jobs "
          "ended redoes only what did not finish")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "-" if v is None else str(v)


def _console() -> Console:
    """On a terminal its width; piped or to a file, lines as long as they are (no wrapping at 80 columns)."""
    return Console() if sys.stdout.isatty() else Console(width=10_000)


def _print_summary(summary: dict, dest: str) -> None:
    console = _console()
    console.print(f"dataset {dest}", highlight=False, soft_wrap=True)
    table = Table()
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
        tasks, units = summary.get("tasks") or 0, summary.get("units") or 0
        how = (f"{f'{units} of {tasks}' if units < tasks else tasks} tasks on the {summary['executor']} executor"
               if summary.get("executor") else f"{summary.get('workers')} workers")
        console.print(f"{summary.get('seconds')}s, {summary.get('units')} units, {how}", highlight=False)
    if summary.get("throughput"):
        console.print(summary["throughput"], highlight=False)
    if summary.get("curation"):
        print_curation(summary["curation"], console)
    for line in input_warnings(summary):
        console.print(line, highlight=False, markup=False)


def print_curation(c: dict, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    verb = "flagged" if c.get("action") == "flag" else "removed"
    # The title as a line of its own: a table's title wraps at the table's width.
    console.print(f"curation: {c['documents_kept']:,} of {c['documents_in']:,} documents kept "
                  f"({', '.join(c.get('steps') or [])})", highlight=False, soft_wrap=True)
    if c.get("by_reason"):
        table = Table()
        table.add_column(f"{verb} by", no_wrap=True)
        table.add_column("documents", justify="right")
        table.add_column("share", justify="right")
        for reason, n in c["by_reason"].items():
            table.add_row(reason, f"{n:,}", f"{n / max(1, c['documents_in']):.1%}")
        console.print(table)
    if c.get("contaminated_tasks"):
        console.print("contaminated tasks (documents): " + ", ".join(
            f"{t} {n}" for t, n in c["contaminated_tasks"].items()), highlight=False)
    if c.get("removed_samples"):
        console.print(f"samples of {verb} documents: {os.path.dirname(c['removed_samples'][0])}", highlight=False)


def _dedup(args) -> int:
    from lmforge.data.prepare.dedup import curate_to_jsonl

    summary = curate_to_jsonl(args.input, args.out, curation_from_args(args), workers=args.workers,
                              text_field=args.text_field, overwrite=args.overwrite, removed_out=args.removed_out,
                              executor=executor_from_args(args), unit_bytes=unit_bytes_from_args(args),
                              progress=not args.json and sys.stderr.isatty(), on_bad_input=args.on_bad_input)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if summary.get("submitted"):
        _print_submitted(summary, args.out, "curation.json")
        return 0
    if summary.get("already_done"):
        print(f"already done: {args.out} (same inputs and settings; nothing to do)")
    print_curation(summary["curation"])
    print(f"kept documents: {os.path.join(args.out, 'documents.jsonl')}")
    for line in input_warnings(summary):
        print(line)
    return 0


def _stats(args) -> int:
    from lmforge.data.prepare.stats import MARK, corpus_stats, plot_format, print_stats, write_plots

    if args.plot:  # before reading the corpus: a refusal costs nothing
        from lmforge.guard import check_output_file

        plot_format(args.plot)
        check_output_file(args.plot, "--plot", args.overwrite, same_kind=lambda head: MARK.encode() in head,
                          reads=[("the corpus", s) for s in args.source])
    stats = corpus_stats(args.source, tokenizer=args.tokenizer, text_field=args.text_field, max_docs=args.max_docs)
    if args.plot:
        stats["plot"] = write_plots(stats, args.plot)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print_stats(stats)
    return 0


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
