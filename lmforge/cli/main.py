"""`lmforge` entry point.

Each command group lives in its own small module under ``lmforge.cli`` and exposes
``register(subparsers)``; the list below is the whole wiring (no plugin discovery).
A command handler is ``func(args) -> int``. Bad input is raised as
``lmforge.errors.UserError`` and printed here as one line with exit status 2.
"""

from __future__ import annotations

import importlib
import os
import sys

from lmforge import __version__
from lmforge.cli.common import HelpFormatter, OneLineParser
from lmforge.errors import UserError, environment_error
from lmforge.say import say

# Command modules and the commands each registers, in the order they appear in `lmforge --help`.
# A module that does not exist yet is skipped, so the CLI stays usable while features are added.
COMMANDS = [
    ("lmforge.cli.train", ("train", "finetune")),
    ("lmforge.cli.pipeline", ("pipeline",)),
    ("lmforge.cli.scaling", ("scaling",)),
    ("lmforge.cli.data", ("data",)),
    ("lmforge.cli.tokenizer", ("tokenizer",)),
    ("lmforge.cli.estimate", ("estimate",)),
    ("lmforge.cli.eval", ("eval",)),
    ("lmforge.cli.generate", ("generate",)),
    ("lmforge.cli.export", ("export",)),
    ("lmforge.cli.runs", ("runs",)),
    ("lmforge.cli.report", ("report",)),
    ("lmforge.cli.launch", ("launch",)),
]


def build_parser(command: str | None = None) -> OneLineParser:
    """The whole CLI; with ``command``, only the module that registers it (every other command's
    imports are left out of its start-up: the supervisor and each rank of a run start one)."""
    parser = OneLineParser(
        prog="lmforge",
        description="Own your language model: pretrain, continue pretraining and fine-tune LLMs "
        "from one YAML file.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, commands in COMMANDS:
        if command is not None and command not in commands:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    known = {c for _, commands in COMMANDS for c in commands}
    parser = build_parser(words[0] if words and words[0] in known else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad flag's one line (or --help) was printed: its status, also when called in-process
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        say(e)
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:
        # `lmforge ... | head` closing the pipe is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        err = environment_error(e)  # a full disk, a read-only or forbidden folder: one line, no traceback
        if err is None:
            raise
        say(err)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
