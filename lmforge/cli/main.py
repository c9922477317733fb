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

# Command modules, in the order they appear in `lmforge --help`. A module that does not
# exist yet is skipped, so the CLI stays usable while features are added.
COMMAND_MODULES = [
    "lmforge.cli.train",
    "lmforge.cli.pipeline",
    "lmforge.cli.scaling",
    "lmforge.cli.data",
    "lmforge.cli.tokenizer",
    "lmforge.cli.estimate",
    "lmforge.cli.eval",
    "lmforge.cli.generate",
    "lmforge.cli.export",
    "lmforge.cli.runs",
    "lmforge.cli.report",
    "lmforge.cli.launch",
]


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="lmforge",
        description="Own your language model: pretrain, continue pretraining and fine-tune LLMs "
        "from one YAML file.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
